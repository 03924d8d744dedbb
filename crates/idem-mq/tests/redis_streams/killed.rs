//! Consumers killed with SIGKILL between claim and ack, over hundreds of entries of which 30%
//! are published twice (the harness is `tests/common/killed.rs`).

use super::*;
use crate::harness::{
    Broker, CRASH_ATTEMPTS, ChildEnv, LEASE, N, Tables, assert_inbox, assert_plain, chaos,
    crash_loop, run_child,
};
use idem_mq::redis_streams::{DELIVERIES_FIELD, REASON_FIELD};

/// The group every child reads through.
const GROUP: &str = "killed";

/// A consumer process: consumes until it is killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by the killed-consumer tests as their child process"]
async fn kill_child_consumer() {
    let Some(env) = ChildEnv::from_env() else {
        return;
    };
    let source = RedisStreamSource::builder(&env.name, GROUP)
        .batch(env.concurrency())
        // A killed child's entries come back as its records' leases run out.
        .claim_idle(LEASE)
        .claim_every(Duration::from_millis(100))
        .max_deliveries(200)
        .connect(&env.url)
        .await
        .expect("source");
    run_child(env, source).await;
}

impl Broker for Stream {
    fn url(&self) -> &str {
        &self.url
    }

    fn name(&self) -> &str {
        &self.name
    }

    async fn publish(&self, id: &str, payload: &[u8]) {
        Stream::publish(self, id, payload).await;
    }

    async fn wait_settled(&self) {
        Stream::wait_settled(self, GROUP).await;
    }
}

/// The ids published twice: 30% of them.
fn twice() -> Vec<usize> {
    (0..N).filter(|i| i % 10 < 3).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_killed_mid_entry_never_run_an_id_twice_within_a_lease() {
    let (Some(url), Some(pg)) = (redis_url(), idem_testkit::services::POSTGRES.url()) else {
        return;
    };
    let stream = Stream::new(&url).await;
    assert_plain(&chaos(&stream, &pg, "plain", &twice()).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_killed_mid_entry_leave_one_effect_per_id_in_inbox_mode() {
    let (Some(url), Some(pg)) = (redis_url(), idem_testkit::services::POSTGRES.url()) else {
        return;
    };
    let stream = Stream::new(&url).await;
    assert_inbox(&chaos(&stream, &pg, "inbox", &twice()).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_that_crashes_its_consumer_ends_in_the_dead_letter() {
    let (Some(url), Some(pg)) = (redis_url(), idem_testkit::services::POSTGRES.url()) else {
        return;
    };
    let stream = Stream::new(&url).await;
    let (tables, pool) = Tables::create(&pg).await;
    stream.publish("crash-1", b"crash").await;
    for i in 0..10 {
        stream.publish(&format!("ok-{i}"), b"").await;
    }
    let crashes = crash_loop(&stream, &pg, &tables, || async {
        !stream.entries(&stream.dead()).await.is_empty()
    })
    .await;

    let dead = stream.entries(&stream.dead()).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].1["message_id"], "crash-1");
    assert_eq!(dead[0].1[REASON_FIELD], "attempts_exhausted");
    assert_eq!(
        dead[0].1[DELIVERIES_FIELD],
        (CRASH_ATTEMPTS + 1).to_string(),
        "dead-lettered on the delivery after the last allowed"
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
