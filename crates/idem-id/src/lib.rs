//! Globally unique ids: every idempotency scheme starts from one.
//!
//! - [`Layout`]: how a 63-bit Snowflake id splits into time, worker and sequence, validated
//!   when built, with the date it runs out.
//! - [`Snowflake`]: a generator whose time never goes backward (anchored to the monotonic
//!   clock, so a wall clock stepped back neither stops it nor repeats an id), lock-free, that
//!   borrows the next milliseconds (up to a bound) when a millisecond's sequence is used up.
//! - [`WorkerPool`] / [`LeasedSnowflake`]: worker ids leased from an idem store, so no two
//!   live processes share one, and a time floor per id space in the store, so a process
//!   restarted after a clock rollback still issues ids above those issued before;
//!   [`ManagedSnowflake`]: a generator that keeps its worker id (renews it, and replaces a
//!   lost one where no id can repeat) and reports a [`WorkerStatus`] for health checks.
//! - [`Segments`]: Leaf-style ranges of a per-tag counter in the store, with a segment buffer
//!   (the current range and the one fetched ahead) so the store is asked before ids run out.
//! - [`uuid7`] / [`Uuid7`]: RFC 9562 version 7 UUIDs that strictly increase within the
//!   process, and [`token`]: 128 random bits for ids that must not be guessable.
//!
//! Both generators read time through a ticker thread that keeps the elapsed milliseconds in
//! an atomic while ids are being made (a clock read costs more than an id), and parks after a
//! second without readers.

mod error;
mod layout;
mod managed;
mod segment;
mod snowflake;
mod ticker;
mod uuid7;
mod workers;

pub use error::IdError;
pub use layout::{DEFAULT_EPOCH_MS, Layout, LayoutError, Parts};
pub use managed::{ManagedSnowflake, WorkerStatus};
pub use segment::{SegmentOptions, SegmentStatus, Segments};
pub use snowflake::{Batch, Snowflake, SnowflakeOptions, SystemTimeSource, TimeSource};
pub use uuid::Uuid;
pub use uuid7::{Uuid7, token, uuid7};
pub use workers::{ISSUE_WINDOW, LeasedSnowflake, WorkerPool};
