//! Models of idem's protocols, checked exhaustively with [`stateright`]: one key's record
//! ([`record`]), a distributed lock with fences ([`lock`]), and a message's way from the broker
//! through a consumer and back ([`delivery`]), and Kafka's offset rule over a group that
//! rebalances ([`kafka`]).
//!
//! The model is a key's record in a store, several clients that retry one request against it
//! (begin, a write to a fenced resource, a step, complete, release, crash at any point, pause
//! for as long as they like), and the faults around them: leases that run out, a client whose
//! clock jumps ahead, an operator who deletes or reopens the record, retention that ends in a
//! purge. Every interleaving is explored up to the bounds given in [`Bounds`].
//!
//! The store in the model is not a copy of the rules: each transition calls the real state
//! machine in `idem-core` ([`idem_core::Record::begin`], `complete`, `release`,
//! `record_step_in_place`, `reopen_in_place`), the one the memory and SQLite stores apply and
//! the SQL and Lua stores are tested against. The tests replay random traces of the model
//! against the real memory and SQLite stores and compare every answer, so the model cannot
//! drift from what ships.
//!
//! The lock model calls idem-core's lock state machine ([`idem_core::LockState`]) the same
//! way, and the delivery model the record's, in the order `idem-mq`'s consumer and `idem relay`
//! call them.
//!
//! The guarantees are written as [`stateright::Property`]s of [`RecordModel`], [`LockModel`]
//! and [`DeliveryModel`]; see docs/guarantees.md for what each one means and what idem does not
//! promise.

pub mod delivery;
pub mod kafka;
pub mod linearizable;
pub mod lock;
pub mod lock_spec;
pub mod oracle;
pub mod record;

pub use delivery::{DeliveryBounds, DeliveryBug, DeliveryModel, Mode};
pub use lock::{LockBounds, LockBug, LockModel};
pub use record::{Action, Answer, Bounds, Bug, RecordModel, State};
