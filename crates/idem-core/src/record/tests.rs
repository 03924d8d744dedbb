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

/// The retention idem documents: a day by default, a year at most.
#[test]
fn the_documented_retention_bounds() {
    assert_eq!(DEFAULT_TTL, Duration::from_secs(86_400));
    assert_eq!(MAX_TTL, Duration::from_secs(365 * 86_400));
}

/// A status's name is what the SQL stores write and read back: each one round-trips, and
/// nothing else is read as a status.
#[test]
fn a_status_reads_back_as_written() {
    for status in [Status::InProgress, Status::Completed, Status::Released] {
        assert_eq!(Status::parse(status.as_str()), Some(status));
        assert_eq!(status.to_string(), status.as_str());
    }
    assert_eq!(
        [Status::InProgress, Status::Completed, Status::Released].map(Status::as_str),
        ["in_progress", "completed", "released"]
    );
    assert_eq!(Status::parse("xyzzy"), None);
    assert_eq!(Status::parse(""), None);
}

/// A record lives until its expiry, not at it: at `expires_at` it is gone (an in-progress one
/// once both its lease and its expiry have passed).
#[test]
fn a_record_is_live_until_its_expiry_and_not_at_it() {
    let r = req(b"a");
    let (lease, rec) = acquire(None, &r, t(0));
    let done = Record::complete(Some(&rec), &lease, Bytes::from_static(b"ok"), t(2))
        .unwrap()
        .unwrap();
    let end = done.expires_at;
    assert!(done.is_live(Timestamp::from_millis(end.as_millis() - 1)));
    assert!(!done.is_live(end));
    assert!(rec.is_live(Timestamp::from_millis(rec.expires_at.as_millis() - 1)));
    assert!(!rec.is_live(rec.expires_at.max(rec.lease_expires_at)));
}

/// A record holds a lease only when both its id and its fence are the record's.
#[test]
fn a_lease_is_held_only_with_its_id_and_its_fence() {
    let (lease, rec) = acquire(None, &req(b"a"), t(0));
    assert!(rec.holds(&lease));
    let other_fence = Lease {
        fence: lease.fence + 1,
        ..lease
    };
    let other_id = Lease {
        id: LeaseId::generate(),
        ..lease
    };
    assert!(!rec.holds(&other_fence));
    assert!(!rec.holds(&other_id));
}

/// Only the holder of a live in-progress record renews it: the lease moves on, and retention
/// after it; another lease, a completed record and a record past its expiry are refused.
#[test]
fn only_the_holder_of_a_live_attempt_renews_it() {
    let r = req(b"a");
    let (lease, rec) = acquire(None, &r, t(0));
    let mut renewed = rec.clone();
    let longer = renewed
        .renew_in_place(&lease, Duration::from_secs(30), t(5))
        .unwrap();
    assert_eq!((longer.id, longer.fence), (lease.id, lease.fence));
    assert_eq!(longer.expires_at, t(35));
    assert_eq!(renewed.lease_expires_at, t(35));
    assert_eq!(renewed.expires_at, t(135));
    // A lease that ran out but was not taken over may still renew: its record is kept.
    let mut lapsed = rec.clone();
    assert!(
        lapsed
            .renew_in_place(&lease, Duration::from_secs(30), t(15))
            .is_ok()
    );

    let stranger = Lease {
        id: LeaseId::generate(),
        ..lease
    };
    let mut other = rec.clone();
    assert_eq!(
        other.renew_in_place(&stranger, Duration::from_secs(30), t(5)),
        Err(StaleLease)
    );
    let done = Record::complete(Some(&rec), &lease, Bytes::from_static(b"ok"), t(2))
        .unwrap()
        .unwrap();
    let mut completed = done.clone();
    assert_eq!(
        completed.renew_in_place(&lease, Duration::from_secs(30), t(5)),
        Err(StaleLease)
    );
    let mut dead = rec.clone();
    let gone = dead.expires_at.max(dead.lease_expires_at);
    assert_eq!(
        dead.renew_in_place(&lease, Duration::from_secs(30), gone),
        Err(StaleLease)
    );
    assert_eq!((other, completed, dead), (rec.clone(), done, rec));
}

/// The lease lengths idem documents: a minute by default, a day at most.
#[test]
fn the_documented_lease_bounds() {
    assert_eq!(DEFAULT_LEASE, Duration::from_secs(60));
    assert_eq!(MAX_LEASE, Duration::from_secs(86_400));
}

/// A lease id survives the stores' two forms (16 big-endian bytes, 32 hex digits); nothing
/// else parses as one, and its debug form shows only a prefix (the whole id is a capability).
#[test]
fn a_lease_id_round_trips_and_shows_only_a_prefix() {
    let id = LeaseId::parse("0123456789abcdef0123456789abcdef").unwrap();
    assert_eq!(id.to_bytes()[..4], [0x01, 0x23, 0x45, 0x67]);
    assert_eq!(LeaseId::from_bytes(id.to_bytes()), id);
    assert_eq!(LeaseId::parse(&id.to_string()), Some(id));
    let drawn = LeaseId::generate();
    assert_eq!(LeaseId::parse(&drawn.to_string()), Some(drawn));
    let signs = "+".repeat(32);
    for bad in [
        "0123456789abcdef0123456789abcde",
        "0123456789abcdef0123456789abcdefa",
        "0123456789abcdef0123456789abcdeg",
        "xyz",
        &signs,
        "",
    ] {
        assert_eq!(LeaseId::parse(bad), None, "{bad}");
    }
    assert_eq!(format!("{id:?}"), "LeaseId(01234567…)");
}

/// A renewed lease keeps its id and fence and ends `length` after now (at least a
/// millisecond).
#[test]
fn a_renewed_lease_ends_its_length_after_now() {
    let (lease, _) = acquire(None, &req(b"a"), t(0));
    let renewed = lease.renewed(Duration::from_secs(7), t(3));
    assert_eq!(
        renewed,
        Lease {
            expires_at: t(10),
            ..lease
        }
    );
    let least = lease.renewed(Duration::ZERO, t(3));
    assert_eq!(least.expires_at, Timestamp::from_millis(3_001));
}

/// Only a live record completed by the named fence is reopened.
#[test]
fn only_a_live_completion_of_the_named_fence_reopens() {
    let (lease, rec) = acquire(None, &req(b"a"), t(0));
    let done = Record::complete(Some(&rec), &lease, Bytes::from_static(b"ok"), t(2))
        .unwrap()
        .unwrap();
    let mut wrong_fence = done.clone();
    assert!(!wrong_fence.reopen_in_place(lease.fence + 1, t(3)));
    let mut running = rec.clone();
    assert!(!running.reopen_in_place(lease.fence, t(3)));
    let mut dead = done.clone();
    assert!(!dead.reopen_in_place(lease.fence, done.expires_at));
    assert_eq!(
        (wrong_fence, running, dead),
        (done.clone(), rec, done.clone())
    );
    let mut reopened = done;
    assert!(reopened.reopen_in_place(lease.fence, t(3)));
    assert_eq!(reopened.status, Status::Released);
    assert_eq!(reopened.response, None);
}
