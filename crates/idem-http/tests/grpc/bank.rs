//! A tonic service written as tonic's generated code is (no protoc): `bank.v1.Bank` with a
//! unary `Transfer` that records its runs in a [`Ledger`], and a client for it.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::uri::PathAndQuery;
use idem_core::BoxFuture;
use idem_http::{GrpcIdempotencyLayer, Settle};
use idem_testkit::chaos::{Ledger, SLOW};
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore};
use tonic::metadata::MetadataValue;
use tonic::server::{NamedService, UnaryService};
use tonic::transport::{Channel, Server};
use tonic::{Code, Status};

/// What a transfer does, by its `then` field: `""` answers, `"status:<n>"` fails with code n
/// (after running), `"gate"` waits for a permit of the server's gate, `"panic"` panics,
/// `"big"` answers 64 KiB, `"unknown"` answers and marks the outcome unknown, `"chaos"`
/// answers after [`SLOW`] for every 25th operation.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct TransferRequest {
    #[prost(string, tag = "1")]
    pub(crate) request_id: String,
    #[prost(uint64, tag = "2")]
    pub(crate) op: u64,
    #[prost(int64, tag = "3")]
    pub(crate) amount: i64,
    #[prost(string, tag = "4")]
    pub(crate) then: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct TransferReply {
    #[prost(string, tag = "1")]
    pub(crate) answer: String,
}

pub(crate) const TRANSFER: &str = "/bank.v1.Bank/Transfer";
/// Answers written by hand, as a misbehaving or hand-rolled server would, by `then`:
/// `"trailers:<n>"` (a reply, then `grpc-status: n` in the trailers), `"http:<s>"` (HTTP
/// status s, no gRPC status at all), `"nostatus"` (a reply and no status).
pub(crate) const RAW: &str = "/bank.v1.Bank/Raw";
/// The same handler under a path the tests' layers do not guard.
pub(crate) const UNGUARDED: &str = "/bank.v1.Bank/Quote";

#[derive(Clone)]
pub(crate) struct Bank {
    pub(crate) ledger: Ledger,
    /// `then: "gate"` transfers wait for a permit.
    pub(crate) gate: Arc<Semaphore>,
    /// Told when a `then: "gate"` transfer starts waiting.
    pub(crate) entered: Arc<Notify>,
}

impl Bank {
    pub(crate) fn new() -> Self {
        Self {
            ledger: Ledger::default(),
            gate: Arc::new(Semaphore::new(0)),
            entered: Arc::new(Notify::new()),
        }
    }
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
            match req.uri().path() {
                TRANSFER | UNGUARDED => {
                    let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
                    Ok(grpc.unary(Transfer(bank), req).await)
                }
                RAW => Ok(raw(&bank, req).await),
                _ => Ok(Status::unimplemented("no such method").into_http()),
            }
        })
    }
}

struct Transfer(Bank);

impl UnaryService<TransferRequest> for Transfer {
    type Response = TransferReply;
    type Future = BoxFuture<'static, Result<tonic::Response<TransferReply>, Status>>;

    fn call(&mut self, req: tonic::Request<TransferRequest>) -> Self::Future {
        let bank = self.0.clone();
        Box::pin(async move {
            let t = req.into_inner();
            match t.then.as_str() {
                "gate" => {
                    bank.entered.notify_one();
                    bank.gate.acquire().await.unwrap().forget();
                }
                "panic" => panic!("the transfer handler fails"),
                "chaos" if t.op.is_multiple_of(25) => tokio::time::sleep(SLOW).await,
                _ => {}
            }
            let answer = bank.ledger.execute(t.op);
            if let Some(code) = t.then.strip_prefix("status:") {
                let mut status = Status::new(Code::from(code.parse::<i32>().unwrap()), answer);
                status
                    .metadata_mut()
                    .insert("x-why", MetadataValue::from_static("because"));
                return Err(status);
            }
            let answer = if t.then == "big" {
                "x".repeat(64 << 10)
            } else {
                answer
            };
            let mut res = tonic::Response::new(TransferReply { answer });
            res.metadata_mut()
                .insert("x-bank", MetadataValue::from_static("one"));
            if t.then == "unknown" {
                res.extensions_mut().insert(Settle::Unknown);
            }
            Ok(res)
        })
    }
}

async fn raw(
    bank: &Bank,
    req: http::Request<tonic::body::Body>,
) -> http::Response<tonic::body::Body> {
    use http_body_util::BodyExt;
    use prost::Message;
    let body = req.into_body().collect().await.unwrap().to_bytes();
    let t = TransferRequest::decode(&body[5..]).unwrap();
    let answer = bank.ledger.execute(t.op);
    let reply = frame(
        &TransferReply {
            answer: answer.clone(),
        },
        false,
    );
    let mut res = http::Response::builder().header("content-type", "application/grpc");
    let body = match t.then.split_once(':') {
        Some(("trailers", code)) => {
            let mut trailers = http::HeaderMap::new();
            trailers.insert("grpc-status", code.parse().unwrap());
            trailers.insert("grpc-message", answer.parse().unwrap());
            http_body_util::Full::new(reply)
                .with_trailers(std::future::ready(Some(Ok(trailers))))
                .boxed_unsync()
        }
        Some(("http", status)) => {
            res = res.status(status.parse::<u16>().unwrap());
            http_body_util::Full::new(bytes::Bytes::new()).boxed_unsync()
        }
        _ => http_body_util::Full::new(reply).boxed_unsync(),
    };
    res.body(tonic::body::Body::new(body)).unwrap()
}

/// `message` as a gRPC request or reply body: a 5-byte head (the compressed flag, the length),
/// then the message.
pub(crate) fn frame(message: &impl prost::Message, compressed: bool) -> bytes::Bytes {
    let bytes = message.encode_to_vec();
    let mut out = vec![u8::from(compressed)];
    out.extend_from_slice(&u32::try_from(bytes.len()).unwrap().to_be_bytes());
    out.extend_from_slice(&bytes);
    out.into()
}

/// Serves `bank` behind `layer` on a free loopback port.
pub(crate) async fn serve(bank: Bank, layer: GrpcIdempotencyLayer) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tokio::spawn(
        Server::builder()
            .layer(layer)
            .add_service(bank)
            .serve_with_incoming(incoming),
    );
    addr
}

/// A client of the server at `addr` (connected on first use).
pub(crate) fn client(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_lazy()
}

/// Calls `path` with `message` and the metadata `meta`.
pub(crate) async fn call(
    channel: &Channel,
    path: &'static str,
    message: TransferRequest,
    meta: &[(&'static str, &str)],
) -> Result<tonic::Response<TransferReply>, Status> {
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let mut req = tonic::Request::new(message);
    for (name, value) in meta {
        req.metadata_mut()
            .append(*name, MetadataValue::try_from(*value).unwrap());
    }
    grpc.unary(
        req,
        PathAndQuery::from_static(path),
        tonic_prost::ProstCodec::default(),
    )
    .await
}

/// A transfer of operation `op` that does `then`.
pub(crate) fn transfer(op: u64, then: &str) -> TransferRequest {
    TransferRequest {
        request_id: String::new(),
        op,
        amount: 100,
        then: then.to_owned(),
    }
}
