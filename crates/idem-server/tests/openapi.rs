//! The OpenAPI document: the committed `openapi.json` is what the code generates, it is
//! OpenAPI 3.1, it lists every route the router serves, and the server serves it.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use idem_server::{AppState, router};
use idem_store::MemoryStore;
use serde_json::Value;
use tower::ServiceExt;

/// The status and the body of `method path` (with an empty JSON object as the body of a POST),
/// on the listener that serves it: the admin listener for the page and the tools under
/// `/_idem`, the API's for the rest.
async fn send(method: &str, path: &str) -> (StatusCode, Vec<u8>) {
    let state = AppState::new(Arc::new(MemoryStore::new()));
    let on_api = path == "/_idem/health" || path == "/_idem/metrics";
    let app = if path.starts_with("/_idem") && !on_api {
        idem_server::admin_router(state)
    } else {
        router(state)
    };
    let mut req = Request::builder().method(method).uri(path);
    let body = if method == "POST" {
        req = req.header(header::CONTENT_TYPE, "application/json");
        Body::from("{}")
    } else {
        Body::empty()
    };
    let res = app.oneshot(req.body(body).unwrap()).await.unwrap();
    let status = res.status();
    let bytes = axum::body::to_bytes(res.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, bytes.to_vec())
}

/// Every route the router serves, as `METHOD path` (path parameters in braces).
const ROUTES: &[&str] = &[
    "GET /healthz",
    "POST /v1/records/begin",
    "POST /v1/records/step",
    "POST /v1/records/complete",
    "POST /v1/records/release",
    "POST /v1/records/renew",
    "GET /v1/records/{namespace}/{key}",
    "POST /v1/tokens",
    "POST /v1/tokens/consume",
    "POST /v1/locks/{name}/acquire",
    "POST /v1/locks/{name}/renew",
    "POST /v1/locks/{name}/release",
    "GET /v1/ids/uuid7",
    "GET /v1/ids/snowflake",
    "GET /v1/ids/segment/{tag}",
    "GET /openapi.json",
    "GET /_idem",
    "GET /_idem/",
    "GET /_idem/assets/app.js",
    "GET /_idem/assets/app.css",
    "GET /_idem/health",
    "GET /_idem/metrics",
    "GET /_idem/records",
    "GET /_idem/records/counts",
    "GET /_idem/records/show",
    "GET /_idem/records/history",
    "POST /_idem/records/repair",
    "GET /_idem/segments",
    "GET /_idem/locks",
];

fn committed_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("openapi.json")
}

#[test]
fn committed_document_is_current() {
    let generated = idem_server::openapi::pretty();
    let path = committed_path();
    if std::env::var_os("IDEM_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, &generated).expect("write openapi.json");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "{} is not the document the code generates; refresh it with\n\n    \
         IDEM_BLESS=1 cargo test -p idem-server --test openapi\n\nand commit it.",
        path.display()
    );
}

#[test]
fn document_is_openapi_3_1_and_lists_every_route() {
    let doc: Value = serde_json::from_str(&idem_server::openapi::pretty()).unwrap();
    let version = doc["openapi"].as_str().unwrap();
    assert!(version.starts_with("3.1."), "{version}");
    let mut listed: Vec<String> = doc["paths"]
        .as_object()
        .unwrap()
        .iter()
        .flat_map(|(path, item)| {
            item.as_object()
                .unwrap()
                .keys()
                .filter(|m| ["get", "post", "put", "patch", "delete"].contains(&m.as_str()))
                .map(move |m| format!("{} {path}", m.to_uppercase()))
        })
        .collect();
    listed.sort();
    let mut expected: Vec<String> = ROUTES.iter().map(|r| (*r).to_owned()).collect();
    expected.sort();
    assert_eq!(listed, expected);
    // Both security schemes, and every problem answer refers to the problem schema.
    for scheme in ["api_key", "admin_token"] {
        assert_eq!(
            doc["components"]["securitySchemes"][scheme]["scheme"],
            "bearer"
        );
    }
    let problem = &doc["components"]["schemas"]["Problem"]["properties"];
    for member in ["type", "title", "status", "detail", "code"] {
        assert!(problem.get(member).is_some(), "Problem lacks {member}");
    }
}

/// Each listed route is one the router answers (not its fallback's 404 or 405).
#[tokio::test]
async fn router_serves_every_listed_route() {
    for route in ROUTES {
        let (method, path) = route.split_once(' ').unwrap();
        let path = path
            .replace("{namespace}", "n")
            .replace("{key}", "k")
            .replace("{name}", "n")
            .replace("{tag}", "t");
        let (status, body) = send(method, &path).await;
        let answer: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        // The record under a key that has none is a 404 of its own, with the same code.
        let fallback = status == StatusCode::METHOD_NOT_ALLOWED
            || (status == StatusCode::NOT_FOUND
                && answer["detail"]
                    .as_str()
                    .is_some_and(|d| d.starts_with("There is no such endpoint")));
        assert!(!fallback, "{route}: {status} {answer}");
    }
}

#[tokio::test]
async fn serves_the_document() {
    let (status, body) = send("GET", "/openapi.json").await;
    assert_eq!(status, StatusCode::OK);
    let served: Value = serde_json::from_slice(&body).unwrap();
    let generated: Value = serde_json::from_str(&idem_server::openapi::pretty()).unwrap();
    assert_eq!(served, generated);
}
