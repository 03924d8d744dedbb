//! The Snowflake generator: unique and increasing under threads, unmoved by a wall clock that
//! steps back, above a time floor after a restart, borrowing then refusing when asked for too
//! many, and silent once its worker id is lost.

#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use idem_id::{IdError, Layout, Snowflake, SnowflakeOptions, TimeSource};

/// A clock under the test's control: the wall clock and the monotonic clock move separately.
struct ManualTime {
    wall: Mutex<SystemTime>,
    elapsed_ms: AtomicU64,
}

impl ManualTime {
    fn new(wall: SystemTime) -> Arc<Self> {
        Arc::new(Self {
            wall: Mutex::new(wall),
            elapsed_ms: AtomicU64::new(0),
        })
    }
    fn set_wall(&self, t: SystemTime) {
        *self.wall.lock().unwrap() = t;
    }
    fn advance(&self, ms: u64) {
        self.elapsed_ms.fetch_add(ms, Ordering::SeqCst);
    }
}

impl TimeSource for ManualTime {
    fn wall(&self) -> SystemTime {
        *self.wall.lock().unwrap()
    }
    fn elapsed(&self) -> Duration {
        Duration::from_millis(self.elapsed_ms.load(Ordering::SeqCst))
    }
}

fn generator(time: &Arc<ManualTime>, options: SnowflakeOptions) -> Snowflake {
    Snowflake::with_time(Layout::default(), 7, options, time.clone()).unwrap()
}

#[test]
fn ids_are_unique_and_increasing_across_threads() {
    let g = Arc::new(Snowflake::new(Layout::default(), 1, SnowflakeOptions::default()).unwrap());
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let g = g.clone();
            std::thread::spawn(move || (0..250_000).map(|_| g.next().unwrap()).collect::<Vec<_>>())
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
            assert!(all.insert(id), "duplicate id {id}");
            assert_eq!(g.layout().decode(id).worker, 1);
        }
    }
    assert_eq!(all.len(), 1_000_000);
}

#[test]
fn a_wall_clock_stepped_back_neither_stops_issuing_nor_repeats() {
    let start = SystemTime::now();
    let time = ManualTime::new(start);
    let g = generator(&time, SnowflakeOptions::default());
    let mut last = g.try_next().unwrap();
    for back in [Duration::from_secs(5), Duration::from_secs(3 * 3600)] {
        time.set_wall(start - back);
        for _ in 0..10_000 {
            time.advance(1);
            let id = g.try_next().unwrap();
            assert!(id > last);
            last = id;
        }
    }
}

#[test]
fn a_restart_after_a_clock_rollback_stays_above_the_time_floor() {
    let start = SystemTime::now();
    let time = ManualTime::new(start);
    let before = generator(&time, SnowflakeOptions::default());
    time.advance(60_000);
    let issued: Vec<u64> = (0..1000).map(|_| before.try_next().unwrap()).collect();
    let time_floor = before.last_millis() + 1;

    // The process restarts while the wall clock is an hour behind.
    let rolled_back = ManualTime::new(start - Duration::from_secs(3600));
    let unfloored = generator(&rolled_back, SnowflakeOptions::default());
    assert!(
        unfloored.try_next().unwrap() < issued[0],
        "the hazard this guards against"
    );
    let floored = generator(
        &rolled_back,
        SnowflakeOptions {
            floor_millis: time_floor,
            ..SnowflakeOptions::default()
        },
    );
    let after = floored.try_next().unwrap();
    assert!(issued.iter().all(|id| *id < after));
}

#[test]
fn a_used_up_sequence_borrows_the_next_milliseconds_then_refuses_until_the_clock_catches_up() {
    let time = ManualTime::new(SystemTime::now());
    let g = generator(
        &time,
        SnowflakeOptions {
            max_borrow: Duration::from_millis(2),
            ..SnowflakeOptions::default()
        },
    );
    let now = g.now_millis();
    // 4,096 ids per millisecond: this millisecond and two borrowed ones.
    let ids: Vec<u64> = (0..3 * 4096).map(|_| g.try_next().unwrap()).collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]));
    assert_eq!(g.layout().decode(ids[4096]).millis, now + 1);
    let e = g.try_next().unwrap_err();
    assert_eq!(
        e,
        IdError::Exhausted {
            retry_after: Duration::from_millis(1)
        }
    );
    time.advance(1);
    let id = g.try_next().unwrap();
    assert!(id > *ids.last().unwrap());
    assert_eq!(g.layout().decode(id).millis, now + 3);
}

#[test]
fn a_batch_is_a_run_of_fresh_increasing_ids() {
    let time = ManualTime::new(SystemTime::now());
    let g = generator(&time, SnowflakeOptions::default());
    let first = g.try_next().unwrap();
    let batch: Vec<u64> = g.try_next_batch(10_000).unwrap().collect();
    assert_eq!(batch.len(), 10_000);
    assert!(first < batch[0]);
    assert!(batch.windows(2).all(|w| w[0] < w[1]));
    assert!(g.try_next().unwrap() > batch[9_999]);
    // More than the borrowing bound allows is refused, not wrapped.
    assert!(matches!(
        g.try_next_batch(u32::MAX),
        Err(IdError::Exhausted { .. })
    ));
}

#[test]
fn a_lost_worker_id_issues_nothing() {
    let time = ManualTime::new(SystemTime::now());
    let g = generator(&time, SnowflakeOptions::default());
    g.try_next().unwrap();
    g.mark_lost();
    assert_eq!(g.try_next(), Err(IdError::WorkerLost));
    assert_eq!(g.next(), Err(IdError::WorkerLost));
    assert!(g.try_next_batch(5).is_err());
}

#[test]
fn a_worker_id_too_large_or_a_spent_layout_is_refused() {
    let time = ManualTime::new(SystemTime::now());
    let e = Snowflake::with_time(
        Layout::default(),
        1024,
        SnowflakeOptions::default(),
        time.clone(),
    );
    assert!(matches!(e, Err(IdError::Layout(_))));
    // 31 bits of milliseconds last 24.8 days; from an epoch 30 days back they are spent.
    let epoch = SystemTime::now() - Duration::from_secs(30 * 24 * 3600);
    let short = Layout::new(31, 10, 22, epoch).unwrap();
    let e = Snowflake::with_time(short, 1, SnowflakeOptions::default(), time);
    assert!(matches!(e, Err(IdError::LayoutExhausted)));
}
