//! The conformance cases of recovery points: `record_step` and what `begin`, `release`,
//! `reopen` and expiry do to a record's steps.

use idem_core::{
    BeginOutcome, Lease, LeaseId, RecordState, Repair, Shown, Status, Step, StepError, StepName,
    StepOutcome, StepRefused, Store,
};

use super::{Case, LEASE, TTL, acquire, complete};

fn name(s: &str) -> StepName {
    StepName::new(s).unwrap()
}

fn done(s: &str, output: &[u8]) -> Step {
    Step::done(name(s), output.to_vec()).unwrap()
}

fn names(steps: &[Step]) -> Vec<&str> {
    steps.iter().map(|s| s.name.as_str()).collect()
}

async fn steps_of<S: Store>(store: &S, c: &Case, key: &str, at: u64) -> Vec<Step> {
    store
        .get(&c.key(key), c.at(at))
        .await
        .unwrap()
        .map(|r| r.steps)
        .unwrap_or_default()
}

fn assert_refused(result: Result<(), StepError>, expected: &StepRefused) {
    match result {
        Err(StepError::Refused(r)) if &r == expected => {}
        other => panic!("expected {expected:?}, got {other:?}"),
    }
}

fn stale() -> StepRefused {
    StepRefused::Stale(idem_core::StaleLease)
}

/// A step moves the record's `updated_at` forward even within the millisecond of the claim
/// (or behind it): every write past a claim changes the record, which stores that settle by
/// comparing values rely on.
pub async fn a_step_always_moves_the_record_forward<S: Store>(store: &S) {
    let c = Case::new();
    let req = c.req("k", "a");
    let lease = acquire(store, &req, c.at(0)).await;
    let claimed = store.get(&req.key, c.at(0)).await.unwrap().unwrap();
    store
        .record_step(&req.key, &lease, &done("debit", b"1"), c.at(0))
        .await
        .unwrap();
    let first = store.get(&req.key, c.at(0)).await.unwrap().unwrap();
    assert!(
        first.updated_at > claimed.updated_at,
        "a step in the claim's millisecond still moves the record forward"
    );
    store
        .record_step(&req.key, &lease, &done("bank", b"2"), c.at(0))
        .await
        .unwrap();
    let second = store.get(&req.key, c.at(0)).await.unwrap().unwrap();
    assert!(second.updated_at > first.updated_at, "and so does the next");
    // A repeat changes nothing, and a later step is stamped with its own time.
    store
        .record_step(&req.key, &lease, &done("bank", b"2"), c.at(0))
        .await
        .unwrap();
    let repeated = store.get(&req.key, c.at(0)).await.unwrap().unwrap();
    assert_eq!(repeated.updated_at, second.updated_at);
    store
        .record_step(&req.key, &lease, &done("ship", b"3"), c.at(5))
        .await
        .unwrap();
    let later = store.get(&req.key, c.at(5)).await.unwrap().unwrap();
    assert_eq!(later.updated_at, c.at(5));
}

/// Steps are kept in order under the lease; an attempt that takes an expired lease over finds
/// them, the overtaken one can record no more, and completion keeps them.
pub async fn steps_survive_a_takeover<S: Store>(store: &S) {
    let c = Case::new();
    let req = c.req("k", "a");
    let first = acquire(store, &req, c.at(0)).await;
    store
        .record_step(&req.key, &first, &done("debit", b"{\"hold\":7}"), c.at(1))
        .await
        .unwrap();
    store
        .record_step(&req.key, &first, &done("bank", b"tx-1"), c.at(2))
        .await
        .unwrap();
    assert_eq!(names(&steps_of(store, &c, "k", 2).await), ["debit", "bank"]);
    let rec = store.get(&req.key, c.at(2)).await.unwrap().unwrap();
    assert_eq!(
        rec.updated_at,
        c.at(2),
        "recording a step stamps the record"
    );

    // The first attempt dies; after its lease a takeover resumes.
    let second = acquire(store, &req, c.at(11)).await;
    assert!(second.fence > first.fence);
    let steps = steps_of(store, &c, "k", 11).await;
    assert_eq!(
        steps,
        [done("debit", b"{\"hold\":7}"), done("bank", b"tx-1")]
    );
    assert_refused(
        store
            .record_step(&req.key, &first, &done("credit", b"late"), c.at(12))
            .await,
        &stale(),
    );
    store
        .record_step(&req.key, &second, &done("credit", b"ok"), c.at(12))
        .await
        .unwrap();
    complete(store, &req.key, &second, b"ok", c.at(13)).await;
    let rec = store.get(&req.key, c.at(13)).await.unwrap().unwrap();
    assert_eq!(rec.status, Status::Completed);
    assert_eq!(names(&rec.steps), ["debit", "bank", "credit"]);
    assert_refused(
        store
            .record_step(&req.key, &second, &done("after", b""), c.at(14))
            .await,
        &stale(),
    );
}

/// A step recorded again with the same outcome changes nothing; with another it is refused and
/// the first stays; an unknown step may finish, and nothing comes after it until it does.
pub async fn steps_repeat_conflict_and_unknown<S: Store>(store: &S) {
    let c = Case::new();
    let req = c.req("k", "a");
    let lease = acquire(store, &req, c.at(0)).await;
    let record = |step: Step, at: u64| {
        let (key, now) = (&req.key, c.at(at));
        async move { store.record_step(key, &lease, &step, now).await }
    };
    record(done("a", b"1"), 1).await.unwrap();
    record(done("a", b"1"), 2).await.unwrap();
    assert_refused(
        record(done("a", b"2"), 2).await,
        &StepRefused::Conflict(name("a")),
    );
    record(Step::unknown(name("bank")), 3).await.unwrap();
    record(Step::unknown(name("bank")), 3).await.unwrap();
    assert_refused(
        record(done("c", b"3"), 3).await,
        &StepRefused::AfterUnknown(name("bank")),
    );
    let steps = steps_of(store, &c, "k", 3).await;
    assert_eq!(steps[1].outcome, StepOutcome::Unknown);
    // Run again, the unknown step finishes.
    record(done("bank", b"tx"), 4).await.unwrap();
    record(done("c", b"3"), 5).await.unwrap();
    assert_eq!(
        steps_of(store, &c, "k", 5).await,
        [done("a", b"1"), done("bank", b"tx"), done("c", b"3")]
    );
}

/// A released record keeps its steps for the same request, which resumes them; another
/// request with the key is a mismatch while they stand.
pub async fn released_steps_resume_for_the_same_request_only<S: Store>(store: &S) {
    let c = Case::new();
    let req = c.req("k", "a");
    let lease = acquire(store, &req, c.at(0)).await;
    store
        .record_step(&req.key, &lease, &done("debit", b"1"), c.at(1))
        .await
        .unwrap();
    store.release(&req.key, &lease, c.at(2)).await.unwrap();
    assert_eq!(
        store.begin(&c.req("k", "other"), c.at(3)).await.unwrap(),
        BeginOutcome::Mismatch
    );
    let again = acquire(store, &req, c.at(3)).await;
    assert!(again.fence > lease.fence);
    assert_eq!(names(&steps_of(store, &c, "k", 3).await), ["debit"]);

    // Released without steps, the key is free for any request, as before.
    let plain = c.req("plain", "a");
    let lease = acquire(store, &plain, c.at(0)).await;
    store.release(&plain.key, &lease, c.at(1)).await.unwrap();
    acquire(store, &c.req("plain", "other"), c.at(2)).await;
}

/// A reopen runs the work again from its start: the steps go. So do they when the record
/// expires: the next request with the key starts afresh.
pub async fn reopen_and_expiry_drop_steps<S: Store>(store: &S) {
    let c = Case::new();
    let req = c.req("k", "a");
    let lease = acquire(store, &req, c.at(0)).await;
    store
        .record_step(&req.key, &lease, &done("s", b"1"), c.at(1))
        .await
        .unwrap();
    complete(store, &req.key, &lease, b"done", c.at(2)).await;
    assert!(store.reopen(&req.key, lease.fence, c.at(3)).await.unwrap());
    assert!(steps_of(store, &c, "k", 3).await.is_empty());
    let again = acquire(store, &req, c.at(4)).await;
    assert!(steps_of(store, &c, "k", 4).await.is_empty());

    // Expiry: an in-progress record's steps live as long as it does.
    store
        .record_step(&req.key, &again, &done("s", b"2"), c.at(5))
        .await
        .unwrap();
    let gone = c.at(4).saturating_add(LEASE).saturating_add(TTL);
    let fresh = store.begin(&c.req("k", "b"), gone).await.unwrap();
    assert!(matches!(fresh, BeginOutcome::Acquired(_)), "{fresh:?}");
    let rec = store.get(&req.key, gone).await.unwrap().unwrap();
    assert!(rec.steps.is_empty(), "{:?}", rec.steps);
}

/// Only the holder of a live in-progress record's lease records steps.
pub async fn steps_need_the_holding_lease<S: Store>(store: &S) {
    let c = Case::new();
    let req = c.req("k", "a");
    let step = done("s", b"1");
    let forged = Lease {
        id: LeaseId::generate(),
        fence: 1,
        expires_at: c.at(10),
    };
    assert_refused(
        store.record_step(&req.key, &forged, &step, c.at(0)).await,
        &stale(),
    );
    let lease = acquire(store, &req, c.at(0)).await;
    assert_refused(
        store.record_step(&req.key, &forged, &step, c.at(1)).await,
        &stale(),
    );
    let wrong_fence = Lease {
        fence: lease.fence + 1,
        ..lease
    };
    assert_refused(
        store
            .record_step(&req.key, &wrong_fence, &step, c.at(1))
            .await,
        &stale(),
    );
    store.release(&req.key, &lease, c.at(2)).await.unwrap();
    assert_refused(
        store.record_step(&req.key, &lease, &step, c.at(3)).await,
        &stale(),
    );
    assert!(steps_of(store, &c, "k", 3).await.is_empty());
}

/// Outputs come back byte for byte, up to the bound on a record's steps.
pub async fn step_outputs_are_kept_exactly<S: Store>(store: &S) {
    let c = Case::new();
    let req = c.req("k", "a");
    let lease = acquire(store, &req, c.at(0)).await;
    let binary: Vec<u8> = (0..=255u8).cycle().take(200 * 1024).collect();
    store
        .record_step(&req.key, &lease, &done("binary", &binary), c.at(1))
        .await
        .unwrap();
    store
        .record_step(&req.key, &lease, &done("empty", b""), c.at(1))
        .await
        .unwrap();
    let steps = steps_of(store, &c, "k", 1).await;
    assert_eq!(steps[0].output().map(|o| &o[..]), Some(&binary[..]));
    assert_eq!(steps[1].output().map(|o| &o[..]), Some(&b""[..]));
    let most = idem_core::step::MAX_STEPS_BYTES;
    let too_much = done("big", &vec![7u8; most - binary.len()]);
    assert_refused(
        store
            .record_step(&req.key, &lease, &too_much, c.at(2))
            .await,
        &StepRefused::Full,
    );
    assert_eq!(steps_of(store, &c, "k", 2).await.len(), 2);
}

/// Steps recorded at once under one lease (work that runs branches in parallel) are all kept.
pub async fn concurrent_steps_are_all_kept<S: Store + Clone>(store: &S) {
    let c = Case::new();
    let req = c.req("k", "a");
    let lease = acquire(store, &req, c.at(0)).await;
    let now = c.at(1);
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let (store, key) = (store.clone(), req.key.clone());
            tokio::spawn(async move {
                let step = done(&format!("branch-{i}"), format!("out-{i}").as_bytes());
                store.record_step(&key, &lease, &step, now).await
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let mut got: Vec<String> = steps_of(store, &c, "k", 1)
        .await
        .iter()
        .map(|s| {
            let out = String::from_utf8(s.output().unwrap().to_vec()).unwrap();
            format!("{}={out}", s.name)
        })
        .collect();
    got.sort();
    let want: Vec<String> = (0..8).map(|i| format!("branch-{i}=out-{i}")).collect();
    assert_eq!(got, want);
}

/// An operator's repairs: releasing a stuck record keeps its steps (the next attempt resumes);
/// releasing a completed one drops them, as a reopen does; deleting drops them with the record.
pub async fn repairs_keep_or_drop_steps<S: Store>(store: &S) {
    let Some(admin) = store.admin() else {
        return;
    };
    let c = Case::new();
    let shown = |record: &idem_core::Record, at| Shown {
        state: RecordState::of(record, at),
        fence: record.fence,
    };
    let mut leases = Vec::new();
    for k in ["stuck", "completed", "deleted"] {
        let req = c.req(k, "a");
        let lease = acquire(store, &req, c.at(0)).await;
        store
            .record_step(&req.key, &lease, &done("s", b"1"), c.at(1))
            .await
            .unwrap();
        leases.push((req, lease));
    }
    let (completed, lease) = &leases[1];
    complete(store, &completed.key, lease, b"ok", c.at(2)).await;
    // The first attempt is gone: past its lease the record is stuck.
    let now = c.at(11);
    for (req, repair) in [
        (&leases[0].0, Repair::Release),
        (completed, Repair::Release),
        (&leases[2].0, Repair::Delete),
    ] {
        let record = store.get(&req.key, now).await.unwrap().unwrap();
        let applied = admin
            .repair(&req.key, shown(&record, now), repair, now)
            .await
            .unwrap();
        assert!(applied, "{}", req.key.client_key().as_str());
    }
    assert_eq!(names(&steps_of(store, &c, "stuck", 11).await), ["s"]);
    assert!(steps_of(store, &c, "completed", 11).await.is_empty());
    acquire(store, &c.req("deleted", "other"), now).await;
    assert!(steps_of(store, &c, "deleted", 11).await.is_empty());
}
