//! The AMQP adapter against a real RabbitMQ (skipped, with a note, when none answers; a
//! failure under `CI=true`).

#![cfg(feature = "amqp")]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::{MemoryStore, PostgresOptions, PostgresStore};

use futures_util::future::BoxFuture;
use idem_mq::amqp::lapin::options::QueueDeclareOptions;
use idem_mq::amqp::lapin::types::FieldTable;
use idem_mq::amqp::lapin::{Connection, ConnectionProperties};
use idem_mq::amqp::{ATTEMPT_HEADER, AmqpPublisher, AmqpSource, BasicProperties, QueueType};
use idem_mq::inbox::{Inbox, InboxFn, inbox_fn};
use idem_mq::{Consumer, DeadLetter, Delivery, Disposition, Failure, Message, Reason, Source};
use idem_testkit::services::{POSTGRES, RABBITMQ};
use idem_testkit::within;

fn unique(prefix: &str) -> String {
    format!("idem-test-{prefix}-{:016x}", rand::random::<u64>())
}

/// Deletes the queue's topology when the test ends, even by a panic.
struct Cleanup {
    url: String,
    queue: String,
    /// PostgreSQL tables to drop too, with the database's URL.
    tables: Option<(String, Vec<String>)>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some((pg, tables)) = self.tables.take() {
            idem_testkit::on_a_thread_of_its_own(async move {
                let Ok(pool) = sqlx::PgPool::connect(&pg).await else {
                    return;
                };
                for table in tables {
                    let sql = format!("DROP TABLE IF EXISTS {table}");
                    let _ = sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&pool).await;
                }
            });
        }
        let (url, queue) = (self.url.clone(), self.queue.clone());
        let deleted = idem_testkit::on_a_thread_of_its_own(async move {
            AmqpSource::delete_topology(&url, &queue).await
        });
        if let Some(Err(e)) = deleted {
            eprintln!("cleanup: {e}");
        }
    }
}

async fn next<S: Source>(source: &mut S) -> S::Delivery {
    within("a delivery", async {
        loop {
            match source.next().await {
                Some(Ok(d)) => return d,
                Some(Err(e)) => eprintln!("source error (retrying): {e}"),
                None => panic!("source closed"),
            }
        }
    })
    .await
}

/// How many messages a queue holds (ready, not unacked).
async fn depth(url: &str, queue: &str) -> u32 {
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("connect");
    let ch = conn.create_channel().await.expect("channel");
    let q = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("passive declare");
    let _ = conn.close(200, "OK".into()).await;
    q.message_count()
}

use idem_mq::bench::{get_one, header_text};

async fn setup(prefix: &str, queue_type: QueueType) -> Option<(String, String, Cleanup)> {
    let url = RABBITMQ.url()?;
    let queue = unique(prefix);
    let cleanup = Cleanup {
        url: url.clone(),
        queue: queue.clone(),
        tables: None,
    };
    let _ = queue_type;
    Some((url, queue, cleanup))
}

/// Closes, on the broker's side, every connection whose client properties mention `name`
/// (`rabbitmqctl close_connection`). False when `rabbitmqctl` cannot be run.
fn kill_connections(name: &str) -> bool {
    let Ok(out) = std::process::Command::new("rabbitmqctl")
        .args(["-q", "list_connections", "pid", "client_properties"])
        .output()
    else {
        return false;
    };
    assert!(out.status.success(), "rabbitmqctl list_connections failed");
    let mut killed = 0;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some((pid, properties)) = line.split_once('\t') else {
            continue;
        };
        if !properties.contains(name) {
            continue;
        }
        let status = std::process::Command::new("rabbitmqctl")
            .args([
                "-q",
                "close_connection",
                pid,
                "closed by the idem test suite",
            ])
            .status()
            .expect("rabbitmqctl close_connection");
        assert!(status.success(), "rabbitmqctl close_connection failed");
        killed += 1;
    }
    assert!(killed > 0, "no connection named {name} at the broker");
    true
}

#[path = "../common/runs.rs"]
mod runs;
use runs::store_failure_requeues;

mod adapter;
mod consumer;
mod killed;
