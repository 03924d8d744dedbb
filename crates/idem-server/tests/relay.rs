//! The relay's rules against a real HTTP target on loopback, fed by the in-process queue:
//! what is delivered once, retried, recorded and dead-lettered.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem_mq::memory::Queue;
use idem_mq::{Consumer, Reason};
use idem_server::relay::{Relay, Target};
use idem_store::MemoryStore;
use tokio::net::TcpListener;

const PATIENCE: Duration = Duration::from_secs(30);

/// What the target saw, and what it answers: a list of statuses to give, in order, per key
/// (then 201), and a delay.
#[derive(Clone, Default)]
struct Counting {
    calls: Arc<Mutex<HashMap<String, Vec<String>>>>,
    script: Arc<Mutex<HashMap<String, Vec<u16>>>>,
    delay: Arc<Mutex<Duration>>,
}

impl Counting {
    fn calls(&self, key: &str) -> usize {
        self.calls.lock().unwrap().get(key).map_or(0, Vec::len)
    }
}

async fn answer(State(t): State<Counting>, headers: HeaderMap, body: String) -> Response {
    let key = headers
        .get("idempotency-key")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    t.calls
        .lock()
        .unwrap()
        .entry(key.clone())
        .or_default()
        .push(body);
    let delay = *t.delay.lock().unwrap();
    tokio::time::sleep(delay).await;
    let status = {
        let mut script = t.script.lock().unwrap();
        script
            .get_mut(&key)
            .and_then(|s| (!s.is_empty()).then(|| s.remove(0)))
            .unwrap_or(201)
    };
    if status == 409 {
        return (
            StatusCode::CONFLICT,
            [("content-type", "application/problem+json")],
            r#"{"code":"request_in_progress"}"#,
        )
            .into_response();
    }
    StatusCode::from_u16(status).unwrap().into_response()
}

async fn target() -> (Counting, SocketAddr) {
    let t = Counting::default();
    let app = Router::new()
        .route("/orders", post(answer))
        .with_state(t.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (t, addr)
}

fn consumer() -> Consumer<MemoryStore> {
    Consumer::new(MemoryStore::new())
        .scope("relay")
        .max_attempts(4)
        .backoff(Duration::from_millis(10), Duration::from_millis(40))
        .concurrency(8)
}

async fn relay_all(c: &Consumer<MemoryStore>, q: &Queue, relay: Relay) {
    tokio::time::timeout(PATIENCE, c.run(q.source(), relay, q.clone().drained()))
        .await
        .expect("the queue drains in time")
        .expect("the relay runs");
}

#[tokio::test]
async fn each_message_reaches_the_target_once_with_its_key() {
    let (t, addr) = target().await;
    let q = Queue::new("orders");
    for i in 0..100 {
        let id = format!("o-{i}");
        q.publish(Some(&id), format!("{{\"n\":{i}}}"));
        if i % 10 < 3 {
            q.publish(Some(&id), format!("{{\"n\":{i}}}"));
        }
    }
    let c = consumer();
    let relay = Relay::new(Target::parse(&format!("http://{addr}/orders")).unwrap());
    relay_all(&c, &q, relay).await;
    for i in 0..100 {
        let calls = t.calls.lock().unwrap().get(&format!("o-{i}")).cloned();
        assert_eq!(calls, Some(vec![format!("{{\"n\":{i}}}")]), "o-{i}");
    }
    assert_eq!(q.acked(), 130);
    assert_eq!(c.counts().replayed, 30);
}

#[tokio::test]
async fn server_errors_and_in_progress_answers_are_retried_with_the_same_key() {
    let (t, addr) = target().await;
    t.script
        .lock()
        .unwrap()
        .insert("flaky".into(), vec![503, 409, 429, 200]);
    t.script
        .lock()
        .unwrap()
        .insert("broken".into(), vec![500, 500, 500, 500]);
    let q = Queue::new("orders");
    q.publish(Some("flaky"), b"{}".as_slice());
    q.publish(Some("broken"), b"{}".as_slice());
    let c = consumer();
    relay_all(
        &c,
        &q,
        Relay::new(Target::parse(&format!("http://{addr}/orders")).unwrap()),
    )
    .await;
    assert_eq!(t.calls("flaky"), 4, "three retryable answers, then 200");
    assert_eq!(t.calls("broken"), 4, "max_attempts");
    let dead = q.dead_letters();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].0.id.as_deref(), Some("broken"));
    assert_eq!(dead[0].1.reason, Reason::AttemptsExhausted);
    assert!(dead[0].1.detail.contains("500"), "{}", dead[0].1.detail);
}

#[tokio::test]
async fn a_client_error_is_recorded_and_acked_or_dead_lettered_if_asked() {
    let (t, addr) = target().await;
    t.script
        .lock()
        .unwrap()
        .insert("bad".into(), vec![422, 422]);
    let q = Queue::new("orders");
    q.publish(Some("bad"), b"{}".as_slice());
    q.publish(Some("bad"), b"{}".as_slice());
    let url = format!("http://{addr}/orders");
    let c = consumer().concurrency(1);
    relay_all(&c, &q, Relay::new(Target::parse(&url).unwrap())).await;
    assert_eq!(t.calls("bad"), 1, "the redelivery got the recorded answer");
    assert_eq!((q.acked(), c.counts().replayed), (2, 1));

    let q = Queue::new("orders");
    q.publish(Some("bad"), b"{}".as_slice());
    let strict = Target::parse(&url).unwrap().dead_letter_4xx(true);
    relay_all(&consumer(), &q, Relay::new(strict)).await;
    assert_eq!(q.dead_letters()[0].1.reason, Reason::Permanent);
}

#[tokio::test]
async fn a_target_that_is_down_or_slow_is_retried_then_dead_lettered() {
    // A port nothing listens on.
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = closed.local_addr().unwrap();
    drop(closed);
    let q = Queue::new("orders");
    q.publish(Some("down"), b"{}".as_slice());
    let c = consumer();
    relay_all(
        &c,
        &q,
        Relay::new(Target::parse(&format!("http://{addr}/orders")).unwrap()),
    )
    .await;
    assert_eq!(q.dead_letters()[0].1.reason, Reason::AttemptsExhausted);
    assert_eq!(c.counts().requeued, 3);

    let (t, addr) = target().await;
    *t.delay.lock().unwrap() = Duration::from_millis(500);
    let q = Queue::new("orders");
    q.publish(Some("slow"), b"{}".as_slice());
    let target = Target::parse(&format!("http://{addr}/orders"))
        .unwrap()
        .timeout(Duration::from_millis(100));
    relay_all(&consumer().max_attempts(2), &q, Relay::new(target)).await;
    assert_eq!(t.calls("slow"), 2);
    let (_, why) = &q.dead_letters()[0];
    assert!(why.detail.contains("did not answer"), "{}", why.detail);
}

#[test]
fn targets_and_headers_are_checked() {
    assert!(Target::parse("https://example.com/x").is_err());
    assert!(Target::parse("not a url").is_err());
    let t = Target::parse("http://127.0.0.1:1/x").unwrap();
    assert!(t.clone().header("Idempotency-Key", "x").is_err());
    assert!(t.clone().header("bad name", "x").is_err());
    assert!(t.clone().header("X-Tenant", "bad\nvalue").is_err());
    assert!(t.header("Content-Type", "text/plain").is_ok());
}
