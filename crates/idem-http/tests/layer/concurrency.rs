//! Requests in flight, clients that hang up, bounded bodies, full and failing stores.

use super::*;

#[tokio::test]
async fn a_request_in_flight_is_refused_with_retry_after() {
    let app = app(Policy::default().lease(Duration::from_secs(30)));
    let first = app.spawn("/slow", "k");
    app.counters.entered.notified().await;
    let r = app.send(post_with("/slow", "k", "")).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(r.code(), "request_in_progress");
    // Look again in a second, not at the end of the 30 s lease.
    assert_eq!(r.headers["retry-after"], "1");
    app.counters.gate.notify_one();
    assert_eq!(first.await.unwrap().status(), StatusCode::OK);
    let r = app.send(post_with("/slow", "k", "")).await;
    assert!(r.replayed());
    assert_eq!(r.body, "slow run 1");
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn a_request_in_flight_can_wait_for_the_first_answer() {
    let app = app(Policy::default().in_flight(InFlight::Wait(Duration::from_secs(30))));
    let first = app.spawn("/slow", "k");
    app.counters.entered.notified().await;
    let second = app.spawn("/slow", "k");
    tokio::time::sleep(Duration::from_millis(50)).await;
    app.counters.gate.notify_one();
    first.await.unwrap();
    let second = second.await.unwrap();
    assert_eq!(second.status(), StatusCode::OK);
    assert_eq!(second.headers()["idempotent-replayed"], "true");
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn a_client_that_hangs_up_does_not_cancel_the_work() {
    let app = app(Policy::default().in_flight(InFlight::Wait(Duration::from_secs(30))));
    let first = app.spawn("/slow", "k");
    app.counters.entered.notified().await;
    first.abort(); // the connection is gone
    app.counters.gate.notify_one();
    let r = app.send(post_with("/slow", "k", "")).await;
    assert!(r.replayed());
    assert_eq!(r.body, "slow run 1");
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn a_client_that_hangs_up_while_the_key_is_taken_leaves_no_stranded_record() {
    let store = FaultyStore::new(MemoryStore::new());
    // The begin is sent and waits at the store until released, whatever the client does.
    let taken = Stall::new();
    store.fail_next(Op::Begin, Fault::StallThenLand(taken.clone()));
    let app = app_on(
        Arc::new(store),
        Policy::default().in_flight(InFlight::Wait(PATIENCE)),
    );
    let router = app.router.clone();
    // The connection is gone while the key is being taken.
    taken
        .abandon(async move { router.oneshot(post_with("/orders", "k", "")).await })
        .await;
    taken.release();
    // The retry gets the first attempt's answer; a stranded record would answer "in
    // progress" until its 60 s lease ran out (and the test clock never moves).
    let r = within("the retry", app.send(post_with("/orders", "k", ""))).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert!(r.replayed());
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn a_client_that_hangs_up_while_waiting_for_another_attempt_leaves_nothing_behind() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let app = app_on(
        store.clone(),
        Policy::default().in_flight(InFlight::Wait(PATIENCE)),
    );
    let first = app.spawn("/slow", "k");
    within("the first attempt", app.counters.entered.notified()).await;
    // The second is told "in progress" once, then hangs up while it waits to ask again.
    let asked = Stall::new();
    store.fail_next(Op::Begin, Fault::StallThenLand(asked.clone()));
    asked.release();
    let second = app.spawn("/slow", "k");
    within("the second attempt", asked.landed()).await;
    second.abort();
    assert!(second.await.unwrap_err().is_cancelled());
    app.counters.gate.notify_one();
    assert_eq!(first.await.unwrap().status(), StatusCode::OK);
    let r = within("a retry", app.send(post_with("/slow", "k", ""))).await;
    assert!(r.replayed());
    assert_eq!(r.body, "slow run 1");
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn an_oversized_request_is_refused_and_stores_nothing() {
    let app = app(Policy::default().max_body(16));
    let r = app.send(post_with("/orders", "k", &"x".repeat(17))).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(r.code(), "body_too_large");
    // without a declared length (a streamed body), the limit holds too
    let stream = frames(vec![data("x".repeat(10)), data("x".repeat(10))]);
    let mut streamed = req(Method::POST, "/orders", &[("idempotency-key", "k")], "");
    *streamed.body_mut() = stream;
    assert_eq!(
        app.send(streamed).await.status,
        StatusCode::PAYLOAD_TOO_LARGE
    );
    assert_eq!(app.runs(), 0);
    // the key was not used up
    let r = app.send(post_with("/orders", "k", "small")).await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert!(!r.replayed());
}

#[tokio::test]
async fn a_full_store_refuses_new_keys_and_still_replays() {
    let store = MemoryStore::with_limits(idem_store::MemoryLimits::new(1, usize::MAX));
    let app = app_on(Arc::new(store), Policy::default());
    assert_eq!(
        app.send(post_with("/orders", "k", "x")).await.status,
        StatusCode::CREATED
    );
    let r = app.send(post_with("/orders", "other", "x")).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.code(), "store_full");
    assert!(r.headers.contains_key("retry-after"));
    assert_eq!(app.runs(), 1);
    assert!(app.send(post_with("/orders", "k", "x")).await.replayed());
}

#[tokio::test]
async fn a_failing_store_fails_closed() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let app = app_on(store.clone(), Policy::default());
    store.set_down(true);
    let r = app.send(post_with("/orders", "k", "x")).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.code(), "store_unavailable");
    assert_eq!(app.runs(), 0);
    store.set_down(false);
    assert_eq!(
        app.send(post_with("/orders", "k", "x")).await.status,
        StatusCode::CREATED
    );
}

#[tokio::test]
async fn an_answer_the_store_did_not_take_is_not_given_and_is_stored_when_the_store_returns() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let app = app_on(store.clone(), Policy::default());
    let first = app.spawn("/slow", "k");
    app.counters.entered.notified().await;
    // The store goes away while the handler runs: its answer cannot be stored.
    store.set_down(true);
    app.counters.gate.notify_one();
    let first = app.reply(first.await.unwrap()).await;
    assert_eq!(
        first.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        first.body
    );
    assert_eq!(first.code(), "answer_not_stored");
    assert_eq!(first.headers["retry-after"], "1");
    assert!(!first.body.contains("slow run"), "{}", first.body);
    // The store is back: the answer is stored in the background, and a retry is given it.
    store.set_down(false);
    let retry = within("the answer is stored", async {
        loop {
            let r = app.send(post_with("/slow", "k", "")).await;
            if r.replayed() {
                return r;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(retry.body, "slow run 1");
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn an_answer_never_stored_runs_again_after_its_lease_and_only_that_answer_is_given() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let app = app_on(
        store.clone(),
        Policy::default().lease(Duration::from_secs(5)),
    );
    let first = app.spawn("/slow", "k");
    app.counters.entered.notified().await;
    store.set_down(true);
    app.counters.gate.notify_one();
    let first = app.reply(first.await.unwrap()).await;
    assert_eq!(first.code(), "answer_not_stored");
    // The store stays away until well past the lease and the time an answer is still
    // offered: the background attempt gives up, and the key is taken over.
    app.clock.advance(Duration::from_secs(60));
    tokio::time::sleep(Duration::from_millis(300)).await;
    store.set_down(false);
    let again = app.spawn("/slow", "k");
    app.counters.entered.notified().await;
    app.counters.gate.notify_one();
    let again = app.reply(again.await.unwrap()).await;
    assert_eq!(again.status, StatusCode::OK, "{}", again.body);
    assert_eq!(again.body, "slow run 2");
    let replay = app.send(post_with("/slow", "k", "")).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, "slow run 2");
}

#[tokio::test]
async fn the_handler_sees_a_rising_fence() {
    let app = app(Policy::default());
    let fence = |body: &str| body.parse::<u64>().unwrap();
    let r = app.send(post_with("/fence", "k", "")).await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
    let first = fence(&r.body);
    // the released key is taken again with a higher fence, the next one
    let r = app.send(post_with("/fence", "k", "")).await;
    assert_eq!((r.status, fence(&r.body)), (StatusCode::OK, first + 1));
    let other = fence(&app.send(post_with("/fence", "other", "")).await.body);
    assert_eq!(
        idem_core::Lease::acquisition_of(other),
        1,
        "another key's first lease"
    );
}

#[tokio::test]
async fn a_declared_length_over_the_limit_is_refused_without_reading_the_body() {
    let app = app(Policy::default().max_body(16));
    // A body that fails if read: only the declared length can decide.
    let mut r = req(
        Method::POST,
        "/orders",
        &[("idempotency-key", "k"), ("content-length", "1000")],
        "",
    );
    *r.body_mut() = frames(vec![Err(std::io::Error::other("unread"))]);
    let r = app.send(r).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(app.runs(), 0);
}

#[tokio::test]
async fn a_waiter_runs_the_request_itself_when_the_first_attempt_gives_the_key_back() {
    let app = app(Policy::default().in_flight(InFlight::Wait(Duration::from_secs(30))));
    let first = app.spawn("/slow-then-fail", "k");
    app.counters.entered.notified().await;
    let second = app.spawn("/slow-then-fail", "k");
    tokio::time::sleep(Duration::from_millis(50)).await;
    app.counters.gate.notify_one();
    assert_eq!(
        first.await.unwrap().status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
    let second = second.await.unwrap();
    assert_eq!(second.status(), StatusCode::OK);
    assert!(second.headers().get("idempotent-replayed").is_none());
    assert_eq!(app.runs(), 2);
}

/// A handler that answers after its lease ran out and another attempt took the key over: its
/// caller is not given that answer (it is not the one kept) but a conflict to retry, and every
/// caller from then on gets the answer of the attempt that holds the key.
#[tokio::test]
async fn an_attempt_overtaken_while_its_handler_ran_does_not_deliver_its_answer() {
    let lease = Duration::from_secs(30);
    let app = app(Policy::default().lease(lease));
    let first = app.spawn("/slow", "k");
    app.counters.entered.notified().await;
    // The first attempt stalls past its lease: the next one takes the key over.
    app.clock.advance(lease + Duration::from_secs(1));
    let second = app.spawn("/slow", "k");
    app.counters.entered.notified().await;
    app.counters.gate.notify_one();
    let overtaken = first.await.unwrap();
    assert_eq!(overtaken.status(), StatusCode::CONFLICT);
    assert_eq!(overtaken.headers()["retry-after"], "1");
    app.counters.gate.notify_one();
    let kept = second.await.unwrap();
    assert_eq!(kept.status(), StatusCode::OK);
    let r = app.send(post_with("/slow", "k", "")).await;
    assert!(r.replayed());
    assert_eq!(r.body, "slow run 2", "the attempt that holds the key");
    assert_eq!(app.runs(), 2);
}

/// Answers the store did not take are kept in memory up to the layer's budget in bytes: two
/// answers of 400 KiB fit in 1 MiB and are stored once the store is back; the third finds no
/// room, so its record is marked an unknown outcome: a retry is told so, and nothing runs a
/// fourth time.
#[tokio::test]
async fn answers_the_store_did_not_take_are_bounded_in_bytes_and_never_run_again() {
    const CALLS: usize = 3;
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let app = app_with(store.clone(), Policy::default(), |layer| {
        layer
            .unstored_answers(UnstoredAnswers::new(1 << 20))
            .store_timeout(Duration::from_millis(300))
    });
    let key = |i: usize| format!("wide-{i}");
    let calls: Vec<_> = (0..CALLS)
        .map(|i| {
            let router = app.router.clone();
            let req = post_with("/wide", &key(i), "");
            tokio::spawn(async move { router.oneshot(req).await.unwrap() })
        })
        .collect();
    within("every call claims its key", async {
        while store.inner().len() < CALLS {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    store.set_down(true);
    for call in calls {
        while !call.is_finished() {
            app.counters.gate.notify_waiters();
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let reply = app.reply(call.await.unwrap()).await;
        assert_eq!(reply.code(), "answer_not_stored", "{}", reply.body);
    }
    store.set_down(false);
    let (replays, unknown) = within("the answers are stored, or marked unknown", async {
        loop {
            let (mut replays, mut unknown) = (0, 0);
            for i in 0..CALLS {
                let r = app.send(post_with("/wide", &key(i), "")).await;
                if r.replayed() {
                    assert_eq!(r.body.len(), 400 << 10);
                    replays += 1;
                } else if r.code() == "outcome_unknown" {
                    unknown += 1;
                }
            }
            if replays + unknown == CALLS {
                return (replays, unknown);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert_eq!((replays, unknown), (CALLS - 1, 1));
    assert_eq!(app.runs(), CALLS, "no answer ran twice");
}

/// A store that stalls on the answer (it neither takes it nor fails) leaves the caller waiting
/// no longer than the store timeout: it is answered `answer_not_stored`, and a retry is given
/// the answer once the store takes it in the background.
#[tokio::test]
async fn a_store_that_stalls_on_the_answer_is_waited_for_only_the_store_timeout() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let app = app_with(store.clone(), Policy::default(), |layer| {
        layer.store_timeout(Duration::from_millis(200))
    });
    let stall = store.stall_next(Op::Complete);
    let call = {
        let router = app.router.clone();
        tokio::spawn(async move { router.oneshot(post_with("/wide", "s", "")).await.unwrap() })
    };
    app.counters.entered.notified().await;
    app.counters.gate.notify_one();
    let reply = within("the caller is answered", call).await.unwrap();
    let reply = app.reply(reply).await;
    assert_eq!(reply.code(), "answer_not_stored", "{}", reply.body);
    stall.release();
    let replayed = within("the answer is stored in the background", async {
        loop {
            let r = app.send(post_with("/wide", "s", "")).await;
            if r.replayed() {
                return r;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert_eq!(replayed.body.len(), 400 << 10);
    assert_eq!(app.runs(), 1);
}

/// An answer the store refuses for good (an error retrying will not cure) is given up, not
/// offered to it again and again: refused when the handler ends, it is never offered again;
/// kept after failures that may pass, and refused when offered again, it is not offered a
/// third time. The record stays in progress until its lease ends.
#[tokio::test]
async fn an_answer_the_store_refuses_for_good_is_not_offered_again() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let app = app_on(store.clone(), Policy::default());
    store.fail_next(Op::Complete, Fault::Refused);
    let first = app.send(post_with("/orders", "refused", "{}")).await;
    assert_eq!(first.code(), "answer_not_stored", "{}", first.body);
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(
        store.calls(Op::Complete),
        1,
        "offered again after a refusal"
    );

    // Three failures that may pass (the settle's own retries), then kept and offered again
    // 100 ms on, and refused.
    for _ in 0..3 {
        store.fail_next(Op::Complete, Fault::Unavailable);
    }
    store.fail_next(Op::Complete, Fault::Refused);
    let second = app.send(post_with("/orders", "refused-later", "{}")).await;
    assert_eq!(second.code(), "answer_not_stored", "{}", second.body);
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert_eq!(
        store.calls(Op::Complete),
        1 + 3 + 1,
        "offered again after a refusal"
    );
}

/// An answer kept for a store that is away is offered again less and less often (100 ms,
/// doubling to 2 s): a second of outage costs the store a few reads, not a stream of them.
#[tokio::test]
async fn a_kept_answer_is_offered_again_with_backoff() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let app = app_on(store.clone(), Policy::default());
    for _ in 0..3 {
        store.fail_next(Op::Complete, Fault::Unavailable);
    }
    let reply = app.send(post_with("/orders", "backoff", "{}")).await;
    assert_eq!(reply.code(), "answer_not_stored", "{}", reply.body);
    store.set_down(true);
    let before = store.calls(Op::Get);
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let asked = store.calls(Op::Get) - before;
    store.set_down(false);
    // At 100, 300 and 700 ms; a little slack for a slow machine's timers.
    assert!((2..=5).contains(&asked), "asked {asked} times in a second");
}

/// The default budget for answers the store has not taken is the documented 64 MiB.
#[test]
fn the_default_budget_for_unstored_answers_is_64_mib() {
    assert_eq!(idem_http::DEFAULT_UNSTORED_BYTES, 64 * 1024 * 1024);
}
