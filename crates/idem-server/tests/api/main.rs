//! The record API over HTTP semantics: outcomes, scopes, and every kind of bad input.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use idem_core::{ManualClock, SharedStore};
use idem_server::auth::Auth;
use idem_server::{AppState, router};
use idem_store::MemoryStore;
use idem_testkit::{Fault, FaultyStore, Op, Stall, within};
use serde_json::{Value, json};
use tower::ServiceExt;

const KEY_A: &str = "shop-key-0123456789abcdef";
const KEY_B: &str = "bank-key-0123456789abcdef";

struct Api {
    app: Router,
    clock: ManualClock,
}

struct Reply {
    status: StatusCode,
    headers: axum::http::HeaderMap,
    body: Value,
    /// The body as it was sent.
    text: String,
}

impl Reply {
    fn code(&self) -> &str {
        self.body["code"].as_str().unwrap_or("")
    }
}

impl Api {
    fn new() -> Self {
        Self::with(Arc::new(MemoryStore::new()), Auth::anonymous())
    }

    fn with(store: SharedStore, auth: Auth) -> Self {
        Self::with_state(AppState::new(store), auth)
    }

    fn with_state(mut state: AppState, auth: Auth) -> Self {
        let clock = ManualClock::starting_now();
        state.clock = Arc::new(clock.clone());
        state.auth = Arc::new(auth);
        state.max_body = 4096;
        Self {
            app: router(state),
            clock,
        }
    }

    async fn send(&self, req: Request<Body>) -> Reply {
        let res = self.app.clone().oneshot(req).await.unwrap();
        let status = res.status();
        let headers = res.headers().clone();
        let bytes = axum::body::to_bytes(res.into_body(), usize::MAX)
            .await
            .unwrap();
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        if !status.is_success() {
            assert_eq!(
                headers[header::CONTENT_TYPE],
                "application/problem+json",
                "every error is problem+json: {body}"
            );
            assert!(body["detail"].as_str().is_some_and(|d| !d.is_empty()));
            assert_eq!(body["status"], status.as_u16());
        }
        Reply {
            status,
            headers,
            body,
            text: String::from_utf8_lossy(&bytes).into_owned(),
        }
    }

    async fn post(&self, path: &str, auth: Option<&str>, body: &Value) -> Reply {
        self.post_raw(path, auth, "application/json", body.to_string())
            .await
    }

    async fn post_raw(
        &self,
        path: &str,
        auth: Option<&str>,
        content_type: &str,
        body: String,
    ) -> Reply {
        let mut req = Request::post(path).header(header::CONTENT_TYPE, content_type);
        if let Some(key) = auth {
            req = req.header(header::AUTHORIZATION, format!("Bearer {key}"));
        }
        self.send(req.body(Body::from(body)).unwrap()).await
    }

    async fn get(&self, path: &str, auth: Option<&str>) -> Reply {
        let mut req = Request::get(path);
        if let Some(key) = auth {
            req = req.header(header::AUTHORIZATION, format!("Bearer {key}"));
        }
        self.send(req.body(Body::empty()).unwrap()).await
    }

    async fn begin(&self, auth: Option<&str>, key: &str, request: Value) -> Reply {
        self.post(
            "/v1/records/begin",
            auth,
            &json!({"namespace": "pay", "key": key, "request": request, "lease_ms": 10_000}),
        )
        .await
    }

    async fn complete(&self, auth: Option<&str>, key: &str, lease: &str, response: Value) -> Reply {
        self.post(
            "/v1/records/complete",
            auth,
            &json!({"namespace": "pay", "key": key, "lease": lease, "response": response}),
        )
        .await
    }
}

fn lease_of(r: &Reply) -> String {
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body["outcome"], "acquired", "{}", r.body);
    r.body["lease"]["id"].as_str().unwrap().to_owned()
}

mod bad_input;
mod records;

/// Which acquisition of its record the fence in an answer is (1 for the lease that created it).
fn acquisition(fence: &serde_json::Value) -> u32 {
    idem_core::Lease::acquisition_of(fence.as_u64().expect("a fence"))
}
