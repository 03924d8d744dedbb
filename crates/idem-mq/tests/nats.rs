//! The NATS JetStream adapter against a real server: each test on its own streams, deleted at
//! the end. Skipped (with a note) when no NATS answers; a failure under `CI=true`.

#![cfg(feature = "nats")]

use std::time::Duration;

use async_nats::jetstream::{self, stream};
use bytes::Bytes;
use idem_mq::nats::{
    DELIVERIES_HEADER, DETAIL_HEADER, DeadLetterTarget, MSG_ID_HEADER, NatsDelivery, NatsSource,
    REASON_HEADER, SEQUENCE_HEADER, STREAM_HEADER, SUBJECT_HEADER, publish_once,
};
use idem_mq::{DeadLetter, Delivery, Disposition, Horizon, MqError, Reason, Source};

/// Generous bound on any single wait for the broker.
const WAIT: Duration = Duration::from_secs(30);

fn nats_url() -> Option<String> {
    idem_testkit::services::NATS.url()
}

/// A stream `name` on `<name>.in`, and its dead-letter stream `<name>_DL` on `<name>.dead`;
/// both deleted when dropped.
struct Streams {
    url: String,
    name: String,
    js: jetstream::Context,
}

impl Streams {
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
        js.create_stream(config).await.expect("create the stream");
        js.create_stream(stream::Config {
            name: format!("{name}_DL"),
            subjects: vec![format!("{name}.dead")],
            max_age: Duration::from_secs(3600),
            ..Default::default()
        })
        .await
        .expect("create the dead-letter stream");
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
    tokio::time::timeout(WAIT, async {
        loop {
            match source.next().await {
                Some(Ok(d)) => return d,
                Some(Err(e)) => eprintln!("next: {e}"),
                None => panic!("the source closed"),
            }
        }
    })
    .await
    .expect("a delivery within the bound")
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
    assert_eq!(source.name(), streams.name);
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
        let deadline = std::time::Instant::now() + WAIT;
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
    tokio::time::timeout(WAIT, async {
        while publish_once(&js, "RESTART.in", "after", Bytes::new())
            .await
            .is_err()
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("publish after the restart");
    let d = next(&mut source).await;
    assert_eq!(d.message_id(), Some("after"));
    d.settle(Disposition::Ack)
        .await
        .expect("ack after the restart");
}
