//! A client that retries through a proxy that loses requests and answers, against the layer on
//! a real Redis: hundreds of operations, each run once, each call ending with the answer of
//! that run. Without the layer the same retries run operations twice.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use idem_core::SharedStore;
use idem_http::{GrpcIdempotencyLayer, KeyRequirement, Policy};
use idem_store::{RedisOptions, RedisStore};
use idem_testkit::chaos::{CLIENT_TIMEOUT, Call, ChaosProxy, Faults, SLOW};
use idem_testkit::services::{REDIS, forget_redis_keys};
use tonic::Code;
use tonic_types::StatusExt;

use crate::bank::{Bank, TRANSFER, UNGUARDED, call, client, serve, transfer};

const OPS: u64 = 300;
const WORKERS: usize = 16;

/// What the storm saw besides answers.
#[derive(Default)]
struct Seen {
    retries: AtomicUsize,
    replays: AtomicUsize,
}

/// Calls `path` for operations 1..=OPS through the proxy, each with its own key, retrying every
/// failure (ABORTED after its RetryInfo delay) until it has an answer.
async fn storm(proxy: &ChaosProxy, path: &'static str) -> (Vec<Call>, Seen) {
    let ch = client(proxy.addr());
    let next = Arc::new(AtomicU64::new(1));
    let seen = Arc::new(Seen::default());
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| {
            let (ch, next, seen) = (ch.clone(), next.clone(), seen.clone());
            tokio::spawn(async move {
                let mut calls = Vec::new();
                loop {
                    let op = next.fetch_add(1, Ordering::SeqCst);
                    if op > OPS {
                        return calls;
                    }
                    let key = format!("op-{op}");
                    let meta = [("idempotency-key", key.as_str())];
                    let mut answer = Err(String::from("no attempt answered"));
                    for attempt in 0..60 {
                        if attempt > 0 {
                            seen.retries.fetch_add(1, Ordering::SeqCst);
                        }
                        let result = tokio::time::timeout(
                            CLIENT_TIMEOUT,
                            call(&ch, path, transfer(op, "chaos"), &meta),
                        )
                        .await;
                        let pause = match result {
                            Ok(Ok(res)) => {
                                if res.metadata().contains_key("idempotent-replayed") {
                                    seen.replays.fetch_add(1, Ordering::SeqCst);
                                }
                                answer = Ok(res.into_inner().answer);
                                break;
                            }
                            Ok(Err(status)) if status.code() == Code::Aborted => status
                                .get_details_retry_info()
                                .and_then(|r| r.retry_delay)
                                .unwrap_or(Duration::from_millis(100)),
                            Ok(Err(status)) => {
                                answer = Err(format!("{status:?}"));
                                Duration::from_millis(20)
                            }
                            Err(_) => Duration::from_millis(20),
                        };
                        tokio::time::sleep(pause).await;
                    }
                    calls.push(Call {
                        op,
                        answer,
                        report: None,
                    });
                }
            })
        })
        .collect();
    let mut calls = Vec::new();
    for w in workers {
        calls.extend(w.await.unwrap());
    }
    let seen = Arc::into_inner(seen).unwrap();
    (calls, seen)
}

async fn lossy_proxy(bank: Bank) -> (ChaosProxy, Bank, String, String) {
    let url = REDIS.url().unwrap_or_default();
    let prefix = format!(
        "idem-test-grpc:{}:{}:",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let store: SharedStore = Arc::new(
        RedisStore::connect(
            &url,
            RedisOptions {
                prefix: prefix.clone(),
                ..RedisOptions::default()
            },
        )
        .await
        .unwrap(),
    );
    let layer = GrpcIdempotencyLayer::new(store, Policy::default().key(KeyRequirement::Required))
        .method(TRANSFER);
    let addr = serve(bank.clone(), layer).await;
    let faults = Faults {
        drop_request: 0.1,
        drop_answer: 0.15,
        delay_answer: 0.05,
        delay: SLOW,
    };
    (ChaosProxy::start_h2(addr, faults).await, bank, url, prefix)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retries_through_lost_requests_and_answers_run_each_operation_once() {
    if REDIS.url().is_none() {
        return;
    }
    let (proxy, bank, url, prefix) = lossy_proxy(Bank::new()).await;
    let (calls, seen) = storm(&proxy, TRANSFER).await;
    assert_eq!(calls.len(), usize::try_from(OPS).unwrap());
    bank.ledger.check(&calls);
    let faults = proxy.counts().faults();
    let (retries, replays) = (
        seen.retries.load(Ordering::SeqCst),
        seen.replays.load(Ordering::SeqCst),
    );
    assert!(faults > 50, "only {faults} faults");
    assert!(retries > 50, "only {retries} retries");
    assert!(
        replays > 20,
        "only {replays} retries answered with a replay"
    );
    forget_redis_keys(&url, &prefix).await;
}

/// The same storm on a method the layer does not guard: the retries alone run operations
/// twice, which the check above would catch.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_the_layer_the_same_retries_run_operations_twice() {
    if REDIS.url().is_none() {
        return;
    }
    let (proxy, bank, url, prefix) = lossy_proxy(Bank::new()).await;
    storm(&proxy, UNGUARDED).await;
    let repeated = bank.ledger.repeated();
    assert!(repeated > 10, "{repeated} repeated");
    forget_redis_keys(&url, &prefix).await;
}
