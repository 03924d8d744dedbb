//! The operator's cases: listing, counting and fenced repairs ([`RecordAdmin`]), which every
//! store in idem offers.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use idem_core::{
    BeginRequest, Bytes, Counts, Cursor, Fingerprint, Key, Lease, Namespace, Page, RecordAdmin,
    RecordFilter, RecordState, Repair, Scope, Shown, Status, Store, StoreError, Timestamp,
};

use super::{Case, LEASE, TTL, acquire, complete};

/// The HTTP layer's mark of an unknown outcome, as a response prefix to filter by.
const UNKNOWN: &[u8] = b"IDH1\x01";

fn admin<S: Store>(store: &S) -> &dyn RecordAdmin {
    store
        .admin()
        .expect("every store in idem offers the operator's view")
}

fn in_scope(c: &Case) -> RecordFilter {
    RecordFilter {
        scope: Some(Scope::new(c.scope.clone()).unwrap()),
        ..RecordFilter::default()
    }
}

/// Every page of a listing, followed to its end (bounded, so a cursor that never ends fails).
async fn list_all(
    admin: &dyn RecordAdmin,
    filter: &RecordFilter,
    limit: usize,
    now: Timestamp,
) -> Vec<idem_core::Listed> {
    let mut out = Vec::new();
    let mut after: Option<Cursor> = None;
    for _ in 0..10_000 {
        let Page { records, next } = admin
            .list(filter, after.as_ref(), limit, now)
            .await
            .unwrap();
        out.extend(records);
        match next {
            // The text form is what clients hand back.
            Some(cursor) => after = Some(cursor.to_string().parse().unwrap()),
            None => return out,
        }
    }
    panic!("a listing that never ends");
}

fn keys(listed: &[idem_core::Listed]) -> Vec<String> {
    let mut keys: Vec<String> = listed
        .iter()
        .map(|l| l.key.client_key().as_str().to_owned())
        .collect();
    keys.sort();
    keys
}

/// When the records [`populate`] writes are looked at, in seconds from the case's start.
///
/// Late enough that the `expired` record's TTL is long: a store that also expires records
/// natively (Redis: the TTL plus a margin, in wall-clock time) still holds it while a listing
/// scans a crowded server.
const SEEN: u64 = 60;

/// Records in every state, in the case's scope, as seen at `c.at(SEEN)`:
/// `running` in progress (acquired a second before), `stuck` (acquired at 0, lease ran out at
/// 10), `done` completed, `unknown` completed with the HTTP layer's unknown mark, `released`,
/// `expired` (completed at 0 with a TTL that ended 10 s before `SEEN`), and `other` in another
/// namespace (completed).
async fn populate<S: Store>(store: &S, c: &Case) -> BTreeMap<&'static str, Lease> {
    let short = |k: &str| {
        BeginRequest::new(c.key(k), Fingerprint::of_bytes(b"a"))
            .with_lease(LEASE)
            .with_ttl(Duration::from_secs(SEEN - 10))
    };
    let mut leases = BTreeMap::new();
    leases.insert("stuck", acquire(store, &c.req("stuck", "a"), c.at(0)).await);
    for (name, body) in [("done", &b"IDH1\x00ok"[..]), ("unknown", UNKNOWN)] {
        let lease = acquire(store, &c.req(name, "a"), c.at(1)).await;
        store
            .complete(&c.key(name), &lease, Bytes::copy_from_slice(body), c.at(2))
            .await
            .unwrap();
        leases.insert(name, lease);
    }
    let lease = acquire(store, &c.req("released", "a"), c.at(1)).await;
    store
        .release(&c.key("released"), &lease, c.at(3))
        .await
        .unwrap();
    leases.insert("released", lease);
    let lease = acquire(store, &short("expired"), c.at(0)).await;
    store
        .complete(&c.key("expired"), &lease, Bytes::new(), c.at(0))
        .await
        .unwrap();
    leases.insert("expired", lease);
    let other = Key::parse(&c.scope, "elsewhere", "other").unwrap();
    let req = BeginRequest::new(other.clone(), Fingerprint::of_bytes(b"a")).with_ttl(TTL);
    let lease = acquire(store, &req, c.at(1)).await;
    store
        .complete(&other, &lease, Bytes::new(), c.at(1))
        .await
        .unwrap();
    leases.insert("other", lease);
    leases.insert(
        "running",
        acquire(store, &c.req("running", "a"), c.at(SEEN - 1)).await,
    );
    leases
}

/// Following the cursor pages through every record once, with the state each is in, however
/// small the pages; a page never holds far more than asked.
pub async fn listing_pages_through_every_record_once<S: Store>(store: &S) {
    let c = Case::new();
    let mut names = Vec::new();
    for i in 0..23u32 {
        let name = format!("k{i:02}");
        let lease = acquire(store, &c.req(&name, "a"), c.at(0)).await;
        if i.is_multiple_of(3) {
            complete(store, &c.key(&name), &lease, b"r", c.at(1)).await;
        }
        names.push(name);
    }
    let admin = admin(store);
    for limit in [1, 4, 7, 100] {
        let listed = list_all(admin, &in_scope(&c), limit, c.at(2)).await;
        assert_eq!(keys(&listed), names, "pages of {limit}");
        let distinct: HashSet<_> = listed.iter().map(|l| l.key.clone()).collect();
        assert_eq!(distinct.len(), listed.len(), "no record listed twice");
        for l in &listed {
            let i: u32 = l.key.client_key().as_str()[1..].parse().unwrap();
            let (state, len) = if i.is_multiple_of(3) {
                (RecordState::Completed, Some(1))
            } else {
                (RecordState::InProgress, None)
            };
            assert_eq!((l.state, l.response_len), (state, len), "{i}");
            assert_eq!(l.fence, Lease::first_fence(c.at(0)));
            assert_eq!(l.created_at, c.at(0));
            assert_eq!(l.lease_expires_at, c.at(0).saturating_add(LEASE));
        }
    }
    let first = admin.list(&in_scope(&c), None, 5, c.at(2)).await.unwrap();
    assert!(first.next.is_some(), "23 records do not fit a page of 5");
    assert!(
        first.records.len() <= 5 + 64,
        "a page holds about what was asked"
    );
}

/// Each filter narrows the listing: by state (every one of them), namespace, age and response
/// prefix; the head of a stored response comes with it.
pub async fn listing_filters_by_state_namespace_age_and_prefix<S: Store>(store: &S) {
    let c = Case::new();
    populate(store, &c).await;
    let admin = admin(store);
    let now = c.at(SEEN);
    let by = |f: RecordFilter| async move { keys(&list_all(admin, &f, 3, now).await) };
    let state = |s| RecordFilter {
        state: Some(s),
        ..in_scope(&c)
    };
    assert_eq!(by(state(RecordState::InProgress)).await, ["running"]);
    assert_eq!(by(state(RecordState::Stuck)).await, ["stuck"]);
    assert_eq!(
        by(state(RecordState::Completed)).await,
        ["done", "other", "unknown"]
    );
    assert_eq!(by(state(RecordState::Released)).await, ["released"]);
    assert_eq!(by(state(RecordState::Expired)).await, ["expired"]);
    let everything = by(in_scope(&c)).await;
    assert_eq!(everything.len(), 7, "{everything:?}");

    let namespace = RecordFilter {
        namespace: Some(Namespace::new("elsewhere").unwrap()),
        ..in_scope(&c)
    };
    assert_eq!(by(namespace).await, ["other"]);
    let old = RecordFilter {
        created_before: Some(c.at(0)),
        ..in_scope(&c)
    };
    assert_eq!(by(old).await, ["expired", "stuck"]);
    let unknown = RecordFilter {
        response_prefix: Some(Bytes::from_static(UNKNOWN)),
        ..in_scope(&c)
    };
    let listed = list_all(admin, &unknown, 3, now).await;
    assert_eq!(keys(&listed), ["unknown"]);
    assert_eq!(&listed[0].response_head[..], UNKNOWN);
    assert_eq!(listed[0].response_len, Some(UNKNOWN.len() as u64));
    let done = list_all(
        admin,
        &RecordFilter {
            response_prefix: Some(Bytes::from_static(b"IDH1")),
            state: Some(RecordState::Completed),
            namespace: Some(Namespace::new("conformance").unwrap()),
            ..in_scope(&c)
        },
        3,
        now,
    )
    .await;
    assert_eq!(keys(&done), ["done", "unknown"]);
}

/// Counts by state agree with the listing, filters narrow them, and the oldest attempt's age is
/// reported.
pub async fn counts_by_state<S: Store>(store: &S) {
    let c = Case::new();
    let admin = admin(store);
    assert_eq!(
        admin.count(&in_scope(&c), c.at(SEEN)).await.unwrap(),
        Counts::default()
    );
    populate(store, &c).await;
    let counts = admin.count(&in_scope(&c), c.at(SEEN)).await.unwrap();
    assert_eq!(
        counts,
        Counts {
            in_progress: 1,
            stuck: 1,
            completed: 3,
            released: 1,
            expired: 1,
            oldest_in_progress: Some(c.at(0)),
        }
    );
    let unknown = RecordFilter {
        response_prefix: Some(Bytes::from_static(UNKNOWN)),
        // The state of a count's filter is ignored.
        state: Some(RecordState::Released),
        ..in_scope(&c)
    };
    let counts = admin.count(&unknown, c.at(SEEN)).await.unwrap();
    assert_eq!((counts.completed, counts.total()), (1, 1));
    let namespace = RecordFilter {
        namespace: Some(Namespace::new("elsewhere").unwrap()),
        ..in_scope(&c)
    };
    assert_eq!(
        admin.count(&namespace, c.at(SEEN)).await.unwrap().total(),
        1
    );
}

/// A repair lands only on the record that was shown (same state, same fence): releasing a
/// stuck attempt or an unknown outcome lets the next `begin` run; deleting forgets the record;
/// a repair of a record that moved on, or that it does not apply to, changes nothing.
pub async fn repairs_are_fenced<S: Store>(store: &S) {
    let c = Case::new();
    let leases = populate(store, &c).await;
    let admin = admin(store);
    let now = c.at(SEEN);
    let shown = |name: &str, state| Shown {
        state,
        fence: leases[name].fence,
    };

    // Moved on, or not what was shown: nothing changes.
    let stuck = shown("stuck", RecordState::Stuck);
    let wrong_fence = Shown {
        fence: stuck.fence + 1,
        ..stuck
    };
    assert!(!fix(admin, &c, "stuck", wrong_fence, Repair::Release, now).await);
    assert!(
        !fix(
            admin,
            &c,
            "stuck",
            shown("stuck", RecordState::InProgress),
            Repair::Release,
            now
        )
        .await
    );
    assert!(
        !fix(
            admin,
            &c,
            "stuck",
            shown("stuck", RecordState::Completed),
            Repair::Delete,
            now
        )
        .await
    );
    let released = shown("released", RecordState::Released);
    assert!(!fix(admin, &c, "released", released, Repair::Release, now).await);
    assert!(!fix(admin, &c, "absent", stuck, Repair::Delete, now).await);
    assert_eq!(admin.count(&in_scope(&c), now).await.unwrap().total(), 7);

    // A stuck attempt released: the next begin runs, with a higher fence.
    let stuck_again = Shown {
        state: RecordState::Stuck,
        fence: leases["stuck"].fence,
    };
    assert!(
        !admin
            .repair(&c.key("running"), stuck_again, Repair::Release, now)
            .await
            .unwrap(),
        "a running attempt is not stuck"
    );
    assert!(fix(admin, &c, "stuck", stuck_again, Repair::Release, now).await);
    assert!(
        !fix(admin, &c, "stuck", stuck_again, Repair::Release, now).await,
        "once"
    );
    let rec = store.get(&c.key("stuck"), now).await.unwrap().unwrap();
    assert_eq!(rec.status, Status::Released);
    let next = acquire(store, &c.req("stuck", "a"), now).await;
    assert!(next.fence > leases["stuck"].fence);
    // The old attempt cannot complete over the new one.
    assert!(
        store
            .complete(&c.key("stuck"), &leases["stuck"], Bytes::new(), now)
            .await
            .is_err()
    );

    // An unknown outcome released: its answer is gone and the next begin runs.
    assert!(
        fix(
            admin,
            &c,
            "unknown",
            shown("unknown", RecordState::Completed),
            Repair::Release,
            now
        )
        .await
    );
    let rec = store.get(&c.key("unknown"), now).await.unwrap().unwrap();
    assert_eq!((rec.status, rec.response), (Status::Released, None));
    assert_eq!(
        rec.expires_at,
        now.saturating_add(TTL),
        "retention restarts"
    );
    acquire(store, &c.req("unknown", "a"), now).await;

    // Deleting: a completed record and an expired one are forgotten.
    assert!(
        fix(
            admin,
            &c,
            "done",
            shown("done", RecordState::Completed),
            Repair::Delete,
            now
        )
        .await
    );
    assert_eq!(store.get(&c.key("done"), now).await.unwrap(), None);
    let recreated = acquire(store, &c.req("done", "b"), now).await;
    assert!(
        recreated.fence > leases["done"].fence,
        "the fence went back"
    );
    assert!(
        fix(
            admin,
            &c,
            "expired",
            shown("expired", RecordState::Expired),
            Repair::Delete,
            now
        )
        .await
    );
    let left = keys(&list_all(admin, &in_scope(&c), 10, now).await);
    assert_eq!(
        left,
        ["done", "other", "released", "running", "stuck", "unknown"]
    );
}

async fn fix(
    admin: &dyn RecordAdmin,
    c: &Case,
    name: &str,
    shown: Shown,
    repair: Repair,
    now: Timestamp,
) -> bool {
    admin
        .repair(&c.key(name), shown, repair, now)
        .await
        .unwrap()
}

/// A listing a store cannot answer is refused as such, without asking the store: a page of 0
/// or of more than the most, a prefix longer than a response's head.
pub async fn listing_refuses_bad_arguments<S: Store>(store: &S) {
    let c = Case::new();
    let admin = admin(store);
    let now = c.at(0);
    for limit in [0, idem_core::admin::MAX_PAGE + 1] {
        let result = admin.list(&in_scope(&c), None, limit, now).await;
        assert!(
            matches!(result, Err(StoreError::Invalid(_))),
            "limit {limit}: {result:?}"
        );
    }
    let long = RecordFilter {
        response_prefix: Some(Bytes::from(vec![b'x'; idem_core::admin::RESPONSE_HEAD + 1])),
        ..in_scope(&c)
    };
    assert!(matches!(
        admin.list(&long, None, 10, now).await,
        Err(StoreError::Invalid(_))
    ));
}

/// A key's fences never go back: across release, reopen, a takeover, an operator's delete (of
/// a running attempt too), expiry and purge, every acquisition's fence is higher than every one
/// before, so a resource that checks fences refuses the attempt that was overtaken. The lease
/// that creates a record has [`Lease::first_fence`] of its time; every other acquisition has a
/// higher one, which is how a caller tells that there may be steps to resume.
pub async fn fences_never_go_back<S: Store>(store: &S) {
    let c = Case::new();
    let admin = admin(store);
    let req = c.req("k", "a");
    let created = |lease: &Lease, at: Timestamp| {
        assert_eq!(
            lease.fence,
            Lease::first_fence(at),
            "a created record's fence"
        );
        assert!(!lease.may_resume());
    };
    let mut fences = Vec::new();

    let first = acquire(store, &req, c.at(0)).await;
    created(&first, c.at(0));
    fences.push(first.fence);
    // Released and acquired again within the same millisecond.
    store.release(&req.key, &first, c.at(0)).await.unwrap();
    let again = acquire(store, &req, c.at(0)).await;
    assert!(again.may_resume(), "a second lease may resume steps");
    fences.push(again.fence);
    complete(store, &req.key, &again, b"r", c.at(1)).await;
    assert!(store.reopen(&req.key, again.fence, c.at(1)).await.unwrap());
    let reopened = acquire(store, &req, c.at(1)).await;
    fences.push(reopened.fence);

    // An operator deletes the running attempt: the next one's fence is higher still, and the
    // deleted one can no longer settle.
    let shown = Shown {
        state: RecordState::InProgress,
        fence: reopened.fence,
    };
    let now = c.at(2);
    assert!(
        admin
            .repair(&req.key, shown, Repair::Delete, now)
            .await
            .unwrap()
    );
    let recreated = acquire(store, &req, now).await;
    created(&recreated, now);
    fences.push(recreated.fence);
    complete_refused_after_delete(store, &req.key, &reopened, now).await;

    // Its lease runs out and another attempt takes over; that one completes, the record ends
    // its retention and is purged; the key begins again.
    let lease_end = recreated.expires_at;
    let taken = acquire(store, &req, lease_end).await;
    fences.push(taken.fence);
    complete(store, &req.key, &taken, b"r", lease_end).await;
    let gone = lease_end.saturating_add(TTL);
    store.purge_expired(gone, 1000).await.unwrap();
    assert_eq!(store.get(&req.key, gone).await.unwrap(), None);
    let after_purge = acquire(store, &req, gone).await;
    fences.push(after_purge.fence);

    assert!(
        fences.windows(2).all(|w| w[0] < w[1]),
        "fences went back: {fences:?}"
    );
}

async fn complete_refused_after_delete<S: Store>(
    store: &S,
    key: &Key,
    lease: &Lease,
    now: Timestamp,
) {
    let late = store
        .complete(key, lease, Bytes::from_static(b"late"), now)
        .await;
    assert!(
        matches!(late, Err(idem_core::LeaseError::Stale(_))),
        "a deleted attempt completed: {late:?}"
    );
}
