//! `idem-client` against `IdempotencyLayer` through a proxy that loses requests and answers:
//! hundreds of operations, each run once by the handler, each call ending with the answer of
//! that one run.

#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use idem_core::SharedStore;
use idem_http::{IdempotencyLayer, Policy};
use idem_store::MemoryStore;
use idem_testkit::chaos::{Ledger, check_storm, standard_storm};
use tokio::net::TcpListener;

async fn transfer(State(ledger): State<Ledger>, body: Bytes) -> (StatusCode, String) {
    (StatusCode::CREATED, ledger.serve(&body).await)
}

/// The handler behind the layer, or bare.
async fn service(ledger: Ledger, guarded: bool) -> SocketAddr {
    let store: SharedStore = Arc::new(MemoryStore::new());
    let route = if guarded {
        post(transfer).layer(IdempotencyLayer::new(store, Policy::default()))
    } else {
        post(transfer)
    };
    let app = Router::new()
        .route("/v1/transfers", route)
        .with_state(ledger);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retries_through_lost_requests_and_answers_run_each_operation_once() {
    let ledger = Ledger::default();
    let service = service(ledger.clone(), true).await;
    let (proxy, calls) = standard_storm(service, "/v1/transfers").await;
    check_storm(&ledger, &proxy, &calls);
}

/// The same storm against the bare handler: the client's retries alone run operations twice,
/// which the check above would catch.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_the_layer_the_same_retries_run_operations_twice() {
    let ledger = Ledger::default();
    let service = service(ledger.clone(), false).await;
    standard_storm(service, "/v1/transfers").await;
    assert!(ledger.repeated() > 10, "{} repeated", ledger.repeated());
}
