//! The conformance suite: one function per case, each taking any [`Store`].
//!
//! Every case works in a scope of its own (random), so the suite can run against a shared
//! server concurrently with other runs; only purges reach across scopes, so a fixture on a
//! shared server gives each case a table of its own ([`case_table`]). Time is passed explicitly: cases start from the wall
//! clock and move forward by adding to it, never by sleeping.

use std::any::Any;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

mod listing;
mod steps;
pub use listing::*;
pub use steps::*;

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Fingerprint, Key, Lease, LeaseError, LeaseId, Status, Store,
    StoreError, Timestamp,
};

/// A store under test, and whatever must outlive it (a temporary directory, a server).
pub struct Fixture<S> {
    /// The store.
    pub store: S,
    _guard: Option<Box<dyn Any + Send>>,
}

impl<S> Fixture<S> {
    /// A fixture that needs nothing else.
    pub fn new(store: S) -> Self {
        Self {
            store,
            _guard: None,
        }
    }

    /// A fixture that keeps `guard` alive as long as the store.
    pub fn with_guard(store: S, guard: impl Any + Send) -> Self {
        Self {
            store,
            _guard: Some(Box::new(guard)),
        }
    }
}

thread_local! {
    /// The name of the case [`conformance_tests!`](crate::conformance_tests) is running on
    /// this thread, for fixtures that give each case a store of its own.
    pub static CASE: std::cell::Cell<&'static str> = const { std::cell::Cell::new("") };
}

/// A table name (or key prefix) of the current case's own: `<prefix>_<8 hex digits>`, the
/// same in every run. Stores on a shared server need one per case, since a purge deletes
/// whatever has expired by its clock, other cases' records included.
pub fn case_table(prefix: &str) -> String {
    use std::hash::{Hash, Hasher};
    let case = CASE.get();
    assert!(
        !case.is_empty(),
        "case_table is for fixtures of conformance_tests!, on the case's own thread"
    );
    let mut h = std::collections::hash_map::DefaultHasher::new();
    case.hash(&mut h);
    format!("{prefix}_{:08x}", h.finish() & 0xffff_ffff)
}

/// What a fixture expression may yield: a [`Fixture`], or `Option<Fixture>` where `None`
/// skips the case (see [`crate::services`]).
pub trait IntoFixture<S> {
    /// The fixture, if the case runs.
    fn into_fixture(self) -> Option<Fixture<S>>;
}

impl<S> IntoFixture<S> for Fixture<S> {
    fn into_fixture(self) -> Option<Fixture<S>> {
        Some(self)
    }
}

impl<S> IntoFixture<S> for Option<Fixture<S>> {
    fn into_fixture(self) -> Option<Fixture<S>> {
        self
    }
}

const LEASE: Duration = Duration::from_secs(10);
const TTL: Duration = Duration::from_secs(100);

/// A scope no other run uses.
fn fresh_scope() -> String {
    format!("conformance-{:016x}", rand::random::<u64>())
}

struct Case {
    scope: String,
    t0: Timestamp,
}

impl Case {
    fn new() -> Self {
        Self {
            scope: fresh_scope(),
            t0: Timestamp::now(),
        }
    }

    fn key(&self, client_key: &str) -> Key {
        Key::parse(&self.scope, "conformance", client_key).unwrap()
    }

    fn req(&self, client_key: &str, fp: &str) -> BeginRequest {
        BeginRequest::new(self.key(client_key), Fingerprint::of_bytes(fp.as_bytes()))
            .with_lease(LEASE)
            .with_ttl(TTL)
    }

    /// `t0 + secs`.
    fn at(&self, secs: u64) -> Timestamp {
        self.t0.saturating_add(Duration::from_secs(secs))
    }
}

async fn acquire<S: Store>(store: &S, req: &BeginRequest, now: Timestamp) -> Lease {
    match store.begin(req, now).await.unwrap() {
        BeginOutcome::Acquired(lease) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// Completes the record `lease` holds with `body`; the store must take it.
async fn complete<S: Store>(
    store: &S,
    key: &Key,
    lease: &Lease,
    body: &'static [u8],
    now: Timestamp,
) {
    store
        .complete(key, lease, Bytes::from_static(body), now)
        .await
        .unwrap();
}

/// Asserts that `complete` with `lease` is refused as stale.
async fn complete_refused<S: Store>(
    store: &S,
    key: &Key,
    lease: &Lease,
    body: &'static [u8],
    now: Timestamp,
) {
    assert_stale(
        store
            .complete(key, lease, Bytes::from_static(body), now)
            .await,
    );
}

async fn replayed<S: Store>(store: &S, req: &BeginRequest, now: Timestamp) -> Bytes {
    match store.begin(req, now).await.unwrap() {
        BeginOutcome::Replay(r) => r.response,
        other => panic!("expected Replay, got {other:?}"),
    }
}

fn assert_stale(result: Result<(), LeaseError>) {
    match result {
        Err(LeaseError::Stale(_)) => {}
        other => panic!("expected a stale-lease refusal, got {other:?}"),
    }
}

/// The first `begin` of a key acquires it, with the first fence of its time
/// ([`Lease::first_fence`]) and the asked lease length.
pub async fn begin_on_absent_key_acquires<S: Store>(store: &S) {
    let c = Case::new();
    let lease = acquire(store, &c.req("k", "a"), c.at(0)).await;
    assert_eq!(lease.fence, Lease::first_fence(c.at(0)));
    assert_eq!(lease.expires_at, c.at(0).saturating_add(LEASE));
}

/// While a lease is live, another `begin` with the same fingerprint is told "in progress"
/// and when that lease runs out.
pub async fn second_begin_is_in_progress<S: Store>(store: &S) {
    let c = Case::new();
    let lease = acquire(store, &c.req("k", "a"), c.at(0)).await;
    for t in [0, 1, 9] {
        assert_eq!(
            store.begin(&c.req("k", "a"), c.at(t)).await.unwrap(),
            BeginOutcome::InProgress {
                lease_expires_at: lease.expires_at
            }
        );
    }
}

/// After `complete`, every `begin` with the same fingerprint replays the stored response,
/// with the completing fence and time.
pub async fn complete_then_every_retry_replays<S: Store>(store: &S) {
    let c = Case::new();
    let req = c.req("k", "a");
    let lease = acquire(store, &req, c.at(0)).await;
    complete(store, &req.key, &lease, b"done", c.at(1)).await;
    for t in [1, 2, 50, 100] {
        match store.begin(&req, c.at(t)).await.unwrap() {
            BeginOutcome::Replay(r) => {
                assert_eq!(&r.response[..], b"done");
                assert_eq!(r.fence, lease.fence);
                assert_eq!(r.completed_at, c.at(1));
            }
            other => panic!("expected Replay at t={t}, got {other:?}"),
        }
    }
}

/// `begin_from_memory` never claims: `None` for an absent or held key, and for a completed
/// one either `None` or exactly what `begin` answers (the replay, or a mismatch for another
/// fingerprint); asking it changes nothing.
pub async fn memory_answers_are_begin_s_answers<S: Store>(store: &S) {
    let c = Case::new();
    let req = c.req("k", "a");
    assert_eq!(
        store.begin_from_memory(&req, c.at(0)),
        None,
        "an absent key"
    );
    let lease = acquire(store, &req, c.at(0)).await;
    assert_eq!(store.begin_from_memory(&req, c.at(1)), None, "a held key");
    complete(store, &req.key, &lease, b"done", c.at(1)).await;
    let other = c.req("k", "b");
    for t in [2, 3] {
        // The first `begin` may be what puts the answer in memory.
        let from_store = store.begin(&req, c.at(t)).await.unwrap();
        assert!(matches!(from_store, BeginOutcome::Replay(_)));
        if let Some(answer) = store.begin_from_memory(&req, c.at(t)) {
            assert_eq!(answer, from_store, "the replay at t={t}");
        }
        if let Some(answer) = store.begin_from_memory(&other, c.at(t)) {
            assert_eq!(
                answer,
                BeginOutcome::Mismatch,
                "another fingerprint at t={t}"
            );
        }
    }
    // Past the record's expiry, nothing is answered from memory.
    assert_eq!(
        store.begin_from_memory(&req, c.at(200)),
        None,
        "an expired record"
    );
    assert!(matches!(
        store.begin(&req, c.at(200)).await.unwrap(),
        BeginOutcome::Acquired(_)
    ));
}

/// Responses are opaque bytes: empty, binary, and large ones come back exactly.
pub async fn replay_returns_bytes_exactly<S: Store>(store: &S) {
    let c = Case::new();
    let binary: Vec<u8> = (0..=255u8).chain([0, 0, 255]).collect();
    let large: Vec<u8> = (0..1024 * 1024)
        .map(|i: u32| i.to_le_bytes()[0] ^ 0x5a)
        .collect();
    for (name, body) in [("empty", Vec::new()), ("binary", binary), ("large", large)] {
        let req = c.req(name, "a");
        let lease = acquire(store, &req, c.at(0)).await;
        store
            .complete(&req.key, &lease, Bytes::from(body.clone()), c.at(0))
            .await
            .unwrap();
        assert_eq!(replayed(store, &req, c.at(1)).await, body, "{name}");
    }
}

/// A key reused with a different fingerprint is a mismatch, whether the record is in progress
/// (even with its lease run out) or completed; the record is left as it was.
pub async fn other_fingerprint_is_a_mismatch<S: Store>(store: &S) {
    let c = Case::new();
    let lease = acquire(store, &c.req("k", "a"), c.at(0)).await;
    assert_eq!(
        store.begin(&c.req("k", "b"), c.at(1)).await.unwrap(),
        BeginOutcome::Mismatch
    );
    assert_eq!(
        store.begin(&c.req("k", "b"), c.at(20)).await.unwrap(),
        BeginOutcome::Mismatch,
        "an expired lease still binds the key to its fingerprint"
    );
    complete(store, &c.key("k"), &lease, b"r", c.at(21)).await;
    assert_eq!(
        store.begin(&c.req("k", "b"), c.at(22)).await.unwrap(),
        BeginOutcome::Mismatch
    );
    assert_eq!(&replayed(store, &c.req("k", "a"), c.at(23)).await[..], b"r");
}

/// `release` gives the key back: the next `begin`, with any fingerprint, acquires it with a
/// higher fence; the record is shown as released until then.
pub async fn release_gives_the_key_back<S: Store>(store: &S) {
    let c = Case::new();
    let first = acquire(store, &c.req("k", "a"), c.at(0)).await;
    store.release(&c.key("k"), &first, c.at(1)).await.unwrap();
    // releasing again with the same lease is a no-op success
    store.release(&c.key("k"), &first, c.at(1)).await.unwrap();
    let rec = store.get(&c.key("k"), c.at(1)).await.unwrap().unwrap();
    assert_eq!(rec.status, Status::Released);
    let second = acquire(store, &c.req("k", "b"), c.at(2)).await;
    assert!(second.fence > first.fence);
    complete_refused(store, &c.key("k"), &first, b"", c.at(3)).await;
}

/// `reopen` turns a completed record back into a released one only when named by its fence:
/// the next `begin` runs again with a higher fence, and a second `reopen` with the old fence
/// (racing, or late) changes nothing, not even the new attempt.
pub async fn reopen_reruns_a_completed_record<S: Store>(store: &S) {
    let c = Case::new();
    let req = c.req("k", "a");
    // Nothing to reopen: absent, in progress.
    assert!(!store.reopen(&req.key, 1, c.at(0)).await.unwrap());
    let first = acquire(store, &req, c.at(0)).await;
    assert!(!store.reopen(&req.key, first.fence, c.at(1)).await.unwrap());
    complete(store, &req.key, &first, b"unknown", c.at(1)).await;
    // A wrong fence changes nothing.
    assert!(
        !store
            .reopen(&req.key, first.fence + 1, c.at(2))
            .await
            .unwrap()
    );
    assert_eq!(&replayed(store, &req, c.at(2)).await[..], b"unknown");
    assert!(store.reopen(&req.key, first.fence, c.at(3)).await.unwrap());
    let rec = store.get(&req.key, c.at(3)).await.unwrap().unwrap();
    assert_eq!(rec.status, Status::Released);
    assert_eq!(rec.response, None);
    assert!(!store.reopen(&req.key, first.fence, c.at(3)).await.unwrap());
    let second = acquire(store, &req, c.at(4)).await;
    assert!(second.fence > first.fence);
    assert!(!store.reopen(&req.key, first.fence, c.at(5)).await.unwrap());
    complete(store, &req.key, &second, b"ok", c.at(5)).await;
    assert!(!store.reopen(&req.key, first.fence, c.at(6)).await.unwrap());
    assert_eq!(&replayed(store, &req, c.at(6)).await[..], b"ok");
    // An expired record is not reopened.
    let after = c.at(5).saturating_add(TTL);
    assert!(!store.reopen(&req.key, second.fence, after).await.unwrap());
}

/// An expired lease is taken over by the next `begin` with the same fingerprint, each time
/// with a strictly higher fence.
pub async fn expired_lease_is_taken_over_with_higher_fence<S: Store>(store: &S) {
    let c = Case::new();
    let req = c.req("k", "a");
    let mut fence = 0;
    for round in 0..5u64 {
        let now = c.at(round * 11);
        let lease = acquire(store, &req, now).await;
        assert!(lease.fence > fence, "fence {} after {fence}", lease.fence);
        fence = lease.fence;
        assert!(matches!(
            store.begin(&req, now).await.unwrap(),
            BeginOutcome::InProgress { .. }
        ));
    }
    let rec = store.get(&req.key, c.at(44)).await.unwrap().unwrap();
    assert_eq!(rec.fence, fence);
}

/// A lease that expired and was taken over can neither complete nor release, and its attempts
/// change nothing: the new holder still completes.
pub async fn stale_lease_cannot_complete_or_release<S: Store>(store: &S) {
    let c = Case::new();
    let req = c.req("k", "a");
    let old = acquire(store, &req, c.at(0)).await;
    let new = acquire(store, &req, c.at(11)).await;
    assert!(new.fence > old.fence);
    complete_refused(store, &req.key, &old, b"old", c.at(12)).await;
    assert_stale(store.release(&req.key, &old, c.at(12)).await);
    let rec = store.get(&req.key, c.at(12)).await.unwrap().unwrap();
    assert_eq!(rec.status, Status::InProgress);
    assert_eq!(rec.fence, new.fence);
    complete(store, &req.key, &new, b"new", c.at(13)).await;
    complete_refused(store, &req.key, &old, b"old", c.at(14)).await;
    assert_eq!(&replayed(store, &req, c.at(14)).await[..], b"new");
}

/// A lease that ran out but that nobody took over may still complete.
pub async fn expired_lease_not_taken_over_may_complete<S: Store>(store: &S) {
    let c = Case::new();
    let req = c.req("k", "a");
    let lease = acquire(store, &req, c.at(0)).await;
    complete(store, &req.key, &lease, b"late", c.at(30)).await;
    assert_eq!(&replayed(store, &req, c.at(31)).await[..], b"late");
}

/// Repeating `complete` with the same lease and the same response succeeds and changes
/// nothing; `release` after `complete` is refused.
pub async fn repeated_complete_is_a_noop<S: Store>(store: &S) {
    let c = Case::new();
    let req = c.req("k", "a");
    let lease = acquire(store, &req, c.at(0)).await;
    for at in [1, 2] {
        complete(store, &req.key, &lease, b"first", c.at(at)).await;
    }
    assert_stale(store.release(&req.key, &lease, c.at(2)).await);
    let rec = store.get(&req.key, c.at(3)).await.unwrap().unwrap();
    assert_eq!(rec.updated_at, c.at(1));
    assert_eq!(&replayed(store, &req, c.at(3)).await[..], b"first");
}

/// Repeating `complete` with the same lease but another response is refused as stale, also
/// after the lease ran out, and the first response is what retries replay: a second result
/// is never dropped silently.
pub async fn repeated_complete_with_another_response_is_stale<S: Store>(store: &S) {
    let c = Case::new();
    let req = c.req("k", "a");
    let lease = acquire(store, &req, c.at(0)).await;
    complete(store, &req.key, &lease, b"first", c.at(1)).await;
    for (response, at) in [(&b"second"[..], 2), (b"", 2), (b"first and more", 30)] {
        complete_refused(store, &req.key, &lease, response, c.at(at)).await;
    }
    assert_eq!(&replayed(store, &req, c.at(31)).await[..], b"first");
}

/// A lease that ran out and was taken over cannot complete even with the response its
/// successor stored.
pub async fn taken_over_lease_is_stale_even_with_the_same_response<S: Store>(store: &S) {
    let c = Case::new();
    let req = c.req("k", "a");
    let old = acquire(store, &req, c.at(0)).await;
    let new = acquire(store, &req, c.at(11)).await;
    complete(store, &req.key, &new, b"same", c.at(12)).await;
    complete_refused(store, &req.key, &old, b"same", c.at(13)).await;
    let rec = store.get(&req.key, c.at(13)).await.unwrap().unwrap();
    assert_eq!((rec.fence, rec.updated_at), (new.fence, c.at(12)));
}

/// A lease with a made-up id, or for a key that has no record, is stale.
pub async fn forged_or_absent_lease_is_stale<S: Store>(store: &S) {
    let c = Case::new();
    let req = c.req("k", "a");
    let real = acquire(store, &req, c.at(0)).await;
    let forged = Lease {
        id: LeaseId::generate(),
        ..real
    };
    complete_refused(store, &req.key, &forged, b"", c.at(1)).await;
    assert_stale(store.release(&req.key, &forged, c.at(1)).await);
    let wrong_fence = Lease {
        fence: real.fence + 1,
        ..real
    };
    complete_refused(store, &req.key, &wrong_fence, b"", c.at(1)).await;
    complete_refused(store, &c.key("nobody"), &real, b"", c.at(1)).await;
    assert_stale(store.release(&c.key("nobody"), &real, c.at(1)).await);
    assert!(matches!(
        store.begin(&req, c.at(1)).await.unwrap(),
        BeginOutcome::InProgress { .. }
    ));
}

/// A completed record is replayed until `completed_at + ttl`, and is absent from then on:
/// `get` does not return it and `begin` acquires again (with a higher fence).
pub async fn completed_record_expires_after_ttl<S: Store>(store: &S) {
    let c = Case::new();
    let req = c.req("k", "a");
    let lease = acquire(store, &req, c.at(0)).await;
    complete(store, &req.key, &lease, b"r", c.at(5)).await;
    let expires = c.at(5).saturating_add(TTL);
    let just_before = Timestamp::from_millis(expires.as_millis() - 1);
    assert_eq!(&replayed(store, &req, just_before).await[..], b"r");
    assert!(store.get(&req.key, just_before).await.unwrap().is_some());
    assert!(store.get(&req.key, expires).await.unwrap().is_none());
    let again = acquire(store, &c.req("k", "other"), expires).await;
    assert!(again.fence > lease.fence);
}

/// An in-progress record is kept a whole TTL after its lease runs out (so its fence is
/// remembered); then it is absent and a different fingerprint may acquire the key.
pub async fn in_progress_record_expires_after_lease_and_retention<S: Store>(store: &S) {
    let c = Case::new();
    acquire(store, &c.req("k", "a"), c.at(0)).await;
    // lease ends at 10, retention at 110
    assert_eq!(
        store.begin(&c.req("k", "b"), c.at(109)).await.unwrap(),
        BeginOutcome::Mismatch
    );
    // A purge then keeps it (other runs may share the store, so the count proves nothing).
    store.purge_expired(c.at(109), 1000).await.unwrap();
    assert!(store.get(&c.key("k"), c.at(109)).await.unwrap().is_some());
    assert_eq!(
        store.begin(&c.req("k", "b"), c.at(109)).await.unwrap(),
        BeginOutcome::Mismatch
    );
    assert!(store.get(&c.key("k"), c.at(110)).await.unwrap().is_none());
    acquire(store, &c.req("k", "b"), c.at(110)).await;
}

/// A zero lease is raised to one millisecond: two `begin`s in the same millisecond are not
/// both acquired.
pub async fn zero_lease_still_excludes<S: Store>(store: &S) {
    let c = Case::new();
    let req = c.req("k", "a").with_lease(Duration::ZERO);
    let lease = acquire(store, &req, c.at(0)).await;
    assert_eq!(
        store.begin(&req, c.at(0)).await.unwrap(),
        BeginOutcome::InProgress {
            lease_expires_at: lease.expires_at
        }
    );
    assert_eq!(lease.expires_at.as_millis(), c.at(0).as_millis() + 1);
}

/// `purge_expired` deletes dead records and keeps live ones, including an in-progress record
/// whose retention has passed but whose lease is still live.
pub async fn purge_removes_only_dead_records<S: Store>(store: &S) {
    let c = Case::new();
    // done: completed at 0, expires at 100
    let done = c.req("done", "a");
    let l = acquire(store, &done, c.at(0)).await;
    store
        .complete(&done.key, &l, Bytes::new(), c.at(0))
        .await
        .unwrap();
    // fresh: completed at 50, expires at 150
    let fresh = c.req("fresh", "a");
    let l = acquire(store, &fresh, c.at(50)).await;
    store
        .complete(&fresh.key, &l, Bytes::new(), c.at(50))
        .await
        .unwrap();
    // long: in progress with a lease far beyond its retention
    let long = c.req("long", "a").with_lease(Duration::from_secs(1000));
    acquire(store, &long, c.at(0)).await;

    let now = c.at(120);
    // Other runs may share the store: purge until nothing dead is left.
    while store.purge_expired(now, 1000).await.unwrap() > 0 {}
    assert!(store.get(&done.key, now).await.unwrap().is_none());
    assert!(store.get(&fresh.key, now).await.unwrap().is_some());
    assert!(store.get(&long.key, now).await.unwrap().is_some());
    // after the purge, "done" is a fresh key
    acquire(store, &done, now).await;
    assert!(matches!(
        store.begin(&fresh, now).await.unwrap(),
        BeginOutcome::Replay(_)
    ));
}

/// A record completed after its lease ran out (and was not taken over) is retained from its
/// completion, so a purge past the lease's retention but before the completion's keeps it.
pub async fn purge_keeps_a_late_completion<S: Store>(store: &S) {
    let c = Case::new();
    let req = c.req("late", "a"); // lease 10, retention 100
    let lease = acquire(store, &req, c.at(0)).await;
    complete(store, &req.key, &lease, b"late", c.at(30)).await;
    // Past lease end plus retention (110), before completion plus retention (130).
    store.purge_expired(c.at(120), 100_000).await.unwrap();
    assert_eq!(&replayed(store, &req, c.at(120)).await[..], b"late");
}

/// `purge_expired` deletes no more than asked.
pub async fn purge_respects_limit<S: Store>(store: &S) {
    let c = Case::new();
    for i in 0..10 {
        let req = c.req(&format!("k{i}"), "a");
        let l = acquire(store, &req, c.at(0)).await;
        store
            .complete(&req.key, &l, Bytes::new(), c.at(0))
            .await
            .unwrap();
    }
    let now = c.at(200);
    assert!(store.purge_expired(now, 3).await.unwrap() <= 3);
    assert_eq!(store.purge_expired(now, 0).await.unwrap(), 0);
}

/// `get` shows status, fence, fingerprint, lease and timestamps of the live record.
pub async fn get_reports_the_record<S: Store>(store: &S) {
    let c = Case::new();
    let req = c.req("k", "a");
    assert!(store.get(&req.key, c.at(0)).await.unwrap().is_none());
    let lease = acquire(store, &req, c.at(0)).await;
    let rec = store.get(&req.key, c.at(1)).await.unwrap().unwrap();
    assert_eq!(rec.key, req.key);
    assert_eq!(rec.status, Status::InProgress);
    assert_eq!(rec.fingerprint, req.fingerprint);
    assert_eq!(rec.fence, lease.fence);
    assert_eq!(rec.lease_id, lease.id);
    assert_eq!(rec.lease_expires_at, lease.expires_at);
    assert_eq!(rec.created_at, c.at(0));
    assert_eq!(rec.response, None);
    complete(store, &req.key, &lease, b"x", c.at(2)).await;
    let rec = store.get(&req.key, c.at(3)).await.unwrap().unwrap();
    assert_eq!(rec.status, Status::Completed);
    assert_eq!(rec.response.as_deref(), Some(&b"x"[..]));
    assert_eq!(rec.updated_at, c.at(2));
    assert_eq!(rec.expires_at, c.at(2).saturating_add(TTL));
}

/// The same namespace and client key in two scopes are two records: neither sees, blocks or
/// replays the other.
pub async fn scope_isolation<S: Store>(store: &S) {
    let a = Case::new();
    let b = Case {
        scope: fresh_scope(),
        t0: a.t0,
    };
    let la = acquire(store, &a.req("shared", "x"), a.at(0)).await;
    // B's begin is not blocked by A's lease, and may even use another fingerprint.
    let lb = acquire(store, &b.req("shared", "y"), a.at(0)).await;
    complete(store, &a.key("shared"), &la, b"A", a.at(1)).await;
    complete_refused(store, &b.key("shared"), &la, b"A", a.at(1)).await;
    assert_eq!(
        store
            .get(&b.key("shared"), a.at(2))
            .await
            .unwrap()
            .unwrap()
            .status,
        Status::InProgress
    );
    complete(store, &b.key("shared"), &lb, b"B", a.at(2)).await;
    assert_eq!(
        &replayed(store, &a.req("shared", "x"), a.at(3)).await[..],
        b"A"
    );
    assert_eq!(
        &replayed(store, &b.req("shared", "y"), a.at(3)).await[..],
        b"B"
    );
}

/// The same client key in two namespaces of one scope are two records.
pub async fn namespace_isolation<S: Store>(store: &S) {
    let c = Case::new();
    let k1 = Key::parse(&c.scope, "ns1", "k").unwrap();
    let k2 = Key::parse(&c.scope, "ns2", "k").unwrap();
    let fp = Fingerprint::of_bytes(b"a");
    acquire(store, &BeginRequest::new(k1, fp), c.at(0)).await;
    acquire(store, &BeginRequest::new(k2, fp), c.at(0)).await;
}

const STORM: usize = 500;

/// 500 concurrent `begin`s of one absent key: exactly one `Acquired`, every other answer
/// `InProgress`.
pub async fn duplicate_storm<S: Store + Clone>(store: &S) {
    let c = Case::new();
    let req = Arc::new(c.req("storm", "a"));
    let now = c.at(0);
    let barrier = Arc::new(tokio::sync::Barrier::new(STORM));
    let tasks: Vec<_> = (0..STORM)
        .map(|_| {
            let (store, req, barrier) = (store.clone(), req.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                store.begin(&req, now).await.unwrap()
            })
        })
        .collect();
    let mut acquired = 0;
    for t in tasks {
        match t.await.unwrap() {
            BeginOutcome::Acquired(_) => acquired += 1,
            BeginOutcome::InProgress { .. } => {}
            other => panic!("unexpected outcome in a storm: {other:?}"),
        }
    }
    assert_eq!(acquired, 1, "exactly one begin may acquire");
}

/// 500 concurrent `begin`s of one key while the winner completes as soon as it wins: exactly
/// one `Acquired`; the others see `InProgress` or the winner's `Replay`, nothing else.
pub async fn duplicate_storm_with_completion<S: Store + Clone>(store: &S) {
    let c = Case::new();
    let req = Arc::new(c.req("storm", "a"));
    let now = c.at(0);
    let barrier = Arc::new(tokio::sync::Barrier::new(STORM));
    let tasks: Vec<_> = (0..STORM)
        .map(|_| {
            let (store, req, barrier) = (store.clone(), req.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let outcome = store.begin(&req, now).await.unwrap();
                if let BeginOutcome::Acquired(lease) = &outcome {
                    complete(&store, &req.key, lease, b"winner", now).await;
                }
                outcome
            })
        })
        .collect();
    let (mut acquired, mut replays) = (0, 0);
    for t in tasks {
        match t.await.unwrap() {
            BeginOutcome::Acquired(_) => acquired += 1,
            BeginOutcome::InProgress { .. } => {}
            BeginOutcome::Replay(r) => {
                assert_eq!(&r.response[..], b"winner");
                replays += 1;
            }
            BeginOutcome::Mismatch => panic!("a mismatch in a storm of one fingerprint"),
        }
    }
    assert_eq!(acquired, 1, "exactly one begin may acquire");
    assert!(replays < STORM);
    assert_eq!(&replayed(store, &req, now).await[..], b"winner");
}

/// `renew` extends the holder's lease (same id and fence): until the new end other begins get
/// `InProgress`, and the renewed lease completes. Renewing a lease that ran out but was not
/// taken over works too.
pub async fn renew_extends_the_lease<S: Store>(store: &S) {
    let c = Case::new();
    let req = c.req("k", "a");
    let lease = acquire(store, &req, c.at(0)).await;
    let renewed = store
        .renew(&req.key, &lease, Duration::from_secs(30), c.at(8))
        .await
        .unwrap();
    assert_eq!((renewed.id, renewed.fence), (lease.id, lease.fence));
    assert_eq!(renewed.expires_at, c.at(38));
    // Past the old lease end, the key is still held.
    assert_eq!(
        store.begin(&req, c.at(20)).await.unwrap(),
        BeginOutcome::InProgress {
            lease_expires_at: c.at(38)
        }
    );
    let r = store.get(&req.key, c.at(20)).await.unwrap().unwrap();
    assert_eq!(r.lease_expires_at, c.at(38));
    // Retention runs on from the new lease end.
    assert_eq!(r.expires_at, c.at(38).saturating_add(TTL));
    // Ran out at 38, nobody took over: renewing at 50 still works.
    let again = store
        .renew(&req.key, &renewed, Duration::from_secs(10), c.at(50))
        .await
        .unwrap();
    assert_eq!(again.expires_at, c.at(60));
    complete(store, &req.key, &again, b"done", c.at(55)).await;
    assert_eq!(&replayed(store, &req, c.at(56)).await[..], b"done");
}

/// `renew` is refused to a lease that was taken over, completed, released or never existed.
pub async fn stale_lease_cannot_renew<S: Store>(store: &S) {
    let c = Case::new();
    let req = c.req("k", "a");
    let old = acquire(store, &req, c.at(0)).await;
    let new = acquire(store, &req, c.at(10)).await; // took over at the end of the old lease
    let ten = Duration::from_secs(10);
    assert!(matches!(
        store.renew(&req.key, &old, ten, c.at(11)).await,
        Err(LeaseError::Stale(_))
    ));
    store
        .complete(&req.key, &new, Bytes::new(), c.at(12))
        .await
        .unwrap();
    assert!(matches!(
        store.renew(&req.key, &new, ten, c.at(13)).await,
        Err(LeaseError::Stale(_))
    ));
    let other = c.req("released", "a");
    let l = acquire(store, &other, c.at(0)).await;
    store.release(&other.key, &l, c.at(1)).await.unwrap();
    assert!(matches!(
        store
            .renew(&other.key, &l, Duration::from_secs(10), c.at(2))
            .await,
        Err(LeaseError::Stale(_))
    ));
    let forged = Lease {
        id: LeaseId::generate(),
        ..new
    };
    assert!(matches!(
        store
            .renew(&c.key("absent"), &forged, Duration::from_secs(10), c.at(2))
            .await,
        Err(LeaseError::Stale(_))
    ));
}

/// `advance` hands out disjoint ranges to concurrent callers, keeps counters apart from each
/// other and from records, and never lets a purge reset one.
pub async fn counters_advance_atomically<S: Store + Clone>(store: &S) {
    let c = Case::new();
    let key = c.key("counter");
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let (store, key) = (store.clone(), key.clone());
            tokio::spawn(async move {
                let mut got = Vec::new();
                for _ in 0..10 {
                    got.push(store.advance(&key, 100).await.unwrap());
                }
                got
            })
        })
        .collect();
    let mut ends = HashSet::new();
    for t in tasks {
        for end in t.await.unwrap() {
            assert_eq!(end % 100, 0, "ranges of 100 from 0");
            assert!(
                ends.insert(end),
                "the range ending at {end} was handed out twice"
            );
        }
    }
    assert_eq!(ends.len(), 200);
    assert_eq!(ends.iter().max(), Some(&20_000));
    // Another counter starts from zero; a record under the same key is another thing.
    assert_eq!(store.advance(&c.key("other"), 1).await.unwrap(), 1);
    acquire(store, &c.req("counter", "a"), c.at(0)).await;
    // Purges (at any time) leave counters alone.
    store
        .purge_expired(c.at(10 * 365 * 24 * 3600), 100_000)
        .await
        .unwrap();
    assert_eq!(store.advance(&key, 1).await.unwrap(), 20_001);
    // A step no counter can hold is refused, not cut down to a wrong range.
    assert!(matches!(
        store.advance(&key, u64::MAX).await,
        Err(StoreError::CounterExhausted)
    ));
    assert_eq!(store.advance(&key, 1).await.unwrap(), 20_002);
}

/// `raise` keeps the highest value it was given, shares counters with `advance`, and never
/// lowers one.
pub async fn counters_only_rise<S: Store + Clone>(store: &S) {
    let c = Case::new();
    let key = c.key("mark");
    assert_eq!(
        store.raise(&key, 1_795_000_000_000).await.unwrap(),
        1_795_000_000_000
    );
    assert_eq!(store.raise(&key, 5).await.unwrap(), 1_795_000_000_000);
    assert_eq!(
        store.raise(&key, 1_795_000_000_001).await.unwrap(),
        1_795_000_000_001
    );
    // Beyond what a double holds exactly.
    let big = (1u64 << 60) + 1;
    assert_eq!(store.raise(&key, big).await.unwrap(), big);
    assert_eq!(store.raise(&key, big - 1).await.unwrap(), big);
    assert_eq!(store.advance(&key, 1).await.unwrap(), big + 1);
    // Concurrent raises leave the largest.
    let other = c.key("race");
    let tasks: Vec<_> = (1..=50u64)
        .map(|i| {
            let (store, key) = (store.clone(), other.clone());
            tokio::spawn(async move { store.raise(&key, i * 1000).await.unwrap() })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(store.raise(&other, 0).await.unwrap(), 50_000);
}

/// Keys are compared byte for byte: keys that differ only in letter case name different
/// records (a case-insensitive SQL collation would fold them into one).
pub async fn keys_are_compared_exactly<S: Store>(store: &S) {
    let c = Case::new();
    let now = c.at(0);
    let lease = acquire(store, &c.req("Order-1", "a"), now).await;
    complete(store, &c.key("Order-1"), &lease, b"upper", now).await;
    for other in ["order-1", "ORDER-1"] {
        let l = acquire(store, &c.req(other, "b"), now).await;
        assert_eq!(
            l.fence,
            Lease::first_fence(now),
            "{other:?} shares a record with Order-1"
        );
    }
    assert_eq!(
        &replayed(store, &c.req("Order-1", "a"), now).await[..],
        b"upper"
    );
}

/// 50 keys, 20 concurrent attempts each, all interleaved: exactly one winner per key.
pub async fn storm_over_many_keys<S: Store + Clone>(store: &S) {
    let c = Case::new();
    let now = c.at(0);
    let tasks: Vec<_> = (0..1000)
        .map(|i| {
            let store = store.clone();
            let req = c.req(&format!("key-{}", i % 50), "a");
            tokio::spawn(async move {
                match store.begin(&req, now).await.unwrap() {
                    BeginOutcome::Acquired(_) => Some(req.key.client_key().to_string()),
                    BeginOutcome::InProgress { .. } => None,
                    other => panic!("unexpected outcome: {other:?}"),
                }
            })
        })
        .collect();
    let mut winners = HashSet::new();
    for t in tasks {
        if let Some(k) = t.await.unwrap() {
            assert!(winners.insert(k.clone()), "two winners for {k}");
        }
    }
    assert_eq!(winners.len(), 50);
}

/// 40 keys completed at once, then completed again at once by the same leases, half with the
/// same response and half with another: the first are `Ok`, the others stale, and every key
/// replays its first response (stores that complete many records in one statement must agree).
pub async fn concurrent_repeated_completes<S: Store + Clone>(store: &S) {
    let c = Case::new();
    let now = c.at(0);
    let mut leases = Vec::new();
    for i in 0..40 {
        let req = c.req(&format!("key-{i}"), "a");
        leases.push((req.clone(), acquire(store, &req, now).await));
    }
    let complete_all = |second: bool| {
        let tasks: Vec<_> = leases
            .iter()
            .enumerate()
            .map(|(i, (req, lease))| {
                let (store, key, lease) = (store.clone(), req.key.clone(), *lease);
                let body = if second && i % 2 == 1 {
                    "other"
                } else {
                    "first"
                };
                tokio::spawn(async move {
                    store
                        .complete(&key, &lease, Bytes::from(format!("{body}-{i}")), now)
                        .await
                })
            })
            .collect();
        async move {
            let mut results = Vec::new();
            for t in tasks {
                results.push(t.await.unwrap());
            }
            results
        }
    };
    for done in complete_all(false).await {
        done.unwrap();
    }
    for (i, done) in complete_all(true).await.into_iter().enumerate() {
        if i % 2 == 1 {
            assert_stale(done);
        } else {
            done.unwrap();
        }
    }
    for (i, (req, _)) in leases.iter().enumerate() {
        let expected = format!("first-{i}");
        assert_eq!(&replayed(store, req, now).await[..], expected.as_bytes());
    }
}
