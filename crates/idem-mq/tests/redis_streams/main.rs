//! The Redis Streams adapter against a real server: each test on streams of its own, deleted
//! at the end. Skipped (with a note) when no Redis answers; a failure under `CI=true`.

#![cfg(feature = "redis-streams")]

use std::collections::HashMap;
use std::time::Duration;

use idem_mq::redis_streams::{RedisStreamDelivery, RedisStreamSource, RedisStreamSourceBuilder};
use idem_mq::{Delivery, Source};
use redis::Value;
use redis::aio::MultiplexedConnection;

#[path = "../common/runs.rs"]
mod runs;
use runs::{next, store_failure_requeues};

mod adapter;
mod consumer;
#[cfg(feature = "postgres")]
#[path = "../common/killed.rs"]
mod harness;
#[cfg(feature = "postgres")]
mod killed;

fn redis_url() -> Option<String> {
    idem_testkit::services::REDIS.url()
}

/// A stream of the test's own and its dead-letter stream, deleted when dropped.
struct Stream {
    url: String,
    name: String,
    conn: MultiplexedConnection,
}

impl Stream {
    async fn new(url: &str) -> Self {
        Self::named(url, format!("idemt:{:016x}", rand::random::<u64>())).await
    }

    async fn named(url: &str, name: String) -> Self {
        let client = redis::Client::open(url).expect("a Redis URL");
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("connect to Redis");
        Self {
            url: url.to_owned(),
            name,
            conn,
        }
    }

    fn dead(&self) -> String {
        format!("{}:dead", self.name)
    }

    fn builder(&self, group: &str) -> RedisStreamSourceBuilder {
        RedisStreamSource::builder(&self.name, group)
    }

    async fn source(&self, group: &str) -> RedisStreamSource {
        self.builder(group)
            .connect(&self.url)
            .await
            .expect("the source")
    }

    /// Adds an entry under message id `id`; its entry id.
    async fn publish(&self, id: &str, payload: &[u8]) -> String {
        idem_mq::redis_streams::publish(&mut self.conn.clone(), &self.name, id, payload)
            .await
            .expect("publish")
    }

    /// How many entries of `group` are pending (read, not acked).
    async fn pending(&self, group: &str) -> i64 {
        let summary: Value = redis::cmd("XPENDING")
            .arg(&self.name)
            .arg(group)
            .query_async(&mut self.conn.clone())
            .await
            .expect("XPENDING");
        match summary {
            Value::Array(items) => match items.first() {
                Some(Value::Int(n)) => *n,
                other => panic!("XPENDING summary: {other:?}"),
            },
            other => panic!("XPENDING: {other:?}"),
        }
    }

    /// The entries of stream `name`, each as its id and fields.
    async fn entries(&self, name: &str) -> Vec<(String, HashMap<String, String>)> {
        let range: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
            .arg(name)
            .arg("-")
            .arg("+")
            .query_async(&mut self.conn.clone())
            .await
            .expect("XRANGE");
        range
            .into_iter()
            .map(|(id, fields)| (id, fields.into_iter().collect()))
            .collect()
    }

    /// Waits until nothing read through `group` is left unacked.
    async fn wait_settled(&self, group: &str) {
        tokio::time::timeout(Duration::from_secs(60), async {
            while self.pending(group).await > 0 {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
        .await
        .expect("every entry settled");
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let (url, keys) = (self.url.clone(), [self.name.clone(), self.dead()]);
        idem_testkit::on_a_thread_of_its_own(async move {
            if let Ok(client) = redis::Client::open(url)
                && let Ok(mut conn) = client.get_multiplexed_async_connection().await
            {
                let _: Result<(), _> = redis::cmd("DEL").arg(&keys).exec_async(&mut conn).await;
            }
        });
    }
}

/// The next delivery within `wait`, if any.
async fn next_within(
    source: &mut RedisStreamSource,
    wait: Duration,
) -> Option<RedisStreamDelivery> {
    tokio::time::timeout(wait, async {
        loop {
            match source.next().await {
                Some(Ok(d)) => return d,
                Some(Err(e)) => eprintln!("next: {e}"),
                None => std::future::pending().await,
            }
        }
    })
    .await
    .ok()
}

fn id_of(d: &RedisStreamDelivery) -> String {
    d.message_id().unwrap_or_default().to_owned()
}
