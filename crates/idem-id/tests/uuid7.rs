//! UUIDv7: RFC 9562 fields, strictly increasing across threads, carrying the time; tokens.

#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_id::{Uuid7, token, uuid7};

fn unix_ms(t: SystemTime) -> u64 {
    u64::try_from(t.duration_since(UNIX_EPOCH).unwrap().as_millis()).unwrap()
}

#[test]
fn uuids_are_version_7_and_strictly_increase_across_threads() {
    let g = Arc::new(Uuid7::new());
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let g = g.clone();
            std::thread::spawn(move || (0..100_000).map(|_| g.next()).collect::<Vec<_>>())
        })
        .collect();
    let mut all = HashSet::new();
    for t in threads {
        let ids = t.join().unwrap();
        assert!(
            ids.windows(2).all(|w| w[0] < w[1]),
            "not increasing within a thread"
        );
        for id in ids {
            assert_eq!(id.get_version_num(), 7);
            assert_eq!(id.get_variant(), uuid::Variant::RFC4122);
            assert!(all.insert(id), "duplicate {id}");
        }
    }
    // Sorted by value is sorted by creation: the global order is a total one.
    let mut sorted: Vec<_> = all.into_iter().collect();
    sorted.sort();
    assert_eq!(sorted.len(), 400_000);
}

#[test]
fn a_uuid_carries_its_creation_time() {
    let before = unix_ms(SystemTime::now());
    let id = uuid7();
    let after = unix_ms(SystemTime::now());
    let (secs, nanos) = id.get_timestamp().unwrap().to_unix();
    let ms = secs * 1000 + u64::from(nanos) / 1_000_000;
    // The clock is read through a ticker that may lag it by a tick.
    assert!(
        ms + 1000 >= before && ms <= after,
        "{before} <= {ms} <= {after}"
    );
}

#[test]
fn the_process_generator_increases_and_tokens_do_not_repeat() {
    let a = uuid7();
    std::thread::sleep(Duration::from_millis(2));
    let b = uuid7();
    assert!(a < b);
    let tokens: HashSet<String> = (0..10_000).map(|_| token()).collect();
    assert_eq!(tokens.len(), 10_000);
    assert!(
        tokens
            .iter()
            .all(|t| t.len() == 32 && t.bytes().all(|b| b.is_ascii_hexdigit()))
    );
}

/// Each millisecond's counter starts at a random point, the first one included, so a UUID
/// does not tell how many were made before it.
#[test]
fn counters_start_at_random_points() {
    let firsts: HashSet<u128> = (0..20)
        .map(|_| {
            let bits = Uuid7::new().next().as_u128();
            ((bits >> 64) & 0xfff) << 10 | ((bits >> 52) & 0x3ff)
        })
        .collect();
    assert!(firsts.len() > 10, "first counters repeat: {firsts:?}");
}
