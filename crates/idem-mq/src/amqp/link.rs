//! One connection to the broker, shared by a source and the deliveries it handed out: the
//! channels they use, the delay queues declared on it, and closing it when the last is gone.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

use lapin::options::ConfirmSelectOptions;
use lapin::{Channel, Connection};

use super::topology::{Topology, durable, short};
use super::{Bounded, open_channel};
use crate::MqError;

/// One connection's worth of state, shared with the deliveries it handed out: the connection
/// stays open while the source or any of them holds it.
pub(super) struct Link {
    /// Shared, so that the close sent when the link is dropped can own it.
    pub(super) connection: Arc<Connection>,
    /// The channel the deliveries arrived on (and are acked on).
    pub(super) consume: Channel,
    /// A channel in confirm mode, for the copies requeues and dead letters publish; see
    /// [`Link::publish_channel`].
    publish: Mutex<Channel>,
    /// Held while a closed `publish` is replaced, so that one new channel replaces it.
    reopening: tokio::sync::Mutex<()>,
    pub(super) topology: Topology,
    /// The delay buckets declared on this connection.
    pub(super) delays: Mutex<HashSet<u64>>,
}

/// Closes the connection once the source and every delivery of it are gone, explicitly:
/// lapin closes a connection by itself only when the last handle to it and to each of its
/// channels is gone, and a connection left open keeps its unacknowledged deliveries from
/// every other consumer until the process exits.
impl Drop for Link {
    fn drop(&mut self) {
        let connection = self.connection.clone();
        if connection.status().connected()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(async move {
                let _ = connection.close(200, "OK".into()).bounded("closing").await;
            });
        }
    }
}

impl Link {
    pub(super) fn new(
        connection: Connection,
        consume: Channel,
        publish: Channel,
        topology: Topology,
    ) -> Self {
        Self {
            connection: Arc::new(connection),
            consume,
            publish: Mutex::new(publish),
            reopening: tokio::sync::Mutex::new(()),
            topology,
            delays: Mutex::new(HashSet::new()),
        }
    }

    /// The confirm-mode channel to publish copies on, opened again when the last one was
    /// closed: a publish the broker refuses with a channel error (a dead letter to an exchange
    /// that was deleted, say) closes that channel alone, and every later requeue and dead
    /// letter would fail on it while the deliveries keep arriving on the other.
    pub(super) async fn publish_channel(&self) -> Result<Channel, MqError> {
        let current = self.current_publish();
        if current.status().connected() {
            return Ok(current);
        }
        let _reopening = self.reopening.lock().await;
        let current = self.current_publish();
        if current.status().connected() {
            return Ok(current); // reopened meanwhile
        }
        let fresh = open_confirm_channel(&self.connection).await?;
        *self.publish.lock().unwrap_or_else(PoisonError::into_inner) = fresh.clone();
        Ok(fresh)
    }

    fn current_publish(&self) -> Channel {
        self.publish
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub(super) async fn ensure_delay_queue(&self, bucket_ms: u64) -> Result<String, MqError> {
        let name = self.topology.delay_queue(bucket_ms);
        let known = self
            .delays
            .lock()
            .map(|d| d.contains(&bucket_ms))
            .unwrap_or(false);
        if known {
            return Ok(name);
        }
        // A separate channel: a refused declaration closes its channel, and must not take the
        // publishing channel with it.
        let channel = open_channel(&self.connection).await?;
        channel
            .queue_declare(
                short(&name)?,
                durable(),
                self.topology.delay_queue_arguments(bucket_ms),
            )
            .bounded("declaring a delay queue")
            .await?;
        let _ = channel.close(200, "OK".into()).bounded("closing").await;
        if let Ok(mut d) = self.delays.lock() {
            d.insert(bucket_ms);
        }
        Ok(name)
    }
}

/// A new channel in confirm mode.
pub(super) async fn open_confirm_channel(connection: &Connection) -> Result<Channel, MqError> {
    let channel = open_channel(connection).await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .bounded("enabling publisher confirms")
        .await?;
    Ok(channel)
}
