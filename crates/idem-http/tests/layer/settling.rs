//! How a handler's answer settles its record: stored, released, too large, broken off, or
//! an unknown outcome, and what an operator and a replay cache do with it.

use super::*;

#[tokio::test]
async fn server_errors_release_the_key_under_ietf_and_are_stored_under_stripe() {
    let ietf = app(Policy::default());
    for _ in 0..2 {
        let r = ietf.send(post_with("/fail", "k", "")).await;
        assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(!r.replayed());
    }
    assert_eq!(ietf.runs(), 2);

    let stripe = app(Policy::default().preset(Preset::Stripe));
    stripe.send(post_with("/fail", "k", "")).await;
    let r = stripe.send(post_with("/fail", "k", "")).await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(r.replayed());
    assert_eq!(stripe.runs(), 1);

    // 429 says nothing was done, under both presets
    for preset in [Preset::Ietf, Preset::Stripe] {
        let app = app(Policy::default().preset(preset));
        app.send(post_with("/limited", "k", "")).await;
        app.send(post_with("/limited", "k", "")).await;
        assert_eq!(app.runs(), 2);
    }
}

#[tokio::test]
async fn a_handler_may_decline_to_store_its_answer() {
    let app = app(Policy::default());
    for _ in 0..2 {
        let r = app.send(post_with("/declined", "k", "")).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST);
        assert!(!r.replayed());
    }
    assert_eq!(app.runs(), 2);
}

#[tokio::test]
async fn an_answer_too_large_to_store_is_delivered_once_and_never_rerun() {
    let app = app(Policy::default().max_response(1000));
    let r = app.send(post_with("/big", "k", "")).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.body.len(), 10_000);
    let again = app.send(post_with("/big", "k", "")).await;
    assert_eq!(again.status, StatusCode::CONFLICT);
    assert_eq!(again.code(), "response_not_replayable");
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn a_panicking_handler_releases_the_key() {
    let app = app(Policy::default());
    let r = app.send(post_with("/panics", "k", "")).await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(r.code(), "handler_failed");
    // the release runs in a task of its own; wait for the key to come back
    let mut r = app.send(post_with("/panics", "k", "")).await;
    for _ in 0..100 {
        if r.status == StatusCode::OK {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        r = app.send(post_with("/panics", "k", "")).await;
    }
    assert_eq!(r.body, "second time lucky");
}

#[tokio::test]
async fn an_unknown_outcome_is_held() {
    let app = app(Policy::default());
    let r = app.send(post_with("/unknown", "k", "")).await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT);
    app.clock.advance(Duration::from_secs(3600));
    let r = app.send(post_with("/unknown", "k", "")).await;
    assert_eq!(r.status, StatusCode::CONFLICT);
    assert_eq!(r.code(), "outcome_unknown");
    assert!(r.headers.get("retry-after").is_none());
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn an_unknown_outcome_runs_again_after_the_lease_when_so_configured() {
    let app = app(Policy::default()
        .lease(Duration::from_secs(60))
        .on_unknown(OnUnknown::ReleaseAfterLease));
    app.send(post_with("/unknown", "k", "")).await;
    app.clock.advance(Duration::from_secs(30));
    let r = app.send(post_with("/unknown", "k", "")).await;
    assert_eq!(r.code(), "outcome_unknown");
    assert_eq!(r.headers["retry-after"], "30");
    assert_eq!(app.runs(), 1);
    app.clock.advance(Duration::from_secs(30));
    let r = app.send(post_with("/unknown", "k", "")).await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(app.runs(), 2);
}

/// Behind a replay cache, answers come from memory as the store would give them: the same
/// replay, the same mismatch; and an unknown outcome kept there (no `skip`) still runs again
/// once its lease is over, while memory still holds it (the lease ends before the entry's
/// `max_age` does).
#[tokio::test]
async fn answers_from_memory_are_the_stores_answers() {
    use idem_store::{ReplayCache, ReplayCacheLimits};
    let limits = ReplayCacheLimits::default();
    let cache = ReplayCache::new(MemoryStore::new(), limits);
    let lease = Duration::from_secs(30);
    assert!(lease < limits.max_age);
    let app = app_on(
        Arc::new(cache.clone()),
        Policy::default()
            .lease(lease)
            .on_unknown(OnUnknown::ReleaseAfterLease),
    );
    let first = app.send(post_with("/orders", "k", "pay 10")).await;
    let from_store = app.send(post_with("/orders", "k", "pay 10")).await;
    assert_eq!(cache.hits(), 0, "the first replay is the store's");
    for _ in 0..2 {
        let again = app.send(post_with("/orders", "k", "pay 10")).await;
        assert_eq!(
            (again.status, &again.body, again.replayed()),
            (from_store.status, &from_store.body, true)
        );
        assert_eq!(again.headers, from_store.headers);
        assert_eq!(again.body, first.body);
    }
    let other = app.send(post_with("/orders", "k", "pay 99")).await;
    assert_eq!(other.code(), "idempotency_key_mismatch");
    assert_eq!((cache.hits(), app.runs()), (3, 1));

    app.send(post_with("/unknown", "u", "")).await;
    let r = app.send(post_with("/unknown", "u", "")).await;
    assert_eq!(
        r.code(),
        "outcome_unknown",
        "from the store, and now kept in memory"
    );
    let r = app.send(post_with("/unknown", "u", "")).await;
    assert_eq!(r.code(), "outcome_unknown", "from memory");
    assert_eq!(app.runs(), 2);
    let hits = cache.hits();
    app.clock.advance(lease);
    let r = app.send(post_with("/unknown", "u", "")).await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT, "the retry ran again");
    assert_eq!(app.runs(), 3);
    assert!(cache.hits() > hits, "memory still held the unknown outcome");
}

/// A replay the cache holds is answered within the request's first poll: no task is spawned
/// for it. A request that claims its key goes through the task that claims, which a first
/// poll only starts.
#[tokio::test]
async fn a_replay_from_memory_is_answered_in_the_first_poll() {
    use idem_store::{ReplayCache, ReplayCacheLimits};
    use std::task::{Context, Poll, Waker};
    let cache = ReplayCache::new(MemoryStore::new(), ReplayCacheLimits::default());
    let app = app_on(Arc::new(cache.clone()), Policy::default());
    app.send(post_with("/orders", "k", "pay 10")).await;
    app.send(post_with("/orders", "k", "pay 10")).await; // the store's replay, now kept
    let first_poll = |req| {
        let mut answer = Box::pin(app.router.clone().oneshot(req));
        answer
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
            .map(|r| r.unwrap())
    };
    let hits = cache.hits();
    let Poll::Ready(replay) = first_poll(post_with("/orders", "k", "pay 10")) else {
        panic!("a replay from memory waited")
    };
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(cache.hits(), hits + 1);
    assert!(
        first_poll(post_with("/orders", "fresh", "pay 10")).is_pending(),
        "a claim runs in a task of its own"
    );
}

#[tokio::test]
async fn an_operator_reopens_a_held_unknown_outcome_and_nothing_else() {
    use idem_core::{Clock, Key};
    use idem_http::operator::{RecordState, Reopened, inspect, reopen_unknown};
    let store: SharedStore = Arc::new(MemoryStore::new());
    let app = app_on(store.clone(), Policy::default());
    let key = |k: &str| Key::parse("anonymous", "http", k).unwrap();
    let now = || app.clock.now();

    app.send(post_with("/unknown", "k", "")).await;
    let view = inspect(&*store, &key("k"), now()).await.unwrap().unwrap();
    assert_eq!(view.state, RecordState::Unknown { until: None });
    let first = view.fence;

    let r = reopen_unknown(&*store, &key("k"), now()).await.unwrap();
    assert_eq!(r, Reopened::Reopened { fence: first });
    let r = app.send(post_with("/unknown", "k", "")).await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT, "the retry ran again");
    assert_eq!(app.runs(), 2);
    let view = inspect(&*store, &key("k"), now()).await.unwrap().unwrap();
    assert!(view.fence > first, "the rerun has a higher fence");

    // A stored answer is never reopened; a missing record is reported as such.
    app.send(post_with("/orders", "o", "{}")).await;
    let Reopened::NotUnknown(view) = reopen_unknown(&*store, &key("o"), now()).await.unwrap()
    else {
        panic!("a stored answer was reopened");
    };
    assert_eq!(
        view.state,
        RecordState::Stored {
            status: StatusCode::CREATED
        }
    );
    let r = app.send(post_with("/orders", "o", "{}")).await;
    assert!(r.replayed());
    assert_eq!(
        reopen_unknown(&*store, &key("none"), now()).await.unwrap(),
        Reopened::NotFound
    );
}

#[tokio::test]
async fn a_listing_tells_unknown_outcomes_from_stored_answers() {
    use idem_core::{Clock, RecordFilter};
    use idem_http::operator::{RecordState, counts, listed_state};
    let store: SharedStore = Arc::new(MemoryStore::new());
    let app = app_on(store.clone(), Policy::default());
    app.send(post_with("/unknown", "u1", "")).await;
    app.send(post_with("/unknown", "u2", "")).await;
    app.send(post_with("/orders", "o", "{}")).await;
    let admin = store.admin().unwrap();
    let now = app.clock.now();
    let page = admin
        .list(&RecordFilter::default(), None, 10, now)
        .await
        .unwrap();
    let states: Vec<(String, RecordState)> = page
        .records
        .iter()
        .map(|l| (l.key.client_key().as_str().to_owned(), listed_state(l)))
        .collect();
    assert_eq!(
        states,
        [
            (
                "o".to_owned(),
                RecordState::Stored {
                    status: StatusCode::CREATED
                }
            ),
            ("u1".to_owned(), RecordState::Unknown { until: None }),
            ("u2".to_owned(), RecordState::Unknown { until: None }),
        ]
    );
    let counted = counts(admin, &RecordFilter::default(), now).await.unwrap();
    assert_eq!((counted.records.completed, counted.unknown), (3, 2));
}

#[tokio::test]
async fn headers_named_in_connection_are_not_replayed() {
    let app = app(Policy::default());
    let first = app.send(post_with("/private", "k", "")).await;
    assert_eq!(first.headers["x-private"], "1");
    let again = app.send(post_with("/private", "k", "")).await;
    assert!(again.replayed());
    assert!(again.headers.get("x-private").is_none());
    assert!(again.headers.get("connection").is_none());
    assert_eq!(again.headers["x-public"], "1");
}

#[tokio::test]
async fn an_answer_that_breaks_off_is_an_unknown_outcome() {
    let app = app(Policy::default());
    let r = app.send(post_with("/breaks", "k", "")).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert_eq!(r.code(), "response_failed");
    let r = app.send(post_with("/breaks", "k", "")).await;
    assert_eq!(r.code(), "outcome_unknown");
    assert_eq!(app.runs(), 1);
}

#[tokio::test]
async fn an_answers_trailers_are_kept_and_replayed() {
    use http_body_util::BodyExt;
    use tower::Layer;
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        tower::service_fn(move |_req: Request<Body>| {
            runs.fetch_add(1, Ordering::SeqCst);
            let mut trailers = HeaderMap::new();
            trailers.insert("x-checksum", "abc".parse().unwrap());
            let body = http_body_util::Full::new(axum::body::Bytes::from_static(b"ok"))
                .with_trailers(std::future::ready(Some(Ok(trailers))));
            std::future::ready(Ok::<_, std::convert::Infallible>(Response::new(body)))
        })
    };
    let service =
        IdempotencyLayer::new(Arc::new(MemoryStore::new()), Policy::default()).layer(handler);
    for replayed in [false, true] {
        let res = service
            .clone()
            .oneshot(post_with("/", "k", ""))
            .await
            .unwrap();
        assert_eq!(res.headers().contains_key("idempotent-replayed"), replayed);
        let body = res.into_body().collect().await.unwrap();
        assert_eq!(body.trailers().unwrap()["x-checksum"], "abc", "{replayed}");
        assert_eq!(body.to_bytes(), "ok");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
