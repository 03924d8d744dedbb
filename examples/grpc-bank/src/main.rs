//! A tonic service generated from `proto/bank.proto`, behind the gRPC layer, and a client that
//! calls it as a retrying client would: `cargo run -p grpc-bank`.
//!
//! The client sends one transfer three times with one key (the first runs, the others are
//! replayed), then the same key with another amount (refused with FAILED_PRECONDITION), then a
//! transfer without a key (refused with INVALID_ARGUMENT), then the method's path spelled
//! another way (`%54ransfer`, refused by the layer before the generated router, which matches
//! exact paths only, could answer UNIMPLEMENTED).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use idem_http::{GrpcIdempotencyLayer, KeyRequirement, Policy};
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Server};
use tonic::{Request, Response, Status};
use tonic_types::StatusExt;

/// The generated messages, server and client.
pub mod bank {
    tonic::include_proto!("bank.v1");
}

use bank::bank_client::BankClient;
use bank::bank_server::{Bank, BankServer};
use bank::{TransferReply, TransferRequest};

/// The guarded method's path.
const TRANSFER: &str = "/bank.v1.Bank/Transfer";

/// The service: every transfer that really runs gets the next id.
#[derive(Default)]
struct Teller {
    transfers: AtomicU64,
}

#[tonic::async_trait]
impl Bank for Teller {
    async fn transfer(
        &self,
        req: Request<TransferRequest>,
    ) -> Result<Response<TransferReply>, Status> {
        let n = self.transfers.fetch_add(1, Ordering::SeqCst) + 1;
        let t = req.into_inner();
        say(&format!(
            "  (the bank moves {} to {}: transfer t-{n})",
            t.amount, t.to
        ));
        Ok(Response::new(TransferReply {
            transfer_id: format!("t-{n}"),
        }))
    }
}

/// One transfer from the generated client, with `key` as its idempotency key.
async fn transfer(
    client: &mut BankClient<Channel>,
    key: Option<&str>,
    amount: i64,
) -> Result<String, Status> {
    let mut req = Request::new(TransferRequest {
        to: "acct-2".into(),
        amount,
    });
    if let Some(key) = key {
        let key = MetadataValue::try_from(key).map_err(|e| Status::internal(e.to_string()))?;
        req.metadata_mut().insert("idempotency-key", key);
    }
    let res = client.transfer(req).await?;
    let replayed = res.metadata().contains_key("idempotent-replayed");
    let id = res.into_inner().transfer_id;
    Ok(if replayed {
        format!("{id} (replayed)")
    } else {
        id
    })
}

/// The same call sent to another spelling of the method's path, as a client of a server that
/// does not match paths exactly might.
async fn transfer_spelled(ch: &Channel, path: &'static str) -> Result<String, Status> {
    let mut grpc = tonic::client::Grpc::new(ch.clone());
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let mut req = Request::new(TransferRequest {
        to: "acct-2".into(),
        amount: 100,
    });
    req.metadata_mut()
        .insert("idempotency-key", MetadataValue::from_static("k-2"));
    let res: Response<TransferReply> = grpc
        .unary(
            req,
            http::uri::PathAndQuery::from_static(path),
            tonic_prost::ProstCodec::default(),
        )
        .await?;
    Ok(res.into_inner().transfer_id)
}

fn show(result: Result<String, Status>) {
    match result {
        Ok(answer) => say(&format!("-> {answer}")),
        Err(status) => {
            let reason = status.get_details_error_info().map(|i| i.reason);
            say(&format!(
                "-> {:?} {reason:?}: {}",
                status.code(),
                status.message()
            ));
        }
    }
}

/// What the example shows, on standard output.
fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stdout(), "{line}");
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store = Arc::new(idem_store::MemoryStore::new());
    let layer = GrpcIdempotencyLayer::new(store, Policy::default().key(KeyRequirement::Required))
        .method(TRANSFER);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(
        Server::builder()
            .layer(layer)
            .add_service(BankServer::new(Teller::default()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let ch = Channel::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let mut client = BankClient::new(ch.clone());

    for attempt in 1..=3 {
        say(&format!("transfer 100 with key k-1, attempt {attempt}"));
        show(transfer(&mut client, Some("k-1"), 100).await);
    }
    say("transfer 250 with key k-1");
    show(transfer(&mut client, Some("k-1"), 250).await);
    say("transfer 100 without a key");
    show(transfer(&mut client, None, 100).await);
    say("transfer 100 with key k-2, to /bank.v1.Bank/%54ransfer");
    show(transfer_spelled(&ch, "/bank.v1.Bank/%54ransfer").await);
    Ok(())
}
