//! A tonic service behind the gRPC layer, and a client that calls it as a retrying client
//! would: `cargo run -p idem-http --example grpc`.
//!
//! `bank.v1.Bank/Transfer` is written as tonic's generated code is (here by hand, so that the
//! example needs no `protoc`), answering its exact path only. The client sends one transfer
//! three times with one key (the first runs, the others are replayed), then the same key with
//! another amount (refused with FAILED_PRECONDITION), then a transfer without a key (refused
//! with INVALID_ARGUMENT).

#![allow(clippy::print_stdout, clippy::unwrap_used)]

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use http::uri::PathAndQuery;
use idem_core::BoxFuture;
use idem_http::{GrpcIdempotencyLayer, KeyRequirement, Policy};
use tonic::metadata::MetadataValue;
use tonic::server::{NamedService, UnaryService};
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status};
use tonic_types::StatusExt;

/// The one method's path.
const TRANSFER: &str = "/bank.v1.Bank/Transfer";

#[derive(Clone, PartialEq, prost::Message)]
struct TransferRequest {
    #[prost(string, tag = "1")]
    to: String,
    #[prost(int64, tag = "2")]
    amount: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct TransferReply {
    #[prost(string, tag = "1")]
    transfer_id: String,
}

/// The service: every transfer that really runs gets the next id.
#[derive(Clone, Default)]
struct Bank {
    transfers: Arc<AtomicU64>,
}

impl NamedService for Bank {
    const NAME: &'static str = "bank.v1.Bank";
}

impl tower_service::Service<http::Request<tonic::body::Body>> for Bank {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let bank = self.clone();
        Box::pin(async move {
            // Only the method's exact path, as tonic's generated code routes (any other
            // spelling is another method, and this service has none).
            if req.uri().path() != TRANSFER {
                return Ok(Status::unimplemented("no such method").into_http());
            }
            let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
            Ok(grpc.unary(bank, req).await)
        })
    }
}

impl UnaryService<TransferRequest> for Bank {
    type Response = TransferReply;
    type Future = std::future::Ready<Result<Response<TransferReply>, Status>>;

    fn call(&mut self, req: Request<TransferRequest>) -> Self::Future {
        let n = self.transfers.fetch_add(1, Ordering::SeqCst) + 1;
        let t = req.into_inner();
        println!(
            "  (the bank moves {} to {}: transfer t-{n})",
            t.amount, t.to
        );
        std::future::ready(Ok(Response::new(TransferReply {
            transfer_id: format!("t-{n}"),
        })))
    }
}

async fn transfer(ch: &Channel, key: Option<&str>, amount: i64) -> Result<String, Status> {
    let mut grpc = tonic::client::Grpc::new(ch.clone());
    grpc.ready().await.unwrap();
    let mut req = Request::new(TransferRequest {
        to: "acct-2".into(),
        amount,
    });
    if let Some(key) = key {
        req.metadata_mut()
            .insert("idempotency-key", MetadataValue::try_from(key).unwrap());
    }
    let res: Response<TransferReply> = grpc
        .unary(
            req,
            PathAndQuery::from_static(TRANSFER),
            tonic_prost::ProstCodec::default(),
        )
        .await?;
    let replayed = res.metadata().contains_key("idempotent-replayed");
    let id = res.into_inner().transfer_id;
    Ok(if replayed {
        format!("{id} (replayed)")
    } else {
        id
    })
}

fn show(result: Result<String, Status>) {
    match result {
        Ok(answer) => println!("-> {answer}"),
        Err(status) => {
            let reason = status.get_details_error_info().map(|i| i.reason);
            println!("-> {:?} {reason:?}: {}", status.code(), status.message());
        }
    }
}

#[tokio::main]
async fn main() {
    let store = Arc::new(idem_store::MemoryStore::new());
    let layer = GrpcIdempotencyLayer::new(store, Policy::default().key(KeyRequirement::Required))
        .method(TRANSFER);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        Server::builder()
            .layer(layer)
            .add_service(Bank::default())
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let ch = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();

    for attempt in 1..=3 {
        println!("transfer 100 with key k-1, attempt {attempt}");
        show(transfer(&ch, Some("k-1"), 100).await);
    }
    println!("transfer 250 with key k-1");
    show(transfer(&ch, Some("k-1"), 250).await);
    println!("transfer 100 without a key");
    show(transfer(&ch, None, 100).await);
}
