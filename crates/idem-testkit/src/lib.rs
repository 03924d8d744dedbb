//! Test support for idem stores.
//!
//! - [`conformance`]: the one suite every [`Store`](idem_core::Store) passes unchanged, and
//!   [`conformance_tests!`] to run it as one `#[test]` per case.
//! - [`locks`]: the suite every lock backend passes, run by [`lock_conformance_tests!`].
//! - [`coordination`]: ZooKeeper and etcd servers (one, or three) of a test's own.
//! - [`FaultyStore`]: wraps a store (and a lock store) and fails chosen operations, before or
//!   after they take effect, to test that callers fail closed; or holds one at a [`Stall`]
//!   until the test releases it, to test that a caller who gives up while the store is slow
//!   leaves nothing behind.
//! - [`load`] (feature `load`): keep-alive HTTP clients under load, for the HTTP benches.
//! - [`chaos`] (feature `chaos`): a proxy that loses requests and answers, a ledger of what
//!   ran, and storms of `idem-client` calls through both.
//! - [`logs`] (feature `logs`): what a test's `tracing` subscriber wrote.

// Test support: a failed expectation is meant to panic.
#![allow(clippy::unwrap_used)]

#[cfg(feature = "chaos")]
pub mod chaos;
pub mod conformance;
pub mod coordination;
mod faulty;
pub mod kafka;
#[cfg(feature = "load")]
pub mod load;
pub mod locks;
#[cfg(feature = "logs")]
pub mod logs;
pub mod services;

pub use faulty::{Fault, FaultyStore, Op, Stall};

/// How long a test waits for something that should happen: generous, so that a slow machine
/// never fails a test, while a bug (a waiter nobody wakes) fails it instead of hanging.
pub const PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);

/// `fut`'s output, or a panic naming `what` if it takes longer than [`PATIENCE`].
pub async fn within<F: std::future::Future>(what: &str, fut: F) -> F::Output {
    match tokio::time::timeout(PATIENCE, fut).await {
        Ok(out) => out,
        Err(_) => panic!("{what}: still waiting after {PATIENCE:?}"),
    }
}

/// Runs `fut` to completion on a fresh multi-threaded runtime (four workers, so that storms
/// really run in parallel).
pub fn block_on<F: std::future::Future>(fut: F) -> F::Output {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("build a tokio runtime")
        .block_on(fut)
}

/// Runs `fut` on a thread of its own, on a runtime of its own, and waits for its output
/// (`None` if it panicked). For a test's cleanup in `Drop`, which cannot await, runs after a
/// failed assertion too, and must not depend on the test's runtime (it may be gone or busy).
pub fn on_a_thread_of_its_own<F>(fut: F) -> Option<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("build a tokio runtime")
            .block_on(fut)
    })
    .join()
    .ok()
}

/// Generates one `#[test]` per conformance case for a store.
///
/// The argument is an async expression (evaluated afresh for each case) that yields a
/// [`Fixture`](conformance::Fixture): the store and whatever must live as long as it.
///
/// ```ignore
/// idem_testkit::conformance_tests!(async { Fixture::new(MemoryStore::new()) });
/// ```
#[macro_export]
macro_rules! conformance_tests {
    ($fixture:expr) => {
        $crate::conformance_tests!(@cases $fixture;
            begin_on_absent_key_acquires,
            second_begin_is_in_progress,
            complete_then_every_retry_replays,
            memory_answers_are_begin_s_answers,
            replay_returns_bytes_exactly,
            other_fingerprint_is_a_mismatch,
            release_gives_the_key_back,
            reopen_reruns_a_completed_record,
            expired_lease_is_taken_over_with_higher_fence,
            stale_lease_cannot_complete_or_release,
            expired_lease_not_taken_over_may_complete,
            repeated_complete_is_a_noop,
            repeated_complete_with_another_response_is_stale,
            taken_over_lease_is_stale_even_with_the_same_response,
            forged_or_absent_lease_is_stale,
            completed_record_expires_after_ttl,
            in_progress_record_expires_after_lease_and_retention,
            zero_lease_still_excludes,
            purge_removes_only_dead_records,
            purge_respects_limit,
            purge_keeps_a_late_completion,
            get_reports_the_record,
            scope_isolation,
            namespace_isolation,
            keys_are_compared_exactly,
            renew_extends_the_lease,
            stale_lease_cannot_renew,
            counters_advance_atomically,
            counters_only_rise,
            duplicate_storm,
            duplicate_storm_with_completion,
            storm_over_many_keys,
            concurrent_repeated_completes,
            steps_survive_a_takeover,
            a_step_always_moves_the_record_forward,
            steps_repeat_conflict_and_unknown,
            released_steps_resume_for_the_same_request_only,
            reopen_and_expiry_drop_steps,
            steps_need_the_holding_lease,
            step_outputs_are_kept_exactly,
            concurrent_steps_are_all_kept,
            repairs_keep_or_drop_steps,
            listing_pages_through_every_record_once,
            listing_filters_by_state_namespace_age_and_prefix,
            counts_by_state,
            repairs_are_fenced,
            fences_never_go_back,
            listing_refuses_bad_arguments,
        );
    };
    (@cases $fixture:expr; $($case:ident,)*) => {
        $(
            #[test]
            fn $case() {
                $crate::conformance::CASE.set(stringify!($case));
                $crate::block_on(async {
                    // `Option<Fixture>`: `None` skips (a backend suite without its server).
                    let Some(fixture) = $crate::conformance::IntoFixture::into_fixture($fixture.await) else {
                        return;
                    };
                    $crate::conformance::$case(&fixture.store).await;
                });
            }
        )*
    };
}
