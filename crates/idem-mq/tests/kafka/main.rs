//! The Kafka source against a real broker of the test's own (Tansu, which speaks Kafka's
//! protocol: consumer groups, rebalances, offset commits, headers). Each test makes topics of
//! its own. Skipped (with a note) when no broker can be run here; a failure under `CI=true`.

#![cfg(feature = "kafka")]

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::Duration;

use idem_mq::kafka::{KafkaSource, KafkaSourceBuilder};
use idem_testkit::kafka::Tansu;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Headers;
use rdkafka::producer::FutureProducer;
use rdkafka::{Message, Offset, TopicPartitionList};

#[path = "../common/runs.rs"]
mod runs;

mod adapter;
mod consumer;

/// One broker for the whole suite (each test on topics of its own), or a skip.
fn tansu() -> Option<&'static Tansu> {
    static BROKER: OnceLock<Option<Tansu>> = OnceLock::new();
    BROKER.get_or_init(Tansu::start).as_ref()
}

/// A topic of the test's own with `partitions` partitions, and its dead-letter topic.
struct Topic {
    brokers: String,
    name: String,
    producer: FutureProducer,
}

impl Topic {
    async fn new(broker: &Tansu, partitions: i32) -> Self {
        let brokers = broker.brokers();
        let name = format!("idemt-{:016x}", rand::random::<u64>());
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .create()
            .expect("an admin client");
        let dead = format!("{name}.dead");
        let topics = [
            NewTopic::new(&name, partitions, TopicReplication::Fixed(1)),
            NewTopic::new(&dead, 1, TopicReplication::Fixed(1)),
        ];
        let made = admin
            .create_topics(&topics, &AdminOptions::new())
            .await
            .expect("create the topics");
        for result in made {
            result.expect("a topic made");
        }
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &brokers);
        for (k, v) in Tansu::producer_config() {
            config.set(k, v);
        }
        let producer = config.create().expect("a producer");
        Self {
            brokers,
            name,
            producer,
        }
    }

    fn dead(&self) -> String {
        format!("{}.dead", self.name)
    }

    /// Produces a record with `key` to `partition`, one at a time (one record per batch).
    async fn produce(&self, partition: i32, key: Option<&str>, payload: &[u8]) -> i64 {
        let mut record = rdkafka::producer::FutureRecord::<str, [u8]>::to(&self.name)
            .partition(partition)
            .payload(payload);
        if let Some(key) = key {
            record = record.key(key);
        }
        self.producer
            .send(record, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)
            .expect("produce")
            .offset
    }

    fn source(&self, group: &str) -> KafkaSourceBuilder {
        KafkaSource::builder(&self.brokers, group, &self.name)
            .commit_interval(Duration::from_millis(100))
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "500")
    }

    /// The offsets `group` has committed, by partition (`None`: nothing committed).
    async fn committed(&self, group: &str, partitions: i32) -> HashMap<i32, Option<i64>> {
        let (brokers, topic, group) = (self.brokers.clone(), self.name.clone(), group.to_owned());
        tokio::task::spawn_blocking(move || {
            let reader: BaseConsumer = ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                .set("group.id", &group)
                .create()
                .expect("a reader");
            let mut tpl = TopicPartitionList::new();
            for p in 0..partitions {
                tpl.add_partition(&topic, p);
            }
            let got = reader
                .committed_offsets(tpl, Duration::from_secs(10))
                .expect("the committed offsets");
            got.elements()
                .iter()
                .map(|e| {
                    let at = match e.offset() {
                        Offset::Offset(at) => Some(at),
                        _ => None,
                    };
                    (e.partition(), at)
                })
                .collect()
        })
        .await
        .expect("task")
    }

    /// Every record of the dead-letter topic: its key and headers.
    async fn dead_letters(
        &self,
        at_least: usize,
    ) -> Vec<(Option<String>, HashMap<String, String>)> {
        let (brokers, topic) = (self.brokers.clone(), self.dead());
        tokio::task::spawn_blocking(move || {
            let reader: BaseConsumer = ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                .set("group.id", "idemt-reader")
                .create()
                .expect("a reader");
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition_offset(&topic, 0, Offset::Beginning)
                .expect("offset");
            reader.assign(&tpl).expect("assign");
            let mut out = Vec::new();
            let until = std::time::Instant::now() + idem_testkit::PATIENCE;
            while out.len() < at_least && std::time::Instant::now() < until {
                let Some(Ok(m)) = reader.poll(Duration::from_millis(200)) else {
                    continue;
                };
                let key = m.key().map(|k| String::from_utf8_lossy(k).into_owned());
                let headers = m
                    .headers()
                    .map(|hs| {
                        hs.iter()
                            .map(|h| {
                                (
                                    h.key.to_owned(),
                                    String::from_utf8_lossy(h.value.unwrap_or_default())
                                        .into_owned(),
                                )
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                out.push((key, headers));
            }
            out
        })
        .await
        .expect("task")
    }
}

/// A fresh group name.
fn group(what: &str) -> String {
    format!("idemt-{what}-{:08x}", rand::random::<u32>())
}

/// A lease short enough that a test sees a claim run out.
const LEASE: Duration = Duration::from_millis(1500);
