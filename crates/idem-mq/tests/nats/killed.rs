//! Consumers killed with SIGKILL between claim and ack (the harness is
//! `tests/common/killed.rs`).

use super::*;
use crate::harness::{
    Broker, CRASH_ATTEMPTS, ChildEnv, LEASE, Tables, assert_inbox, assert_plain, chaos, crash_loop,
    run_child,
};

/// The durable consumer every child pulls from.
const DURABLE: &str = "killed";

/// A consumer process: consumes until it is killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by the killed-consumer tests as their child process"]
async fn kill_child_consumer() {
    let Some(env) = ChildEnv::from_env() else {
        return;
    };
    let crash = env.crash();
    let source = NatsSource::builder(&env.name, DURABLE)
        .ack_wait(LEASE)
        .max_deliver(200)
        .batch(env.concurrency())
        .max_ack_pending(if crash { 1 } else { 64 })
        .max_requeue_delay(Duration::from_secs(1))
        .connect(&env.url)
        .await
        .expect("source");
    run_child(env, source).await;
}

impl Broker for Streams {
    fn url(&self) -> &str {
        &self.url
    }

    fn name(&self) -> &str {
        &self.name
    }

    async fn publish(&self, id: &str, payload: &[u8]) {
        Streams::publish(self, id, Bytes::copy_from_slice(payload)).await;
    }

    async fn wait_settled(&self) {
        Streams::wait_settled(self, DURABLE).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_killed_mid_message_never_run_an_id_twice_within_a_lease() {
    let (Some(url), Some(pg)) = (nats_url(), idem_testkit::services::POSTGRES.url()) else {
        return;
    };
    let streams = Streams::new(&url, |_| {}).await;
    assert_plain(&chaos(&streams, &pg, "plain", &[]).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_killed_mid_message_leave_one_effect_per_id_in_inbox_mode() {
    let (Some(url), Some(pg)) = (nats_url(), idem_testkit::services::POSTGRES.url()) else {
        return;
    };
    let streams = Streams::new(&url, |_| {}).await;
    assert_inbox(&chaos(&streams, &pg, "inbox", &[]).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_crashes_its_consumer_ends_in_the_dead_letter() {
    let (Some(url), Some(pg)) = (nats_url(), idem_testkit::services::POSTGRES.url()) else {
        return;
    };
    let streams = Streams::new(&url, |_| {}).await;
    let (tables, pool) = Tables::create(&pg).await;
    streams
        .publish("crash-1", Bytes::from_static(b"crash"))
        .await;
    for i in 0..10 {
        streams.publish(&format!("ok-{i}"), Bytes::new()).await;
    }
    let crashes = crash_loop(&streams, &pg, &tables, || async {
        !streams.dead_letters().await.is_empty()
    })
    .await;

    let dead = streams.dead_letters().await;
    assert_eq!(dead.len(), 1);
    assert_eq!(header(&dead[0], MSG_ID_HEADER), Some("crash-1"));
    assert_eq!(header(&dead[0], REASON_HEADER), Some("attempts_exhausted"));
    let deliveries = (CRASH_ATTEMPTS + 1).to_string();
    assert_eq!(
        header(&dead[0], DELIVERIES_HEADER),
        Some(deliveries.as_str()),
        "dead-lettered on the delivery after the last allowed, as the server counts"
    );
    let runs = tables.runs_per_id(&pool).await;
    assert_eq!(
        runs.get("crash-1").copied(),
        Some(i64::from(CRASH_ATTEMPTS)),
        "it ran once per allowed delivery"
    );
    for i in 0..10 {
        assert!(runs.contains_key(&format!("ok-{i}")), "ok-{i} ran");
    }
    assert!(crashes >= 1, "the message crashed its consumer");
}
