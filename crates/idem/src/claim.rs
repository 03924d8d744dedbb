//! The two steps every front end of the engine takes around its work: claiming a key (waiting
//! for an attempt in flight, if asked), and settling the record while the store may be briefly
//! unavailable. They live in the `idem-claim` crate, below this one and the HTTP layer
//! (`idem-http`), which both use them.

pub use idem_claim::{InFlight, UnderLease, begin_waiting, cancel, settle_retrying};
