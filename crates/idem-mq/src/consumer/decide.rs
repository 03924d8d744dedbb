//! What becomes of a delivery: run the handler under its key, replay, requeue or
//! dead-letter.

use std::fmt::Display;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt as _;
use idem::{InFlight, RunError};
use idem_core::{ClientKey, Clock, Fingerprint, Key, Store};
use serde::{Deserialize, Serialize};

use super::settings::Ctx;
use super::verdict::{RunEnd, Verdict, verdict};
use super::{Consumer, Failure, Handler, Message, MissingKey, Outcome};
use crate::source::{DeadLetter, Delivery, Disposition, Reason};

impl<S: Store + Clone, C: Clock + Clone> Consumer<S, C> {
    /// [`Consumer::decide`], and what a panic outside the handler's own future comes to (in
    /// a key source, or in serializing the handler's output): the run ended without a
    /// result, so the delivery is requeued with backoff, or dead-lettered once it was
    /// delivered `max_attempts` times. Every delivery is settled either way: one left
    /// unsettled would hold its place in the prefetch window until the broker's own timeout.
    pub(super) async fn decide_or_panicked<D: Delivery, H: Handler>(
        &self,
        ctx: &Ctx,
        delivery: &D,
        handler: &H,
    ) -> (Disposition, Outcome) {
        match AssertUnwindSafe(self.decide(ctx, delivery, handler))
            .catch_unwind()
            .await
        {
            Ok(decided) => decided,
            Err(panic) => {
                let attempt = delivery.delivery_count().unwrap_or(1).max(1);
                tracing::error!(source = &*ctx.source, "a message's handling panicked");
                self.after_failure(Fault::<String>::Panicked(panic_message(&*panic), attempt))
            }
        }
    }

    /// Decides a delivery's fate, running its handler if it is the one to run.
    async fn decide<D: Delivery, H: Handler>(
        &self,
        ctx: &Ctx,
        delivery: &D,
        handler: &H,
    ) -> (Disposition, Outcome) {
        let s = &*self.settings;
        let attempt = delivery.delivery_count().unwrap_or(1).max(1);
        let Some(found) = s.key.find(delivery) else {
            return match s.missing_key {
                MissingKey::DeadLetter => dead(Reason::NoKey, "the message carries no key"),
                MissingKey::RunUnguarded => self.unguarded(delivery, handler, attempt).await,
            };
        };
        let key = match ClientKey::new(found) {
            Ok(client_key) => Key::new(ctx.scope.clone(), ctx.namespace.clone(), client_key),
            Err(e) => return dead(Reason::InvalidKey, e.to_string()),
        };
        let fingerprint = if s.fingerprint {
            Fingerprint::of_bytes(delivery.payload())
        } else {
            Fingerprint::of_bytes(b"")
        };
        let message = Message {
            key: Some(key.clone()),
            lease: None,
            payload: Bytes::copy_from_slice(delivery.payload()),
            message_id: delivery.message_id().map(str::to_owned),
            attempt,
        };
        let key = &key;
        let result = self
            .idem
            .once(key)
            .fingerprint(fingerprint)
            .lease(s.lease)
            .ttl(s.ttl)
            .in_flight(InFlight::Wait(s.wait_in_flight))
            .permanent_if(|f: &Fault<H::Error>| matches!(f, Fault::Permanent(_)))
            .run(|lease| async move {
                // The record counts the attempts that took this key: runs that failed in a
                // retryable way, and runs whose consumer died (a crash loop), but not
                // deliveries that only waited for the key or sat in a dead consumer's buffer.
                let run = lease.acquisition();
                if run > s.max_attempts {
                    return Err(Fault::Exhausted(run - 1));
                }
                let message = Message {
                    lease: Some(lease),
                    attempt: run,
                    ..message
                };
                let renew = self.keep_alive(key, lease, delivery, ctx.ack_wait);
                tokio::select! {
                    done = guarded(run, async move { handler.handle(message).await }) => done,
                    () = renew => Err(Fault::LeaseLost(run)),
                }
            })
            .await;
        let end = match &result {
            Ok(done) if done.replayed => RunEnd::Replayed,
            Ok(_) => RunEnd::Handled,
            Err(RunError::Failed { .. }) => RunEnd::Failed,
            Err(RunError::InProgress { .. }) => RunEnd::InProgress,
            Err(RunError::Mismatch) => RunEnd::Mismatch,
            Err(RunError::Codec(_)) => RunEnd::Undecodable,
            Err(RunError::NotRecorded(e)) => {
                tracing::warn!(error = %e, "a handled message's result could not be stored");
                RunEnd::NotRecorded
            }
            Err(e) => {
                tracing::warn!(error = %e, "a message was not handled; requeued");
                RunEnd::Unsettled
            }
        };
        match verdict(end) {
            Verdict::Ack if end == RunEnd::Replayed => (Disposition::Ack, Outcome::Replayed),
            Verdict::Ack => (Disposition::Ack, Outcome::Handled),
            Verdict::RequeueAfterHolder => {
                let holder = match &result {
                    Err(RunError::InProgress { retry_after }) => *retry_after,
                    _ => s.lease,
                };
                requeue(holder.clamp(s.backoff_first, s.backoff_max))
            }
            // The record stays in progress until its lease runs out; a redelivery before then
            // waits, one after it runs the handler again (at least once).
            Verdict::RequeueAfterLease => requeue(s.lease),
            Verdict::RequeueWithBackoff => requeue(self.delay_after(attempt)),
            Verdict::DeadLetter(reason) => {
                let detail = match &result {
                    Err(RunError::Mismatch) => {
                        "the key was used before with another payload".to_owned()
                    }
                    Err(RunError::Codec(e)) => e.to_string(),
                    Err(e) => e.to_string(),
                    Ok(_) => String::new(),
                };
                dead(reason, detail)
            }
            Verdict::ByFailure => match result {
                Err(RunError::Failed { error, .. }) => self.after_failure(error),
                _ => requeue(self.delay_after(attempt)),
            },
        }
    }

    /// What follows a run that did not succeed: a permanent failure is dead-lettered; a
    /// retryable one (or a panic) is requeued with backoff until the `max_attempts`-th run.
    fn after_failure<E: Display>(&self, fault: Fault<E>) -> (Disposition, Outcome) {
        let max = self.settings.max_attempts;
        let (detail, run, after) = match fault {
            Fault::Permanent(e) => return dead(Reason::Permanent, e.to_string()),
            Fault::Refused(e) => return dead(Reason::Refused, e.to_string()),
            Fault::Exhausted(runs) => {
                return dead(
                    Reason::AttemptsExhausted,
                    format!(
                        "its key was taken {runs} times without a result (failures, or \
                         consumers that died while running it); at most {max} are allowed"
                    ),
                );
            }
            Fault::Retry(e, run, after) => (e.to_string(), run, after),
            Fault::Panicked(why, run) => (format!("the handler panicked: {why}"), run, None),
            Fault::LeaseLost(run) => (
                "the lease was lost while the handler ran; it was stopped".to_owned(),
                run,
                None,
            ),
        };
        if run >= max {
            dead(
                Reason::AttemptsExhausted,
                format!("failed {run} times, the last: {detail}"),
            )
        } else {
            let backoff = self.delay_after(run);
            requeue(after.map_or(backoff, |a| a.min(self.settings.backoff_max)))
        }
    }

    /// Runs a message without a key: at least once, no record.
    async fn unguarded<D: Delivery, H: Handler>(
        &self,
        delivery: &D,
        handler: &H,
        attempt: u32,
    ) -> (Disposition, Outcome) {
        self.counters.note_unguarded();
        let message = Message {
            key: None,
            lease: None,
            payload: Bytes::copy_from_slice(delivery.payload()),
            message_id: delivery.message_id().map(str::to_owned),
            attempt,
        };
        match guarded(attempt, async move { handler.handle(message).await }).await {
            Ok(_) => (Disposition::Ack, Outcome::Handled),
            Err(fault) => self.after_failure(fault),
        }
    }

    /// The requeue delay after the `attempt`-th delivery failed: doubling from the first,
    /// bounded, drawn between half and all of it so that requeued messages spread out.
    fn delay_after(&self, attempt: u32) -> Duration {
        let s = &*self.settings;
        let doubled = s
            .backoff_first
            .saturating_mul(1u32 << attempt.saturating_sub(1).min(20));
        let full = doubled.min(s.backoff_max);
        let half = full / 2;
        half + full.mul_f64(rand::random::<f64>() * 0.5)
    }
}

/// Why a run did not succeed, as the run-once engine stores it: only a permanent failure is
/// ever stored (and read back); the other variants give the key back. The numbers say which
/// run it was, or how many runs came before.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Fault<E> {
    Permanent(E),
    #[serde(skip)]
    Retry(E, u32, Option<Duration>),
    #[serde(skip)]
    Refused(E),
    #[serde(skip)]
    Panicked(String, u32),
    #[serde(skip)]
    Exhausted(u32),
    #[serde(skip)]
    LeaseLost(u32),
}

/// Runs a handler's future (the `run`-th run of its key), turning a panic into a retryable
/// fault. `work` is an `async` block that calls the handler, so that a panic in the call
/// itself, before it returns its future, is caught too.
async fn guarded<T, E>(
    run: u32,
    work: impl Future<Output = Result<T, Failure<E>>>,
) -> Result<T, Fault<E>> {
    match AssertUnwindSafe(work).catch_unwind().await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(Failure::Permanent(e))) => Err(Fault::Permanent(e)),
        Ok(Err(Failure::Retry(e))) => Err(Fault::Retry(e, run, None)),
        Ok(Err(Failure::RetryAfter(e, after))) => Err(Fault::Retry(e, run, Some(after))),
        Ok(Err(Failure::DeadLetter(e))) => Err(Fault::Refused(e)),
        Err(panic) => Err(Fault::Panicked(panic_message(&*panic), run)),
    }
}

/// What a panic said, when it said it with a string.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

fn dead(reason: Reason, detail: impl Into<String>) -> (Disposition, Outcome) {
    (
        Disposition::DeadLetter(DeadLetter {
            reason,
            detail: detail.into(),
        }),
        Outcome::DeadLettered(reason),
    )
}

fn requeue(delay: Duration) -> (Disposition, Outcome) {
    (Disposition::Requeue { delay }, Outcome::Requeued)
}
