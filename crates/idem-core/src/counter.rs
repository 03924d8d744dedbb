//! Named counters that only grow: the ranges segment ids are drawn from, and the time floor
//! of an id space. They live beside records in the same store but follow rules of their own:
//! they never expire and purges never touch them.

use std::future::Future;
use std::sync::Arc;

use crate::Key;
use crate::error::{BoxFuture, StoreError};

/// The largest value a counter reaches (`i64::MAX`, what every backend can hold).
pub const MAX_COUNTER: u64 = i64::MAX.unsigned_abs();

/// The amount one `advance` adds: `by`, at least 1; a step past [`MAX_COUNTER`] is refused
/// rather than cut down, which would hand back a wrong range.
pub fn counter_step(by: u64) -> Result<u64, StoreError> {
    if by > MAX_COUNTER {
        return Err(StoreError::CounterExhausted);
    }
    Ok(by.max(1))
}

/// Named counters, kept durably.
///
/// # Contract
///
/// - **`advance`** adds to a named counter and returns the new value in one atomic step, so
///   concurrent callers get disjoint ranges.
/// - **`raise`** lifts a counter to at least a value in one atomic step; it never lowers one.
/// - Counters start at 0, stop at [`MAX_COUNTER`] (an `advance` past it is
///   [`StoreError::CounterExhausted`] and changes nothing), never expire, and live apart from
///   records: a counter and a record may share a key without touching each other.
///
/// Every [`Store`](crate::Store) offers counters (the id generators run on whatever store
/// keeps the records); code that needs only counters, as segment ids do, asks for this trait.
/// The conformance suite in `idem-testkit` checks every store's.
pub trait Counters: Send + Sync + 'static {
    /// Raises the counter named `key` to at least `to` in one atomic step and returns its
    /// value (the larger of `to` and what it was). A durable high-water mark, such as an id
    /// space's time floor.
    fn raise(&self, key: &Key, to: u64) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Adds `by` (at least 1) to the counter named `key` (0 if it never moved) in one atomic
    /// step and returns its new value, so the caller owns the range `new - by + 1 ..= new`.
    fn advance(&self, key: &Key, by: u64) -> impl Future<Output = Result<u64, StoreError>> + Send;
}

/// An object-safe [`Counters`]. Every `Counters` is a `DynCounters`; [`SharedCounters`] is a
/// `Counters` again, and a [`SharedStore`](crate::SharedStore) turns into one by coercion.
pub trait DynCounters: Send + Sync + 'static {
    /// See [`Counters::raise`].
    fn raise<'a>(&'a self, key: &'a Key, to: u64) -> BoxFuture<'a, Result<u64, StoreError>>;
    /// See [`Counters::advance`].
    fn advance<'a>(&'a self, key: &'a Key, by: u64) -> BoxFuture<'a, Result<u64, StoreError>>;
}

impl<C: Counters> DynCounters for C {
    fn raise<'a>(&'a self, key: &'a Key, to: u64) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(Counters::raise(self, key, to))
    }
    fn advance<'a>(&'a self, key: &'a Key, by: u64) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(Counters::advance(self, key, by))
    }
}

/// Counters chosen at run time.
pub type SharedCounters = Arc<dyn DynCounters>;

/// Counters behind an `Arc`: [`SharedCounters`], a [`SharedStore`](crate::SharedStore) (whose
/// `DynStore` has `DynCounters` as a supertrait), or a store shared by hand.
impl<T: DynCounters + ?Sized> Counters for Arc<T> {
    async fn raise(&self, key: &Key, to: u64) -> Result<u64, StoreError> {
        DynCounters::raise(&**self, key, to).await
    }
    async fn advance(&self, key: &Key, by: u64) -> Result<u64, StoreError> {
        DynCounters::advance(&**self, key, by).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_is_at_least_one_and_at_most_the_bound() {
        assert_eq!(counter_step(0).unwrap(), 1);
        assert_eq!(counter_step(7).unwrap(), 7);
        assert_eq!(counter_step(MAX_COUNTER).unwrap(), MAX_COUNTER);
        assert!(matches!(
            counter_step(MAX_COUNTER + 1),
            Err(StoreError::CounterExhausted)
        ));
    }
}
