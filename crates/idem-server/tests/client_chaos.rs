//! `idem-client` against `idem gateway` through a proxy that loses requests and answers:
//! hundreds of operations, each run once by the upstream, each call ending with the answer of
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
use idem_store::{ReplayCache, ReplayCacheLimits, SqliteStore};
use idem_testkit::chaos::{Ledger, check_storm, standard_storm};
use tokio::net::TcpListener;

mod gateway_support;
use gateway_support::start_gateway;

async fn transfer(State(ledger): State<Ledger>, body: Bytes) -> (StatusCode, String) {
    (StatusCode::CREATED, ledger.serve(&body).await)
}

async fn upstream(ledger: Ledger) -> SocketAddr {
    let app = Router::new()
        .route("/v1/transfers", post(transfer))
        .with_state(ledger);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retries_through_lost_requests_and_answers_run_each_operation_once() {
    let ledger = Ledger::default();
    let upstream = upstream(ledger.clone()).await;
    // As `idem gateway` runs by default: the embedded store behind the replay cache.
    let dir = tempfile::tempdir().unwrap();
    let sqlite = SqliteStore::open(dir.path().join("idem.db")).unwrap();
    let store: SharedStore = Arc::new(ReplayCache::new(
        Arc::new(sqlite) as SharedStore,
        ReplayCacheLimits::default(),
    ));
    let gateway = start_gateway(upstream, store, "").await;
    let (proxy, calls) = standard_storm(gateway, "/v1/transfers").await;
    check_storm(&ledger, &proxy, &calls);
}
