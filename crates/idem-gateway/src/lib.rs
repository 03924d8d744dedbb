//! idem's HTTP front, in front of services that know nothing of idempotency keys.
//!
//! - [`gateway`]: `idem gateway`, a reverse proxy that gives an existing HTTP API
//!   `Idempotency-Key` semantics, with its configuration and its upstream client.
//! - [`relay`]: `idem relay`, which feeds a queue's messages to an HTTP service once each,
//!   through the same upstream client and reading answers by `idem-wire`'s rules.
//! - [`listener`]: the serving loop both this crate's servers and `idem serve` run on, bounded
//!   against slow and idle clients.

pub mod gateway;
pub mod listener;
pub mod relay;
