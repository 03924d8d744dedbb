use super::*;

fn req(fp: &[u8]) -> BeginRequest {
    BeginRequest::new(
        Key::parse("s", "n", "k").unwrap(),
        Fingerprint::of_bytes(fp),
    )
    .with_lease(Duration::from_secs(10))
    .with_ttl(Duration::from_secs(100))
}

fn t(s: u64) -> Timestamp {
    Timestamp::from_millis(s * 1000)
}

fn acquire(existing: Option<&Record>, r: &BeginRequest, now: Timestamp) -> (Lease, Record) {
    let step = Record::begin(existing, r, now, LeaseId::generate());
    match (step.outcome, step.write) {
        (BeginOutcome::Acquired(l), Some(w)) => (l, w),
        other => panic!("expected acquired, got {other:?}"),
    }
}

#[test]
fn full_lifecycle() {
    let r = req(b"a");
    let (lease, rec) = acquire(None, &r, t(0));
    assert_eq!(lease.fence, Lease::first_fence(t(0)));
    assert_eq!(rec.status, Status::InProgress);
    let step = Record::begin(Some(&rec), &r, t(1), LeaseId::generate());
    assert_eq!(
        step.outcome,
        BeginOutcome::InProgress {
            lease_expires_at: t(10)
        }
    );
    let done = Record::complete(Some(&rec), &lease, Bytes::from_static(b"ok"), t(2))
        .unwrap()
        .unwrap();
    assert_eq!(done.expires_at, t(102));
    match Record::begin(Some(&done), &r, t(3), LeaseId::generate()).outcome {
        BeginOutcome::Replay(rep) => assert_eq!(&rep.response[..], b"ok"),
        o => panic!("{o:?}"),
    }
    assert_eq!(
        Record::begin(Some(&done), &req(b"b"), t(3), LeaseId::generate()).outcome,
        BeginOutcome::Mismatch
    );
    // after the TTL the key is free again, with a higher fence
    let (lease2, _) = acquire(Some(&done), &req(b"b"), t(102));
    assert_eq!(lease2.fence, lease.fence + 1);
}

#[test]
fn takeover_and_stale_lease() {
    let r = req(b"a");
    let (old, rec) = acquire(None, &r, t(0));
    let (new, rec2) = acquire(Some(&rec), &r, t(10));
    assert!(new.fence > old.fence);
    assert_eq!(
        Record::complete(Some(&rec2), &old, Bytes::new(), t(11)),
        Err(StaleLease)
    );
    assert_eq!(Record::release(Some(&rec2), &old, t(11)), Err(StaleLease));
    assert!(Record::release(Some(&rec2), &new, t(11)).unwrap().is_some());
}

#[test]
fn release_frees_the_key_for_any_fingerprint() {
    let (lease, rec) = acquire(None, &req(b"a"), t(0));
    let released = Record::release(Some(&rec), &lease, t(1)).unwrap().unwrap();
    assert_eq!(Record::release(Some(&released), &lease, t(1)), Ok(None));
    let (l2, _) = acquire(Some(&released), &req(b"other"), t(2));
    assert_eq!(l2.fence, lease.fence + 1);
}

#[test]
fn repeated_complete_by_the_same_lease_keeps_the_first_response() {
    let (lease, rec) = acquire(None, &req(b"a"), t(0));
    let done = Record::complete(Some(&rec), &lease, Bytes::from_static(b"1"), t(1))
        .unwrap()
        .unwrap();
    assert_eq!(
        Record::complete(Some(&done), &lease, Bytes::from_static(b"1"), t(2)),
        Ok(None)
    );
    assert_eq!(Record::release(Some(&done), &lease, t(2)), Err(StaleLease));
}

#[test]
fn repeated_complete_with_a_different_response_is_stale() {
    let (lease, rec) = acquire(None, &req(b"a"), t(0));
    let done = Record::complete(Some(&rec), &lease, Bytes::from_static(b"1"), t(1))
        .unwrap()
        .unwrap();
    assert_eq!(
        Record::complete(Some(&done), &lease, Bytes::from_static(b"2"), t(2)),
        Err(StaleLease)
    );
    assert_eq!(done.response.as_deref(), Some(&b"1"[..]));
}

#[test]
fn expired_lease_not_taken_over_may_still_complete() {
    let (lease, rec) = acquire(None, &req(b"a"), t(0));
    assert!(
        Record::complete(Some(&rec), &lease, Bytes::new(), t(50))
            .unwrap()
            .is_some()
    );
}

#[test]
fn in_progress_with_other_fingerprint_is_a_mismatch_even_after_lease_expiry() {
    let (_, rec) = acquire(None, &req(b"a"), t(0));
    assert_eq!(
        Record::begin(Some(&rec), &req(b"b"), t(20), LeaseId::generate()).outcome,
        BeginOutcome::Mismatch
    );
    assert_eq!(
        Record::begin(Some(&rec), &req(b"b"), t(109), LeaseId::generate()).outcome,
        BeginOutcome::Mismatch
    );
    // ...until a whole TTL has passed since the lease ran out
    assert!(matches!(
        Record::begin(Some(&rec), &req(b"b"), t(110), LeaseId::generate()).outcome,
        BeginOutcome::Acquired(_)
    ));
}

#[test]
fn zero_lease_and_ttl_are_raised_to_a_millisecond() {
    let r = req(b"a")
        .with_lease(Duration::ZERO)
        .with_ttl(Duration::ZERO);
    let (lease, rec) = acquire(None, &r, t(0));
    assert_eq!(lease.expires_at, Timestamp::from_millis(1));
    assert!(matches!(
        Record::begin(Some(&rec), &r, t(0), LeaseId::generate()).outcome,
        BeginOutcome::InProgress { .. }
    ));
    assert_eq!(rec.ttl_ms, 1);
}

#[test]
fn lease_id_text_round_trip() {
    let id = LeaseId::generate();
    assert_eq!(LeaseId::parse(&id.to_string()), Some(id));
    assert_eq!(LeaseId::parse("xyz"), None);
    assert_eq!(LeaseId::parse(&"+".repeat(32)), None);
}

fn step(name: &str, out: &str) -> Step {
    Step::done(crate::StepName::new(name).unwrap(), out.as_bytes().to_vec()).unwrap()
}

#[test]
fn steps_survive_takeover_and_release_and_go_with_reopen_and_expiry() {
    let r = req(b"a");
    let (first, rec) = acquire(None, &r, t(0));
    let mut rec = rec;
    assert_eq!(
        rec.record_step_in_place(&first, &step("debit", "1"), t(1)),
        Ok(true)
    );
    assert_eq!(rec.updated_at, t(1));
    // the first attempt dies; a takeover finds the step
    let (second, mut rec) = acquire(Some(&rec), &r, t(10));
    assert_eq!(rec.steps, vec![step("debit", "1")]);
    // the overtaken attempt cannot record
    assert_eq!(
        rec.record_step_in_place(&first, &step("bank", "2"), t(11)),
        Err(StepRefused::Stale(StaleLease))
    );
    assert_eq!(
        rec.record_step_in_place(&second, &step("bank", "2"), t(11)),
        Ok(true)
    );
    // a release keeps them for the same request, and refuses another
    let released = Record::release(Some(&rec), &second, t(12))
        .unwrap()
        .unwrap();
    assert_eq!(
        Record::begin(Some(&released), &req(b"b"), t(13), LeaseId::generate()).outcome,
        BeginOutcome::Mismatch
    );
    let (third, rec) = acquire(Some(&released), &r, t(13));
    assert_eq!(rec.steps.len(), 2);
    let mut done = Record::complete(Some(&rec), &third, Bytes::from_static(b"ok"), t(14))
        .unwrap()
        .unwrap();
    assert_eq!(done.steps.len(), 2, "completion keeps them for inspection");
    assert_eq!(
        done.record_step_in_place(&third, &step("late", "x"), t(15)),
        Err(StepRefused::Stale(StaleLease))
    );
    // after its retention the key starts afresh
    let (_, fresh) = acquire(Some(&done), &req(b"b"), t(200));
    assert!(fresh.steps.is_empty());
    // a reopen drops them
    assert!(done.reopen_in_place(third.fence, t(15)));
    assert!(done.steps.is_empty());
}

#[test]
fn begin_is_a_function_of_its_inputs() {
    let r = req(b"a");
    let id = LeaseId::from_bytes([7; 16]);
    let (one, two) = (
        Record::begin(None, &r, t(5), id),
        Record::begin(None, &r, t(5), id),
    );
    assert_eq!(one.write, two.write);
    assert!(
        matches!(one.outcome, BeginOutcome::Acquired(l) if l.id == id && l.fence == Lease::first_fence(t(5)))
    );
}

#[test]
fn fences_count_acquisitions_and_survive_a_lost_record() {
    let r = req(b"a");
    let (first, mut rec) = acquire(None, &r, t(0));
    assert_eq!(first.fence, Lease::first_fence(t(0)));
    assert!(!first.may_resume());
    assert_eq!(first.acquisition(), 1);
    // Released and taken again, 1500 times within one millisecond: one more each time,
    // skipping whole thousands, which only a creating lease has.
    let mut lease = first;
    for n in 2..=1500 {
        let released = Record::release(Some(&rec), &lease, t(0)).unwrap().unwrap();
        let (next, again) = acquire(Some(&released), &r, t(0));
        assert!(next.fence > lease.fence);
        assert!(next.may_resume(), "acquisition {n}");
        if n <= 1000 {
            assert_eq!(next.acquisition(), n);
        }
        (lease, rec) = (next, again);
    }
    assert_eq!(lease.fence, first.fence + 1500);
    // The record is lost (deleted, purged, a store that kept nothing): a key created again
    // starts above every fence it had, once the clock has passed those acquisitions (1500
    // count as 1.5 ms).
    let later = Timestamp::from_millis(t(0).as_millis() + 2);
    assert!(acquire(None, &r, later).0.fence < lease.fence);
    let later = Timestamp::from_millis(t(0).as_millis() + 3);
    let (fresh, _) = acquire(None, &r, later);
    assert!(fresh.fence > lease.fence);
    assert!(!fresh.may_resume());
}
