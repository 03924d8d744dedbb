//! Every rule of the layer over a real tonic server and client, each refusal's status and
//! details asserted.

use std::sync::Arc;
use std::time::Duration;

use idem_http::grpc::stores;
use idem_http::{GrpcIdempotencyLayer, KeyRequirement, Policy, ReplayHeaders};
use idem_store::MemoryStore;
use idem_testkit::{FaultyStore, within};
use prost::Message;
use tonic::metadata::MetadataValue;
use tonic::{Code, Status};
use tonic_types::StatusExt;

use crate::bank::{
    Bank, RAW, TRANSFER, TransferRequest, UNGUARDED, call, client, frame, serve, transfer,
};

fn required() -> Policy {
    Policy::default().key(KeyRequirement::Required)
}

async fn bank_behind(layer: GrpcIdempotencyLayer) -> (Bank, tonic::transport::Channel) {
    let bank = Bank::new();
    let addr = serve(bank.clone(), layer).await;
    (bank, client(addr))
}

async fn bank_with(policy: Policy) -> (Bank, tonic::transport::Channel) {
    bank_behind(GrpcIdempotencyLayer::new(Arc::new(MemoryStore::new()), policy).method(TRANSFER))
        .await
}

/// The refusal's code, and the catalogue code in its ErrorInfo (domain `idem`).
fn refusal(result: Result<tonic::Response<crate::bank::TransferReply>, Status>) -> (Code, String) {
    let status = result.expect_err("a refusal");
    let info = status
        .get_details_error_info()
        .unwrap_or_else(|| panic!("no ErrorInfo in {status:?}"));
    assert_eq!(info.domain, "idem");
    (status.code(), info.reason)
}

fn answer(result: Result<tonic::Response<crate::bank::TransferReply>, Status>) -> String {
    result.unwrap().into_inner().answer
}

fn replayed(res: &tonic::Response<crate::bank::TransferReply>) -> bool {
    res.metadata()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

#[tokio::test]
async fn a_retry_is_given_the_first_answer_and_its_metadata() {
    let (bank, ch) = bank_with(required()).await;
    let first = call(&ch, TRANSFER, transfer(1, ""), &[("idempotency-key", "k1")])
        .await
        .unwrap();
    assert!(!replayed(&first));
    let again = call(&ch, TRANSFER, transfer(1, ""), &[("idempotency-key", "k1")])
        .await
        .unwrap();
    assert!(replayed(&again));
    assert_eq!(again.metadata().get("x-bank").unwrap(), "one");
    assert_eq!(again.into_inner(), first.into_inner());
    assert_eq!(bank.ledger.repeated(), 0);
    // Another key is another operation run.
    let other = answer(call(&ch, TRANSFER, transfer(1, ""), &[("idempotency-key", "k2")]).await);
    assert_eq!(bank.ledger.repeated(), 1, "{other}");
}

#[tokio::test]
async fn a_key_reused_with_another_message_is_failed_precondition() {
    let (_, ch) = bank_with(required()).await;
    let key = [("idempotency-key", "k")];
    answer(call(&ch, TRANSFER, transfer(1, ""), &key).await);
    let mut other = transfer(1, "");
    other.amount = 200;
    assert_eq!(
        refusal(call(&ch, TRANSFER, other, &key).await),
        (Code::FailedPrecondition, "idempotency_key_mismatch".into())
    );
}

#[tokio::test]
async fn a_call_while_the_first_runs_is_aborted_with_a_retry_delay() {
    let (bank, ch) = bank_with(required()).await;
    let key = [("idempotency-key", "slow")];
    let first = tokio::spawn({
        let ch = ch.clone();
        async move { call(&ch, TRANSFER, transfer(1, "gate"), &key).await }
    });
    within("the first call to start", bank.entered.notified()).await;
    let status = call(&ch, TRANSFER, transfer(1, "gate"), &key)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Aborted, "{status:?}");
    assert_eq!(
        status.get_details_error_info().unwrap().reason,
        "request_in_progress"
    );
    let delay = status
        .get_details_retry_info()
        .unwrap()
        .retry_delay
        .unwrap();
    assert!(delay <= Duration::from_secs(1), "{delay:?}");
    bank.gate.add_permits(1);
    let first = answer(first.await.unwrap());
    assert_eq!(
        answer(call(&ch, TRANSFER, transfer(1, "gate"), &key).await),
        first
    );
    assert_eq!(bank.ledger.repeated(), 0);
}

#[tokio::test]
async fn missing_and_invalid_keys_are_invalid_argument_and_run_nothing() {
    let (_, ch) = bank_with(required()).await;
    let long = "k".repeat(300);
    for (meta, reason) in [
        (vec![], "idempotency_key_missing"),
        (
            vec![("idempotency-key", long.as_str())],
            "idempotency_key_invalid",
        ),
        (
            vec![("idempotency-key", "a"), ("idempotency-key", "b")],
            "idempotency_key_invalid",
        ),
    ] {
        assert_eq!(
            refusal(call(&ch, TRANSFER, transfer(1, ""), &meta).await),
            (Code::InvalidArgument, reason.into())
        );
    }
    // Nothing ran before this, the first run.
    let first = answer(call(&ch, TRANSFER, transfer(1, ""), &[("idempotency-key", "k")]).await);
    assert!(first.contains("\"run\":1}"), "{first}");
}

#[tokio::test]
async fn a_store_that_fails_answers_unavailable_and_runs_nothing() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let (_, ch) =
        bank_behind(GrpcIdempotencyLayer::new(store.clone(), required()).method(TRANSFER)).await;
    store.set_down(true);
    let key = [("idempotency-key", "k")];
    assert_eq!(
        refusal(call(&ch, TRANSFER, transfer(1, ""), &key).await),
        (Code::Unavailable, "store_unavailable".into())
    );
    store.set_down(false);
    let first = answer(call(&ch, TRANSFER, transfer(1, ""), &key).await);
    assert!(first.contains("\"run\":1}"), "{first}");
}

#[tokio::test]
async fn failures_that_may_pass_release_the_key_and_the_others_are_kept() {
    let (_, ch) = bank_with(required()).await;
    for n in 1..=16 {
        let code = Code::from(n);
        let key = format!("status-{n}");
        let meta = [("idempotency-key", key.as_str())];
        let message = transfer(u64::try_from(n).unwrap(), &format!("status:{n}"));
        let first = call(&ch, TRANSFER, message.clone(), &meta)
            .await
            .unwrap_err();
        let again = call(&ch, TRANSFER, message, &meta).await.unwrap_err();
        assert_eq!((first.code(), again.code()), (code, code));
        // The message names the run that answered: the same one when the answer was kept.
        if stores(code) {
            assert_eq!(again.message(), first.message(), "{code:?}");
            assert_eq!(again.metadata().get("x-why").unwrap(), "because");
            assert_eq!(
                again.metadata().get("idempotent-replayed").unwrap(),
                "true",
                "{code:?}"
            );
        } else {
            assert_ne!(again.message(), first.message(), "{code:?}");
        }
    }
}

#[tokio::test]
async fn unlisted_methods_pass_through_and_streams_are_refused() {
    let (bank, ch) = bank_with(required()).await;
    let key = [("idempotency-key", "k")];
    answer(call(&ch, UNGUARDED, transfer(1, ""), &[]).await);
    answer(call(&ch, UNGUARDED, transfer(1, ""), &key).await);
    assert_eq!(bank.ledger.repeated(), 1);

    // Two request messages on a guarded method: a client-streaming call.
    let mut grpc = tonic::client::Grpc::new(ch.clone());
    grpc.ready().await.unwrap();
    let messages = tokio_stream::iter([transfer(2, ""), transfer(2, "")]);
    let mut req = tonic::Request::new(messages);
    req.metadata_mut()
        .insert("idempotency-key", MetadataValue::from_static("s"));
    let result: Result<tonic::Response<crate::bank::TransferReply>, Status> = grpc
        .client_streaming(
            req,
            http::uri::PathAndQuery::from_static(TRANSFER),
            tonic_prost::ProstCodec::default(),
        )
        .await;
    assert_eq!(
        refusal(result),
        (Code::InvalidArgument, "invalid_request".into())
    );
}

/// A listed method spelled otherwise (letter case, percent-encoded bytes) is refused before it
/// reaches a server that might run it around the guard; a whole service listed, the same.
#[tokio::test]
async fn another_spelling_of_a_listed_method_is_refused() {
    let (_, ch) = bank_with(required()).await;
    let key = [("idempotency-key", "k")];
    for path in [
        "/bank.v1.Bank/transfer",
        "/bank.v1.Bank/%54ransfer",
        "/bank.v1.bank/Transfer",
        "/bank%2Ev1.Bank/Transfer",
    ] {
        let result = call(&ch, path, transfer(1, ""), &key).await;
        assert_eq!(
            refusal(result),
            (Code::InvalidArgument, "ambiguous_path".into()),
            "{path}"
        );
    }
    // Nothing ran: the first run is the exact call's.
    let first = answer(call(&ch, TRANSFER, transfer(1, ""), &key).await);
    assert!(first.contains("\"run\":1"), "{first}");
    let layer =
        GrpcIdempotencyLayer::new(Arc::new(MemoryStore::new()), required()).service("bank.v1.Bank");
    let (_, ch) = bank_behind(layer).await;
    let result = call(&ch, "/BANK.v1.Bank/Transfer", transfer(1, ""), &key).await;
    assert_eq!(refusal(result).1, "ambiguous_path");
    // The exact path still runs, and an unlisted method still passes through.
    answer(call(&ch, TRANSFER, transfer(2, ""), &key).await);
}

#[tokio::test]
async fn a_key_can_come_from_the_request_message() {
    let layer = GrpcIdempotencyLayer::new(Arc::new(MemoryStore::new()), required())
        .method(TRANSFER)
        .key_from_message(|m| {
            TransferRequest::decode(m)
                .ok()
                .map(|t| t.request_id)
                .filter(|id| !id.is_empty())
        });
    let (bank, ch) = bank_behind(layer).await;
    let mut message = transfer(1, "");
    message.request_id = "req-1".into();
    let first = answer(call(&ch, TRANSFER, message.clone(), &[]).await);
    let again = call(&ch, TRANSFER, message, &[]).await.unwrap();
    assert!(replayed(&again));
    assert_eq!(again.into_inner().answer, first);
    assert_eq!(bank.ledger.repeated(), 0);
    assert_eq!(
        refusal(call(&ch, TRANSFER, transfer(2, ""), &[]).await),
        (Code::InvalidArgument, "idempotency_key_missing".into())
    );
}

#[tokio::test]
async fn a_message_over_the_limit_is_resource_exhausted() {
    let (_, ch) = bank_with(required().max_body(64)).await;
    let mut message = transfer(1, "");
    message.request_id = "r".repeat(100);
    let result = call(&ch, TRANSFER, message, &[("idempotency-key", "k")]).await;
    // The problem's extension members travel in the ErrorInfo's metadata.
    let info = result
        .as_ref()
        .unwrap_err()
        .get_details_error_info()
        .unwrap();
    assert_eq!(
        info.metadata.get("max_body").map(String::as_str),
        Some("64")
    );
    assert_eq!(
        refusal(result),
        (Code::ResourceExhausted, "body_too_large".into())
    );
}

#[tokio::test]
async fn the_key_can_come_in_metadata_of_another_name() {
    let layer = GrpcIdempotencyLayer::new(Arc::new(MemoryStore::new()), required())
        .method(TRANSFER)
        .key_metadata(http::HeaderName::from_static("x-request-id"));
    let (bank, ch) = bank_behind(layer).await;
    let first = answer(call(&ch, TRANSFER, transfer(1, ""), &[("x-request-id", "r1")]).await);
    let again = call(&ch, TRANSFER, transfer(1, ""), &[("x-request-id", "r1")])
        .await
        .unwrap();
    assert!(replayed(&again));
    assert_eq!(again.into_inner().answer, first);
    assert_eq!(bank.ledger.repeated(), 0);
    // The default name is not read any more: without the configured one, the key is missing.
    assert_eq!(
        refusal(call(&ch, TRANSFER, transfer(1, ""), &[("idempotency-key", "r1")]).await),
        (Code::InvalidArgument, "idempotency_key_missing".into())
    );
}

#[tokio::test]
async fn an_answer_too_large_to_keep_is_given_once_and_never_run_again() {
    let (bank, ch) = bank_with(required().max_response(1024)).await;
    let key = [("idempotency-key", "big")];
    assert_eq!(
        answer(call(&ch, TRANSFER, transfer(1, "big"), &key).await).len(),
        64 << 10
    );
    assert_eq!(
        refusal(call(&ch, TRANSFER, transfer(1, "big"), &key).await),
        (Code::FailedPrecondition, "response_not_replayable".into())
    );
    assert_eq!(bank.ledger.repeated(), 0);
}

#[tokio::test]
async fn a_handler_that_panics_is_internal_and_releases_the_key() {
    let (_, ch) = bank_with(required()).await;
    let key = [("idempotency-key", "p")];
    assert_eq!(
        refusal(call(&ch, TRANSFER, transfer(1, "panic"), &key).await),
        (Code::Internal, "handler_failed".into())
    );
    // The key is released as the handler unwinds (in a task of its own): a retry soon runs
    // again, and panics again; a key left held would answer ABORTED until its lease ended.
    let again = within("the key to be released", async {
        loop {
            match refusal(call(&ch, TRANSFER, transfer(1, "panic"), &key).await) {
                (Code::Aborted, _) => tokio::time::sleep(Duration::from_millis(10)).await,
                other => return other,
            }
        }
    })
    .await;
    assert_eq!(again, (Code::Internal, "handler_failed".into()));
}

#[tokio::test]
async fn a_status_in_the_trailers_is_kept_or_released_as_one_in_the_head() {
    let layer =
        GrpcIdempotencyLayer::new(Arc::new(MemoryStore::new()), required()).service("bank.v1.Bank");
    let (bank, ch) = bank_behind(layer).await;
    for (n, kept) in [(5, true), (14, false)] {
        let key = format!("trailers-{n}");
        let meta = [("idempotency-key", key.as_str())];
        let message = transfer(n, &format!("trailers:{n}"));
        let first = call(&ch, RAW, message.clone(), &meta).await.unwrap_err();
        let again = call(&ch, RAW, message, &meta).await.unwrap_err();
        let code = Code::from(i32::try_from(n).unwrap());
        assert_eq!((first.code(), again.code()), (code, code));
        assert_eq!(again.message() == first.message(), kept, "{code:?}");
    }
    assert_eq!(bank.ledger.repeated(), 1);
}

#[tokio::test]
async fn an_answer_without_a_grpc_status_is_read_by_its_http_status() {
    let layer =
        GrpcIdempotencyLayer::new(Arc::new(MemoryStore::new()), required()).service("bank.v1.Bank");
    let (bank, ch) = bank_behind(layer).await;
    // 503 is UNAVAILABLE to a client: released. 404 is UNIMPLEMENTED: kept.
    for (op, status, code) in [(1, 503, Code::Unavailable), (2, 404, Code::Unimplemented)] {
        let key = format!("http-{status}");
        let meta = [("idempotency-key", key.as_str())];
        for _ in 0..2 {
            let message = transfer(op, &format!("http:{status}"));
            assert_eq!(
                call(&ch, RAW, message, &meta).await.unwrap_err().code(),
                code
            );
        }
    }
    assert_eq!(bank.ledger.repeated(), 1);
    // An HTTP 200 that ends without a status broke off: its outcome is unknown.
    let meta = [("idempotency-key", "none")];
    assert_eq!(
        refusal(call(&ch, RAW, transfer(3, "nostatus"), &meta).await),
        (Code::Internal, "response_failed".into())
    );
    assert_eq!(
        refusal(call(&ch, RAW, transfer(3, "nostatus"), &meta).await),
        (Code::FailedPrecondition, "outcome_unknown".into())
    );
}

#[tokio::test]
async fn a_policy_that_replays_few_headers_still_replays_a_grpc_answer() {
    let policy =
        required().replay_headers(ReplayHeaders::Only(vec![http::HeaderName::from_static(
            "x-why",
        )]));
    let (_, ch) = bank_with(policy).await;
    let key = [("idempotency-key", "few")];
    let first = call(&ch, TRANSFER, transfer(1, "status:5"), &key)
        .await
        .unwrap_err();
    let again = call(&ch, TRANSFER, transfer(1, "status:5"), &key)
        .await
        .unwrap_err();
    assert_eq!(
        (again.code(), again.message()),
        (Code::NotFound, first.message())
    );
    assert_eq!(again.metadata().get("x-why").unwrap(), "because");
    let key = [("idempotency-key", "few-ok")];
    let first = answer(call(&ch, TRANSFER, transfer(2, ""), &key).await);
    let again = call(&ch, TRANSFER, transfer(2, ""), &key).await.unwrap();
    assert!(again.metadata().get("x-bank").is_none());
    assert_eq!(again.into_inner().answer, first);
}

/// Calls the layer in front of a bank directly, with a body and content type of our own.
async fn raw_call(
    layer: GrpcIdempotencyLayer,
    content_type: &str,
    body: bytes::Bytes,
) -> (Bank, http::Response<idem_http::ResponseBody>) {
    use tower::{Layer, ServiceExt};
    let bank = Bank::new();
    let req = http::Request::post(format!("http://localhost{TRANSFER}"))
        .header("content-type", content_type)
        .header("te", "trailers")
        .body(http_body_util::Full::new(body))
        .unwrap();
    let res = layer.layer(bank.clone()).oneshot(req).await.unwrap();
    (bank, res)
}

fn grpc_status(res: &http::Response<idem_http::ResponseBody>) -> &str {
    res.headers()
        .get("grpc-status")
        .map_or("", |v| v.to_str().unwrap())
}

#[tokio::test]
async fn a_guarded_method_cannot_be_reached_around_the_guard() {
    let layer = || {
        GrpcIdempotencyLayer::new(Arc::new(MemoryStore::new()), required())
            .method(TRANSFER)
            .key_from_message(|m| TransferRequest::decode(m).ok().map(|t| t.request_id))
    };
    let mut message = transfer(1, "");
    message.request_id = "r-1".into();
    // Another content type: refused, not passed through without a key.
    for ct in [
        "application/grpc-web+proto",
        "application/json",
        "text/plain",
    ] {
        let (bank, res) = raw_call(layer(), ct, frame(&message, false)).await;
        assert_eq!(grpc_status(&res), "3", "{ct}");
        assert_eq!(bank.ledger.repeated(), 0);
    }
    // The content type in other letter case is gRPC, and guarded: its key read from the
    // message.
    let (_, res) = raw_call(layer(), "Application/gRPC", frame(&message, false)).await;
    assert_eq!(grpc_status(&res), "", "not refused: {:?}", res.headers());
    let body = http_body_util::BodyExt::collect(res.into_body())
        .await
        .unwrap();
    assert_eq!(body.trailers().unwrap()["grpc-status"], "0");
    // A compressed message whose key cannot be read: refused, not run unguarded.
    let (_, res) = raw_call(layer(), "application/grpc", frame(&message, true)).await;
    assert_eq!(grpc_status(&res), "3");
    let status = tonic::Status::from_header_map(res.headers()).unwrap();
    assert_eq!(
        status.get_details_error_info().unwrap().reason,
        "idempotency_key_invalid"
    );
}

#[tokio::test]
async fn an_unknown_outcome_is_held_as_failed_precondition() {
    let (_, ch) = bank_with(required()).await;
    let key = [("idempotency-key", "u")];
    answer(call(&ch, TRANSFER, transfer(1, "unknown"), &key).await);
    assert_eq!(
        refusal(call(&ch, TRANSFER, transfer(1, "unknown"), &key).await),
        (Code::FailedPrecondition, "outcome_unknown".into())
    );
}

#[tokio::test]
async fn keys_are_scoped_to_the_caller() {
    let (bank, ch) = bank_with(required()).await;
    let as_caller = |who: &'static str| [("idempotency-key", "same"), ("authorization", who)];
    let a = answer(call(&ch, TRANSFER, transfer(1, ""), &as_caller("Bearer a")).await);
    let b = answer(call(&ch, TRANSFER, transfer(1, ""), &as_caller("Bearer b")).await);
    assert_ne!(a, b);
    assert_eq!(
        answer(call(&ch, TRANSFER, transfer(1, ""), &as_caller("Bearer a")).await),
        a
    );
    assert_eq!(
        answer(call(&ch, TRANSFER, transfer(1, ""), &as_caller("Bearer b")).await),
        b
    );
    assert_eq!(bank.ledger.repeated(), 1);
}
