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
use crate::policy::{OnUnknown, remove_hop_by_hop};
use crate::problem::ToProblem;
use crate::stored::Stored;
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
    /// [`OnUnknown`]).
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
                let stored = Stored::Response {
                    status: parts.status,
                    headers: kept_fields(&cfg, &parts.headers),
                    body: bytes.clone(),
                    trailers: kept_fields(&cfg, &trailers),
                };
                match settler.complete(stored).await {
                    Completed::Done => Ok(Response::from_parts(
                        parts,
                        full_with_trailers(bytes, trailers),
                    )),
                    Completed::Overtaken => Ok(overtaken(&cfg)),
                    Completed::NotStored => Ok(not_stored(&cfg)),
                }
            }
            Collected::TooLarge(prefix, rest) => {
                // A gRPC answer too large to keep is recorded before its status is known:
                // its first caller is given it whole, retries are refused, never run again.
                let status = parts.status;
                match settler.complete(Stored::TooLarge { status }).await {
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

/// How many answers a layer (or gateway) goes on trying to store in the background after the
/// store failed, at most; past it, such a record stays in progress until its lease ends.
pub(crate) const LATE_ANSWERS: usize = 1024;

/// How long after its lease ends an answer is still offered to the store: until then no
/// other attempt may have taken the key, and the store takes it if none has.
const LATE_GRACE: Duration = Duration::from_secs(30);

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
    /// The store failed: the answer is not kept (yet: a failure that may pass is retried in
    /// the background, see [`complete_later`]). The record stays in progress until it is
    /// stored or its lease ends, after which a retry runs again; so the caller is not given
    /// an answer that retries might never be given.
    NotStored,
}

impl Settler {
    async fn complete(mut self, stored: Stored) -> Completed {
        self.settled = true;
        let kind = match stored {
            Stored::Response { .. } => "stored",
            Stored::Unknown { .. } => "unknown",
            Stored::TooLarge { .. } => "too_large",
        };
        let response = stored.encode();
        let (cfg, key, lease) = (&self.cfg, &self.key, &self.lease);
        let result = settle_retrying(|| {
            cfg.store
                .complete(key, lease, response.clone(), cfg.clock.now())
        })
        .await;
        match result {
            Ok(()) => {
                count_settled(kind);
                Completed::Done
            }
            Err(LeaseError::Stale(_)) => {
                count_settled("overtaken");
                tracing::warn!(
                    key = %key.log_tag(),
                    fence = lease.fence,
                    "the lease was taken over while the handler ran; its answer is not kept"
                );
                Completed::Overtaken
            }
            Err(LeaseError::Store(e)) if e.is_transient() => {
                complete_later(cfg, key, lease, response, kind);
                Completed::NotStored
            }
            Err(e) => {
                count_settled("failed");
                // The record stays in progress until its lease ends; then a retry runs again.
                tracing::warn!(key = %key.log_tag(), error = %e, "could not store the answer");
                Completed::NotStored
            }
        }
    }

    async fn unknown(self) {
        let until = match self.cfg.policy.on_unknown {
            OnUnknown::Hold => None,
            OnUnknown::ReleaseAfterLease => Some(self.lease.expires_at),
        };
        // Scope and namespace (never the client's key) let an operator find the record
        // (`operator::reopen_unknown`) once the caller reports its key.
        tracing::warn!(
            key = %self.key.log_tag(),
            scope = %self.cfg.scope.log_form(self.key.scope()),
            namespace = %self.key.namespace(),
            fence = self.lease.fence,
            "outcome unknown; held until resolved"
        );
        self.complete(Stored::Unknown { until }).await;
    }

    async fn release(mut self) {
        self.settled = true;
        release(&self.cfg, &self.key, &self.lease).await;
    }
}

/// Goes on offering an answer the store failed to take, backing off from 100 ms to 2 s, until
/// it is stored, another attempt holds the key, or [`LATE_GRACE`] after the lease ended; in a
/// task of its own, so that the caller's answer does not wait. At most [`LATE_ANSWERS`] at
/// once: past that the answer is dropped and the record waits for its lease to end.
fn complete_later(
    cfg: &Arc<Config>,
    key: &Key,
    lease: &Lease,
    response: Bytes,
    kind: &'static str,
) {
    let (Ok(permit), Ok(rt)) = (
        cfg.late.clone().try_acquire_owned(),
        tokio::runtime::Handle::try_current(),
    ) else {
        count_settled("failed");
        tracing::warn!(key = %key.log_tag(), "could not store the answer");
        return;
    };
    let (cfg, key, lease) = (cfg.clone(), key.clone(), *lease);
    rt.spawn(async move {
        let _permit = permit;
        let mut pause = Duration::from_millis(100);
        loop {
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(2));
            let now = cfg.clock.now();
            match cfg
                .store
                .complete(&key, &lease, response.clone(), now)
                .await
            {
                Ok(()) => {
                    count_settled(kind);
                    return;
                }
                Err(LeaseError::Store(e))
                    if e.is_transient() && now < lease.expires_at.saturating_add(LATE_GRACE) => {}
                Err(LeaseError::Stale(_)) => {
                    count_settled("overtaken");
                    return;
                }
                Err(e) => {
                    count_settled("failed");
                    tracing::warn!(key = %key.log_tag(), error = %e, "could not store the answer");
                    return;
                }
            }
        }
    });
}

async fn release(cfg: &Config, key: &Key, lease: &Lease) {
    let result = settle_retrying(|| cfg.store.release(key, lease, cfg.clock.now())).await;
    match result {
        Ok(()) => count_settled("released"),
        Err(e) => {
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
