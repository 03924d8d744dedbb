//! A consumer killed with SIGKILL and restarted, over hundreds of messages.

use super::*;

/// The child reads its task from this variable (JSON, a [`ChildTask`]).
const CHILD_ENV: &str = "IDEM_AMQP_KILL_CHILD";
const CHILD_LEASE: Duration = Duration::from_secs(1);

#[derive(serde::Serialize, serde::Deserialize)]
struct ChildTask {
    amqp: String,
    postgres: String,
    queue: String,
    /// The records table.
    records: String,
    /// One row per run of a handler, written outside any transaction.
    runs: String,
    /// Inbox mode: one row per committed effect, written in the inbox transaction. `None`
    /// for plain mode.
    effects: Option<String>,
}

type PgInboxFn = InboxFn<
    Box<
        dyn for<'t> Fn(
                &'t mut sqlx::Transaction<'static, sqlx::Postgres>,
                Message,
            ) -> BoxFuture<'t, Result<(), Failure<String>>>
            + Send
            + Sync,
    >,
>;

/// Records the start of a run: (id, fence, start, the lease's first expiry, pid).
async fn record_run(pool: &sqlx::PgPool, runs: &str, msg: &Message) -> Result<(), Failure<String>> {
    let lease = msg.lease.expect("a lease");
    let started = idem_core::Timestamp::now().as_millis();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {runs} (id, fence, started_ms, expires_ms, pid) VALUES ($1, $2, $3, $4, $5)"
    )))
    .bind(msg.message_id.clone().expect("an id"))
    .bind(i64::try_from(lease.fence).expect("fence"))
    .bind(i64::try_from(started).expect("ms"))
    .bind(i64::try_from(lease.expires_at.as_millis()).expect("ms"))
    .bind(i32::try_from(std::process::id()).expect("pid"))
    .execute(pool)
    .await
    .map(|_| ())
    .map_err(|e| Failure::Retry(e.to_string()))
}

async fn some_work() {
    tokio::time::sleep(Duration::from_millis(50 + rand::random::<u64>() % 100)).await;
}

/// The consumer the kill tests start, kill and start again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a child process of the kill tests"]
async fn kill_child() {
    let Ok(task) = std::env::var(CHILD_ENV) else {
        return;
    };
    let task: ChildTask = serde_json::from_str(&task).expect("task");
    let store = PostgresStore::connect_with(
        &task.postgres,
        PostgresOptions {
            table: task.records.clone(),
            ..PostgresOptions::default()
        },
    )
    .await
    .expect("store");
    let pool = sqlx::PgPool::connect(&task.postgres).await.expect("pool");
    // Crash-loop protection is not under test: each kill returns the deliveries in flight,
    // and each wait for a lease left by a killed run requeues, both counting as deliveries.
    let consumer = Consumer::new(store.clone())
        .max_attempts(1000)
        .lease(CHILD_LEASE)
        .concurrency(8)
        .wait_in_flight(Duration::from_millis(200))
        .backoff(Duration::from_millis(100), Duration::from_millis(500));
    let source = AmqpSource::builder(&task.amqp, &task.queue)
        .prefetch(8)
        .connect()
        .await
        .expect("source");
    let runs = task.runs.clone();
    match task.effects {
        None => {
            let handler = move |msg: Message| {
                let (pool, runs) = (pool.clone(), runs.clone());
                async move {
                    record_run(&pool, &runs, &msg).await?;
                    some_work().await;
                    Ok::<_, Failure<String>>(())
                }
            };
            consumer
                .run(source, handler, std::future::pending())
                .await
                .expect("run");
        }
        Some(effects) => {
            let handler: PgInboxFn = inbox_fn(Box::new(
                move |tx: &mut sqlx::Transaction<'static, sqlx::Postgres>, msg: Message| {
                    let (pool, runs, effects) = (pool.clone(), runs.clone(), effects.clone());
                    Box::pin(async move {
                        record_run(&pool, &runs, &msg).await?;
                        sqlx::query(sqlx::AssertSqlSafe(format!(
                            "INSERT INTO {effects} (id, fence) VALUES ($1, $2)"
                        )))
                        .bind(msg.message_id.clone().expect("an id"))
                        .bind(i64::try_from(msg.fence().expect("a fence")).expect("fence"))
                        .execute(&mut **tx)
                        .await
                        .map_err(|e| Failure::Retry(e.to_string()))?;
                        // Killed here, the effect above rolls back with the record.
                        some_work().await;
                        Ok(())
                    })
                },
            ));
            consumer
                .run(source, Inbox::new(store, handler), std::future::pending())
                .await
                .expect("run");
        }
    }
}

fn spawn_child(task: &ChildTask) -> std::process::Child {
    std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "killed::kill_child", "--nocapture", "--ignored"])
        .env(CHILD_ENV, serde_json::to_string(task).expect("json"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn the child consumer")
}

fn kill(mut child: std::process::Child) {
    // SIGKILL: no destructor runs, no connection is closed, nothing is settled.
    let _ = child.kill();
    let _ = child.wait();
}

async fn count(pool: &sqlx::PgPool, sql: String) -> i64 {
    sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql))
        .fetch_one(pool)
        .await
        .expect("count")
}

/// Publishes `N` messages, then starts a child consumer and kills it at a random moment eight
/// times, then lets one run until every id ran and the queue is empty (killing it too, and
/// starting another if its unacked deliveries came back). Returns the task (tables to check)
/// and the pool, or `None` if a service is missing.
async fn kill_and_restart(
    prefix: &str,
    inbox: bool,
    n: i64,
) -> Option<(ChildTask, sqlx::PgPool, Cleanup)> {
    let (url, queue, mut cleanup) = setup(prefix, QueueType::Quorum).await?;
    let pg = POSTGRES.url()?;
    let suffix = format!("{:012x}", rand::random::<u64>() >> 16);
    let task = ChildTask {
        amqp: url.clone(),
        postgres: pg.clone(),
        queue: queue.clone(),
        records: format!("idem_amqp_{prefix}_records_{suffix}"),
        runs: format!("idem_amqp_{prefix}_runs_{suffix}"),
        effects: inbox.then(|| format!("idem_amqp_{prefix}_effects_{suffix}")),
    };
    // Dropped at the end, or when an assertion fails.
    let companions = ["counters", "locks", "migrations"].map(|t| format!("{}_{t}", task.records));
    let tables = [Some(&task.runs), Some(&task.records), task.effects.as_ref()];
    cleanup.tables = Some((
        pg.clone(),
        tables
            .into_iter()
            .flatten()
            .chain(&companions)
            .cloned()
            .collect(),
    ));
    let pool = sqlx::PgPool::connect(&pg).await.expect("pool");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {} (id text NOT NULL, fence bigint NOT NULL, started_ms bigint NOT NULL, \
         expires_ms bigint NOT NULL, pid int NOT NULL)",
        task.runs
    )))
    .execute(&pool)
    .await
    .expect("runs table");
    if let Some(effects) = &task.effects {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {effects} (id text NOT NULL, fence bigint NOT NULL)"
        )))
        .execute(&pool)
        .await
        .expect("effects table");
    }
    // The queue must exist before the first publish.
    AmqpSource::connect(&url, &queue)
        .await
        .expect("declare")
        .shutdown()
        .await;
    let publisher = AmqpPublisher::connect(&url).await.expect("publisher");
    for i in 0..n {
        publisher
            .publish_once(
                "",
                &queue,
                &format!("k-{i}"),
                b"x",
                BasicProperties::default(),
            )
            .await
            .expect("publish");
    }
    let ran = || {
        count(
            &pool,
            format!("SELECT count(DISTINCT id) FROM {}", task.runs),
        )
    };

    let runs = || count(&pool, format!("SELECT count(*) FROM {}", task.runs));
    for _ in 0..8 {
        let before = runs().await;
        let child = spawn_child(&task);
        // Killed at a random moment once it runs handlers, rather than a fixed time after its
        // start: on a loaded machine a child may take longer than that to start, and a kill
        // that lands before its first handler catches nothing.
        let started = tokio::time::Instant::now();
        while runs().await == before
            && ran().await < n
            && started.elapsed() < Duration::from_secs(10)
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(rand::random::<u64>() % 700)).await;
        kill(child);
    }
    let mut empty = false;
    for _ in 0..10 {
        let child = spawn_child(&task);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
        while !(ran().await == n && depth(&url, &queue).await == 0) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "not done within 90 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Leave time for the settlements in flight, then kill this one too: what it had not
        // acked comes back to the queue.
        tokio::time::sleep(2 * CHILD_LEASE).await;
        kill(child);
        if depth(&url, &queue).await == 0 {
            empty = true;
            break;
        }
    }
    assert!(empty, "messages were left in the queue after 10 rounds");
    assert_eq!(
        depth(&url, &format!("{queue}.dead")).await,
        0,
        "nothing was dead-lettered"
    );
    Some((task, pool, cleanup))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_killed_and_restarted_never_runs_an_id_twice_within_a_lease() {
    const N: i64 = 400;
    let Some((task, pool, _cleanup)) = kill_and_restart("kill", false, N).await else {
        return;
    };
    let rows: Vec<(String, i64, i64, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT id, fence, started_ms, expires_ms FROM {} ORDER BY id, fence",
        task.runs
    )))
    .fetch_all(&pool)
    .await
    .expect("runs");
    let mut by_id: HashMap<String, Vec<(i64, i64, i64)>> = HashMap::new();
    for (id, fence, started, expires) in rows {
        by_id.entry(id).or_default().push((fence, started, expires));
    }
    assert_eq!(i64::try_from(by_id.len()).ok(), Some(N), "every id ran");
    let mut again = 0;
    for (id, runs) in &by_id {
        for pair in runs.windows(2) {
            let ((f1, _, expires1), (f2, started2, _)) = (pair[0], pair[1]);
            assert!(f2 > f1, "{id}: two runs under one fence: {runs:?}");
            // The second run's claim came after the first lease ran out (the same clock: one
            // machine), and its start after its claim.
            assert!(
                started2 >= expires1,
                "{id}: a second run started within the first run's lease: {runs:?}"
            );
        }
        if runs.len() > 1 {
            again += 1;
        }
    }
    // Plain mode is at least once past the lease: a run killed before its result was stored
    // runs again once its lease has run out (never sooner, as asserted above).
    eprintln!("plain mode: {again} of {N} ids ran again after their lease ran out");
    assert!(
        again > 0,
        "no kill caught a handler between claim and ack: the test did not test anything"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_mode_consumer_killed_and_restarted_leaves_each_effect_exactly_once() {
    const N: i64 = 400;
    let Some((task, pool, _cleanup)) = kill_and_restart("inbox", true, N).await else {
        return;
    };
    let effects = task.effects.clone().expect("inbox mode");
    let total = count(&pool, format!("SELECT count(*) FROM {effects}")).await;
    let distinct = count(&pool, format!("SELECT count(DISTINCT id) FROM {effects}")).await;
    let runs = count(&pool, format!("SELECT count(*) FROM {}", task.runs)).await;
    assert_eq!(distinct, N, "every id has its effect");
    assert_eq!(total, N, "no id has two effects");
    assert!(
        runs > N,
        "no kill caught a handler between its write and its commit: the test did not test anything"
    );
    eprintln!("inbox mode: {runs} runs for {N} ids, one effect each");
}
