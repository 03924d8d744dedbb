//! `Retries` against a scripted server: which answers are retried, with which key, how long
//! apart, and how a call ends.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use idem_client::{Error, KeyFormat, Last, Retries, RetryPolicy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// One request as the server saw it.
#[derive(Clone, Debug)]
struct Seen {
    method: Method,
    key: Option<String>,
    at: Instant,
}

#[derive(Clone, Default)]
struct Server {
    seen: Arc<Mutex<HashMap<String, Vec<Seen>>>>,
}

impl Server {
    fn seen(&self, path: &str) -> Vec<Seen> {
        self.seen
            .lock()
            .unwrap()
            .get(path)
            .cloned()
            .unwrap_or_default()
    }
}

fn problem(status: u16, code: &str, headers: &[(&'static str, &'static str)]) -> Response {
    let mut r = (
        StatusCode::from_u16(status).unwrap(),
        [("content-type", "application/problem+json")],
        format!(r#"{{"type":"about:blank","title":"t","status":{status},"code":"{code}","detail":"about {code}"}}"#),
    )
        .into_response();
    for (k, v) in headers {
        r.headers_mut().insert(*k, v.parse().unwrap());
    }
    r
}

/// Answers the n-th request to `/s/<a>,<b>,…` with the n-th item of the script (the last one
/// once the script runs out): a status, or one of `inprogress` (409 with Retry-After: 1),
/// `unknown`, `mismatch`, `replay` (201 marked replayed), `slow429` (429 with Retry-After:
/// 120), `busy503` (503 with Retry-After: 1).
async fn scripted(
    State(server): State<Server>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let path = uri.path().to_owned();
    let n = {
        let mut seen = server.seen.lock().unwrap();
        let list = seen.entry(path.clone()).or_default();
        list.push(Seen {
            method,
            key: headers
                .get("idempotency-key")
                .map(|v| v.to_str().unwrap().to_owned()),
            at: Instant::now(),
        });
        list.len()
    };
    let script: Vec<&str> = path.trim_start_matches("/s/").split(',').collect();
    let step = script[(n - 1).min(script.len() - 1)];
    match step {
        "inprogress" => problem(409, "request_in_progress", &[("retry-after", "1")]),
        "unknown" => problem(409, "outcome_unknown", &[]),
        "mismatch" => problem(422, "idempotency_key_mismatch", &[]),
        "slow429" => problem(429, "busy", &[("retry-after", "120")]),
        "busy503" => problem(503, "overloaded", &[("retry-after", "1")]),
        "replay" => (
            StatusCode::CREATED,
            [("idempotent-replayed", "true")],
            format!("run {n}"),
        )
            .into_response(),
        status => (
            StatusCode::from_u16(status.parse().unwrap()).unwrap(),
            format!("run {n}"),
        )
            .into_response(),
    }
}

async fn server() -> (Server, SocketAddr) {
    let server = Server::default();
    let app = Router::new().fallback(scripted).with_state(server.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (server, addr)
}

/// Quick retries, so that the suite does not sleep through backoffs.
fn fast() -> Retries {
    Retries::new(
        RetryPolicy::default()
            .attempts(5)
            .backoff(Duration::from_millis(5), Duration::from_millis(20)),
    )
}

#[tokio::test]
async fn a_post_gets_one_key_and_keeps_it_on_every_retry() {
    let (server, addr) = server().await;
    let http = reqwest::Client::new();
    let answer = fast()
        .send(
            &http,
            http.post(format!("http://{addr}/s/503,502,500,201"))
                .body("{}"),
        )
        .await
        .unwrap();
    assert_eq!(answer.response.status(), 201);
    assert_eq!(answer.response.text().await.unwrap(), "run 4");
    let seen = server.seen("/s/503,502,500,201");
    assert_eq!(seen.len(), 4);
    let key = answer.report.key.clone().unwrap();
    assert_eq!(answer.report.attempts, 4);
    assert!(!answer.report.replayed);
    // A quoted UUIDv7 (the draft's structured-field string), the same on every attempt.
    let sent = seen[0].key.clone().unwrap();
    assert_eq!(sent, format!("\"{key}\""));
    assert_eq!(key.len(), 36);
    assert_eq!(&key[14..15], "7", "a version 7 UUID: {key}");
    assert!(seen.iter().all(|s| s.key.as_deref() == Some(sent.as_str())));

    // Another call is another operation: another key.
    let other = fast()
        .send(&http, http.post(format!("http://{addr}/s/201")))
        .await
        .unwrap();
    assert_ne!(other.report.key, Some(key));
}

#[tokio::test]
async fn a_callers_key_is_kept_as_given_and_bare_keys_are_bare() {
    let (server, addr) = server().await;
    let http = reqwest::Client::new();
    let url = format!("http://{addr}/s/503,200");
    let answer = fast()
        .send(&http, http.put(&url).header("Idempotency-Key", "order-42"))
        .await
        .unwrap();
    assert_eq!(answer.report.key.as_deref(), Some("order-42"));
    assert!(
        server
            .seen("/s/503,200")
            .iter()
            .all(|s| s.key.as_deref() == Some("order-42"))
    );
    let answer = fast()
        .key_format(KeyFormat::Bare)
        .send(&http, http.patch(format!("http://{addr}/s/200")))
        .await
        .unwrap();
    let key = answer.report.key.unwrap();
    assert_eq!(server.seen("/s/200")[0].key.as_deref(), Some(key.as_str()));
}

#[tokio::test]
async fn a_post_without_a_key_is_sent_once_and_a_get_is_retried_without_one() {
    let (server, addr) = server().await;
    let http = reqwest::Client::new();
    let answer = fast()
        .attach_keys(false)
        .send(&http, http.post(format!("http://{addr}/s/503,201")))
        .await
        .unwrap();
    assert_eq!(answer.response.status(), 503);
    assert_eq!(answer.report.attempts, 1);
    assert_eq!(answer.report.key, None);
    let seen = server.seen("/s/503,201");
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].key, None);

    let answer = fast()
        .send(&http, http.get(format!("http://{addr}/s/503,429,200")))
        .await
        .unwrap();
    assert_eq!(answer.response.status(), 200);
    let seen = server.seen("/s/503,429,200");
    assert_eq!(seen.len(), 3);
    assert!(
        seen.iter()
            .all(|s| s.key.is_none() && s.method == Method::GET)
    );
}

#[tokio::test]
async fn a_mismatch_or_an_unknown_outcome_ends_the_call_at_once() {
    let (server, addr) = server().await;
    let http = reqwest::Client::new();
    let e = fast()
        .send(&http, http.post(format!("http://{addr}/s/mismatch,201")))
        .await
        .unwrap_err();
    let Error::KeyMismatch {
        status,
        detail,
        report,
    } = &e
    else {
        panic!("{e:?}")
    };
    assert_eq!(*status, 422);
    assert_eq!(detail.as_deref(), Some("about idempotency_key_mismatch"));
    assert_eq!(report.attempts, 1);
    assert_eq!(server.seen("/s/mismatch,201").len(), 1);

    let e = fast()
        .send(&http, http.post(format!("http://{addr}/s/503,unknown,201")))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::OutcomeUnknown { report, .. } if report.attempts == 2),
        "{e:?}"
    );
    assert_eq!(server.seen("/s/503,unknown,201").len(), 2);
    // Neither the message nor the debug form names the key.
    let key = e.report().unwrap().key.clone().unwrap();
    assert!(!e.to_string().contains(&key));
    assert!(!format!("{e:?}").contains(&key));
}

#[tokio::test]
async fn a_request_in_progress_is_retried_after_its_retry_after_and_gets_the_replay() {
    let (server, addr) = server().await;
    let http = reqwest::Client::new();
    let answer = fast()
        .send(
            &http,
            http.post(format!("http://{addr}/s/inprogress,replay")),
        )
        .await
        .unwrap();
    assert_eq!(answer.response.status(), 201);
    assert!(answer.report.replayed);
    assert_eq!(answer.report.attempts, 2);
    let seen = server.seen("/s/inprogress,replay");
    // Not sooner than the server asked (a lower bound: a slow machine only waits longer).
    assert!(seen[1].at - seen[0].at >= Duration::from_secs(1));
}

#[tokio::test]
async fn the_call_gives_up_with_its_last_answer_or_error() {
    let (server, addr) = server().await;
    let http = reqwest::Client::new();
    let e = fast()
        .send(&http, http.post(format!("http://{addr}/s/503")))
        .await
        .unwrap_err();
    let Error::GaveUp {
        last: Last::Response(r),
        report,
    } = e
    else {
        panic!("gave up")
    };
    assert_eq!(r.status(), 503);
    assert_eq!(report.attempts, 5);
    assert_eq!(server.seen("/s/503").len(), 5);

    // A server that asks for a longer wait than the policy allows ends the retries at once.
    let e = fast()
        .send(&http, http.post(format!("http://{addr}/s/slow429,201")))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::GaveUp { report, .. } if report.attempts == 1),
        "{e:?}"
    );

    // So does a wait that would outlast the call's total time.
    let short = Retries::new(RetryPolicy::default().total_time(Duration::from_millis(300)));
    let e = short
        .send(&http, http.post(format!("http://{addr}/s/busy503,201")))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::GaveUp { report, .. } if report.attempts == 1),
        "{e:?}"
    );

    // Nobody listening: every attempt fails to connect, and the call ends with that error.
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let e = fast()
        .send(&http, http.post(format!("http://127.0.0.1:{port}/x")))
        .await
        .unwrap_err();
    let Error::GaveUp {
        last: Last::Transport(cause),
        report,
    } = &e
    else {
        panic!("{e:?}")
    };
    assert_eq!(report.attempts, 5);
    assert!(
        matches!(cause, reqwest_middleware::Error::Reqwest(c) if c.is_connect()),
        "{cause:?}"
    );
    assert!(std::error::Error::source(&e).is_some());
}

/// A server that reads each connection's request, then closes the first `drops` connections
/// without answering, and answers 201 on the others.
async fn dropping(drops: usize) -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let requests = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&requests);
    tokio::spawn(async move {
        let mut n = 0;
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            n += 1;
            let mut buf = vec![0u8; 4096];
            let mut got = Vec::new();
            while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                let read = socket.read(&mut buf).await.unwrap();
                if read == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..read]);
            }
            seen.lock()
                .unwrap()
                .push(String::from_utf8_lossy(&got).into_owned());
            if n > drops {
                let _ = socket
                    .write_all(
                        b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok",
                    )
                    .await;
            }
        }
    });
    (addr, requests)
}

#[tokio::test]
async fn connections_that_break_after_sending_are_retried_with_the_same_key() {
    let (addr, requests) = dropping(2).await;
    let http = reqwest::Client::new();
    let answer = fast()
        .send(&http, http.post(format!("http://{addr}/charge")).body("{}"))
        .await
        .unwrap();
    assert_eq!(answer.response.status(), 201);
    assert_eq!(answer.report.attempts, 3);
    let requests = requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 3);
    let key = format!(
        "idempotency-key: \"{}\"",
        answer.report.key.as_deref().unwrap()
    );
    assert!(requests.iter().all(|r| r.contains(&key)), "{requests:?}");
}

#[tokio::test]
async fn the_middleware_reports_on_its_answers_and_fails_with_typed_errors() {
    let (server, addr) = server().await;
    let http = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(fast())
        .build();
    let response = http
        .post(format!("http://{addr}/s/502,replay"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let report = idem_client::report(&response).unwrap().clone();
    assert_eq!(report.attempts, 2);
    assert!(report.replayed);
    let seen = server.seen("/s/502,replay");
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].key, seen[1].key);

    let e = http
        .post(format!("http://{addr}/s/mismatch"))
        .send()
        .await
        .unwrap_err();
    let reqwest_middleware::Error::Middleware(e) = e else {
        panic!("a middleware error")
    };
    assert!(matches!(
        e.downcast_ref::<Error>(),
        Some(Error::KeyMismatch { .. })
    ));

    // A request that is not retried passes through untouched.
    let response = http
        .delete(format!("http://{addr}/s/404"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);
    assert_eq!(idem_client::report(&response).unwrap().attempts, 1);
}
