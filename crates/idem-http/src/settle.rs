//! Settling a guarded request's record once its handler has answered: store the answer,
//! release the key, or record the outcome as unknown; and release the key if the handler
//! never answers.

use std::future::poll_fn;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, Request, Response};
use http_body::Body;
use idem_claim::settle_retrying;
use std::time::Duration;

use idem_core::{Key, Lease, LeaseError, Store};
use tower_service::Service;

use crate::body::{
    BoxError, Collected, Prefixed, ResponseBody, boxed, collect_limited, full_with_trailers,
};
use crate::claim::reject;
use crate::config::{Config, Protocol};
use crate::metrics::count_settled;
use crate::policy::remove_hop_by_hop;
use crate::problem::ToProblem;
use crate::stored::Stored;
use crate::unstored::{complete_later, mark_unknown, unknown_until};
use idem_wire::ProblemCode;

/// How a handler's answer settles its record. By default the layer decides from the status
/// and the [`Preset`](crate::Preset); a handler (or a proxy) that knows better puts one of
/// these in the response's extensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Settle {
    /// Store the answer and replay it to every retry.
    Store,
    /// Do not store it: release the key so that a retry runs again (nothing took effect).
    Release,
    /// The request may or may not have taken effect: record the outcome as unknown (see
    /// [`OnUnknown`](crate::OnUnknown)).
    Unknown,
}

/// Runs the handler and settles the record by what it answered.
pub(crate) async fn run_and_settle<S, ReqBody, ResBody>(
    cfg: Arc<Config>,
    mut inner: S,
    req: Request<ReqBody>,
    key: Key,
    lease: Lease,
) -> Result<Response<ResponseBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let settler = Settler {
        cfg: cfg.clone(),
        key,
        lease,
        settled: false,
    };
    poll_fn(|cx| inner.poll_ready(cx)).await?;
    let res = match inner.call(req).await {
        Ok(res) => res,
        Err(e) => {
            settler.release().await;
            return Err(e);
        }
    };
    let policy = &cfg.policy;
    let (parts, body) = res.into_parts();
    // What the head says; `None` for a gRPC answer whose status comes in its trailers.
    let early = parts
        .extensions
        .get::<Settle>()
        .copied()
        .or_else(|| settle_by_head(&cfg, &parts));
    let body = boxed(body);
    match early {
        Some(Settle::Release) => {
            settler.release().await;
            Ok(Response::from_parts(parts, body))
        }
        Some(Settle::Unknown) => {
            settler.unknown().await;
            Ok(Response::from_parts(parts, body))
        }
        Some(Settle::Store) | None => match collect_limited(body, policy.max_response).await {
            Collected::Full(bytes, trailers) => {
                match early.unwrap_or_else(|| settle_by_trailers(&cfg, &trailers)) {
                    Settle::Store => {}
                    Settle::Release => {
                        settler.release().await;
                        let body = full_with_trailers(bytes, trailers);
                        return Ok(Response::from_parts(parts, body));
                    }
                    Settle::Unknown => {
                        settler.unknown().await;
                        return Ok(response_failed(&cfg));
                    }
                }
                let body_len = bytes.len();
                let stored = Stored::Response {
                    status: parts.status,
                    headers: kept_fields(&cfg, &parts.headers),
                    body: bytes,
                    trailers: kept_fields(&cfg, &trailers),
                };
                match settler.complete(stored).await {
                    // The body as the stored form holds it: one copy of the answer, not two.
                    (Completed::Done, stored) => Ok(Response::from_parts(
                        parts,
                        full_with_trailers(stored.slice(stored.len() - body_len..), trailers),
                    )),
                    (Completed::Overtaken, _) => Ok(overtaken(&cfg)),
                    (Completed::NotStored, _) => Ok(not_stored(&cfg)),
                }
            }
            Collected::TooLarge(prefix, rest) => {
                // A gRPC answer too large to keep is recorded before its status is known:
                // its first caller is given it whole, retries are refused, never run again.
                let status = parts.status;
                match settler.complete(Stored::TooLarge { status }).await.0 {
                    Completed::Done => Ok(Response::from_parts(
                        parts,
                        boxed(Prefixed::new(prefix, rest)),
                    )),
                    Completed::Overtaken => Ok(overtaken(&cfg)),
                    Completed::NotStored => Ok(not_stored(&cfg)),
                }
            }
            Collected::Failed => {
                settler.unknown().await;
                Ok(response_failed(&cfg))
            }
        },
    }
}

/// How an answer settles by its head: its status under the [`Preset`](crate::Preset) over
/// HTTP; over gRPC, the `grpc-status` of a trailers-only answer, or `None` when the status is
/// to come in the trailers.
fn settle_by_head(cfg: &Config, parts: &http::response::Parts) -> Option<Settle> {
    match cfg.protocol {
        Protocol::Http => Some(if cfg.policy.preset.stores(parts.status) {
            Settle::Store
        } else {
            Settle::Release
        }),
        #[cfg(feature = "grpc")]
        Protocol::Grpc => crate::grpc::settle_by_head(parts.status, &parts.headers),
    }
}

/// How a gRPC answer settles by the `grpc-status` of its trailers: without one, the answer
/// broke off and its outcome is unknown. (Over HTTP the head has decided.)
#[cfg_attr(not(feature = "grpc"), allow(unused_variables))]
fn settle_by_trailers(cfg: &Config, trailers: &HeaderMap) -> Settle {
    match cfg.protocol {
        Protocol::Http => Settle::Store,
        #[cfg(feature = "grpc")]
        Protocol::Grpc => crate::grpc::settle_by_status(trailers).unwrap_or(Settle::Unknown),
    }
}

fn response_failed(cfg: &Config) -> Response<ResponseBody> {
    reject(
        cfg,
        ProblemCode::ResponseFailed
            .problem("The handler's response broke off; the outcome is recorded as unknown."),
    )
}

/// The answer to a caller whose attempt was overtaken while its handler ran (its lease ran out
/// and another attempt took the key): not the handler's answer, which is not the one stored,
/// but a conflict to retry, so that every caller is given the one answer the key keeps.
fn overtaken(cfg: &Config) -> Response<ResponseBody> {
    reject(
        cfg,
        ProblemCode::StaleLease
            .problem(
                "This attempt outlived its lease and another took the key over, so its answer \
                 is not the one kept; retry to be given that one.",
            )
            .retry_after(Duration::from_secs(1)),
    )
}

/// The answer to a caller whose handler ran but whose answer the store did not take: not the
/// handler's answer, which a retry might never be given (if the lease ends before it is
/// stored, the retry runs again), but an error to retry, so that every caller is given the one
/// answer the key keeps.
fn not_stored(cfg: &Config) -> Response<ResponseBody> {
    reject(
        cfg,
        ProblemCode::AnswerNotStored
            .problem(
                "The request ran, but its answer could not be stored yet; retry with the same \
                 key to be given the answer that is kept.",
            )
            .retry_after(Duration::from_secs(1)),
    )
}

/// The response header (or trailer) fields kept for replay: the policy's choice (and, over
/// gRPC, the content type and the `grpc-*` fields), never a hop-by-hop field.
fn kept_fields(cfg: &Config, headers: &HeaderMap) -> HeaderMap {
    let keep = &cfg.policy.replay_headers;
    let kept = |name: &HeaderName| match cfg.protocol {
        Protocol::Http => keep.keeps(name),
        #[cfg(feature = "grpc")]
        Protocol::Grpc => keep.keeps(name) || crate::grpc::always_kept(name),
    };
    let mut out = headers.clone();
    remove_hop_by_hop(&mut out);
    let dropped: Vec<HeaderName> = out.keys().filter(|n| !kept(n)).cloned().collect();
    for name in dropped {
        out.remove(name);
    }
    out
}

/// Settles a record once. If dropped unsettled (the handler panicked), releases the key from
/// a task of its own.
struct Settler {
    cfg: Arc<Config>,
    key: Key,
    lease: Lease,
    settled: bool,
}

/// What became of a completion.
#[derive(Debug, PartialEq, Eq)]
enum Completed {
    /// Stored.
    Done,
    /// Another attempt holds the key: this answer is not the one kept.
    Overtaken,
    /// The store failed or did not answer in time: the answer is not kept yet (it is offered
    /// again in the background, see [`complete_later`], or the record marked an unknown
    /// outcome); so the caller is not given an answer that retries might never be given.
    NotStored,
}

impl Settler {
    /// Stores `stored`, charged to the unstored answers' budget from before it is sent until
    /// the store has answered for it (see [`crate::unstored`]): room is waited for, and then
    /// the store, at most the store timeout each. An answer that finds no room is not sent
    /// and its record is marked an unknown outcome; one the store did not take is offered
    /// again in the background. Answers the stored form too, whose last bytes are the body.
    async fn complete(mut self, stored: Stored) -> (Completed, Bytes) {
        self.settled = true;
        let kind = match stored {
            Stored::Response { .. } => "stored",
            Stored::Unknown { .. } => "unknown",
            Stored::TooLarge { .. } => "too_large",
        };
        let response = stored.encode();
        drop(stored);
        let (cfg, key, lease) = (&self.cfg, &self.key, &self.lease);
        let Some(room) = cfg.unstored.room(response.len(), cfg.store_timeout).await else {
            tracing::warn!(
                key = %key.log_tag(),
                "no room for another answer the store has not taken; marking the outcome unknown"
            );
            mark_unknown(cfg, key, lease);
            return (Completed::NotStored, response);
        };
        let result = tokio::time::timeout(
            cfg.store_timeout,
            settle_retrying(|| {
                cfg.store
                    .complete(key, lease, response.clone(), cfg.clock.now())
            }),
        )
        .await;
        let completed = match result {
            Ok(Ok(())) => {
                count_settled(kind);
                Completed::Done
            }
            Ok(Err(LeaseError::Stale(_))) => {
                count_settled("overtaken");
                tracing::warn!(
                    key = %key.log_tag(),
                    fence = lease.fence,
                    "the lease was taken over while the handler ran; its answer is not kept"
                );
                Completed::Overtaken
            }
            // Not taken, or not answered in time (the answer may still be in the store's
            // connection: it stays charged to the budget).
            Ok(Err(LeaseError::Store(e))) if e.is_transient() => {
                complete_later(cfg, key, lease, response.clone(), kind, room);
                Completed::NotStored
            }
            Err(_) => {
                complete_later(cfg, key, lease, response.clone(), kind, room);
                Completed::NotStored
            }
            Ok(Err(e)) => {
                count_settled("failed");
                // The record stays in progress until its lease ends; then a retry runs again.
                tracing::warn!(key = %key.log_tag(), error = %e, "could not store the answer");
                Completed::NotStored
            }
        };
        (completed, response)
    }

    async fn unknown(self) {
        let unknown = unknown_until(&self.cfg, &self.lease);
        // Scope and namespace (never the client's key) let an operator find the record
        // (`operator::reopen_unknown`) once the caller reports its key.
        tracing::warn!(
            key = %self.key.log_tag(),
            scope = %self.cfg.scope.log_form(self.key.scope()),
            namespace = %self.key.namespace(),
            fence = self.lease.fence,
            "outcome unknown; held until resolved"
        );
        self.complete(unknown).await;
    }

    async fn release(mut self) {
        self.settled = true;
        release(&self.cfg, &self.key, &self.lease).await;
    }
}

async fn release(cfg: &Config, key: &Key, lease: &Lease) {
    let result = tokio::time::timeout(
        cfg.store_timeout,
        settle_retrying(|| cfg.store.release(key, lease, cfg.clock.now())),
    )
    .await;
    match result {
        Ok(Ok(())) => count_settled("released"),
        Err(_) => {
            count_settled("failed");
            tracing::warn!(key = %key.log_tag(), "the store did not release the key in time");
        }
        Ok(Err(e)) => {
            count_settled("failed");
            // The key stays held until the lease ends; then a retry takes over.
            tracing::warn!(key = %key.log_tag(), error = %e, "could not release the key");
        }
    }
}

impl Drop for Settler {
    fn drop(&mut self) {
        if !self.settled {
            let (cfg, key, lease) = (self.cfg.clone(), self.key.clone(), self.lease);
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move { release(&cfg, &key, &lease).await });
            }
        }
    }
}
