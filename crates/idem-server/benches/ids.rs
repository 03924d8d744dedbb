//! The id endpoints under load: `GET /v1/ids/{snowflake,segment/bench,uuid7}?count=1000` from
//! 16 keep-alive clients for a few seconds each, with the server (memory store) and the load
//! generator on runtimes of their own in this process. Reports requests and ids per second.
//!
//! `cargo bench -p idem-server --bench ids -- [--seconds N]`

#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::cast_precision_loss)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idem_core::{Clock, SharedStore, SystemClock};
use idem_server::{AppState, router};

fn main() {
    let mut seconds = 5u64;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--seconds" => seconds = args.next().and_then(|v| v.parse().ok()).expect("a number"),
            "--quick" => seconds = 1,
            _ => {}
        }
    }
    let server = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let addr: SocketAddr = server.block_on(async {
        let store: SharedStore = Arc::new(idem_store::MemoryStore::new());
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let pool = idem_id::WorkerPool::new(store.clone(), clock, "bench");
        let g = idem_id::ManagedSnowflake::start(
            pool,
            idem_id::Layout::default(),
            idem_id::SnowflakeOptions::default(),
        )
        .await
        .unwrap();
        let mut state = AppState::new(store);
        state.snowflake = Some(g);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router(state)).await.unwrap() });
        addr
    });
    let load = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    println!("| endpoint (count=1000) | requests/s | ids/s |");
    println!("|---|---|---|");
    for path in ["snowflake", "segment/bench", "uuid7"] {
        let uri = format!("http://{addr}/v1/ids/{path}?count=1000");
        let requests = load.block_on(run(&uri, Duration::from_secs(seconds)));
        let rps = requests as f64 / seconds as f64;
        println!("| {path} | {rps:.0} | {:.0} |", rps * 1000.0);
    }
}

async fn run(uri: &str, length: Duration) -> u64 {
    let client: Client<HttpConnector, Empty<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let until = Instant::now() + length;
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (client, uri) = (client.clone(), uri.to_owned());
            tokio::spawn(async move {
                let mut n = 0u64;
                while Instant::now() < until {
                    let req = Request::get(&uri).body(Empty::new()).unwrap();
                    let res = client.request(req).await.unwrap();
                    assert_eq!(res.status(), StatusCode::OK);
                    res.into_body().collect().await.unwrap();
                    n += 1;
                }
                n
            })
        })
        .collect();
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    total
}
