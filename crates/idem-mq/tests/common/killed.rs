//! Consumers killed with SIGKILL between claim and ack, on any broker: the test binary runs
//! itself as the consumer processes (each suite's `killed::kill_child_consumer`, ignored, which
//! does nothing without its environment), and every run of a handler is logged in PostgreSQL
//! on a connection of its own, so that runs cut off by a kill are seen too.

// Each suite uses a part of it.
#![allow(dead_code)]

use std::collections::HashMap;
use std::future::Future;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem::{PostgresOptions, PostgresStore};
use idem_mq::inbox::{Inbox, inbox_fn};
use idem_mq::{Consumer, Failure, Message, Source};
use sqlx::PgPool;

const ENV_URL: &str = "IDEM_KILLED_CHILD_URL";
const ENV_PG: &str = "IDEM_KILLED_CHILD_PG";
const ENV_NAME: &str = "IDEM_KILLED_CHILD_NAME";
const ENV_TABLES: &str = "IDEM_KILLED_CHILD_TABLES";
const ENV_MODE: &str = "IDEM_KILLED_CHILD_MODE";
/// The records' lease: a killed attempt's key is taken over this long after its claim at
/// the earliest.
pub(crate) const LEASE: Duration = Duration::from_secs(2);
const CONCURRENCY: usize = 4;
/// Messages per chaos run.
pub(crate) const N: usize = 400;
/// The consumer's `max_attempts` in the crash-loop test.
pub(crate) const CRASH_ATTEMPTS: u32 = 3;

/// What a child process was started with.
pub(crate) struct ChildEnv {
    /// The broker's URL.
    pub(crate) url: String,
    pg: String,
    /// The stream or queue.
    pub(crate) name: String,
    tables: String,
    mode: String,
}

impl ChildEnv {
    /// The child's task, or `None` when the test runs without it (not as a child).
    pub(crate) fn from_env() -> Option<Self> {
        let var = |k| std::env::var(k).ok();
        Some(Self {
            url: var(ENV_URL)?,
            pg: var(ENV_PG)?,
            name: var(ENV_NAME)?,
            tables: var(ENV_TABLES)?,
            mode: var(ENV_MODE)?,
        })
    }

    /// In the crash loop one message at a time: every message a crashing process holds has
    /// its delivery counted, and the bystanders would exhaust their attempts too.
    pub(crate) fn crash(&self) -> bool {
        self.mode == "crash"
    }

    /// Handlers at once (and the prefetch a source should take).
    pub(crate) fn concurrency(&self) -> usize {
        if self.crash() { 1 } else { CONCURRENCY }
    }
}

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

/// A consumer process: consumes `source` in the child's mode until it is killed.
pub(crate) async fn run_child<Src: Source>(env: ChildEnv, source: Src) {
    let store = store(&env.pg, &env.tables).await;
    let inbox_store = store.clone();
    let pool = store.pool().clone();
    let crash = env.crash();
    let consumer = Consumer::new(store)
        .concurrency(env.concurrency())
        .lease(LEASE)
        .max_attempts(if crash { CRASH_ATTEMPTS } else { 150 })
        .wait_in_flight(Duration::from_millis(300))
        .backoff(Duration::from_millis(100), Duration::from_secs(1));
    let pid = i32::try_from(std::process::id()).expect("pid");
    let runs = format!("{}_runs", env.tables);
    let effects = format!("{}_effects", env.tables);
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
    match env.mode.as_str() {
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
pub(crate) struct Children {
    env: Vec<(&'static str, String)>,
    pub(crate) live: Vec<Child>,
    /// Pid and when it was killed (micros since the epoch).
    pub(crate) killed: HashMap<i32, i64>,
}

impl Children {
    /// None running yet; each will consume `name` on the broker at `url` in `mode`, its
    /// tables named by `prefix`.
    pub(crate) fn new(url: &str, pg: &str, name: &str, prefix: &str, mode: &str) -> Self {
        Self {
            env: vec![
                (ENV_URL, url.to_owned()),
                (ENV_PG, pg.to_owned()),
                (ENV_NAME, name.to_owned()),
                (ENV_TABLES, prefix.to_owned()),
                (ENV_MODE, mode.to_owned()),
            ],
            live: Vec::new(),
            killed: HashMap::new(),
        }
    }

    pub(crate) fn spawn(&mut self) {
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
    pub(crate) fn reap(&mut self) -> usize {
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
pub(crate) struct Tables {
    pg: String,
    pub(crate) prefix: String,
}

impl Tables {
    /// Tables under a fresh prefix, dropped with the value: the runs and effects tables, and
    /// the records table (made once here rather than by racing children).
    pub(crate) async fn create(pg: &str) -> (Self, PgPool) {
        let prefix = format!("idemt_killed_{:08x}", rand::random::<u32>());
        let tables = Tables {
            pg: pg.to_owned(),
            prefix: prefix.clone(),
        };
        let pool = PgPool::connect(pg).await.expect("PostgreSQL");
        for ddl in [
            format!(
                "CREATE TABLE {prefix}_runs (run BIGSERIAL PRIMARY KEY, id TEXT NOT NULL, \
                 fence BIGINT NOT NULL, pid INT NOT NULL, started BIGINT NOT NULL, \
                 finished BIGINT)"
            ),
            format!(
                "CREATE TABLE {prefix}_effects (id TEXT NOT NULL, fence BIGINT NOT NULL, \
                 pid INT NOT NULL)"
            ),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(ddl))
                .execute(&pool)
                .await
                .expect("a test table");
        }
        drop(store(pg, &prefix).await);
        (tables, pool)
    }

    /// How many runs each id had.
    pub(crate) async fn runs_per_id(&self, pool: &PgPool) -> HashMap<String, i64> {
        let runs: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT id, COUNT(*) FROM {}_runs GROUP BY id",
            self.prefix
        )))
        .fetch_all(pool)
        .await
        .expect("runs");
        runs.into_iter().collect()
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
pub(crate) struct Run {
    id: String,
    fence: i64,
    pid: i32,
    started: i64,
    finished: Option<i64>,
}

/// What a chaos run left: every handler run, every committed effect, every kill.
pub(crate) struct Chaos {
    runs: Vec<Run>,
    effects: HashMap<String, i64>,
    killed: HashMap<i32, i64>,
}

/// A broker's side of a chaos run.
pub(crate) trait Broker {
    /// The URL the children connect to.
    fn url(&self) -> &str;
    /// The stream or queue the children consume.
    fn name(&self) -> &str;
    /// Publishes a message under id `id`.
    fn publish(&self, id: &str, payload: &[u8]) -> impl Future<Output = ()>;
    /// Waits until the children's consumer has nothing read and unsettled.
    fn wait_settled(&self) -> impl Future<Output = ()>;
}

/// Publishes [`N`] messages (and the ids in `twice` a second time), consumes them with two
/// child processes in `mode`, killing one at a random moment and starting another eight
/// times, until every message is done and settled.
pub(crate) async fn chaos(broker: &impl Broker, pg: &str, mode: &str, twice: &[usize]) -> Chaos {
    let (tables, pool) = Tables::create(pg).await;
    let prefix = tables.prefix.clone();
    for i in 0..N {
        broker.publish(&format!("m-{i}"), b"").await;
    }
    for &i in twice {
        broker.publish(&format!("m-{i}"), b"").await;
    }
    let mut children = Children::new(broker.url(), pg, broker.name(), &prefix, mode);
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
    broker.wait_settled().await;
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
    Chaos {
        runs,
        effects: effects.into_iter().collect(),
        killed,
    }
}

/// Plain mode: every id ran and finished; an id ran again only after the process of its
/// previous run was killed, with a higher fence, and not within the lease.
pub(crate) fn assert_plain(chaos: &Chaos) {
    let Chaos { runs, killed, .. } = chaos;
    let mut by_id: HashMap<&str, Vec<&Run>> = HashMap::new();
    for r in runs {
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

/// Inbox mode: one committed effect per id, however often it ran.
pub(crate) fn assert_inbox(chaos: &Chaos) {
    let Chaos {
        runs,
        effects,
        killed,
    } = chaos;
    assert_eq!(effects.len(), N, "every id has its effect");
    for (id, n) in effects {
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

/// Runs one child at a time in crash mode, starting another whenever the message crashed the
/// last, until `dead_lettered` says the crashing message reached the dead letter; then waits
/// for the rest to settle. How many times a child crashed.
pub(crate) async fn crash_loop<F: Future<Output = bool>>(
    broker: &impl Broker,
    pg: &str,
    tables: &Tables,
    mut dead_lettered: impl FnMut() -> F,
) -> usize {
    let mut children = Children::new(broker.url(), pg, broker.name(), &tables.prefix, "crash");
    let mut crashes = 0;
    tokio::time::timeout(Duration::from_secs(120), async {
        loop {
            crashes += children.reap();
            if children.live.is_empty() {
                children.spawn();
            }
            if dead_lettered().await {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await
    .expect("the crashing message dead-lettered within two minutes");
    broker.wait_settled().await;
    crashes
}
