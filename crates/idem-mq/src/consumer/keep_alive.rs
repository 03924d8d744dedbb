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
        // Two heartbeats, each on its own: a store that is slow to renew does not hold back
        // the broker's, nor a slow broker the renewal.
        let renewing = async {
            let mut held_until = lease.expires_at;
            loop {
                tokio::time::sleep(every.min(held_until.saturating_since(clock.now()))).await;
                // A renewal may take what is left of the lease (at least a beat: a process the
                // machine starved past its lease's end still asks; a lease that ran out but was
                // not taken over may be renewed), and no longer: a store that does not answer
                // cannot keep the handler running past the lease.
                let bound = held_until.saturating_since(clock.now()).max(every);
                let renew = self.idem.store().renew(key, &lease, s.lease, clock.now());
                match tokio::time::timeout(bound, renew).await {
                    Ok(Ok(renewed)) => {
                        held_until = renewed.expires_at;
                        continue;
                    }
                    Ok(Err(LeaseError::Stale(_))) => {
                        tracing::warn!(
                            "a running message's key was taken over; its handler is stopped"
                        );
                        return;
                    }
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "cannot renew a running message's lease");
                    }
                    Err(_) => {
                        tracing::debug!(
                            "the store did not renew a running message's lease in time"
                        );
                    }
                }
                if held_until <= clock.now() {
                    tracing::warn!(
                        "a running message's lease ran out unrenewed; its handler is stopped"
                    );
                    return;
                }
            }
        };
        let progress = async {
            loop {
                tokio::time::sleep(every).await;
                if let Err(e) = delivery.in_progress().await {
                    tracing::debug!(error = %e, "cannot tell the broker a message is in progress");
                }
            }
        };
        // `progress` never ends; the lease's loop ends when the lease is lost.
        tokio::select! {
            () = renewing => {}
            _ = progress => {}
        }
    }
}
