//! The NATS JetStream adapter against a real server: each test on its own streams, deleted at
//! the end. Skipped (with a note) when no NATS answers; a failure under `CI=true`.

#![cfg(feature = "nats")]

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use bytes::Bytes;
use idem_mq::nats::{
    DELIVERIES_HEADER, DETAIL_HEADER, DeadLetterTarget, MSG_ID_HEADER, NatsDelivery, NatsSource,
    REASON_HEADER, SEQUENCE_HEADER, STREAM_HEADER, SUBJECT_HEADER, publish_once,
};
use idem_mq::{
    Consumer, DeadLetter, Delivery, Disposition, Failure, Horizon, Message, MqError, Reason, Source,
};
use idem_testkit::{PATIENCE, within};

fn nats_url() -> Option<String> {
    idem_testkit::services::NATS.url()
}

/// What a test handler's run returns.
type Run = std::pin::Pin<Box<dyn Future<Output = Result<(), Failure<String>>> + Send>>;

/// A handler that records each run in `runs` and takes `takes` to finish.
fn timed_handler(runs: &Arc<Runs>, takes: Duration) -> impl Fn(Message) -> Run + use<> {
    let runs = Arc::clone(runs);
    move |msg: Message| {
        let runs = Arc::clone(&runs);
        Box::pin(async move {
            let _run = runs.start(msg.message_id.as_deref().unwrap_or(""));
            tokio::time::sleep(takes).await;
            Ok::<_, Failure<String>>(())
        })
    }
}

/// A stream `name` on `<name>.in`, and its dead-letter stream `<name>_DL` on `<name>.dead`;
/// both deleted when dropped.
struct Streams {
    url: String,
    name: String,
    js: jetstream::Context,
}

/// Creates a stream, trying again a few times: a 2.9 server that deletes an account's last
/// stream while another is created can fail the creation (its storage directory is removed
/// under it), and the tests create and delete streams in parallel.
async fn create_stream(js: &jetstream::Context, config: stream::Config) {
    let mut tries = 0;
    loop {
        match js.create_stream(config.clone()).await {
            Ok(_) => return,
            Err(e) if tries < 5 => {
                tries += 1;
                eprintln!("creating stream {} failed, trying again: {e}", config.name);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("create stream {}: {e}", config.name),
        }
    }
}

impl Streams {
    /// Waits (a minute at most) until the durable consumer `durable` has nothing pending
    /// and nothing unacknowledged.
    async fn wait_settled(&self, durable: &str) {
        tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                let info = self
                    .js
                    .get_stream(&self.name)
                    .await
                    .expect("stream")
                    .consumer_info(durable)
                    .await
                    .expect("info");
                if info.num_pending == 0 && info.num_ack_pending == 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
        .await
        .expect("every message settled");
    }

    async fn new(url: &str, configure: impl FnOnce(&mut stream::Config)) -> Self {
        let name = format!("IDEMT_{:016x}", rand::random::<u64>());
        let client = async_nats::connect(url).await.expect("connect to NATS");
        let js = jetstream::new(client);
        let mut config = stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.in")],
            max_age: Duration::from_secs(3600),
            ..Default::default()
        };
        configure(&mut config);
        create_stream(&js, config).await;
        create_stream(
            &js,
            stream::Config {
                name: format!("{name}_DL"),
                subjects: vec![format!("{name}.dead")],
                max_age: Duration::from_secs(3600),
                ..Default::default()
            },
        )
        .await;
        Self {
            url: url.to_owned(),
            name,
            js,
        }
    }

    fn subject(&self) -> String {
        format!("{}.in", self.name)
    }

    /// The dead-lettered copies stored so far, in order.
    async fn dead_letters(&self) -> Vec<jetstream::message::StreamMessage> {
        let dl = self
            .js
            .get_stream(format!("{}_DL", self.name))
            .await
            .expect("the dead-letter stream");
        let last = dl.get_info().await.expect("info").state.last_sequence;
        let mut out = Vec::new();
        for seq in 1..=last {
            if let Ok(m) = dl.get_raw_message(seq).await {
                out.push(m);
            }
        }
        out
    }
}

impl Drop for Streams {
    fn drop(&mut self) {
        let url = self.url.clone();
        let names = [self.name.clone(), format!("{}_DL", self.name)];
        // Drop cannot await; a thread with its own runtime deletes the streams, even after a
        // failed assertion.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                if let Ok(client) = async_nats::connect(url).await {
                    let js = jetstream::new(client);
                    for name in names {
                        let _ = js.delete_stream(name).await;
                    }
                }
            });
        })
        .join();
    }
}

async fn next(source: &mut NatsSource) -> NatsDelivery {
    within("a delivery", async {
        loop {
            match source.next().await {
                Some(Ok(d)) => return d,
                Some(Err(e)) => eprintln!("next: {e}"),
                None => panic!("the source closed"),
            }
        }
    })
    .await
}

fn header<'a>(m: &'a jetstream::message::StreamMessage, name: &str) -> Option<&'a str> {
    m.headers.get(name).map(|v| v.as_str())
}

#[tokio::test]
async fn adapter_settles_ack_requeue_and_dead_letter() {
    let Some(url) = nats_url() else { return };
    let streams = Streams::new(&url, |_| {}).await;
    let js = &streams.js;
    let subject = streams.subject();

    let first = publish_once(js, subject.clone(), "k-a", Bytes::from_static(b"a"))
        .await
        .expect("publish a");
    assert!(!first.duplicate);
    let again = publish_once(js, subject.clone(), "k-a", Bytes::from_static(b"a"))
        .await
        .expect("publish a again");
    assert!(again.duplicate, "a re-publish within the window is dropped");
    assert_eq!(again.sequence, first.sequence);
    publish_once(js, subject.clone(), "k-b", Bytes::from_static(b"b"))
        .await
        .expect("publish b");
    publish_once(js, subject.clone(), "k-c", Bytes::from_static(b"c"))
        .await
        .expect("publish c");
    js.publish(subject.clone(), Bytes::from_static(b"no key"))
        .await
        .expect("publish without key")
        .await
        .expect("ack");
    assert!(matches!(
        publish_once(js, subject.clone(), "", Bytes::new()).await,
        Err(MqError::Config(_))
    ));

    let mut source = NatsSource::builder(&streams.name, "smoke")
        .ack_wait(Duration::from_secs(30))
        .max_deliver(10)
        .max_requeue_delay(Duration::from_secs(60))
        .connect(&url)
        .await
        .expect("source");
    // Each durable consumer of a stream keeps records of its own.
    assert_eq!(source.name(), format!("{}.smoke", streams.name));
    assert_eq!(source.ack_wait(), Some(Duration::from_secs(30)));
    assert_eq!(
        source.redelivery_horizon(),
        Horizon::Bounded(Duration::from_secs(9 * 90))
    );

    let a = next(&mut source).await;
    assert_eq!(a.message_id(), Some("k-a"));
    assert_eq!(a.payload(), b"a");
    assert_eq!(a.delivery_count(), Some(1));
    assert_eq!(a.header("Nats-Msg-Id").as_deref(), Some("k-a"));
    assert_eq!(a.header("Absent"), None);
    assert_eq!(
        a.header("bad:name"),
        None,
        "an unrepresentable name is no panic"
    );
    a.in_progress().await.expect("progress");
    a.settle(Disposition::Requeue {
        delay: Duration::from_millis(300),
    })
    .await
    .expect("requeue a");

    let b = next(&mut source).await;
    assert_eq!(b.message_id(), Some("k-b"));
    b.settle(Disposition::Ack).await.expect("ack b");

    let c = next(&mut source).await;
    assert_eq!(c.message_id(), Some("k-c"));
    let c_seq = c.stream_sequence().expect("sequence");
    c.settle(Disposition::DeadLetter(DeadLetter {
        reason: Reason::Permanent,
        detail: "out of stock\r\nsecond line".to_owned(),
    }))
    .await
    .expect("dead-letter c");

    let none = next(&mut source).await;
    assert_eq!(none.message_id(), None);
    none.settle(Disposition::DeadLetter(DeadLetter {
        reason: Reason::NoKey,
        detail: "no Nats-Msg-Id".to_owned(),
    }))
    .await
    .expect("dead-letter the keyless message");

    let a = next(&mut source).await;
    assert_eq!(
        a.message_id(),
        Some("k-a"),
        "the requeued message comes back"
    );
    assert_eq!(a.delivery_count(), Some(2), "the server counts deliveries");
    a.settle(Disposition::Ack).await.expect("ack a");

    let dead = streams.dead_letters().await;
    assert_eq!(dead.len(), 2);
    assert_eq!(header(&dead[0], REASON_HEADER), Some("permanent"));
    assert_eq!(
        header(&dead[0], DETAIL_HEADER),
        Some("out of stock  second line")
    );
    assert_eq!(header(&dead[0], MSG_ID_HEADER), Some("k-c"));
    assert_eq!(header(&dead[0], STREAM_HEADER), Some(streams.name.as_str()));
    assert_eq!(header(&dead[0], SUBJECT_HEADER), Some(subject.as_str()));
    assert_eq!(
        header(&dead[0], SEQUENCE_HEADER),
        Some(c_seq.to_string().as_str())
    );
    assert_eq!(header(&dead[0], DELIVERIES_HEADER), Some("1"));
    assert_eq!(dead[0].payload.as_ref(), b"c");
    assert_eq!(header(&dead[1], REASON_HEADER), Some("no_key"));
    assert_eq!(header(&dead[1], MSG_ID_HEADER), None);
    assert_eq!(dead[1].payload.as_ref(), b"no key");

    // Everything settled: nothing pending, nothing waiting for an ack.
    let info = streams
        .js
        .get_stream(&streams.name)
        .await
        .expect("stream")
        .consumer_info("smoke")
        .await
        .expect("consumer info");
    assert_eq!(info.num_ack_pending, 0);
    assert_eq!(info.num_pending, 0);

    source.close().await;
    assert!(source.next().await.is_none(), "a closed source ends");
}

#[tokio::test]
async fn pulling_resumes_after_the_consumer_is_deleted() {
    let Some(url) = nats_url() else { return };
    let streams = Streams::new(&url, |_| {}).await;
    let subject = streams.subject();
    let mut source = NatsSource::builder(&streams.name, "resume")
        .retry_backoff(Duration::from_millis(50), Duration::from_millis(500))
        .connect(&url)
        .await
        .expect("source");
    publish_once(&streams.js, subject.clone(), "one", Bytes::new())
        .await
        .expect("publish");
    next(&mut source)
        .await
        .settle(Disposition::Ack)
        .await
        .expect("ack");

    streams
        .js
        .get_stream(&streams.name)
        .await
        .expect("stream")
        .delete_consumer("resume")
        .await
        .expect("delete the consumer");
    publish_once(&streams.js, subject.clone(), "two", Bytes::new())
        .await
        .expect("publish");
    // The source notices, creates the consumer again (from the start of the stream: "one"
    // comes back, which is what the records are for), and goes on.
    let mut seen = Vec::new();
    while !seen.iter().any(|k| k == "two") {
        let d = next(&mut source).await;
        seen.push(d.message_id().expect("key").to_owned());
        d.settle(Disposition::Ack).await.expect("ack");
    }
    assert!(seen.contains(&"two".to_owned()));
}

#[tokio::test]
async fn a_dead_letter_subject_read_back_or_not_stored_is_refused() {
    let Some(url) = nats_url() else { return };
    let streams = Streams::new(&url, |c| {
        c.subjects.push(format!("{}.other.>", c.name));
    })
    .await;
    let own = format!("{}.other.dead", streams.name);
    let err = NatsSource::builder(&streams.name, "dl")
        .dead_letter_subject(own.clone())
        .connect(&url)
        .await
        .expect_err("read back");
    assert!(matches!(err, MqError::Config(_)), "{err}");
    // Filtered away from the consumer, it is fine (stored in the same stream).
    NatsSource::builder(&streams.name, "dl-filtered")
        .filter_subject(streams.subject())
        .dead_letter_subject(own)
        .connect(&url)
        .await
        .expect("a filtered consumer does not read its dead letters");
    let err = NatsSource::builder(&streams.name, "dl2")
        .dead_letter_subject(format!("{}.nowhere", streams.name))
        .connect(&url)
        .await
        .expect_err("not stored");
    assert!(matches!(err, MqError::Config(_)), "{err}");
    NatsSource::builder(&streams.name, "dl3")
        .dead_letter(DeadLetterTarget::TermOnly)
        .connect(&url)
        .await
        .expect("term only needs no stream");
}

#[tokio::test]
async fn a_core_dead_letter_subject_gets_the_copy_and_term_only_gets_none() {
    let Some(url) = nats_url() else { return };
    let streams = Streams::new(&url, |_| {}).await;
    let core = format!("{}.core-dead", streams.name);
    let mut watcher = streams
        .js
        .client()
        .subscribe(core.clone())
        .await
        .expect("subscribe");
    streams.js.client().flush().await.expect("flush");
    for key in ["to-core", "term-only"] {
        publish_once(
            &streams.js,
            streams.subject(),
            key,
            Bytes::from_static(b"x"),
        )
        .await
        .expect("publish");
    }
    let dead = |reason| {
        Disposition::DeadLetter(DeadLetter {
            reason,
            detail: "gave up".to_owned(),
        })
    };
    let mut to_core = NatsSource::builder(&streams.name, "shared-dl")
        .dead_letter(DeadLetterTarget::Subject(core))
        .connect(&url)
        .await
        .expect("source");
    let d = next(&mut to_core).await;
    assert_eq!(d.message_id(), Some("to-core"));
    d.settle(dead(Reason::Mismatch)).await.expect("dead-letter");
    let copy = within("the copy", futures_util::StreamExt::next(&mut watcher))
        .await
        .expect("a message");
    let headers = copy.headers.expect("headers");
    assert_eq!(
        headers.get(REASON_HEADER).map(|v| v.as_str()),
        Some("mismatch")
    );
    assert_eq!(
        headers.get(MSG_ID_HEADER).map(|v| v.as_str()),
        Some("to-core")
    );
    to_core.close().await;

    let mut term_only = NatsSource::builder(&streams.name, "shared-dl")
        .dead_letter(DeadLetterTarget::TermOnly)
        .connect(&url)
        .await
        .expect("source");
    let d = next(&mut term_only).await;
    assert_eq!(d.message_id(), Some("term-only"));
    d.settle(dead(Reason::Permanent)).await.expect("term");
    assert!(streams.dead_letters().await.is_empty(), "nothing stored");
    assert_all_settled(&streams, "shared-dl").await;
}

#[tokio::test]
async fn a_bound_source_reports_the_consumer_s_own_timers() {
    let Some(url) = nats_url() else { return };
    let streams = Streams::new(&url, |_| {}).await;
    let err = NatsSource::builder(&streams.name, "existing")
        .bind()
        .connect(&url)
        .await
        .expect_err("nothing to bind to");
    assert!(matches!(err, MqError::Broker { .. }), "{err}");
    streams
        .js
        .get_stream(&streams.name)
        .await
        .expect("stream")
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("existing".to_owned()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_secs(7),
            max_deliver: 3,
            backoff: vec![Duration::from_secs(1), Duration::from_secs(10)],
            ..Default::default()
        })
        .await
        .expect("create the consumer");
    let source = NatsSource::builder(&streams.name, "existing")
        .bind()
        // Ignored when binding: the consumer's own settings apply.
        .ack_wait(Duration::from_secs(3))
        .max_deliver(-1)
        .max_requeue_delay(Duration::from_secs(20))
        .connect(&url)
        .await
        .expect("bind");
    assert_eq!(source.consumer_name(), "existing");
    // With a backoff the server's ack wait is its first step.
    assert_eq!(source.ack_wait(), Some(Duration::from_secs(1)));
    // Two redeliveries at most, each after at most the longest backoff step plus the longest
    // requeue delay.
    assert_eq!(
        source.redelivery_horizon(),
        Horizon::Bounded(Duration::from_secs(2 * (10 + 20)))
    );
}

#[tokio::test]
async fn progress_holds_a_message_and_its_absence_lets_it_go() {
    let Some(url) = nats_url() else { return };
    let streams = Streams::new(&url, |_| {}).await;
    let ack_wait = Duration::from_secs(2);
    let open = || async {
        NatsSource::builder(&streams.name, "shared")
            .ack_wait(ack_wait)
            .connect(&url)
            .await
            .expect("source")
    };
    let mut first = open().await;
    let mut second = open().await;
    publish_once(&streams.js, streams.subject(), "slow", Bytes::new())
        .await
        .expect("publish");
    let held = next(&mut first).await;
    assert_eq!(held.delivery_count(), Some(1));

    // Three ack waits with progress every tenth of one: the second instance gets nothing.
    let progress = async {
        for _ in 0..30 {
            held.in_progress().await.expect("progress");
            tokio::time::sleep(ack_wait / 10).await;
        }
    };
    let stolen = tokio::time::timeout(ack_wait * 3, next(&mut second));
    let ((), stolen) = tokio::join!(progress, stolen);
    assert!(
        stolen.is_err(),
        "a message with progress reported is not redelivered"
    );

    // No more progress: after ack_wait the server gives it to whoever pulls.
    let again = next(&mut second).await;
    assert_eq!(again.message_id(), Some("slow"));
    // At least the second delivery: the first instance's pull may have taken a redelivery
    // into its buffer (unread there, it timed out again).
    assert!(
        again.delivery_count() >= Some(2),
        "{:?}",
        again.delivery_count()
    );
    again.settle(Disposition::Ack).await.expect("ack");
    // The stale delivery's ack is harmless.
    held.settle(Disposition::Ack).await.expect("late ack");
}

/// A `nats-server` of the test's own, on a free port, killed when dropped.
struct OwnServer {
    child: std::process::Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl OwnServer {
    const BINARY: &'static str = "/usr/sbin/nats-server";

    fn start() -> Option<Self> {
        if !std::path::Path::new(Self::BINARY).exists() {
            eprintln!("server restart test skipped: no {}", Self::BINARY);
            return None;
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .expect("a free port")
            .local_addr()
            .expect("addr")
            .port();
        let dir = tempfile::tempdir().expect("tempdir");
        let mut server = Self {
            child: Self::spawn(port, dir.path()),
            port,
            dir,
        };
        server.wait_up();
        Some(server)
    }

    fn spawn(port: u16, dir: &std::path::Path) -> std::process::Child {
        std::process::Command::new(Self::BINARY)
            .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
            .arg(dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start nats-server")
    }

    fn wait_up(&mut self) {
        let deadline = std::time::Instant::now() + PATIENCE;
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "nats-server did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = Self::spawn(self.port, self.dir.path());
        self.wait_up();
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn pulling_goes_on_after_the_server_restarts() {
    let Some(mut server) = OwnServer::start() else {
        return;
    };
    let url = server.url();
    let client = async_nats::connect(&url).await.expect("connect");
    let js = jetstream::new(client);
    js.create_stream(stream::Config {
        name: "RESTART".to_owned(),
        subjects: vec!["RESTART.in".to_owned()],
        ..Default::default()
    })
    .await
    .expect("stream");
    let mut source = NatsSource::builder("RESTART", "survivor")
        .dead_letter(DeadLetterTarget::TermOnly)
        .retry_backoff(Duration::from_millis(50), Duration::from_secs(1))
        .connect(&url)
        .await
        .expect("source");
    publish_once(&js, "RESTART.in", "before", Bytes::new())
        .await
        .expect("publish");
    let d = next(&mut source).await;
    assert_eq!(d.message_id(), Some("before"));
    d.settle(Disposition::Ack).await.expect("ack");

    server.restart();

    // The publisher's client reconnects too; retry its publish until the server is back.
    within("publish after the restart", async {
        while publish_once(&js, "RESTART.in", "after", Bytes::new())
            .await
            .is_err()
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let d = next(&mut source).await;
    assert_eq!(d.message_id(), Some("after"));
    d.settle(Disposition::Ack)
        .await
        .expect("ack after the restart");
}

// ---------------------------------------------------------------------------------------------
// Through the consumer.

/// A [`NatsSource`] that counts each message id's deliveries and, with `progress` off, hides
/// the broker's ack timer from the consumer and swallows its progress reports (so the server
/// redelivers a message whose handler outlives `ack_wait`).
struct Observed {
    inner: NatsSource,
    deliveries: Arc<Mutex<HashMap<String, u32>>>,
    progress: bool,
}

impl Observed {
    fn new(inner: NatsSource, deliveries: &Arc<Mutex<HashMap<String, u32>>>) -> Self {
        Self {
            inner,
            deliveries: Arc::clone(deliveries),
            progress: true,
        }
    }

    fn without_progress(mut self) -> Self {
        self.progress = false;
        self
    }
}

struct ObservedDelivery {
    inner: NatsDelivery,
    progress: bool,
}

impl Source for Observed {
    type Delivery = ObservedDelivery;

    fn name(&self) -> &str {
        self.inner.name()
    }

    async fn next(&mut self) -> Option<Result<ObservedDelivery, MqError>> {
        let next = self.inner.next().await?;
        Some(next.map(|inner| {
            if let Some(id) = inner.message_id() {
                *lock(&self.deliveries).entry(id.to_owned()).or_default() += 1;
            }
            ObservedDelivery {
                inner,
                progress: self.progress,
            }
        }))
    }

    fn ack_wait(&self) -> Option<Duration> {
        if self.progress {
            self.inner.ack_wait()
        } else {
            None
        }
    }

    fn redelivery_horizon(&self) -> Horizon {
        self.inner.redelivery_horizon()
    }

    async fn close(&mut self) {
        self.inner.close().await;
    }
}

impl Delivery for ObservedDelivery {
    fn message_id(&self) -> Option<&str> {
        self.inner.message_id()
    }

    fn header(&self, name: &str) -> Option<std::borrow::Cow<'_, str>> {
        self.inner.header(name)
    }

    fn payload(&self) -> &[u8] {
        self.inner.payload()
    }

    fn delivery_count(&self) -> Option<u32> {
        self.inner.delivery_count()
    }

    async fn in_progress(&self) -> Result<(), MqError> {
        if self.progress {
            self.inner.in_progress().await
        } else {
            Ok(())
        }
    }

    async fn settle(self, how: Disposition) -> Result<(), MqError> {
        self.inner.settle(how).await
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What the handlers did: runs per id, and how many ran one id at once at most.
#[derive(Default)]
struct Runs {
    runs: Mutex<HashMap<String, u32>>,
    running: Mutex<HashMap<String, u32>>,
    most_at_once: Mutex<u32>,
}

impl Runs {
    /// Marks a run of `id` as started; the guard marks it ended, also when the run is dropped.
    fn start(self: &Arc<Self>, id: &str) -> RunGuard {
        *lock(&self.runs).entry(id.to_owned()).or_default() += 1;
        let now = {
            let mut running = lock(&self.running);
            let n = running.entry(id.to_owned()).or_default();
            *n += 1;
            *n
        };
        let mut most = lock(&self.most_at_once);
        *most = (*most).max(now);
        RunGuard {
            runs: Arc::clone(self),
            id: id.to_owned(),
        }
    }

    fn of(&self, id: &str) -> u32 {
        lock(&self.runs).get(id).copied().unwrap_or(0)
    }

    fn ids(&self) -> usize {
        lock(&self.runs).len()
    }
}

struct RunGuard {
    runs: Arc<Runs>,
    id: String,
}

impl Drop for RunGuard {
    fn drop(&mut self) {
        if let Some(n) = lock(&self.runs.running).get_mut(&self.id) {
            *n -= 1;
        }
    }
}

/// Waits (bounded by `bound`) until `done` holds, checking every 50 ms.
async fn until(bound: Duration, what: &str, mut done: impl FnMut() -> bool) {
    tokio::time::timeout(bound, async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("not within {bound:?}: {what}"));
}

/// Everything settled: nothing left for the consumer `name`, nothing waiting for an ack.
async fn assert_all_settled(streams: &Streams, name: &str) {
    let info = streams
        .js
        .get_stream(&streams.name)
        .await
        .expect("stream")
        .consumer_info(name)
        .await
        .expect("consumer info");
    assert_eq!(info.num_pending, 0, "messages left unread");
    assert_eq!(info.num_ack_pending, 0, "messages left unsettled");
}

/// A shutdown switch for [`Consumer::run`].
fn shutdown_switch() -> (Arc<tokio::sync::Notify>, impl Future<Output = ()> + Send) {
    let notify = Arc::new(tokio::sync::Notify::new());
    let waiter = Arc::clone(&notify);
    (notify, async move { waiter.notified().await })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_published_twice_run_once_per_id() {
    let Some(url) = nats_url() else { return };
    // A window this short lets the second publish of an id through to the consumer, which is
    // what a re-publish after a real two-minute window looks like.
    let streams = Streams::new(&url, |c| c.duplicate_window = Duration::from_millis(100)).await;
    const N: usize = 300;
    let twice: Vec<usize> = (0..N).filter(|i| i % 10 < 3).collect();
    for i in 0..N {
        publish_once(
            &streams.js,
            streams.subject(),
            &format!("order-{i}"),
            Bytes::from(i.to_string()),
        )
        .await
        .expect("publish");
    }
    for &i in &twice {
        let key = format!("order-{i}");
        within("the duplicate window passes", async {
            // Until the server's window for this id has passed.
            while publish_once(
                &streams.js,
                streams.subject(),
                &key,
                Bytes::from(i.to_string()),
            )
            .await
            .expect("publish again")
            .duplicate
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
    }

    let deliveries = Arc::default();
    let source = NatsSource::builder(&streams.name, "once")
        .batch(32)
        .max_deliver(20)
        .connect(&url)
        .await
        .expect("source");
    let source = Observed::new(source, &deliveries);
    let consumer = Consumer::new(idem::MemoryStore::new()).concurrency(32);
    let runs = Arc::new(Runs::default());
    let handler = timed_handler(&runs, Duration::from_millis(2));
    let (stop, shutdown) = shutdown_switch();
    let run = tokio::spawn({
        let consumer = consumer.clone();
        async move { consumer.run(source, handler, shutdown).await }
    });
    until(PATIENCE * 2, "every delivery settled", || {
        let c = consumer.counts();
        c.handled + c.replayed >= (N + twice.len()) as u64
    })
    .await;
    stop.notify_one();
    run.await.expect("task").expect("run");

    let deliveries = lock(&deliveries).clone();
    for i in 0..N {
        let id = format!("order-{i}");
        let expected = if twice.contains(&i) { 2 } else { 1 };
        assert!(
            deliveries.get(&id).copied().unwrap_or(0) >= expected,
            "{id} was delivered {:?} times, published {expected}",
            deliveries.get(&id)
        );
        assert_eq!(runs.of(&id), 1, "{id} ran once");
    }
    assert_eq!(runs.ids(), N);
    let c = consumer.counts();
    assert_eq!(c.handled, N as u64);
    assert!(c.replayed >= twice.len() as u64, "{c:?}");
    assert_eq!(*lock(&runs.most_at_once), 1);
    assert_all_settled(&streams, "once").await;
}

/// Each durable consumer of a stream sees every message: two of them (inventory and billing)
/// on one record store each run every id, rather than the second taking the first's records
/// for its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_durable_consumers_of_one_stream_each_run_every_message() {
    let Some(url) = nats_url() else { return };
    let streams = Streams::new(&url, |_| {}).await;
    const N: usize = 20;
    for i in 0..N {
        publish_once(
            &streams.js,
            streams.subject(),
            &format!("order-{i}"),
            "{}".into(),
        )
        .await
        .expect("publish");
    }
    let store = idem::MemoryStore::new();
    for name in ["inventory", "billing"] {
        let source = NatsSource::builder(&streams.name, name)
            .connect(&url)
            .await
            .expect("source");
        let consumer = Consumer::new(store.clone());
        let runs = Arc::new(Runs::default());
        let handler = timed_handler(&runs, Duration::ZERO);
        let (stop, shutdown) = shutdown_switch();
        let run = tokio::spawn({
            let consumer = consumer.clone();
            async move { consumer.run(source, handler, shutdown).await }
        });
        until(PATIENCE, "every message settled", || {
            let c = consumer.counts();
            c.handled + c.replayed >= N as u64
        })
        .await;
        stop.notify_one();
        run.await.expect("task").expect("run");
        assert_eq!(runs.ids(), N, "{name} ran every id");
        assert_eq!(
            consumer.counts().replayed,
            0,
            "{name} took no other consumer's record"
        );
    }
}

/// Two instances on one durable consumer, handlers three times longer than `ack_wait`.
async fn slow_handlers_on_two_instances(progress: bool) {
    let Some(url) = nats_url() else { return };
    let streams = Streams::new(&url, |_| {}).await;
    let name = if progress { "progress" } else { "silent" };
    const N: usize = 4;
    for i in 0..N {
        publish_once(
            &streams.js,
            streams.subject(),
            &format!("slow-{i}"),
            Bytes::new(),
        )
        .await
        .expect("publish");
    }
    // Progress goes out every third of it: a stall of over a second and a half would be needed
    // for a redelivery with progress on.
    let ack_wait = Duration::from_secs(2);
    let store = idem::MemoryStore::new();
    let deliveries = Arc::default();
    let runs = Arc::new(Runs::default());
    let mut instances = Vec::new();
    for _ in 0..2 {
        let source = NatsSource::builder(&streams.name, name)
            .ack_wait(ack_wait)
            .batch(N)
            .max_deliver(50)
            .max_requeue_delay(Duration::from_millis(500))
            .connect(&url)
            .await
            .expect("source");
        let mut source = Observed::new(source, &deliveries);
        if !progress {
            source = source.without_progress();
        }
        let consumer = Consumer::new(store.clone())
            .concurrency(N)
            .max_attempts(50)
            .wait_in_flight(Duration::from_millis(300))
            .backoff(Duration::from_millis(100), Duration::from_millis(500));
        let handler = {
            let runs = Arc::clone(&runs);
            move |msg: Message| {
                let runs = Arc::clone(&runs);
                async move {
                    let _run = runs.start(msg.message_id.as_deref().unwrap_or(""));
                    tokio::time::sleep(ack_wait * 3).await;
                    Ok::<_, Failure<String>>(())
                }
            }
        };
        let (stop, shutdown) = shutdown_switch();
        let run = tokio::spawn({
            let consumer = consumer.clone();
            async move { consumer.run(source, handler, shutdown).await }
        });
        instances.push((consumer, stop, run));
    }
    until(PATIENCE * 2, "every message handled", || {
        let handled: u64 = instances.iter().map(|(c, _, _)| c.counts().handled).sum();
        handled >= N as u64
    })
    .await;
    if !progress {
        // The redeliveries settle too (each replayed once the first run stored its result).
        until(PATIENCE * 2, "the redeliveries replayed", || {
            let replayed: u64 = instances.iter().map(|(c, _, _)| c.counts().replayed).sum();
            replayed >= 1
        })
        .await;
    }
    for (_, stop, run) in instances {
        stop.notify_one();
        run.await.expect("task").expect("run");
    }

    let deliveries = lock(&deliveries).clone();
    for i in 0..N {
        let id = format!("slow-{i}");
        assert_eq!(runs.of(&id), 1, "{id} ran once");
        let n = deliveries.get(&id).copied().unwrap_or(0);
        if progress {
            assert_eq!(n, 1, "{id}: with progress reported it is not redelivered");
        } else {
            assert!(n >= 2, "{id}: without progress it is redelivered ({n})");
        }
    }
    assert_eq!(
        *lock(&runs.most_at_once),
        1,
        "never two runs of one id at once"
    );
    assert_all_settled(&streams, name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_progress_a_slow_message_is_not_redelivered() {
    slow_handlers_on_two_instances(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_to_a_second_instance_never_runs_concurrently() {
    slow_handlers_on_two_instances(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_keyless_and_exhausted_messages_reach_the_dead_letter() {
    let Some(url) = nats_url() else { return };
    let streams = Streams::new(&url, |_| {}).await;
    let js = &streams.js;
    publish_once(
        js,
        streams.subject(),
        "poison-1",
        Bytes::from_static(b"poison"),
    )
    .await
    .expect("publish");
    publish_once(
        js,
        streams.subject(),
        "flaky-1",
        Bytes::from_static(b"flaky"),
    )
    .await
    .expect("publish");
    publish_once(js, streams.subject(), "fine-1", Bytes::from_static(b"fine"))
        .await
        .expect("publish");
    js.publish(streams.subject(), Bytes::from_static(b"anonymous"))
        .await
        .expect("publish")
        .await
        .expect("ack");

    let source = NatsSource::builder(&streams.name, "dl")
        .max_deliver(10)
        .connect(&url)
        .await
        .expect("source");
    let consumer = Consumer::new(idem::MemoryStore::new())
        .max_attempts(3)
        .backoff(Duration::from_millis(50), Duration::from_millis(200));
    let runs = Arc::new(Runs::default());
    let handler = {
        let runs = Arc::clone(&runs);
        move |msg: Message| {
            let runs = Arc::clone(&runs);
            async move {
                let _run = runs.start(msg.message_id.as_deref().unwrap_or(""));
                match &msg.payload[..] {
                    b"poison" => Err(Failure::Permanent("malformed order".to_owned())),
                    b"flaky" => Err(Failure::Retry("database down".to_owned())),
                    _ => Ok(()),
                }
            }
        }
    };
    let (stop, shutdown) = shutdown_switch();
    let run = tokio::spawn({
        let consumer = consumer.clone();
        async move { consumer.run(source, handler, shutdown).await }
    });
    until(PATIENCE * 2, "three dead letters and one handled", || {
        let c = consumer.counts();
        c.dead_lettered >= 3 && c.handled >= 1
    })
    .await;
    stop.notify_one();
    run.await.expect("task").expect("run");

    let dead = streams.dead_letters().await;
    let by_reason = |code: &str| -> Vec<&jetstream::message::StreamMessage> {
        dead.iter()
            .filter(|m| header(m, REASON_HEADER) == Some(code))
            .collect()
    };
    assert_eq!(dead.len(), 3, "poison, keyless, exhausted");
    let poison = by_reason("permanent");
    assert_eq!(poison.len(), 1);
    assert_eq!(header(poison[0], MSG_ID_HEADER), Some("poison-1"));
    assert!(header(poison[0], DETAIL_HEADER).is_some_and(|d| d.contains("malformed order")));
    let keyless = by_reason("no_key");
    assert_eq!(keyless.len(), 1);
    assert_eq!(keyless[0].payload.as_ref(), b"anonymous");
    let exhausted = by_reason("attempts_exhausted");
    assert_eq!(exhausted.len(), 1);
    assert_eq!(header(exhausted[0], MSG_ID_HEADER), Some("flaky-1"));
    assert_eq!(
        header(exhausted[0], DELIVERIES_HEADER),
        Some("3"),
        "the server's count"
    );
    assert_eq!(runs.of("poison-1"), 1);
    assert_eq!(
        runs.of("flaky-1"),
        3,
        "one run per delivery, up to max_attempts"
    );
    assert_eq!(runs.of("fine-1"), 1);
    assert_eq!(runs.of(""), 0, "a keyless message does not run");
    assert_all_settled(&streams, "dl").await;
}

// ---------------------------------------------------------------------------------------------
// Consumers killed with SIGKILL between claim and ack. The test binary runs itself as the
// consumer processes: `kill_child_consumer` is ignored, and does nothing without its
// environment.

#[cfg(feature = "postgres")]
mod killed {
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

    impl Drop for Tables {
        fn drop(&mut self) {
            let (pg, prefix) = (self.pg.clone(), self.prefix.clone());
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                rt.block_on(async move {
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
            })
            .join();
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
        let prefix = format!("idemt_nats_{:08x}", rand::random::<u32>());
        let _tables = Tables {
            pg: pg.clone(),
            prefix: prefix.clone(),
        };
        let pool = PgPool::connect(&pg).await.expect("PostgreSQL");
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {prefix}_runs (run BIGSERIAL PRIMARY KEY, id TEXT NOT NULL, \
             fence BIGINT NOT NULL, pid INT NOT NULL, started BIGINT NOT NULL, finished BIGINT)"
        )))
        .execute(&pool)
        .await
        .expect("runs table");
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {prefix}_effects (id TEXT NOT NULL, fence BIGINT NOT NULL, \
             pid INT NOT NULL)"
        )))
        .execute(&pool)
        .await
        .expect("effects table");
        // The records table, made once here rather than by racing children.
        drop(store(&pg, &prefix).await);

        for i in 0..N {
            publish_once(
                &streams.js,
                streams.subject(),
                &format!("m-{i}"),
                Bytes::new(),
            )
            .await
            .expect("publish");
        }

        let mut children = Children {
            env: vec![
                (ENV_NATS, url.clone()),
                (ENV_PG, pg.clone()),
                (ENV_STREAM, streams.name.clone()),
                (ENV_TABLES, prefix.clone()),
                (ENV_MODE, mode.to_owned()),
            ],
            live: Vec::new(),
            killed: HashMap::new(),
        };
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

        let rows: Vec<(String, i64, i32, i64, Option<i64>)> =
            sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT id, fence, pid, started, finished FROM {prefix}_runs ORDER BY id, fence"
            )))
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
        let prefix = format!("idemt_nats_{:08x}", rand::random::<u32>());
        let _tables = Tables {
            pg: pg.clone(),
            prefix: prefix.clone(),
        };
        let pool = PgPool::connect(&pg).await.expect("PostgreSQL");
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {prefix}_runs (run BIGSERIAL PRIMARY KEY, id TEXT NOT NULL, \
             fence BIGINT NOT NULL, pid INT NOT NULL, started BIGINT NOT NULL, finished BIGINT)"
        )))
        .execute(&pool)
        .await
        .expect("runs table");
        drop(store(&pg, &prefix).await);
        publish_once(
            &streams.js,
            streams.subject(),
            "crash-1",
            Bytes::from_static(b"crash"),
        )
        .await
        .expect("publish");
        for i in 0..10 {
            publish_once(
                &streams.js,
                streams.subject(),
                &format!("ok-{i}"),
                Bytes::new(),
            )
            .await
            .expect("publish");
        }
        let mut children = Children {
            env: vec![
                (ENV_NATS, url.clone()),
                (ENV_PG, pg.clone()),
                (ENV_STREAM, streams.name.clone()),
                (ENV_TABLES, prefix.clone()),
                (ENV_MODE, "crash".to_owned()),
            ],
            live: Vec::new(),
            killed: HashMap::new(),
        };
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_runs_each_id_once_across_a_server_restart() {
    let Some(mut server) = OwnServer::start() else {
        return;
    };
    let url = server.url();
    let js = jetstream::new(async_nats::connect(&url).await.expect("connect"));
    js.create_stream(stream::Config {
        name: "RESTARTED".to_owned(),
        subjects: vec!["RESTARTED.in".to_owned()],
        ..Default::default()
    })
    .await
    .expect("stream");
    const BEFORE: usize = 200;
    const AFTER: usize = 100;
    for i in 0..BEFORE {
        publish_once(&js, "RESTARTED.in", &format!("r-{i}"), Bytes::new())
            .await
            .expect("publish");
    }
    let source = NatsSource::builder("RESTARTED", "through")
        .dead_letter(DeadLetterTarget::TermOnly)
        .ack_wait(Duration::from_secs(2))
        .max_deliver(100)
        .batch(4)
        .retry_backoff(Duration::from_millis(50), Duration::from_secs(1))
        .connect(&url)
        .await
        .expect("source");
    let consumer = Consumer::new(idem::MemoryStore::new())
        .concurrency(4)
        .max_attempts(50)
        .backoff(Duration::from_millis(50), Duration::from_millis(500));
    let runs = Arc::new(Runs::default());
    let handler = timed_handler(&runs, Duration::from_millis(30));
    let (stop, shutdown) = shutdown_switch();
    let run = tokio::spawn({
        let consumer = consumer.clone();
        async move { consumer.run(source, handler, shutdown).await }
    });
    until(PATIENCE, "some handled before the restart", || {
        consumer.counts().handled >= 40
    })
    .await;

    let at_restart = consumer.counts().handled;
    server.restart();

    tokio::time::timeout(PATIENCE * 2, async {
        for i in 0..AFTER {
            let key = format!("r-{}", BEFORE + i);
            while publish_once(&js, "RESTARTED.in", &key, Bytes::new())
                .await
                .is_err()
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    })
    .await
    .expect("publish after the restart");
    until(PATIENCE * 2, "every id ran", || {
        runs.ids() == BEFORE + AFTER
    })
    .await;
    let settled = || async {
        let info = js
            .get_stream("RESTARTED")
            .await
            .ok()?
            .consumer_info("through")
            .await
            .ok()?;
        Some(info.num_pending == 0 && info.num_ack_pending == 0)
    };
    tokio::time::timeout(PATIENCE * 2, async {
        while settled().await != Some(true) {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await
    .expect("every message settled after the restart");
    stop.notify_one();
    run.await.expect("task").expect("run");

    for i in 0..BEFORE + AFTER {
        assert_eq!(runs.of(&format!("r-{i}")), 1, "r-{i} ran once");
    }
    assert_eq!(*lock(&runs.most_at_once), 1);
    assert!(
        at_restart < BEFORE as u64,
        "the restart came in the middle of the run ({at_restart} handled)"
    );
}

#[tokio::test]
async fn close_hands_back_what_was_prefetched() {
    let Some(url) = nats_url() else { return };
    let streams = Streams::new(&url, |_| {}).await;
    for i in 0..100 {
        publish_once(
            &streams.js,
            streams.subject(),
            &format!("c-{i}"),
            Bytes::new(),
        )
        .await
        .expect("publish");
    }
    // An ack wait far beyond the test's bound: a message left in the closed source's buffer
    // would not come back in time.
    let open = || async {
        NatsSource::builder(&streams.name, "closing")
            .ack_wait(Duration::from_secs(600))
            .batch(10)
            .max_ack_pending(1000)
            .connect(&url)
            .await
            .expect("source")
    };
    let mut first = open().await;
    next(&mut first)
        .await
        .settle(Disposition::Ack)
        .await
        .expect("ack");
    // Let the prefetch arrive.
    tokio::time::sleep(Duration::from_millis(200)).await;
    first.close().await;
    assert!(first.next().await.is_none());

    let mut second = open().await;
    let mut handed_back = 0;
    for _ in 1..100 {
        let d = next(&mut second).await;
        if d.delivery_count() == Some(2) {
            handed_back += 1;
        }
        d.settle(Disposition::Ack).await.expect("ack");
    }
    assert!(handed_back > 0, "the prefetched messages were handed back");
    assert_all_settled(&streams, "closing").await;
}
