//! Globally unique ids: every idempotency scheme starts from one.
//!
//! - [`Layout`]: how a 63-bit Snowflake id splits into time, worker and sequence, validated
//!   when built, with the date it runs out.
//! - [`Snowflake`]: a generator whose time never goes backward (anchored to the monotonic
//!   clock, so a wall clock stepped back neither stops it nor repeats an id), lock-free, that
//!   borrows the next milliseconds (up to a bound) when a millisecond's sequence is used up.

mod layout;
mod snowflake;
mod ticker;

pub use layout::{DEFAULT_EPOCH_MS, Layout, LayoutError, Parts};
pub use snowflake::{Batch, IdError, Snowflake, SnowflakeOptions, SystemTimeSource, TimeSource};
