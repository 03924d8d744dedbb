//! Settling a guarded request's record once its handler has answered: store the answer,
//! release the key, or record the outcome as unknown; and release the key if the handler
//! never answers.

use std::future::poll_fn;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, Request, Response};
use http_body::Body;
use http_body_util::Full;
use idem_claim::settle_retrying;
use std::time::Duration;

use idem_core::{Key, Lease, LeaseError, Store};
use tower_service::Service;

use crate::body::{BoxError, Collected, Prefixed, ResponseBody, boxed, collect_limited};
use crate::layer::Config;
use crate::metrics::count_settled;
use crate::policy::{OnUnknown, ReplayHeaders, remove_hop_by_hop};
use crate::problem_code::ProblemCode;
use crate::service::reject;
use crate::stored::Stored;

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
    let settle = parts
        .extensions
        .get::<Settle>()
        .copied()
        .unwrap_or_else(|| {
            if policy.preset.stores(parts.status) {
                Settle::Store
            } else {
                Settle::Release
            }
        });
    let body = boxed(body);
    match settle {
        Settle::Release => {
            settler.release().await;
            Ok(Response::from_parts(parts, body))
        }
        Settle::Unknown => {
            settler.unknown().await;
            Ok(Response::from_parts(parts, body))
        }
        Settle::Store => match collect_limited(body, policy.max_response).await {
            Collected::Full(bytes) => {
                let stored = Stored::Response {
                    status: parts.status,
                    headers: stored_headers(&parts.headers, &policy.replay_headers),
                    body: bytes.clone(),
                };
                if settler.complete(stored).await == Completed::Overtaken {
                    return Ok(overtaken());
                }
                Ok(Response::from_parts(parts, boxed(Full::new(bytes))))
            }
            Collected::TooLarge(prefix, rest) => {
                let status = parts.status;
                if settler.complete(Stored::TooLarge { status }).await == Completed::Overtaken {
                    return Ok(overtaken());
                }
                Ok(Response::from_parts(
                    parts,
                    boxed(Prefixed::new(prefix, rest)),
                ))
            }
            Collected::Failed => {
                settler.unknown().await;
                Ok(reject(ProblemCode::ResponseFailed.problem(
                    "The handler's response broke off; the outcome is recorded as unknown.",
                )))
            }
        },
    }
}

/// The answer to a caller whose attempt was overtaken while its handler ran (its lease ran out
/// and another attempt took the key): not the handler's answer, which is not the one stored,
/// but a conflict to retry, so that every caller is given the one answer the key keeps.
fn overtaken() -> Response<ResponseBody> {
    reject(
        ProblemCode::StaleLease
            .problem(
                "This attempt outlived its lease and another took the key over, so its answer \
                 is not the one kept; retry to be given that one.",
            )
            .retry_after(Duration::from_secs(1)),
    )
}

/// The response headers kept for replay: the policy's choice, never a hop-by-hop field.
fn stored_headers(headers: &HeaderMap, keep: &ReplayHeaders) -> HeaderMap {
    let mut out = headers.clone();
    remove_hop_by_hop(&mut out);
    let dropped: Vec<HeaderName> = out.keys().filter(|n| !keep.keeps(n)).cloned().collect();
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
    /// Stored, or the store could not be reached (the record stays in progress until its lease
    /// ends; the caller still gets the answer, the only one there is yet).
    Done,
    /// Another attempt holds the key: this answer is not the one kept.
    Overtaken,
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
            Err(e) => {
                count_settled("failed");
                // The answer still goes to the caller; the record stays in progress until
                // its lease ends, after which a retry may run again.
                tracing::warn!(key = %key.log_tag(), error = %e, "could not store the answer");
                Completed::Done
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
