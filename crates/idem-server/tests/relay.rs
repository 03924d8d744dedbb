//! The relay's rules against a real HTTP target on loopback, fed by the in-process queue:
//! what is delivered once, retried, recorded and dead-lettered. One test per row of the
//! README's table of answers.

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
use idem_gateway::relay::{Relay, Target};
use idem_mq::memory::Queue;
use idem_mq::{Consumer, Reason};
use idem_store::MemoryStore;
use tokio::net::TcpListener;

const PATIENCE: Duration = Duration::from_secs(30);

/// One scripted answer: a status, and the problem `code` of its body ("" for none).
type Scripted = (u16, &'static str);

/// What the target saw (per key, as it reads the `Idempotency-Key` header), and what it
/// answers: a list of answers to give, in order, per key (then 201), and a delay.
#[derive(Clone, Default)]
struct Counting {
    calls: Arc<Mutex<HashMap<String, Vec<String>>>>,
    fences: Arc<Mutex<HashMap<String, Vec<u64>>>>,
    script: Arc<Mutex<HashMap<String, Vec<Scripted>>>>,
    delay: Arc<Mutex<Duration>>,
}

impl Counting {
    fn calls(&self, key: &str) -> usize {
        self.calls.lock().unwrap().get(key).map_or(0, Vec::len)
    }

    fn script(&self, key: &str, answers: &[Scripted]) {
        self.script
            .lock()
            .unwrap()
            .insert(key.into(), answers.to_vec());
    }
}

async fn answer(State(t): State<Counting>, headers: HeaderMap, body: String) -> Response {
    // Read as the gateway reads it.
    let key = idem_http::key_from_headers(&headers)
        .expect("the relay sends a valid Idempotency-Key")
        .unwrap_or_default();
    t.calls
        .lock()
        .unwrap()
        .entry(key.clone())
        .or_default()
        .push(body);
    let fence = headers
        .get("idem-fence")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .expect("the relay sends its attempt's fence");
    t.fences
        .lock()
        .unwrap()
        .entry(key.clone())
        .or_default()
        .push(fence);
    let delay = *t.delay.lock().unwrap();
    tokio::time::sleep(delay).await;
    let (status, code) = {
        let mut script = t.script.lock().unwrap();
        script
            .get_mut(&key)
            .and_then(|s| (!s.is_empty()).then(|| s.remove(0)))
            .unwrap_or((201, ""))
    };
    let status = StatusCode::from_u16(status).unwrap();
    if code.is_empty() {
        return status.into_response();
    }
    (
        status,
        [("content-type", "application/problem+json")],
        format!(r#"{{"code":"{code}"}}"#),
    )
        .into_response()
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

/// What one message, answered by `script`, came to: the target's calls, the acks, and the
/// dead letters, then the same once the message is published again (a redelivery, or the
/// dead letter moved back) and answered 201.
struct Row {
    calls: usize,
    acked: usize,
    dead: Vec<idem_mq::DeadLetter>,
    calls_again: usize,
    acked_again: usize,
    /// The `Idem-Fence` of every POST, in order.
    fences: Vec<u64>,
}

async fn row(script: &[Scripted], ack_4xx: bool) -> Row {
    let (t, addr) = target().await;
    t.script("m", script);
    let q = Queue::new("orders");
    q.publish(Some("m"), b"{}".as_slice());
    let c = consumer();
    let target = Target::parse(&format!("http://{addr}/orders"))
        .unwrap()
        .ack_4xx(ack_4xx);
    let relay = Relay::new(target);
    relay_all(&c, &q, relay.clone()).await;
    let (calls, acked) = (t.calls("m"), q.acked());
    let dead = q.dead_letters().into_iter().map(|(_, d)| d).collect();
    q.publish(Some("m"), b"{}".as_slice());
    relay_all(&c, &q, relay).await;
    Row {
        calls,
        acked,
        dead,
        calls_again: t.calls("m") - calls,
        acked_again: q.acked() - acked,
        fences: t
            .fences
            .lock()
            .unwrap()
            .get("m")
            .cloned()
            .unwrap_or_default(),
    }
}

/// Row "dead-lettered, nothing recorded": each of `answers` (on its own) dead-letters the
/// message with the answer attached, and the message moved back is sent again.
async fn assert_dead_lettered(answers: &[Scripted], ack_4xx: bool) {
    for &(status, code) in answers {
        let r = row(&[(status, code)], ack_4xx).await;
        assert_eq!((r.calls, r.acked), (1, 0), "{status} {code}: not acked");
        assert_eq!(r.dead.len(), 1, "{status} {code}");
        assert_eq!(r.dead[0].reason, Reason::Refused, "{status} {code}");
        assert!(
            r.dead[0].detail.contains(&status.to_string()) && r.dead[0].detail.contains(code),
            "{status} {code}: the answer is attached: {}",
            r.dead[0].detail
        );
        assert_eq!(
            (r.calls_again, r.acked_again),
            (1, 1),
            "{status} {code}: moved back, it is sent again"
        );
    }
}

/// Row: 2xx, and 409 `response_not_replayable` (the request ran): recorded and acked; a
/// redelivery is acked without a POST.
#[tokio::test]
async fn row_delivered_answers_are_recorded_and_acked() {
    for answer in [(200, ""), (204, ""), (409, "response_not_replayable")] {
        let r = row(&[answer], false).await;
        assert_eq!((r.calls, r.acked, r.dead.len()), (1, 1, 0), "{answer:?}");
        assert_eq!(
            (r.calls_again, r.acked_again),
            (0, 1),
            "{answer:?} replayed"
        );
    }
}

/// Row: 408, 425, 429, 5xx and a 409 in progress are retried with the same key until the
/// target takes the message.
#[tokio::test]
async fn row_answers_that_say_not_processed_are_retried_with_the_same_key() {
    let r = row(&[(503, ""), (409, "request_in_progress"), (429, "")], false).await;
    assert_eq!((r.calls, r.acked, r.dead.len()), (4, 1, 0));
    // Each POST is a new attempt at the key, under a higher fence.
    assert_eq!(r.fences.len(), 4);
    assert!(r.fences.windows(2).all(|w| w[0] < w[1]), "{:?}", r.fences);
    let r = row(&[(408, ""), (425, ""), (502, "upstream_failed")], false).await;
    assert_eq!((r.calls, r.acked, r.dead.len()), (4, 1, 0));
}

/// Row: retried answers, as many as `max_attempts`: dead-lettered `attempts_exhausted`.
#[tokio::test]
async fn row_retried_answers_end_in_the_dead_letter_after_the_last_attempt() {
    let r = row(&[(500, ""); 4], false).await;
    assert_eq!((r.calls, r.acked), (4, 0), "max_attempts");
    assert_eq!(r.dead[0].reason, Reason::AttemptsExhausted);
    assert!(r.dead[0].detail.contains("500"), "{}", r.dead[0].detail);
}

/// Row: 409 `outcome_unknown` (the gateway's upstream timed out on an earlier POST) is
/// dead-lettered with the answer, never acked, with or without `--ack-4xx`.
#[tokio::test]
async fn row_an_unknown_outcome_is_dead_lettered_not_acked() {
    assert_dead_lettered(&[(409, "outcome_unknown")], false).await;
    assert_dead_lettered(&[(409, "outcome_unknown")], true).await;
}

/// Row: answers that mean the relay or the target is misconfigured are dead-lettered even
/// with `--ack-4xx`.
#[tokio::test]
async fn row_answers_that_mean_misconfiguration_are_dead_lettered() {
    let answers = [
        (401, "credential_required"),
        (403, ""),
        (404, ""),
        (405, ""),
        (407, ""),
        (413, "body_too_large"),
        (415, ""),
        (501, ""),
        (308, ""),
    ];
    assert_dead_lettered(&answers, true).await;
}

/// Row: the gateway's key errors are dead-lettered even with `--ack-4xx`.
#[tokio::test]
async fn row_the_gateways_key_errors_are_dead_lettered() {
    let answers = [
        (400, "idempotency_key_missing"),
        (400, "idempotency_key_invalid"),
        (422, "idempotency_key_mismatch"),
    ];
    assert_dead_lettered(&answers, true).await;
}

/// Row: other 4xx are dead-lettered by default; with `--ack-4xx` they are business answers,
/// recorded and acked, and a redelivery gets the recorded answer.
#[tokio::test]
async fn row_other_client_errors_are_dead_lettered_unless_they_are_business_answers() {
    assert_dead_lettered(&[(422, ""), (400, ""), (409, ""), (410, "")], false).await;
    let r = row(&[(422, "")], true).await;
    assert_eq!((r.calls, r.acked, r.dead.len()), (1, 1, 0));
    assert_eq!(
        (r.calls_again, r.acked_again),
        (0, 1),
        "the redelivery is replayed"
    );
}

/// Row: a message without a key, or with one no header can carry, is dead-lettered before
/// any POST.
#[tokio::test]
async fn row_a_message_whose_key_cannot_be_sent_is_dead_lettered_unsent() {
    let (t, addr) = target().await;
    let q = Queue::new("orders");
    q.publish(None, b"{}".as_slice());
    q.publish(Some("has space"), b"{}".as_slice());
    q.publish(Some("caf\u{e9}"), b"{}".as_slice());
    q.publish(Some(&"k".repeat(256)), b"{}".as_slice());
    let target = Target::parse(&format!("http://{addr}/orders")).unwrap();
    relay_all(&consumer(), &q, Relay::new(target)).await;
    let reasons: Vec<_> = q.dead_letters().iter().map(|(_, d)| d.reason).collect();
    assert_eq!(
        reasons,
        [
            Reason::NoKey,
            Reason::InvalidKey,
            Reason::InvalidKey,
            Reason::InvalidKey
        ]
    );
    assert!(t.calls.lock().unwrap().is_empty());
}

/// Message ids that read alike as bare header values (`a,b` is two items to a structured
/// field parser, `"q"` reads as `q`) reach the target as exactly the ids they are, each once.
#[tokio::test]
async fn every_key_reaches_the_target_as_exactly_itself() {
    let (t, addr) = target().await;
    let ids = [
        "a,b",
        "\"q\"",
        "q",
        "back\\slash",
        "\"",
        "x;y=z",
        "(){}<>@?=/",
    ];
    let q = Queue::new("orders");
    for id in ids {
        q.publish(Some(id), b"{}".as_slice());
    }
    let target = Target::parse(&format!("http://{addr}/orders")).unwrap();
    relay_all(&consumer(), &q, Relay::new(target)).await;
    for id in ids {
        assert_eq!(t.calls(id), 1, "{id}");
    }
    assert_eq!(t.calls.lock().unwrap().len(), ids.len());
    assert_eq!(q.acked(), ids.len());
}

/// Row: a connection that fails and a timeout are retried, then dead-lettered.
#[tokio::test]
async fn row_a_target_that_is_down_or_slow_is_retried_then_dead_lettered() {
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
