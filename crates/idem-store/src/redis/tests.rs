//! The store against the project's Redis: a resent `begin`, a give-back, a foreign value; and,
//! on a server of its own, every script sent again after the server lost it.

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Fingerprint, Key, Lease, Record, Status, Store, StoreError,
    Timestamp,
};

use super::format::{HEADER, pack, unpack, unpack_named};
use super::*;

/// A store on the project's Redis, or `None` if there is none.
async fn shared_store() -> Option<RedisStore> {
    let url = idem_testkit::services::REDIS.url()?;
    let options = RedisOptions {
        prefix: "idem-test:".into(),
        ..RedisOptions::default()
    };
    Some(RedisStore::connect(&url, options).await.unwrap())
}

/// A `begin` whose answer was lost and which is sent again (the client retries on a
/// dropped connection) holds the lease it was first given, whichever way it first went.
#[test]
fn a_begin_sent_again_holds_its_lease() {
    idem_testkit::block_on(async {
        let Some(store) = shared_store().await else {
            return;
        };
        let now = Timestamp::now();
        let scope = format!("resend-{}-{}", std::process::id(), now.as_millis());
        let req = |k: &str| {
            BeginRequest::new(
                Key::parse(&scope, "n", k).unwrap(),
                Fingerprint::of_bytes(b"b"),
            )
        };
        // Once by the plain SET, and once after a release, by the script.
        let (lease, fresh) = Record::acquired(&req("a"), now, 1, idem_core::LeaseId::generate());
        let first = store.begin_as(&fresh, lease, now).await.unwrap();
        let again = store.begin_as(&fresh, lease, now).await.unwrap();
        assert_eq!(first, BeginOutcome::Acquired(lease));
        assert_eq!(again, first);
        store.release(&fresh.key, &lease, now).await.unwrap();
        let (lease, fresh) = Record::acquired(&req("a"), now, 1, idem_core::LeaseId::generate());
        let first = store.begin_as(&fresh, lease, now).await.unwrap();
        let again = store.begin_as(&fresh, lease, now).await.unwrap();
        let taken_over = Lease { fence: 2, ..lease };
        assert_eq!(first, BeginOutcome::Acquired(taken_over));
        assert_eq!(again, first);
        // Another attempt is not the same call.
        let (other, fresh) = Record::acquired(&req("a"), now, 1, idem_core::LeaseId::generate());
        assert!(matches!(
            store.begin_as(&fresh, other, now).await.unwrap(),
            BeginOutcome::InProgress { .. }
        ));
    });
}

/// The give-back of a failed `begin` releases what that `begin` took, by a plain `SET`
/// or by the script's takeover, and nothing else. (The tests in `tests/late_claims.rs`
/// stall a server to make a `begin` fail and land late; a stall cannot fall between the
/// `SET` and the script, so the takeover's give-back is tested here directly.)
#[test]
fn a_give_back_releases_only_what_its_lease_took() {
    idem_testkit::block_on(async {
        let Some(store) = shared_store().await else {
            return;
        };
        let now = Timestamp::now();
        let scope = format!("give-back-{}-{}", std::process::id(), now.as_millis());
        let req = BeginRequest::new(
            Key::parse(&scope, "n", "k").unwrap(),
            Fingerprint::of_bytes(b"b"),
        );
        let key = store.redis_key(&req.key);
        let (first, fresh) = Record::acquired(&req, now, 1, idem_core::LeaseId::generate());
        store.begin_as(&fresh, first, now).await.unwrap();
        // Another lease's give-back leaves the holder's record alone.
        let (stranger, _) = Record::acquired(&req, now, 1, idem_core::LeaseId::generate());
        store.give_back(&key, &stranger, now);
        store.give_back(
            &key,
            &Lease {
                fence: 1,
                ..stranger
            },
            now,
        );
        // The plain `SET`'s record, given back.
        store.give_back(&key, &first, now);
        let (second, fresh) = Record::acquired(&req, now, 1, idem_core::LeaseId::generate());
        let taken = store.begin_as(&fresh, second, now).await.unwrap();
        assert_eq!(taken, BeginOutcome::Acquired(Lease { fence: 2, ..second }));
        // The script's takeover, given back; the record keeps its fence.
        store.give_back(&key, &second, now);
        let record = store.get(&req.key, now).await.unwrap().unwrap();
        assert_eq!((record.status, record.fence), (Status::Released, 2));
        let (third, fresh) = Record::acquired(&req, now, 1, idem_core::LeaseId::generate());
        let taken = store.begin_as(&fresh, third, now).await.unwrap();
        assert_eq!(taken, BeginOutcome::Acquired(Lease { fence: 3, ..third }));
        // A completed record is not given back.
        store
            .complete(
                &req.key,
                &Lease { fence: 3, ..third },
                Bytes::from_static(b"r"),
                now,
            )
            .await
            .unwrap();
        store.give_back(&key, &third, now);
        let record = store.get(&req.key, now).await.unwrap().unwrap();
        assert_eq!(record.status, Status::Completed);
    });
}

#[test]
fn a_value_of_another_shape_is_corrupt() {
    let key = Key::parse("s", "n", "k").unwrap();
    let req = BeginRequest::new(key.clone(), Fingerprint::of_bytes(b"body"));
    let (_, r) = Record::acquired(
        &req,
        Timestamp::from_millis(5),
        1,
        idem_core::LeaseId::generate(),
    );
    let good = pack(&r);
    let mut other_format = good.clone();
    other_format[0] = b'3';
    let mut bad_number = good.clone();
    bad_number[60] = b'x';
    let mut tail_on_in_progress = good.clone();
    tail_on_in_progress.push(b'r');
    // The key: its length past the value, not a number, or naming another key.
    let mut long_key = good.clone();
    long_key[HEADER..HEADER + 4].copy_from_slice(b"0099");
    let mut bad_length = good.clone();
    bad_length[HEADER + 1] = b'x';
    let other_key = pack(&Record {
        key: Key::parse("s", "n", "j").unwrap(),
        ..r.clone()
    });
    for bad in [
        &good[..HEADER - 1],
        &good[..HEADER + 3],
        &other_format,
        &bad_number,
        &tail_on_in_progress,
        &long_key,
        &bad_length,
        &other_key,
    ] {
        assert!(matches!(unpack(&key, bad), Err(StoreError::Corrupt(_))));
    }
    assert_eq!(unpack(&key, &good).unwrap(), r);
    let (named, at) = unpack_named(&good).unwrap();
    assert_eq!((named, at), (r.clone(), good.len()));
    // Format 1, without the key, is still read, but names no key.
    let mut keyless = good[..HEADER].to_vec();
    keyless[0] = b'1';
    assert_eq!(unpack(&key, &keyless).unwrap(), r);
    assert!(unpack_named(&keyless).is_err());
}

/// A record of format 1, written before records kept their key, is still served in its own
/// format: completed, replayed, repaired; a listing, which cannot name it, skips it.
#[test]
fn a_record_of_format_1_is_still_served() {
    use idem_core::{RecordFilter, RecordState, Repair, Scope, Shown};

    idem_testkit::block_on(async {
        let Some(store) = shared_store().await else {
            return;
        };
        let now = Timestamp::now();
        let scope = format!("format-1-{}-{}", std::process::id(), now.as_millis());
        let req = BeginRequest::new(
            Key::parse(&scope, "n", "k").unwrap(),
            Fingerprint::of_bytes(b"b"),
        );
        let (lease, fresh) = Record::acquired(&req, now, 1, idem_core::LeaseId::generate());
        let mut old = pack(&fresh)[..HEADER].to_vec();
        old[0] = b'1';
        let at = store.redis_key(&req.key);
        let mut conn = store.conn.clone();
        let raw = |conn: &mut Conn| {
            let mut conn = conn.clone();
            let at = at.clone();
            async move {
                let v: Vec<u8> = redis::cmd("GET")
                    .arg(at)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                v
            }
        };
        let _: () = redis::cmd("SET")
            .arg(&at)
            .arg(old)
            .arg("PX")
            .arg(60_000)
            .query_async(&mut conn)
            .await
            .unwrap();
        store
            .complete(&req.key, &lease, Bytes::from_static(b"done"), now)
            .await
            .unwrap();
        let v = raw(&mut conn).await;
        assert_eq!((v[0], &v[HEADER..]), (b'1', &b"done"[..]));
        let replay = store.begin(&req, now).await.unwrap();
        assert!(matches!(replay, BeginOutcome::Replay(r) if r.response.as_ref() == b"done"));

        let admin = store.admin().unwrap();
        let filter = RecordFilter {
            scope: Some(Scope::new(scope.clone()).unwrap()),
            ..RecordFilter::default()
        };
        let mut after = None;
        loop {
            let page = admin.list(&filter, after.as_ref(), 100, now).await.unwrap();
            assert!(page.records.is_empty());
            match page.next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        let shown = Shown {
            state: RecordState::Completed,
            fence: 1,
        };
        assert!(
            admin
                .repair(&req.key, shown, Repair::Release, now)
                .await
                .unwrap()
        );
        let v = raw(&mut conn).await;
        assert_eq!((v[0], v[1], v.len()), (b'1', b'r', HEADER));
        let record = store.get(&req.key, now).await.unwrap().unwrap();
        assert_eq!(record.status, Status::Released);
    });
}

/// The server's version is read from `INFO server`, whatever else the answer holds.
#[test]
fn the_server_version_is_read_from_info() {
    let info = "# Server\r\nredis_version:7.0.15\r\nredis_git_sha1:00000000\r\n";
    assert_eq!(server_version(info), Some((7, 0)));
    assert_eq!(server_version("redis_version:6.2.14\r\n"), Some((6, 2)));
    assert_eq!(server_version("redis_version:8\r\n"), None);
    assert_eq!(server_version("valkey_version:8.0.1\r\n"), None);
}

/// A server that lost the scripts (restarted, failed over, its cache flushed) is sent each one
/// again, and the call it failed runs: the batched `begin` and `complete` (called directly,
/// so that no fallback to one-record calls can hide a failure), the one-record `begin` script
/// (on a released key), `renew`, the settle (of a release and of a completion), and a lock's
/// script.
#[test]
fn every_script_is_sent_again_to_a_server_that_lost_it() {
    use crate::group_commit::{BeginJob, CompleteJob, ManyAtOnce};

    idem_testkit::block_on(async {
        let Some(server) = idem_testkit::services::RedisServer::start() else {
            return;
        };
        let store = RedisStore::connect(&server.url(), RedisOptions::default())
            .await
            .unwrap();
        let mut admin = redis::Client::open(server.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let mut flushed = async || {
            let () = redis::cmd("SCRIPT")
                .arg("FLUSH")
                .query_async(&mut admin)
                .await
                .unwrap();
        };
        let now = Timestamp::now();
        let req = |k: &str| {
            BeginRequest::new(
                Key::parse("s", "flushed", k).unwrap(),
                Fingerprint::of_bytes(b"x"),
            )
        };

        flushed().await;
        let jobs: Vec<BeginJob> = ["a", "b"]
            .iter()
            .map(|k| BeginJob { req: req(k), now })
            .collect();
        let fresh: Vec<_> = jobs
            .iter()
            .map(|j| Record::acquired(&j.req, now, 1, idem_core::LeaseId::generate()))
            .collect();
        let taken = store.begin_many(&jobs, &fresh).await.unwrap();
        assert_eq!(taken.map(|t| t.len()), Some(2), "the batched begin ran");

        flushed().await;
        let completes: Vec<CompleteJob> = jobs
            .iter()
            .zip(&fresh)
            .map(|(j, (lease, _))| CompleteJob {
                key: j.req.key.clone(),
                lease: *lease,
                response: Bytes::from_static(b"done"),
                now,
            })
            .collect();
        let done = store.complete_many(&completes).await.unwrap();
        assert_eq!(done, Some(vec![true, true]), "the batched complete ran");

        let BeginOutcome::Acquired(lease) = store.begin(&req("c"), now).await.unwrap() else {
            panic!("a fresh key is acquired");
        };
        flushed().await;
        store
            .renew(
                &req("c").key,
                &lease,
                std::time::Duration::from_secs(30),
                now,
            )
            .await
            .unwrap();
        flushed().await;
        store.release(&req("c").key, &lease, now).await.unwrap();
        flushed().await;
        // A released key is taken by the `begin` script, not the plain `SET`.
        let BeginOutcome::Acquired(again) = store.begin(&req("c"), now).await.unwrap() else {
            panic!("a released key is acquired again");
        };
        assert_eq!(again.fence, lease.fence + 1);

        // The settle of a completion (its response stored), and a lock's script.
        flushed().await;
        store
            .complete(&req("c").key, &again, Bytes::from_static(b"done"), now)
            .await
            .unwrap();
        let record = store.get(&req("c").key, now).await.unwrap();
        let response = record.and_then(|r| r.response);
        assert_eq!(response.as_deref(), Some(&b"done"[..]));
        flushed().await;
        let name = idem_core::LockName::new("flushed").unwrap();
        let owner = idem_core::OwnerDigest([7; 32]);
        let held =
            idem_core::LockStore::acquire(&store, &name, owner, std::time::Duration::from_secs(10))
                .await
                .unwrap();
        assert!(matches!(held, idem_core::Acquire::Acquired(_)), "{held:?}");
    });
}

/// A server without `SET … IFEQ` (the project's Redis 7) refuses it with the error that turns
/// the plain settles off; a server that takes it would answer instead.
#[test]
fn a_refused_ifeq_is_told_apart() {
    idem_testkit::block_on(async {
        let Some(store) = shared_store().await else {
            return;
        };
        assert!(!store.plain.enabled(), "Redis 7 has no SET … IFEQ");
        let refused = redis::cmd("SET")
            .arg("idem-test:{ifeq-refused}")
            .arg("")
            .arg("IFEQ")
            .arg("")
            .query_async::<redis::Value>(&mut store.conn.clone())
            .await
            .unwrap_err();
        assert!(super::plain::refused_ifeq(&refused), "{refused}");
        // Other refusals are not taken for it.
        let wrong_type = redis::cmd("INCR")
            .arg("idem-test:{ifeq-refused}")
            .arg("extra")
            .query_async::<redis::Value>(&mut store.conn.clone())
            .await
            .unwrap_err();
        assert!(!super::plain::refused_ifeq(&wrong_type), "{wrong_type}");
    });
}

/// A server replaced under a running store keeps it working: on Valkey 9 it settles plainly;
/// replaced by a Redis 7 (no `SET … IFEQ`), the first plain settle is refused, the store
/// turns plain settles off and decides by script from then on, also once a Valkey is back.
#[test]
fn a_server_replaced_under_the_store_keeps_it_working() {
    use idem_testkit::services::RedisServer;

    idem_testkit::block_on(async {
        let (Some(mut server), Some(redis)) = (RedisServer::start_valkey(), RedisServer::start())
        else {
            return;
        };
        let valkey = RedisServer::start_valkey().expect("a second Valkey");
        let store = RedisStore::connect(&server.url(), RedisOptions::default())
            .await
            .unwrap();
        assert!(store.plain.enabled(), "Valkey 9 takes SET … IFEQ");
        let now = Timestamp::now();
        let req = |k: &str| {
            BeginRequest::new(
                Key::parse("swap", "plain", k).unwrap(),
                Fingerprint::of_bytes(b"r"),
            )
        };
        let acquire = async |r: &BeginRequest| match store.begin(r, now).await.unwrap() {
            BeginOutcome::Acquired(lease) => lease,
            other => panic!("expected Acquired, got {other:?}"),
        };
        let completed = async |r: &BeginRequest| {
            let record = store.get(&r.key, now).await.unwrap().unwrap();
            assert_eq!(record.status, Status::Completed);
        };

        // Until the store has its connection to the new server back.
        let reconnected = async || {
            for _ in 0..100 {
                if store.get(&req("probe").key, now).await.is_ok() {
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            panic!("the store did not reconnect");
        };

        let before = req("before");
        let lease = acquire(&before).await;
        server.replace_with_program_of(&redis);
        reconnected().await;
        // The claim's record went with the old server; the refused plain settle hands the
        // call to the script, which finds no record.
        let lost = store
            .complete(&before.key, &lease, Bytes::from_static(b"1"), now)
            .await;
        assert!(lost.is_err(), "{lost:?}");
        assert!(!store.plain.enabled(), "turned off by the refusal");
        let after = req("after");
        let lease = acquire(&after).await;
        store
            .complete(&after.key, &lease, Bytes::from_static(b"2"), now)
            .await
            .unwrap();
        completed(&after).await;

        server.replace_with_program_of(&valkey);
        reconnected().await;
        let back = req("back");
        let lease = acquire(&back).await;
        store
            .complete(&back.key, &lease, Bytes::from_static(b"3"), now)
            .await
            .unwrap();
        completed(&back).await;
        assert!(!store.plain.enabled(), "off for good");
    });
}
