//! The conformance suite for lock backends ([`LockStore`](idem_core::LockStore)): every
//! backend passes these cases unchanged. Run them with [`lock_conformance_tests!`](crate::lock_conformance_tests).
//!
//! Leases run by the backend's own clock, so the cases that need a lease to run out wait for it
//! (a few hundred milliseconds); each case uses lock names of its own, so cases may share a
//! server.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    Acquire, DynLockStore, Held, LockError, LockName, LockOwner, OwnerDigest, SharedLockStore,
};

/// A long lease: never runs out during a case.
const LONG: Duration = Duration::from_secs(60);

/// A lock name no other case or run uses.
pub fn fresh_name(case: &str) -> LockName {
    let n: u64 = rand::random();
    LockName::new(&format!("conformance:{case}:{n:016x}")).unwrap()
}

fn owner() -> OwnerDigest {
    LockOwner::random().digest()
}

async fn acquired(
    store: &dyn DynLockStore,
    name: &LockName,
    who: OwnerDigest,
    lease: Duration,
) -> Held {
    match store.acquire(name, who, lease).await.unwrap() {
        Acquire::Acquired(held) => held,
        Acquire::Busy { until } => panic!("expected to acquire {name}, held until {until:?}"),
    }
}

async fn busy(store: &dyn DynLockStore, name: &LockName, who: OwnerDigest) {
    match store.acquire(name, who, LONG).await.unwrap() {
        Acquire::Busy { .. } => {}
        Acquire::Acquired(held) => panic!("acquired {name} while it is held: {held:?}"),
    }
}

/// One holder at a time; the holder acquiring again keeps its fence; others are told until
/// when it is held.
pub async fn one_holder_at_a_time(store: &dyn DynLockStore) {
    let name = fresh_name("one_holder");
    let (a, b) = (owner(), owner());
    let held = acquired(store, &name, a, LONG).await;
    assert!(held.fence > 0);
    match store.acquire(&name, b, LONG).await.unwrap() {
        Acquire::Busy { until } => assert_eq!(until, held.expires_at),
        Acquire::Acquired(_) => panic!("two holders"),
    }
    let again = acquired(store, &name, a, LONG).await;
    assert_eq!(
        again.fence, held.fence,
        "a repeated acquire keeps the fence"
    );
    busy(store, &name, b).await;
}

/// Renew and release by anyone but the holder, or with another fence, are refused and change
/// nothing.
pub async fn only_the_owner_renews_and_releases(store: &dyn DynLockStore) {
    let name = fresh_name("owner_checks");
    let (a, b) = (owner(), owner());
    let held = acquired(store, &name, a, LONG).await;
    let not_owner =
        |r: Result<(), LockError>| assert!(matches!(r, Err(LockError::NotOwner)), "{r:?}");
    not_owner(store.release(&name, b, held.fence).await);
    not_owner(store.release(&name, a, held.fence + 1).await);
    not_owner(store.renew(&name, b, held.fence, LONG).await.map(drop));
    not_owner(store.renew(&name, a, held.fence - 1, LONG).await.map(drop));
    busy(store, &name, b).await;
    let renewed = store.renew(&name, a, held.fence, LONG).await.unwrap();
    assert_eq!(renewed.fence, held.fence);
    assert!(renewed.expires_at >= held.expires_at);
    // Nobody holds an unknown name.
    not_owner(store.release(&fresh_name("never_held"), a, 1).await);
    not_owner(
        store
            .renew(&fresh_name("never_held"), a, 1, LONG)
            .await
            .map(drop),
    );
}

/// A release frees the lock at once for others, with a higher fence; the released holding can
/// no longer be renewed or released... except that repeating the release succeeds.
pub async fn release_frees_and_fences_increase(store: &dyn DynLockStore) {
    let name = fresh_name("release");
    let (a, b) = (owner(), owner());
    let first = acquired(store, &name, a, LONG).await;
    store.release(&name, a, first.fence).await.unwrap();
    store.release(&name, a, first.fence).await.unwrap();
    assert!(matches!(
        store.renew(&name, a, first.fence, LONG).await,
        Err(LockError::NotOwner)
    ));
    let second = acquired(store, &name, b, LONG).await;
    assert!(second.fence > first.fence);
    assert!(matches!(
        store.release(&name, a, first.fence).await,
        Err(LockError::NotOwner)
    ));
    store.release(&name, b, second.fence).await.unwrap();
    // The same owner acquiring after its own release is a new holding.
    let third = acquired(store, &name, a, LONG).await;
    assert!(third.fence > second.fence);
}

/// A lease that runs out frees the lock for another owner, with a higher fence; the old holder
/// can then neither renew nor release.
pub async fn a_lease_runs_out(store: &dyn DynLockStore) {
    let name = fresh_name("lease");
    let (a, b) = (owner(), owner());
    let short = Duration::from_millis(150);
    let old = acquired(store, &name, a, short).await;
    busy(store, &name, b).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    // Ran out, nobody took it: it cannot be renewed (lost stays lost).
    assert!(matches!(
        store.renew(&name, a, old.fence, LONG).await,
        Err(LockError::NotOwner)
    ));
    let new = acquired(store, &name, b, LONG).await;
    assert!(new.fence > old.fence);
    assert!(matches!(
        store.release(&name, a, old.fence).await,
        Err(LockError::NotOwner)
    ));
    busy(store, &name, a).await;
}

/// The longest lease there is (`Duration::MAX`, granted as
/// [`MAX_LEASE_MILLIS`](idem_core::lock::MAX_LEASE_MILLIS)) is held, renewed and released like
/// any other, and leaves nothing behind.
pub async fn an_endless_lease_is_held_and_released(store: &dyn DynLockStore) {
    let name = fresh_name("endless");
    let (a, b) = (owner(), owner());
    let held = acquired(store, &name, a, Duration::MAX).await;
    busy(store, &name, b).await;
    let renewed = store
        .renew(&name, a, held.fence, Duration::MAX)
        .await
        .unwrap();
    assert_eq!(renewed.fence, held.fence);
    store.release(&name, a, held.fence).await.unwrap();
    let next = acquired(store, &name, b, LONG).await;
    assert!(next.fence > held.fence);
    store.release(&name, b, next.fence).await.unwrap();
}

/// Of many concurrent acquires of a free lock exactly one wins.
pub async fn acquire_storm(store: SharedLockStore) {
    let name = fresh_name("storm");
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let (store, name) = (Arc::clone(&store), name.clone());
            tokio::spawn(async move { store.acquire(&name, owner(), LONG).await.unwrap() })
        })
        .collect();
    let mut winners = 0;
    for t in tasks {
        if matches!(t.await.unwrap(), Acquire::Acquired(_)) {
            winners += 1;
        }
    }
    assert_eq!(winners, 1);
}

/// Names are independent.
pub async fn names_are_independent(store: &dyn DynLockStore) {
    let (x, y) = (fresh_name("x"), fresh_name("y"));
    let (a, b) = (owner(), owner());
    acquired(store, &x, a, LONG).await;
    acquired(store, &y, b, LONG).await;
}

/// A backend that offers a release feed reports a release of a held lock to a listener that
/// subscribed before it.
pub async fn a_release_is_heard(store: &dyn DynLockStore) {
    let Some(mut listener) = store.listen() else {
        return;
    };
    let name = fresh_name("heard");
    let a = owner();
    let held = acquired(store, &name, a, LONG).await;
    // A feed that must first subscribe at its server gets a moment to do so.
    tokio::time::sleep(Duration::from_millis(200)).await;
    store.release(&name, a, held.fence).await.unwrap();
    let heard = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            // `None` (releases may have been missed, as when the feed connects) is no answer.
            if listener.next().await.is_some_and(|n| *n == *name.as_str()) {
                return true;
            }
        }
    })
    .await;
    assert_eq!(
        heard.ok(),
        Some(true),
        "the release of {name} was not heard"
    );
}

/// A backend that lists held locks shows those whose lease lasts, with the fence and lease
/// end their acquire reported, ordered by name and at most as many as asked for; not one whose
/// lease ran out, nor one released.
pub async fn held_lists_live_locks(store: &dyn DynLockStore) {
    let (a, b) = (fresh_name("held"), fresh_name("held"));
    let (ran_out, released) = (fresh_name("held"), fresh_name("held"));
    let who = owner();
    let short = acquired(store, &ran_out, who, Duration::from_millis(150)).await;
    let held_a = acquired(store, &a, who, LONG).await;
    let held_b = acquired(store, &b, owner(), LONG).await;
    let gone = acquired(store, &released, who, LONG).await;
    store.release(&released, who, gone.fence).await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        short.expires_at < held_a.expires_at,
        "the short lease ends first"
    );
    let Some(listed) = store.held(1000).await.unwrap() else {
        return;
    };
    assert!(listed.len() <= 1000);
    assert!(
        listed.windows(2).all(|w| w[0].name < w[1].name),
        "ordered by name, each once"
    );
    let find = |name: &LockName| listed.iter().find(|l| l.name == *name);
    for (name, held) in [(&a, held_a), (&b, held_b)] {
        let l = find(name).unwrap_or_else(|| panic!("{name} is held but not listed"));
        assert_eq!((l.fence, l.expires_at), (held.fence, held.expires_at));
    }
    assert!(find(&ran_out).is_none(), "a lease that ran out is listed");
    assert!(find(&released).is_none(), "a released lock is listed");
    let one = store.held(1).await.unwrap().unwrap_or_default();
    assert!(one.len() <= 1);
}

/// Waits in the backend's queue for `name` (for up to `wait`), or `None` for a backend without
/// one.
fn queued(
    store: &dyn DynLockStore,
    name: &LockName,
    who: OwnerDigest,
    lease: Duration,
    wait: Duration,
) -> Option<tokio::task::JoinHandle<Acquire>> {
    let fut = store.acquire_queued(name, who, lease, wait)?;
    Some(tokio::spawn(async move { fut.await.unwrap().answer }))
}

/// Whether the spawned waiter has answered.
async fn answered(waiter: &tokio::task::JoinHandle<Acquire>) -> bool {
    tokio::time::sleep(Duration::from_millis(300)).await;
    waiter.is_finished()
}

/// A backend with a queue of waiters: a waiter answers only once the holder releases, and
/// then holds with a higher fence; waiters are served in the order they came; the holder
/// asking again in the queue keeps its fence at once.
pub async fn a_queue_serves_waiters_in_order(store: &dyn DynLockStore) {
    let name = fresh_name("queue");
    let (a, b, c) = (owner(), owner(), owner());
    let first = acquired(store, &name, a, LONG).await;
    let wait = Duration::from_secs(20);
    let Some(second) = queued(store, &name, b, LONG, wait) else {
        return;
    };
    assert!(
        !answered(&second).await,
        "a waiter answered while the lock is held"
    );
    let third = queued(store, &name, c, LONG, wait).unwrap();
    assert!(!answered(&third).await);
    let again = store
        .acquire_queued(&name, a, LONG, wait)
        .unwrap()
        .await
        .unwrap();
    match again.answer {
        Acquire::Acquired(held) => {
            assert_eq!(
                held.fence, first.fence,
                "the holder asking again keeps its fence"
            );
        }
        Acquire::Busy { .. } => panic!("the holder waited behind its own holding"),
    }
    store.release(&name, a, first.fence).await.unwrap();
    let Acquire::Acquired(held_b) = tokio::time::timeout(wait, second).await.unwrap().unwrap()
    else {
        panic!("the first waiter did not get the lock");
    };
    assert!(held_b.fence > first.fence);
    assert!(
        !answered(&third).await,
        "the second waiter got the lock while the first holds it"
    );
    busy(store, &name, a).await;
    store.release(&name, b, held_b.fence).await.unwrap();
    let Acquire::Acquired(held_c) = tokio::time::timeout(wait, third).await.unwrap().unwrap()
    else {
        panic!("the second waiter did not get the lock");
    };
    assert!(held_c.fence > held_b.fence);
    store.release(&name, c, held_c.fence).await.unwrap();
}

/// A backend with a queue: a waiter whose holder's lease runs out (no release) gets the lock;
/// one whose wait runs out answers `Busy` and leaves the queue, as does one dropped while it
/// waits, so that the next caller is not kept behind them.
pub async fn a_queue_outlives_no_one(store: &dyn DynLockStore) {
    let name = fresh_name("queue_leave");
    let (a, b, c, d) = (owner(), owner(), owner(), owner());
    let short = Duration::from_millis(400);
    let first = acquired(store, &name, a, short).await;
    let Some(waiter) = queued(store, &name, b, LONG, Duration::from_secs(20)) else {
        return;
    };
    let Acquire::Acquired(held_b) = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("a waiter behind a lease that ran out still waits")
        .unwrap()
    else {
        panic!("the waiter did not get the lock after the lease ran out");
    };
    assert!(held_b.fence > first.fence);
    // A wait that runs out answers who holds it, and leaves nothing behind.
    let timed_out = store
        .acquire_queued(&name, c, LONG, Duration::from_millis(200))
        .unwrap()
        .await
        .unwrap();
    assert_eq!(
        timed_out.answer,
        Acquire::Busy {
            until: held_b.expires_at
        }
    );
    // A waiter dropped while it waits.
    let dropped = store
        .acquire_queued(&name, d, LONG, Duration::from_secs(20))
        .unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(300), dropped)
            .await
            .is_err()
    );
    // Give a backend that leaves its queue in the background a moment to do so.
    tokio::time::sleep(Duration::from_millis(300)).await;
    store.release(&name, b, held_b.fence).await.unwrap();
    let next = acquired(store, &name, a, LONG).await;
    assert!(next.fence > held_b.fence);
}

/// For a backend with a queue: eight waiters queued behind one holder get the lock one after
/// another, in the order they came, one at a time, with rising fences; each hand-off wakes the
/// waiter next in line only (its predecessor taking the lock, then leaving it), never the whole
/// queue. `wakeups` reads the backend's count of waiters woken by a watch: at most three per
/// hand-off.
pub async fn a_release_wakes_only_the_next_waiter(
    store: SharedLockStore,
    wakeups: impl Fn() -> u64,
) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let name = fresh_name("herd");
    let holder = owner();
    let first = acquired(&*store, &name, holder, LONG).await;
    const WAITERS: usize = 8;
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let held = Arc::new(AtomicBool::new(true));
    let mut tasks = Vec::new();
    for i in 0..WAITERS {
        let (store, name, order) = (Arc::clone(&store), name.clone(), Arc::clone(&order));
        let held_flag = Arc::clone(&held);
        tasks.push(tokio::spawn(async move {
            let who = owner();
            let queued = store
                .acquire_queued(&name, who, LONG, LONG)
                .expect("a backend with a queue")
                .await
                .unwrap();
            let Acquire::Acquired(got) = queued.answer else {
                panic!("waiter {i} timed out");
            };
            let was = held_flag.swap(true, Ordering::SeqCst);
            assert!(!was, "waiter {i} got the lock while another held it");
            order.lock().unwrap().push((i, got.fence));
            tokio::task::yield_now().await;
            held_flag.store(false, Ordering::SeqCst);
            store.release(&name, who, got.fence).await.unwrap();
        }));
        // Each in the queue before the next comes.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let before = wakeups();
    held.store(false, Ordering::SeqCst);
    store.release(&name, holder, first.fence).await.unwrap();
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("every waiter gets the lock")
            .unwrap();
    }
    let order = order.lock().unwrap().clone();
    assert_eq!(
        order.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
        (0..WAITERS).collect::<Vec<_>>(),
        "first come, first served"
    );
    assert!(
        order.windows(2).all(|w| w[0].1 < w[1].1),
        "fences rise: {order:?}"
    );
    assert!(order[0].1 > first.fence);
    let woken = wakeups() - before;
    assert!(
        woken <= 3 * WAITERS as u64,
        "{woken} wake-ups for {WAITERS} hand-offs: releases wake more than the next waiter"
    );
}

/// Generates one `#[test]` per lock conformance case. The argument is an async expression
/// yielding `Option<SharedLockStore>` (`None` skips, for a backend without its server), or
/// a tuple of that and a guard to keep alive.
#[macro_export]
macro_rules! lock_conformance_tests {
    ($fixture:expr) => {
        $crate::lock_conformance_tests!(@cases $fixture;
            one_holder_at_a_time,
            only_the_owner_renews_and_releases,
            release_frees_and_fences_increase,
            a_lease_runs_out,
            names_are_independent,
            a_release_is_heard,
            held_lists_live_locks,
            an_endless_lease_is_held_and_released,
            a_queue_serves_waiters_in_order,
            a_queue_outlives_no_one,
        );
        #[test]
        fn acquire_storm() {
            $crate::block_on(async {
                let Some((store, _guard)) = $crate::locks::IntoLockFixture::into_lock_fixture($fixture.await) else {
                    return;
                };
                $crate::locks::acquire_storm(store).await;
            });
        }
    };
    (@cases $fixture:expr; $($case:ident,)*) => {
        $(
            #[test]
            fn $case() {
                $crate::block_on(async {
                    let Some((store, _guard)) = $crate::locks::IntoLockFixture::into_lock_fixture($fixture.await) else {
                        return;
                    };
                    $crate::locks::$case(&*store).await;
                });
            }
        )*
    };
}

/// What a lock fixture expression may yield: a backend (or `None` to skip), optionally with a
/// guard that must live as long as it.
pub trait IntoLockFixture {
    /// The backend and its guard, or `None` to skip.
    fn into_lock_fixture(self) -> Option<(SharedLockStore, Box<dyn std::any::Any>)>;
}

impl IntoLockFixture for Option<SharedLockStore> {
    fn into_lock_fixture(self) -> Option<(SharedLockStore, Box<dyn std::any::Any>)> {
        self.map(|s| (s, Box::new(()) as Box<dyn std::any::Any>))
    }
}

impl IntoLockFixture for SharedLockStore {
    fn into_lock_fixture(self) -> Option<(SharedLockStore, Box<dyn std::any::Any>)> {
        Some((self, Box::new(())))
    }
}

impl<G: std::any::Any> IntoLockFixture for Option<(SharedLockStore, G)> {
    fn into_lock_fixture(self) -> Option<(SharedLockStore, Box<dyn std::any::Any>)> {
        self.map(|(s, g)| (s, Box::new(g) as Box<dyn std::any::Any>))
    }
}
