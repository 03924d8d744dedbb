//! What `idem gateway` logs: scopes withheld or keyed. A test binary of its own, so that the
//! test runs in a process of its own: a call site that another test's thread reaches first,
//! logging nowhere, can cache that nobody listens (a race in `tracing`'s interest cache, which
//! `rebuild_interest_cache` does not close) and hide a line from this test's subscriber.

#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;

use axum::http::{Method, Request};
use idem_gateway::gateway::{FileConfig, Gateway, Upstream as UpstreamUrl};
use serde_json::Value;

use idem_testkit::logs::Log;

mod gateway_support;
use gateway_support::*;

/// The warnings a gateway configured with `config` logs when it starts.
fn warnings_of(config: &str) -> Vec<String> {
    let file = FileConfig::parse(config).unwrap();
    let url = UpstreamUrl::parse("http://127.0.0.1:9").unwrap();
    Gateway::new(url, memory())
        .configure(&file)
        .unwrap()
        .warnings()
}

/// The `scope=` field of the log's unknown-outcome line.
fn logged_scope(log: &str) -> String {
    let line = log
        .lines()
        .find(|l| l.contains("outcome unknown"))
        .unwrap_or_else(|| panic!("no unknown outcome in the log:\n{log}"));
    let at = line.find("scope=").unwrap() + "scope=".len();
    line[at..].split_whitespace().next().unwrap().to_owned()
}

// A single-threaded runtime: the gateway's tasks log on this thread, to this test's subscriber.
#[tokio::test(flavor = "current_thread")]
async fn scopes_are_logged_only_when_keyed_and_the_record_tools_take_both_forms() {
    const TOKEN: &str = "operator-token-0123456789";
    let log = Log::default();
    let _guard = tracing::subscriber::set_default(log.subscriber());
    // Call sites other tests' threads reached first (logging nowhere) may have cached that
    // nobody listens; ask them again now that this thread does.
    tracing::callsite::rebuild_interest_cache();

    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let secret_file = dir.path().join("scope-secret");
    std::fs::write(&secret_file, "0123456789abcdef0123456789abcdef\n").unwrap();
    let alice = "Bearer alice-secret";
    let plain = {
        let parts = Request::builder()
            .header("authorization", alice)
            .body(())
            .unwrap()
            .into_parts()
            .0;
        idem_http::ScopeSource::default().scope_of(&parts)
    };
    let slow = [
        ("idempotency-key", "t"),
        ("authorization", alice),
        ("x-delay-ms", "1000"),
    ];
    let (_, up) = start_upstream().await;
    let inspect = |gw: SocketAddr, body: Value| async move {
        let headers = [
            ("authorization", "Bearer operator-token-0123456789"),
            ("content-type", "application/json"),
        ];
        send(
            gw,
            Method::POST,
            "/_idem/records/inspect",
            &headers,
            &body.to_string(),
        )
        .await
    };

    // Without a secret the log withholds the scope; the tools take the credential.
    let config = format!(
        "upstream_timeout = \"200ms\"\nadmin_token_file = {:?}",
        token_file.display()
    );
    let (gw, tools) = start_gateway_with_admin(up, memory(), &config).await;
    let r = send(gw, Method::POST, "/orders", &slow, "pay").await;
    assert_eq!(r.code(), "upstream_timeout");
    let text = log.text_with("outcome unknown", 1).await;
    assert_eq!(logged_scope(&text), "withheld");
    assert!(!text.contains(plain.as_str()), "{text}");
    // What the gateway warns at start, asked of it directly: a test that captures the log
    // can miss a line whose call site another test's thread, logging nowhere, reached first.
    assert!(
        warnings_of(&config)
            .iter()
            .any(|w| w.contains("no scope_secret_file"))
    );
    let r = inspect(
        tools,
        serde_json::json!({"path": "/orders", "key": "t", "credential": alice}),
    )
    .await;
    assert_eq!(r.json()["state"], "unknown", "{}", r.body);
    let r = inspect(
        tools,
        serde_json::json!({"path": "/orders", "key": "t", "scope": "withheld"}),
    )
    .await;
    assert_eq!(r.code(), "invalid_request");
    assert!(r.json()["detail"].as_str().unwrap().contains("credential"));

    // With a secret the log carries the keyed scope, and the tools take it or the credential
    // (any spelling of its scheme).
    log.clear();
    let config = format!(
        "upstream_timeout = \"200ms\"\nadmin_token_file = {:?}\nscope_secret_file = {:?}",
        token_file.display(),
        secret_file.display()
    );
    let (gw, tools) = start_gateway_with_admin(up, memory(), &config).await;
    let r = send(gw, Method::POST, "/orders", &slow, "pay").await;
    assert_eq!(r.code(), "upstream_timeout");
    let text = log.text_with("outcome unknown", 1).await;
    let keyed = logged_scope(&text);
    assert!(
        keyed.starts_with("cred-") && keyed != plain.as_str(),
        "{text}"
    );
    assert!(!text.contains(plain.as_str()), "{text}");
    assert!(
        !warnings_of(&config)
            .iter()
            .any(|w| w.contains("no scope_secret_file"))
    );
    for who in [
        serde_json::json!({"scope": keyed}),
        serde_json::json!({"credential": alice}),
        serde_json::json!({"credential": "bearer alice-secret"}),
    ] {
        let mut body = serde_json::json!({"path": "/orders", "key": "t"});
        body.as_object_mut()
            .unwrap()
            .extend(who.as_object().unwrap().clone());
        let r = inspect(tools, body.clone()).await;
        assert_eq!(r.json()["state"], "unknown", "{body}: {}", r.body);
    }
    let r = inspect(
        tools,
        serde_json::json!({"path": "/orders", "key": "t", "scope": plain.as_str()}),
    )
    .await;
    assert_eq!(r.code(), "record_not_found");
    // The path is read as a request's would be.
    let r = inspect(
        tools,
        serde_json::json!({"path": "/x/../orders", "key": "t", "scope": keyed}),
    )
    .await;
    assert_eq!(r.json()["state"], "unknown", "{}", r.body);
    let r = inspect(
        tools,
        serde_json::json!({"path": "/%2e/orders", "key": "t", "scope": keyed}),
    )
    .await;
    assert_eq!(r.code(), "ambiguous_path");
}
