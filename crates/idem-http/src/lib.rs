//! HTTP `Idempotency-Key` semantics over the idem record engine, as a [`tower_layer::Layer`].
//!
//! Follows the IETF httpapi `Idempotency-Key` draft, with Stripe's behaviour as a
//! [`Preset`]:
//!
//! - POST and PATCH are guarded (configurable); other methods pass through untouched.
//! - The key is the `Idempotency-Key` header, as an RFC 8941 string or a bare token. A
//!   repeated or invalid header is 400; a missing one is 400 on routes that require it.
//! - Keys are scoped to the caller ([`ScopeSource`]) and fingerprinted with the request
//!   (method, path, query, body, and chosen headers): the same key with another request is 422
//!   (400 under the Stripe preset).
//! - A request whose key is held by a running attempt gets 409 with `Retry-After`, or waits
//!   for it ([`InFlight`]).
//! - The handler's answer is stored and replayed with `Idempotent-Replayed: true`, except 5xx
//!   (IETF preset), 408, 425 and 429, which release the key so a retry runs again.
//! - Errors are RFC 9457 problem details with a stable `code`; [`ProblemCode`] is the
//!   catalogue of every code idem answers with (the layer's, `idem serve`'s and
//!   `idem gateway`'s).
//!
//! Expired records stay in the store until deleted: a service spawns
//! `idem::purge::purge_loop` next to its server.
//!
//! See `docs/design.md` in the repository for the reasoning behind each choice.
//!
//! Where things are: `layer.rs` (the [`IdempotencyLayer`]), `config.rs` (what it hands each
//! request), `service.rs` (the [`IdempotencyService`]: a request from its key to its answer),
//! `fingerprint.rs`, `claim.rs` (run, replay or refuse), `settle.rs` (storing or releasing
//! after the handler), `body.rs`, `stored.rs` (the stored answer's layout), `problem.rs`
//! (errors; their catalogue is `idem-wire`'s), `operator.rs` (inspecting and reopening
//! records), `metrics.rs`.

mod body;
mod claim;
mod config;
mod fingerprint;
pub mod form_token;
#[cfg(feature = "grpc")]
pub mod grpc;
pub mod header;
mod layer;
mod metrics;
pub mod operator;
pub mod policy;
mod problem;
pub mod scope;
mod service;
mod settle;
mod stored;
mod unstored;

pub use body::{BoxError, ResponseBody, boxed};
pub use config::DEFAULT_STORE_TIMEOUT;
pub use form_token::{FORM_TOKEN, FormToken, FormTokenLayer, token_problem};
#[cfg(feature = "grpc")]
pub use grpc::{GrpcIdempotencyLayer, GrpcIdempotencyService};
pub use header::{
    FENCE_HEADER, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, KeyHeaderError, encode_key,
    key_from_headers, parse_key,
};
pub use idem_wire::ProblemCode;
pub use layer::IdempotencyLayer;
pub use metrics::describe_metrics;
pub use policy::{InFlight, KeyRequirement, OnUnknown, Policy, Preset, ReplayHeaders};
pub use problem::{Problem, ToProblem};
pub use scope::{ScopeSecret, ScopeSource};
pub use service::{IdempotencyService, LeaseFence};
pub use settle::Settle;
pub use unstored::{DEFAULT_UNSTORED_BYTES, UnstoredAnswers};

/// The service's former name.
#[deprecated(note = "renamed to `IdempotencyService`")]
pub type Idempotent<S> = IdempotencyService<S>;

/// The lease fence's former name.
#[deprecated(note = "renamed to `LeaseFence`")]
pub type Guarded = LeaseFence;

/// The operator tools' former module name.
#[deprecated(note = "renamed to `operator`")]
pub mod records {
    pub use crate::operator::*;
}
