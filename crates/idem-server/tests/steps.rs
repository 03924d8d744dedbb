//! Recovery points over the JSON API: `POST /v1/records/step`, the steps in `begin`'s acquired
//! answer after a takeover, and in `GET /v1/records/{namespace}/{key}`.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use idem_core::{ManualClock, SharedStore};
use idem_server::AppState;
use idem_store::MemoryStore;
use idem_testkit::{Fault, FaultyStore, Op, Stall, within};
use serde_json::{Value, json};

use common::{BANK, SHOP, acquisition, get, post, with_callers};

/// The server over `store`, with a clock the test moves, and the shop and bank as callers.
fn server(store: SharedStore) -> (AppState, ManualClock) {
    let clock = ManualClock::starting_now();
    let mut state = with_callers(AppState::new(store));
    state.clock = Arc::new(clock.clone());
    state.max_body = 2 << 20;
    (state, clock)
}

const LEASE_MS: u64 = 10_000;

async fn begin(state: &AppState, caller: &str, key: &str, request: Value) -> (StatusCode, Value) {
    let body = json!({"namespace": "transfer", "key": key, "request": request,
                      "lease_ms": LEASE_MS, "step_keys": ["debit", "bank", "credit"]});
    post(state, caller, "/v1/records/begin", body).await
}

/// The lease token of an `acquired` answer.
fn lease(answer: &(StatusCode, Value)) -> String {
    assert_eq!(answer.0, StatusCode::OK, "{}", answer.1);
    assert_eq!(answer.1["outcome"], "acquired", "{}", answer.1);
    answer.1["lease"]["id"].as_str().unwrap().to_owned()
}

async fn step(
    state: &AppState,
    key: &str,
    lease: &str,
    name: &str,
    what: Value,
) -> (StatusCode, Value) {
    let mut body = json!({"namespace": "transfer", "key": key, "lease": lease, "step": name});
    for (k, v) in what.as_object().unwrap() {
        body[k] = v.clone();
    }
    post(state, SHOP, "/v1/records/step", body).await
}

fn done(output: Value) -> Value {
    let mut what = json!({});
    what["output"] = output;
    what
}

fn unknown() -> Value {
    json!({ "unknown": true })
}

/// `(name, outcome)` of each step in an answer's `steps`.
fn names(answer: &Value) -> Vec<(String, String)> {
    answer["steps"]
        .as_array()
        .unwrap_or_else(|| panic!("no steps in {answer}"))
        .iter()
        .map(|s| {
            let s = (s["step"].as_str().unwrap(), s["outcome"].as_str().unwrap());
            (s.0.to_owned(), s.1.to_owned())
        })
        .collect()
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
        .collect()
}

#[tokio::test]
async fn a_takeover_gets_the_finished_steps_in_order_and_resumes_after_them() {
    let (state, clock) = server(Arc::new(MemoryStore::new()));
    let transfer = json!({"from": "alice", "to": "bob", "amount": 100});

    let first = begin(&state, SHOP, "t-1", transfer.clone()).await;
    assert_eq!(first.1["steps"], json!([]), "a fresh record has no steps");
    let step_keys = first.1["step_keys"].clone();
    let l1 = lease(&first);
    let r = step(&state, "t-1", &l1, "debit", done(json!({"hold": "h-7"}))).await;
    assert_eq!(
        r,
        (
            StatusCode::OK,
            json!({"step": "debit", "outcome": "done", "fence": first.1["lease"]["fence"]})
        )
    );
    let r = step(&state, "t-1", &l1, "bank", unknown()).await;
    assert_eq!(r.0, StatusCode::OK, "{}", r.1);
    assert_eq!(r.1["outcome"], "unknown");

    // The first attempt dies; the next takes the key over once its lease has run out.
    clock.advance(Duration::from_millis(LEASE_MS + 1));
    let second = begin(&state, SHOP, "t-1", transfer.clone()).await;
    let l2 = lease(&second);
    assert_eq!(acquisition(&second.1["lease"]["fence"]), 2);
    assert_eq!(
        names(&second.1),
        pairs(&[("debit", "done"), ("bank", "unknown")])
    );
    assert_eq!(second.1["steps"][0]["output"], json!({"hold": "h-7"}));
    assert!(second.1["steps"][1].get("output").is_none(), "{}", second.1);
    // The step keys are the same on every attempt, and the same as those asked for up front.
    assert_eq!(second.1["step_keys"], step_keys);
    assert_eq!(second.1["steps"][1]["step_key"], step_keys["bank"]);
    assert_eq!(step_keys["bank"].as_str().unwrap().len(), 32);
    assert_ne!(step_keys["bank"], step_keys["debit"]);

    // The overtaken attempt cannot record anything more.
    let r = step(&state, "t-1", &l1, "bank", done(json!("late"))).await;
    assert_eq!(
        (r.0, r.1["code"].as_str()),
        (StatusCode::CONFLICT, Some("stale_lease"))
    );

    // The new attempt runs the unknown step again and finishes.
    let r = step(&state, "t-1", &l2, "bank", done(json!({"receipt": "b-1"}))).await;
    assert_eq!(r.0, StatusCode::OK, "{}", r.1);
    let r = step(&state, "t-1", &l2, "credit", done(json!(null))).await;
    assert_eq!(r.0, StatusCode::OK, "{}", r.1);
    let r = post(
        &state,
        SHOP,
        "/v1/records/complete",
        json!({"namespace": "transfer", "key": "t-1", "lease": l2, "response": {"ok": true}}),
    )
    .await;
    assert_eq!(r.0, StatusCode::OK, "{}", r.1);

    let (status, _, record) = get(&state, SHOP, "/v1/records/transfer/t-1").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        names(&record),
        pairs(&[("debit", "done"), ("bank", "done"), ("credit", "done")])
    );
    assert_eq!(record["steps"][1]["output"], json!({"receipt": "b-1"}));
    assert_eq!(record["steps"][2]["output"], Value::Null);
    assert_eq!(record["steps"][2]["step_key"], step_keys["credit"]);
    let replay = begin(&state, SHOP, "t-1", transfer).await;
    assert_eq!(replay.1["outcome"], "replay");
    assert_eq!(replay.1["response"], json!({"ok": true}));
}

#[tokio::test]
async fn a_release_keeps_the_steps_for_the_same_request_only() {
    let (state, _) = server(Arc::new(MemoryStore::new()));
    let l1 = lease(&begin(&state, SHOP, "t-2", json!(1)).await);
    step(&state, "t-2", &l1, "debit", done(json!(5))).await;
    let r = post(
        &state,
        SHOP,
        "/v1/records/release",
        json!({"namespace": "transfer", "key": "t-2", "lease": l1}),
    )
    .await;
    assert_eq!(r.0, StatusCode::OK, "{}", r.1);

    // Another request under the key never resumes this one's steps.
    let other = begin(&state, SHOP, "t-2", json!(2)).await;
    assert_eq!(
        (other.0, other.1["code"].as_str()),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("fingerprint_mismatch")
        )
    );
    // Another caller's key of the same name is another record.
    let bank = begin(&state, BANK, "t-2", json!(1)).await;
    assert_eq!(bank.1["steps"], json!([]), "{}", bank.1);
    // The same request resumes.
    let retry = begin(&state, SHOP, "t-2", json!(1)).await;
    lease(&retry);
    assert_eq!(names(&retry.1), pairs(&[("debit", "done")]));
    assert_eq!(retry.1["steps"][0]["output"], 5);
}

#[tokio::test]
async fn refused_steps_have_stable_codes_and_change_nothing() {
    let (state, _) = server(Arc::new(MemoryStore::new()));
    let l = lease(&begin(&state, SHOP, "t-3", json!(1)).await);
    let code = |r: (StatusCode, Value)| (r.0, r.1["code"].as_str().unwrap_or("").to_owned());
    let conflict = (StatusCode::CONFLICT, "step_conflict".to_owned());
    let bad = |c: &str| (StatusCode::BAD_REQUEST, c.to_owned());

    assert_eq!(
        step(&state, "t-3", &l, "debit", done(json!(1))).await.0,
        StatusCode::OK
    );
    // A repeat of what is recorded is accepted; another output under the name is not.
    assert_eq!(
        step(&state, "t-3", &l, "debit", done(json!(1))).await.0,
        StatusCode::OK
    );
    assert_eq!(
        code(step(&state, "t-3", &l, "debit", done(json!(2))).await),
        conflict
    );
    assert_eq!(
        code(step(&state, "t-3", &l, "debit", unknown()).await),
        conflict
    );
    // Nothing after an unknown step until it is recorded done.
    assert_eq!(
        step(&state, "t-3", &l, "bank", unknown()).await.0,
        StatusCode::OK
    );
    assert_eq!(
        code(step(&state, "t-3", &l, "credit", done(json!(3))).await),
        (StatusCode::CONFLICT, "step_after_unknown".to_owned())
    );
    // Bad input.
    for name in ["", "with space", "é", &"n".repeat(65)] {
        assert_eq!(
            code(step(&state, "t-3", &l, name, done(json!(1))).await),
            bad("invalid_step")
        );
    }
    let both = json!({"output": 1, "unknown": true});
    for what in [json!({}), both, json!({"unknown": false})] {
        assert_eq!(
            code(step(&state, "t-3", &l, "x", what).await),
            bad("invalid_request")
        );
    }
    assert_eq!(
        code(step(&state, "t-3", "1.zz", "x", done(json!(1))).await),
        bad("invalid_lease")
    );
    let r = post(
        &state,
        SHOP,
        "/v1/records/begin",
        json!({"namespace": "transfer", "key": "t-4", "request": 1, "step_keys": ["a b"]}),
    )
    .await;
    assert_eq!(code(r), bad("invalid_step"));
    let many: Vec<String> = (0..65).map(|i| format!("s{i}")).collect();
    let r = post(
        &state,
        SHOP,
        "/v1/records/begin",
        json!({"namespace": "transfer", "key": "t-4", "request": 1, "step_keys": many}),
    )
    .await;
    assert_eq!(code(r), bad("invalid_request"));

    let (_, _, record) = get(&state, SHOP, "/v1/records/transfer/t-3").await;
    assert_eq!(
        names(&record),
        pairs(&[("debit", "done"), ("bank", "unknown")])
    );
    assert_eq!(record["steps"][0]["output"], 1);
}

#[tokio::test]
async fn a_record_holds_at_most_64_steps_and_one_mebibyte() {
    let (state, _) = server(Arc::new(MemoryStore::new()));
    let full = (StatusCode::CONFLICT, Some("steps_full"));
    let l = lease(&begin(&state, SHOP, "t-5", json!(1)).await);
    for i in 0..64 {
        let r = step(&state, "t-5", &l, &format!("s{i}"), done(json!(i))).await;
        assert_eq!(r.0, StatusCode::OK, "step {i}: {}", r.1);
    }
    let r = step(&state, "t-5", &l, "s64", done(json!(64))).await;
    assert_eq!((r.0, r.1["code"].as_str()), full);

    let l = lease(&begin(&state, SHOP, "t-6", json!(1)).await);
    let half = "x".repeat(600 * 1024);
    assert_eq!(
        step(&state, "t-6", &l, "a", done(json!(half))).await.0,
        StatusCode::OK
    );
    let r = step(&state, "t-6", &l, "b", done(json!(half))).await;
    assert_eq!(
        (r.0, r.1["code"].as_str()),
        full,
        "together they are over 1 MiB"
    );
    let r = step(&state, "t-6", &l, "c", done(json!("x".repeat(1 << 20)))).await;
    assert_eq!((r.0, r.1["code"].as_str()), full, "alone it is over 1 MiB");
    let (_, _, record) = get(&state, SHOP, "/v1/records/transfer/t-6").await;
    assert_eq!(names(&record), pairs(&[("a", "done")]));
}

/// A takeover whose steps cannot be read answers 503 and gives the key back, so the next
/// attempt is not kept waiting for a lease nobody was told of.
#[tokio::test]
async fn a_takeover_whose_steps_cannot_be_read_gives_the_key_back() {
    let faulty = FaultyStore::new(MemoryStore::new());
    let (state, clock) = server(Arc::new(faulty.clone()));
    let l1 = lease(&begin(&state, SHOP, "t-7", json!(1)).await);
    step(&state, "t-7", &l1, "debit", done(json!(1))).await;
    clock.advance(Duration::from_millis(LEASE_MS + 1));

    faulty.fail_next(Op::Get, Fault::Unavailable);
    let r = begin(&state, SHOP, "t-7", json!(1)).await;
    assert_eq!(
        (r.0, r.1["code"].as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, Some("store_unavailable"))
    );
    // The clock has not moved: a key still held would answer `in_progress`.
    let retry = begin(&state, SHOP, "t-7", json!(1)).await;
    lease(&retry);
    assert_eq!(acquisition(&retry.1["lease"]["fence"]), 3);
    assert_eq!(names(&retry.1), pairs(&[("debit", "done")]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_while_the_steps_are_read_leaves_the_key_free() {
    let faulty = FaultyStore::new(MemoryStore::new());
    let (state, clock) = server(Arc::new(faulty.clone()));
    let l1 = lease(&begin(&state, SHOP, "t-8", json!(1)).await);
    step(&state, "t-8", &l1, "debit", done(json!(1))).await;
    clock.advance(Duration::from_millis(LEASE_MS + 1));

    let read = Stall::new();
    faulty.fail_next(Op::Get, Fault::StallThenLand(read.clone()));
    let given_back = Stall::new();
    given_back.release();
    faulty.fail_next(Op::Release, Fault::Stall(given_back.clone()));
    let abandoned = state.clone();
    read.abandon(async move { begin(&abandoned, SHOP, "t-8", json!(1)).await })
        .await;
    read.release();
    within("the key to be given back", given_back.landed()).await;
    let retry = begin(&state, SHOP, "t-8", json!(1)).await;
    lease(&retry);
    assert_eq!(names(&retry.1), pairs(&[("debit", "done")]));
}

/// A lease overtaken while its steps were being read is not handed out: the caller is told
/// the key is in progress, and when to come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_overtaken_while_its_steps_are_read_is_not_handed_out() {
    let faulty = FaultyStore::new(MemoryStore::new());
    let (state, clock) = server(Arc::new(faulty.clone()));
    let l1 = lease(&begin(&state, SHOP, "t-9", json!(1)).await);
    step(&state, "t-9", &l1, "debit", done(json!(1))).await;
    clock.advance(Duration::from_millis(LEASE_MS + 1));

    // The second attempt takes the key; its read of the steps waits on the way to the store.
    let read = faulty.stall_next(Op::Get);
    let slow = tokio::spawn({
        let state = state.clone();
        async move { begin(&state, SHOP, "t-9", json!(1)).await }
    });
    within("the read to reach the store", read.reached()).await;
    // Meanwhile its lease runs out and a third attempt takes the key over.
    clock.advance(Duration::from_millis(LEASE_MS + 1));
    let third = begin(&state, SHOP, "t-9", json!(1)).await;
    assert_eq!(acquisition(&third.1["lease"]["fence"]), 3);
    read.release();
    let (status, body) = slow.await.unwrap();
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::CONFLICT, Some("in_progress"))
    );
    assert!(
        body["retry_after_ms"].as_u64().is_some_and(|ms| ms > 0),
        "{body}"
    );
}
