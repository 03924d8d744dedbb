//! The upstream failing: unreachable, timing out, breaking off; what each means for the key.

use super::*;

#[tokio::test]
async fn an_unreachable_upstream_releases_the_key() {
    // A port with nothing behind it.
    let spare = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = spare.local_addr().unwrap();
    drop(spare);
    let gw = start_gateway(up, memory(), "").await;
    let r = post(gw, "/orders", "k", "pay").await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert_eq!(r.code(), "upstream_unreachable");
    // The upstream comes up: the retry runs, since nothing was sent before.
    let seen = start_upstream_on(TcpListener::bind(up).await.unwrap()).await;
    let r = post(gw, "/orders", "k", "pay").await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert!(!r.replayed());
    assert_eq!(seen.runs(), 1);
}

#[tokio::test]
async fn an_upstream_timeout_is_an_unknown_outcome_and_never_rerun_silently() {
    let (seen, up) = start_upstream().await;
    let gw = start_gateway(up, memory(), "upstream_timeout = \"200ms\"").await;
    let slow = [("idempotency-key", "t"), ("x-delay-ms", "1000")];
    let r = send(gw, Method::POST, "/orders", &slow, "pay").await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(r.code(), "upstream_timeout");
    for _ in 0..2 {
        let r = send(gw, Method::POST, "/orders", &slow, "pay").await;
        assert_eq!(r.status, StatusCode::CONFLICT);
        assert_eq!(r.code(), "outcome_unknown");
    }
    assert_eq!(seen.runs(), 1);
}

#[tokio::test]
async fn an_unknown_outcome_may_run_again_after_the_lease() {
    let (seen, up) = start_upstream().await;
    let config = "upstream_timeout = \"100ms\"\n[defaults]\nlease = \"300ms\"\non_unknown = \"release_after_lease\"";
    let gw = start_gateway(up, memory(), config).await;
    let slow = [("idempotency-key", "t"), ("x-delay-ms", "150")];
    assert_eq!(
        send(gw, Method::POST, "/orders", &slow, "pay").await.status,
        StatusCode::GATEWAY_TIMEOUT
    );
    let r = send(gw, Method::POST, "/orders", &slow, "pay").await;
    assert_eq!(r.code(), "outcome_unknown");
    assert!(r.headers.contains_key("retry-after"));
    tokio::time::sleep(Duration::from_millis(400)).await;
    let fast = [("idempotency-key", "t"), ("x-delay-ms", "0")];
    // The delay header is not part of the fingerprint by default, so this is the same request.
    let r = send(gw, Method::POST, "/orders", &fast, "pay").await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    assert_eq!(seen.runs(), 2);
    assert!(
        send(gw, Method::POST, "/orders", &fast, "pay")
            .await
            .replayed()
    );
}

#[tokio::test]
async fn a_connection_broken_after_sending_is_an_unknown_outcome() {
    let (seen, up) = start_upstream().await;
    let gw = start_gateway(up, memory(), "").await;
    let r = post(gw, "/broken", "b", "").await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert_eq!(r.code(), "upstream_failed");
    let r = post(gw, "/broken", "b", "").await;
    assert_eq!(r.code(), "outcome_unknown");
    assert_eq!(seen.runs(), 1);
}

#[tokio::test]
async fn an_answer_body_that_stalls_past_the_timeout_is_an_unknown_outcome() {
    let (seen, up) = start_upstream().await;
    let gw = start_gateway(up, memory(), "upstream_timeout = \"200ms\"").await;
    let r = post(gw, "/stalls", "s", "").await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{}", r.body);
    assert_eq!(r.code(), "response_failed");
    assert_eq!(post(gw, "/stalls", "s", "").await.code(), "outcome_unknown");
    // unguarded, the same answer streams through whole, however long it takes
    let r = send(gw, Method::POST, "/stalls", &[], "").await;
    assert_eq!(r.body, "{\"slow\":true}");
    assert_eq!(seen.runs(), 2);
}
