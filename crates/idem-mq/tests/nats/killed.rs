//! Consumers killed with SIGKILL between claim and ack. The test binary runs itself as the
//! consumer processes: `kill_child_consumer` is ignored, and does nothing without its
//! environment.

use super::*;
use std::process::{Child, Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

use idem::{PostgresOptions, PostgresStore};
use idem_mq::inbox::{Inbox, inbox_fn};
use sqlx::PgPool;

const ENV_NATS: &str = "IDEM_NATS_CHILD_URL";
const ENV_PG: &str = "IDEM_NATS_CHILD_PG";
const ENV_STREAM: &str = "IDEM_NATS_CHILD_STREAM";
const ENV_TABLES: &str = "IDEM_NATS_CHILD_TABLES";
const ENV_MODE: &str = "IDEM_NATS_CHILD_MODE";
/// The durable consumer every child pulls from.
const DURABLE: &str = "killed";
/// The records' lease: a killed attempt's key is taken over this long after its claim at
/// the earliest.
const LEASE: Duration = Duration::from_secs(2);
const ACK_WAIT: Duration = Duration::from_secs(2);
const CONCURRENCY: usize = 4;
/// Messages per chaos run.
const N: usize = 400;
/// The consumer's `max_attempts` in the crash-loop test.
const CRASH_ATTEMPTS: u32 = 3;

fn micros_now() -> i64 {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970");
    i64::try_from(d.as_micros()).expect("fits")
}

async fn store(pg: &str, tables: &str) -> PostgresStore {
    PostgresStore::connect_with(
        pg,
        PostgresOptions {
            table: format!("{tables}_records"),
            max_connections: 8,
            ..Default::default()
        },
    )
    .await
    .expect("the PostgreSQL store")
}

/// A consumer process: consumes until it is killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by the killed-consumer tests as their child process"]
async fn kill_child_consumer() {
    let (Ok(url), Ok(pg), Ok(stream), Ok(tables), Ok(mode)) = (
        std::env::var(ENV_NATS),
        std::env::var(ENV_PG),
        std::env::var(ENV_STREAM),
        std::env::var(ENV_TABLES),
        std::env::var(ENV_MODE),
    ) else {
        return;
    };
    let store = store(&pg, &tables).await;
    let inbox_store = store.clone();
    let pool = store.pool().clone();
    // In the crash loop one message at a time: every message a crashing process holds
    // has its delivery counted, and the bystanders would exhaust their attempts too.
    let crash = mode == "crash";
    let concurrency = if crash { 1 } else { CONCURRENCY };
    let source = NatsSource::builder(&stream, DURABLE)
        .ack_wait(ACK_WAIT)
        .max_deliver(200)
        .batch(concurrency)
        .max_ack_pending(if crash { 1 } else { 64 })
        .max_requeue_delay(Duration::from_secs(1))
        .connect(&url)
        .await
        .expect("source");
    let consumer = Consumer::new(store)
        .concurrency(concurrency)
        .lease(LEASE)
        .max_attempts(if mode == "crash" { CRASH_ATTEMPTS } else { 150 })
        .wait_in_flight(Duration::from_millis(300))
        .backoff(Duration::from_millis(100), Duration::from_secs(1));
    let pid = i32::try_from(std::process::id()).expect("pid");
    let runs = format!("{tables}_runs");
    let effects = format!("{tables}_effects");
    // Every run is logged on its own connection (it stays if the run is rolled back or
    // killed); the handler's work is long enough for kills to land inside it.
    let log_run = move |id: String, fence: u64| {
        let (pool, runs) = (pool.clone(), runs.clone());
        async move {
            let fence = i64::try_from(fence).expect("fence");
            let row: (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {runs} (id, fence, pid, started) VALUES ($1, $2, $3, $4) \
                 RETURNING run"
            )))
            .bind(&id)
            .bind(fence)
            .bind(pid)
            .bind(micros_now())
            .fetch_one(&pool)
            .await
            .map_err(|e| Failure::Retry(e.to_string()))?;
            let ms = 20 + rand::random::<u64>() % 100;
            tokio::time::sleep(Duration::from_millis(ms)).await;
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "UPDATE {runs} SET finished = $1 WHERE run = $2"
            )))
            .bind(micros_now())
            .bind(row.0)
            .execute(&pool)
            .await
            .map_err(|e| Failure::Retry(e.to_string()))?;
            Ok::<_, Failure<String>>(())
        }
    };
    match mode.as_str() {
        "plain" => {
            let handler = move |msg: Message| {
                log_run(
                    msg.message_id.clone().unwrap_or_default(),
                    msg.fence().unwrap_or(0),
                )
            };
            consumer
                .run(source, handler, std::future::pending())
                .await
                .expect("run");
        }
        "crash" => {
            // A message that kills its consumer every time it runs.
            let handler = move |msg: Message| {
                let crash = &msg.payload[..] == b"crash";
                let run = log_run(
                    msg.message_id.clone().unwrap_or_default(),
                    msg.fence().unwrap_or(0),
                );
                async move {
                    let done = run.await;
                    if crash {
                        std::process::abort();
                    }
                    done
                }
            };
            consumer
                .run(source, handler, std::future::pending())
                .await
                .expect("run");
        }
        "inbox" => {
            let handler = inbox_fn(
                move |tx: &mut sqlx::Transaction<'static, sqlx::Postgres>, msg: Message| {
                    let id = msg.message_id.clone().unwrap_or_default();
                    let fence = msg.fence().unwrap_or(0);
                    let work = log_run(id.clone(), fence);
                    let effects = effects.clone();
                    Box::pin(async move {
                        // The business write, in the inbox's transaction.
                        sqlx::query(sqlx::AssertSqlSafe(format!(
                            "INSERT INTO {effects} (id, fence, pid) VALUES ($1, $2, $3)"
                        )))
                        .bind(&id)
                        .bind(i64::try_from(fence).expect("fence"))
                        .bind(pid)
                        .execute(&mut **tx)
                        .await
                        .map_err(|e| Failure::Retry(e.to_string()))?;
                        work.await
                    })
                },
            );
            consumer
                .run(
                    source,
                    Inbox::new(inbox_store, handler),
                    std::future::pending(),
                )
                .await
                .expect("run");
        }
        other => panic!("unknown mode {other}"),
    }
}

/// The child processes, killed when dropped.
struct Children {
    env: Vec<(&'static str, String)>,
    live: Vec<Child>,
    /// Pid and when it was killed (micros since the epoch).
    killed: HashMap<i32, i64>,
}

impl Children {
    /// None running yet; each will consume `streams` in `mode`, its tables named by `prefix`.
    fn new(nats: &str, pg: &str, streams: &Streams, prefix: &str, mode: &str) -> Self {
        Self {
            env: vec![
                (ENV_NATS, nats.to_owned()),
                (ENV_PG, pg.to_owned()),
                (ENV_STREAM, streams.name.clone()),
                (ENV_TABLES, prefix.to_owned()),
                (ENV_MODE, mode.to_owned()),
            ],
            live: Vec::new(),
            killed: HashMap::new(),
        }
    }

    fn spawn(&mut self) {
        let exe = std::env::current_exe().expect("the test binary");
        let mut cmd = Command::new(exe);
        cmd.args([
            "--exact",
            "killed::kill_child_consumer",
            "--nocapture",
            "--ignored",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        self.live.push(cmd.spawn().expect("spawn a consumer"));
    }

    /// Forgets the children that exited by themselves; how many did.
    fn reap(&mut self) -> usize {
        let before = self.live.len();
        self.live
            .retain_mut(|c| c.try_wait().map(|s| s.is_none()).unwrap_or(false));
        before - self.live.len()
    }

    fn kill_one(&mut self) {
        if self.live.is_empty() {
            return;
        }
        let i = usize::try_from(rand::random::<u64>() % self.live.len() as u64).expect("idx");
        let mut child = self.live.swap_remove(i);
        let pid = i32::try_from(child.id()).expect("pid");
        child.kill().expect("SIGKILL");
        let _ = child.wait();
        self.killed.insert(pid, micros_now());
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for child in &mut self.live {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Drops the test's tables, also after a failed assertion.
struct Tables {
    pg: String,
    prefix: String,
}

impl Tables {
    /// Tables under a fresh prefix, dropped with the value: the runs table, and the records
    /// table (made once here rather than by racing children).
    async fn create(pg: &str) -> (Self, PgPool) {
        let prefix = format!("idemt_nats_{:08x}", rand::random::<u32>());
        let tables = Tables {
            pg: pg.to_owned(),
            prefix: prefix.clone(),
        };
        let pool = PgPool::connect(pg).await.expect("PostgreSQL");
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {prefix}_runs (run BIGSERIAL PRIMARY KEY, id TEXT NOT NULL, \
             fence BIGINT NOT NULL, pid INT NOT NULL, started BIGINT NOT NULL, finished BIGINT)"
        )))
        .execute(&pool)
        .await
        .expect("runs table");
        drop(store(pg, &prefix).await);
        (tables, pool)
    }
}

impl Drop for Tables {
    fn drop(&mut self) {
        let (pg, prefix) = (self.pg.clone(), self.prefix.clone());
        idem_testkit::on_a_thread_of_its_own(async move {
            if let Ok(pool) = PgPool::connect(&pg).await {
                for t in ["runs", "records", "effects"] {
                    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                        "DROP TABLE IF EXISTS {prefix}_{t}"
                    )))
                    .execute(&pool)
                    .await;
                }
            }
        });
    }
}

#[derive(Debug)]
struct Run {
    id: String,
    fence: i64,
    pid: i32,
    started: i64,
    finished: Option<i64>,
}

/// What a chaos run left: every handler run, every committed effect, every kill.
struct Chaos {
    runs: Vec<Run>,
    effects: HashMap<String, i64>,
    killed: HashMap<i32, i64>,
}

/// Publishes `N` messages, consumes them with two child processes in `mode`, killing one
/// at a random moment and starting another eight times, until every message is done and
/// settled.
async fn chaos(mode: &str) -> Option<Chaos> {
    let url = nats_url()?;
    let pg = idem_testkit::services::POSTGRES.url()?;
    let streams = Streams::new(&url, |_| {}).await;
    let (tables, pool) = Tables::create(&pg).await;
    let prefix = tables.prefix.clone();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {prefix}_effects (id TEXT NOT NULL, fence BIGINT NOT NULL, \
         pid INT NOT NULL)"
    )))
    .execute(&pool)
    .await
    .expect("effects table");

    for i in 0..N {
        streams.publish(&format!("m-{i}"), Bytes::new()).await;
    }

    let mut children = Children::new(&url, &pg, &streams, &prefix, mode);
    children.spawn();
    children.spawn();
    for _ in 0..8 {
        let ms = 300 + rand::random::<u64>() % 700;
        tokio::time::sleep(Duration::from_millis(ms)).await;
        children.kill_one();
        children.spawn();
    }
    let done_ids = if mode == "plain" {
        format!("SELECT COUNT(DISTINCT id) FROM {prefix}_runs WHERE finished IS NOT NULL")
    } else {
        format!("SELECT COUNT(DISTINCT id) FROM {prefix}_effects")
    };
    tokio::time::timeout(Duration::from_secs(120), async {
        loop {
            let (done,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(done_ids.clone()))
                .fetch_one(&pool)
                .await
                .expect("count");
            if usize::try_from(done).is_ok_and(|d| d == N) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await
    .expect("every message handled within two minutes");
    // Let the survivors settle what they hold, then stop them.
    streams.wait_settled(DURABLE).await;
    let killed = children.killed.clone();
    drop(children);

    let rows: Vec<(String, i64, i32, i64, Option<i64>)> = sqlx::query_as(sqlx::AssertSqlSafe(
        format!("SELECT id, fence, pid, started, finished FROM {prefix}_runs ORDER BY id, fence"),
    ))
    .fetch_all(&pool)
    .await
    .expect("runs");
    let runs = rows
        .into_iter()
        .map(|(id, fence, pid, started, finished)| Run {
            id,
            fence,
            pid,
            started,
            finished,
        })
        .collect();
    let effects: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT id, COUNT(*) FROM {prefix}_effects GROUP BY id"
    )))
    .fetch_all(&pool)
    .await
    .expect("effects");
    Some(Chaos {
        runs,
        effects: effects.into_iter().collect(),
        killed,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_killed_mid_message_never_run_an_id_twice_within_a_lease() {
    let Some(Chaos { runs, killed, .. }) = chaos("plain").await else {
        return;
    };
    let mut by_id: HashMap<&str, Vec<&Run>> = HashMap::new();
    for r in &runs {
        by_id.entry(r.id.as_str()).or_default().push(r);
    }
    assert_eq!(by_id.len(), N, "every id ran");
    let lease = i64::try_from(LEASE.as_micros()).expect("fits");
    let slack = 200_000; // between the claim and the run's first statement
    let mut again = 0;
    let mut again_after_finish = 0;
    for (id, runs) in &by_id {
        assert!(
            runs.iter().any(|r| r.finished.is_some()),
            "{id}: no run finished"
        );
        for pair in runs.windows(2) {
            let (first, second) = (pair[0], pair[1]);
            again += 1;
            assert!(
                first.fence < second.fence,
                "{id}: a fence ran twice: {runs:?}"
            );
            let killed_at = killed.get(&first.pid).unwrap_or_else(|| {
                panic!("{id} ran again though its first run's process was not killed: {runs:?}")
            });
            assert!(
                second.started > *killed_at,
                "{id}: the second run started before the first one's process died: {runs:?}"
            );
            assert!(
                second.started + slack >= first.started + lease,
                "{id}: taken over within the lease: {runs:?}"
            );
            if first.finished.is_some() {
                // Killed after the handler's work, before its result was stored: the
                // at-least-once window of plain mode.
                again_after_finish += 1;
            }
        }
    }
    eprintln!(
        "plain: {N} ids, {} runs, {} kills: {again} re-runs after a kill, \
         {again_after_finish} of them after the killed run had finished its work (plain \
         mode's at-least-once window)",
        runs.len(),
        killed.len()
    );
    assert!(!killed.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_killed_mid_message_leave_one_effect_per_id_in_inbox_mode() {
    let Some(Chaos {
        runs,
        effects,
        killed,
    }) = chaos("inbox").await
    else {
        return;
    };
    assert_eq!(effects.len(), N, "every id has its effect");
    for (id, n) in &effects {
        assert_eq!(*n, 1, "{id}: one effect, however often it ran");
    }
    eprintln!(
        "inbox: {N} ids, {} runs, {} kills: {} runs rolled back",
        runs.len(),
        killed.len(),
        runs.len() - N
    );
    assert!(!killed.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_crashes_its_consumer_ends_in_the_dead_letter() {
    let Some(url) = nats_url() else { return };
    let Some(pg) = idem_testkit::services::POSTGRES.url() else {
        return;
    };
    let streams = Streams::new(&url, |_| {}).await;
    let (tables, pool) = Tables::create(&pg).await;
    let prefix = tables.prefix.clone();
    streams
        .publish("crash-1", Bytes::from_static(b"crash"))
        .await;
    for i in 0..10 {
        streams.publish(&format!("ok-{i}"), Bytes::new()).await;
    }
    let mut children = Children::new(&url, &pg, &streams, &prefix, "crash");
    // One consumer at a time, started again whenever the message crashed it.
    let mut crashes = 0;
    tokio::time::timeout(Duration::from_secs(120), async {
        loop {
            crashes += children.reap();
            if children.live.is_empty() {
                children.spawn();
            }
            if !streams.dead_letters().await.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await
    .expect("the crashing message dead-lettered within two minutes");
    streams.wait_settled(DURABLE).await;
    drop(children);

    let dead = streams.dead_letters().await;
    assert_eq!(dead.len(), 1);
    assert_eq!(header(&dead[0], MSG_ID_HEADER), Some("crash-1"));
    assert_eq!(header(&dead[0], REASON_HEADER), Some("attempts_exhausted"));
    let attempts = CRASH_ATTEMPTS.to_string();
    let deliveries = (CRASH_ATTEMPTS + 1).to_string();
    assert_eq!(
        header(&dead[0], DELIVERIES_HEADER),
        Some(deliveries.as_str()),
        "dead-lettered on the delivery after the last allowed, as the server counts"
    );
    let runs: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT id, COUNT(*) FROM {prefix}_runs GROUP BY id"
    )))
    .fetch_all(&pool)
    .await
    .expect("runs");
    let runs: HashMap<String, i64> = runs.into_iter().collect();
    assert_eq!(
        runs.get("crash-1").map(i64::to_string).as_deref(),
        Some(attempts.as_str()),
        "it ran once per allowed delivery"
    );
    for i in 0..10 {
        assert!(runs.contains_key(&format!("ok-{i}")), "ok-{i} ran");
    }
    assert!(crashes >= 1, "the message crashed its consumer");
}
