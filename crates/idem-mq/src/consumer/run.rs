//! The receive loop, and one delivery from claim to settle.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use idem_core::{Clock, Store};

use super::settings::Ctx;
use super::{Consumer, Handler, Outcome};
use crate::MqError;
use crate::source::{Delivery, Horizon, Source};

impl<S: Store + Clone, C: Clock + Clone> Consumer<S, C> {
    /// Consumes `source` until `shutdown` completes or the source closes: up to
    /// `concurrency` handlers at once. At shutdown it stops taking messages, waits up to the
    /// drain time for running handlers to finish and settle, and returns.
    pub async fn run<Src, H>(
        &self,
        mut source: Src,
        handler: H,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), MqError>
    where
        Src: Source,
        H: Handler,
        S: Clone,
    {
        let ctx = Arc::new(self.context(&source)?);
        if source.redelivery_horizon() == Horizon::Unbounded {
            tracing::warn!(
                source = source.name(),
                ttl = ?self.settings.ttl,
                "the broker may redeliver a message at any time: one redelivered after its \
                 record expired runs again; bound how long messages live in the broker, or \
                 raise the record TTL"
            );
        }
        let label = &*ctx.source;
        let handler = Arc::new(handler);
        let slots = Arc::new(tokio::sync::Semaphore::new(self.settings.concurrency));
        let mut running = tokio::task::JoinSet::new();
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            let slot = tokio::select! {
                biased;
                () = &mut shutdown => break,
                slot = slots.clone().acquire_owned() => match slot {
                    Ok(slot) => slot,
                    Err(_) => break,
                },
            };
            let next = tokio::select! {
                biased;
                () = &mut shutdown => break,
                next = source.next() => next,
            };
            match next {
                None => break,
                Some(Err(e)) => {
                    metrics::counter!("idem_mq_source_errors_total", "source" => label.to_owned())
                        .increment(1);
                    tracing::warn!(source = label, error = %e, "cannot receive a message");
                    // Sources reconnect by themselves; this only keeps a source that fails
                    // at once from spinning.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Some(Ok(delivery)) => {
                    let (this, handler, ctx) = (self.clone(), handler.clone(), ctx.clone());
                    running.spawn(async move {
                        let _slot = slot;
                        this.process_in(&ctx, delivery, &*handler).await
                    });
                }
            }
            while running.try_join_next().is_some() {}
        }
        source.close().await;
        let drained = tokio::time::timeout(self.settings.drain, async {
            while let Some(done) = running.join_next().await {
                if let Err(e) = done {
                    tracing::error!(source = label, error = %e, "a consumer task failed");
                }
            }
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                source = label,
                left = running.len(),
                "handlers still running at the end of the drain time are stopped; their \
                 messages are left to the broker"
            );
            running.shutdown().await;
        }
        Ok(())
    }

    /// Handles one delivery of `source` and settles it, for a receive loop of one's own
    /// ([`Consumer::run`] does this for each delivery, several at once).
    pub async fn process<Src: Source, H: Handler>(
        &self,
        source: &Src,
        delivery: Src::Delivery,
        handler: &H,
    ) -> Result<Outcome, MqError> {
        let ctx = self.context(source)?;
        Ok(self.process_in(&ctx, delivery, handler).await)
    }

    async fn process_in<D: Delivery, H: Handler>(
        &self,
        ctx: &Ctx,
        delivery: D,
        handler: &H,
    ) -> Outcome {
        let source = &*ctx.source;
        self.counters.note_received(&ctx.source);
        let (disposition, outcome) = self.decide_or_panicked(ctx, &delivery, handler).await;
        let outcome = match delivery.settle(disposition).await {
            Ok(()) => outcome,
            Err(e) => {
                tracing::warn!(source, error = %e, "the broker did not take the settlement; it will redeliver");
                Outcome::Unsettled
            }
        };
        self.counters.note_settled(&ctx.source, outcome);
        outcome
    }
}
