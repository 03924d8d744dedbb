//! Renewing the lease and the broker's timer while a handler runs.

use std::time::Duration;

use idem_core::{Clock, Key, Lease, LeaseError, Store};

use super::Consumer;
use crate::source::Delivery;

impl<S: Store + Clone, C: Clock + Clone> Consumer<S, C> {
    /// Renews the lease, and tells the broker the message is in progress, while the handler
    /// runs; dropped when the handler finishes. Ends only when the lease is lost: another
    /// attempt took the key over, or the lease ran out while the store could not renew it.
    /// Then the handler is stopped, so that it never runs beside an attempt that may have
    /// taken the key.
    pub(super) async fn keep_alive<D: Delivery>(
        &self,
        key: &Key,
        lease: Lease,
        delivery: &D,
        ack_wait: Option<Duration>,
    ) {
        let s = &*self.settings;
        let mut every = s.lease / 3;
        if let Some(ack_wait) = ack_wait {
            every = every.min(ack_wait / 3);
        }
        let every = every.max(Duration::from_millis(10));
        let clock = self.idem.clock();
        let mut held_until = lease.expires_at;
        loop {
            let left = held_until.saturating_since(clock.now());
            if left.is_zero() {
                tracing::warn!(
                    "a running message's lease ran out unrenewed; its handler is stopped"
                );
                return;
            }
            tokio::time::sleep(every.min(left)).await;
            // The two heartbeats at once: a slow store does not hold back the broker's.
            let (renewed, progress) = tokio::join!(
                self.idem.store().renew(key, &lease, s.lease, clock.now()),
                delivery.in_progress()
            );
            match renewed {
                Ok(renewed) => held_until = renewed.expires_at,
                Err(LeaseError::Stale(_)) => {
                    tracing::warn!(
                        "a running message's key was taken over; its handler is stopped"
                    );
                    return;
                }
                Err(e) => tracing::debug!(error = %e, "cannot renew a running message's lease"),
            }
            if let Err(e) = progress {
                tracing::debug!(error = %e, "cannot tell the broker a message is in progress");
            }
        }
    }
}
