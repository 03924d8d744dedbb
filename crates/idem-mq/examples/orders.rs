//! Publishes orders to RabbitMQ, NATS JetStream or a Redis stream (some twice, as a publisher
//! that retries would) and consumes them so that each order is handled once.
//!
//! ```sh
//! cargo run -p idem-mq --features amqp,nats,redis-streams --example orders -- amqp://guest:guest@127.0.0.1:5672/%2f
//! cargo run -p idem-mq --features amqp,nats,redis-streams --example orders -- nats://127.0.0.1:4222
//! cargo run -p idem-mq --features amqp,nats,redis-streams --example orders -- redis://127.0.0.1:6379
//! ```
//!
//! Records go to an in-memory store here; give `idem::RedisStore` or `idem::PostgresStore`
//! to consumers that run on several machines.

#![allow(clippy::print_stdout)] // an example prints what it did

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_mq::{Consumer, Failure, Message};

type Handled = Arc<Mutex<HashMap<String, usize>>>;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let orders: Vec<String> = (1..=20).map(|i| format!("order-{i}")).collect();
    let handled = Handled::default();
    let seen = handled.clone();
    let handler = move |msg: Message| {
        let seen = seen.clone();
        async move {
            let id = msg.message_id.clone().unwrap_or_default();
            // The work: here, counting; msg.fence() would guard a write elsewhere.
            *seen
                .lock()
                .map_err(|_| Failure::Retry("poisoned".to_owned()))?
                .entry(id)
                .or_default() += 1;
            Ok::<_, Failure<String>>(msg.payload.len())
        }
    };
    let consumer = Consumer::new(idem::MemoryStore::new()).concurrency(16);
    // Stops once every order has been handled and the rest had time to be acked.
    let all = handled.clone();
    let total = orders.len();
    let done = async move {
        while all.lock().map_or(0, |m| m.len()) < total {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };

    if url.starts_with("redis://") {
        let stream = format!("orders-{:08x}", rand::random::<u32>());
        let client = redis::Client::open(url.as_str())?;
        let source =
            idem_mq::redis_streams::RedisStreamSource::builder(stream.clone(), "inventory")
                .connect(&url)
                .await?;
        let mut conn = client.get_multiplexed_async_connection().await?;
        for (i, id) in orders.iter().enumerate() {
            for _ in 0..(1 + i % 3 / 2) {
                let body = format!("{{\"order\":\"{id}\"}}");
                idem_mq::redis_streams::publish(&mut conn, &stream, id, body.as_bytes()).await?;
            }
        }
        consumer.run(source, handler, done).await?;
        redis::cmd("DEL").arg(&stream).exec_async(&mut conn).await?;
    } else if url.starts_with("nats://") {
        let stream = format!("ORDERS_{:08x}", rand::random::<u32>());
        let client = async_nats::connect(&url).await?;
        let js = async_nats::jetstream::new(client);
        js.create_stream(async_nats::jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![format!("{stream}.paid")],
            ..Default::default()
        })
        .await?;
        let mut dropped = 0;
        for (i, id) in orders.iter().enumerate() {
            for _ in 0..(1 + i % 3 / 2) {
                let body = format!("{{\"order\":\"{id}\"}}");
                let published =
                    idem_mq::nats::publish_once(&js, format!("{stream}.paid"), id, body.into())
                        .await?;
                dropped += usize::from(published.duplicate);
            }
        }
        println!("the stream's duplicate window dropped {dropped} re-publishes");
        let source = idem_mq::nats::NatsSource::builder(stream.clone(), "inventory")
            .dead_letter(idem_mq::nats::DeadLetterTarget::TermOnly)
            .connect(&url)
            .await?;
        consumer.run(source, handler, done).await?;
        js.delete_stream(&stream).await?;
    } else {
        let queue = format!("orders-{:08x}", rand::random::<u32>());
        let source = idem_mq::amqp::AmqpSource::builder(url.clone(), queue.clone())
            .connect()
            .await?;
        let publisher = idem_mq::amqp::AmqpPublisher::connect(&url).await?;
        for (i, id) in orders.iter().enumerate() {
            for _ in 0..(1 + i % 3 / 2) {
                let body = format!("{{\"order\":\"{id}\"}}");
                publisher
                    .publish_once("", &queue, id, body.as_bytes(), Default::default())
                    .await?;
            }
        }
        publisher.close().await;
        consumer.run(source, handler, done).await?;
        idem_mq::amqp::AmqpSource::delete_topology(&url, &queue).await?;
    }

    let counts = consumer.counts();
    let handled = handled.lock().map(|m| m.clone()).unwrap_or_default();
    let twice = handled.values().filter(|&&n| n > 1).count();
    println!(
        "{} orders handled, {twice} twice; {} deliveries: {} handled, {} acked without running",
        handled.len(),
        counts.received,
        counts.handled,
        counts.replayed
    );
    Ok(())
}
