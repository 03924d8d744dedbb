//! Read connections: reads that need no write lock run here, beside the writer. In WAL mode a
//! reader sees the last committed state and never holds up the writer, nor waits for it.
//!
//! A [`Readers`] is a few threads, each owning one `query_only` connection and taking jobs
//! from one bounded queue; they start at the first job (for the listings, at open, when the
//! key filter loads) and stop when every clone of the store is gone. The store keeps two: one
//! for replays and `get` (short point reads), and one for listings, counts and the key
//! filter's loads, so that a count over a large table never delays a replay.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::thread;
use std::time::Duration;

use idem_core::StoreError;
use rusqlite::{Connection, OpenFlags};
use tokio::sync::oneshot;

use super::schema::open_error;
use super::schema::store_error;

type ReadJob = Box<dyn FnOnce(&Connection) + Send>;

/// The most reads a thread takes from the queue at once.
const MAX_BATCH: usize = 64;

/// Runs the reads of `batch` (emptying it) in one read transaction, as the writer runs its
/// batches in one write transaction: taking and leaving a snapshot of the WAL costs more than
/// a point read. Each read then sees the same committed state, as of the batch's start.
fn run_batch(conn: &Connection, batch: &mut Vec<ReadJob>) {
    let together = batch.len() > 1 && conn.execute_batch("BEGIN").is_ok();
    for job in batch.drain(..) {
        job(conn);
    }
    if together {
        // A read transaction has nothing to keep; a failure here leaves nothing behind.
        let _ = conn.execute_batch("COMMIT");
    }
}

/// A pool of read connections and their threads.
#[derive(Debug)]
pub(super) struct Readers {
    name: &'static str,
    path: PathBuf,
    busy_timeout: Duration,
    threads: usize,
    queue: usize,
    jobs: Mutex<Option<mpsc::SyncSender<ReadJob>>>,
}

impl Readers {
    /// `threads` connections (at least 1), named `name` in thread names and errors, with at
    /// most `queue` reads waiting.
    pub(super) fn new(
        name: &'static str,
        path: PathBuf,
        busy_timeout: Duration,
        threads: usize,
        queue: usize,
    ) -> Self {
        Self {
            name,
            path,
            busy_timeout,
            threads: threads.max(1),
            queue: queue.max(1),
            jobs: Mutex::new(None),
        }
    }

    /// Runs `read` on one of the read connections.
    pub(super) async fn run<T: Send + 'static>(
        &self,
        read: impl FnOnce(&Connection) -> rusqlite::Result<Result<T, StoreError>> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.send(Box::new(move |conn| {
            // A caller that stopped waiting needs no answer.
            if !reply.is_closed() {
                let _ = reply.send(read(conn).unwrap_or_else(|e| Err(store_error(&e))));
            }
        }))?;
        answer.await.unwrap_or_else(|_| Err(self.stopped()))
    }

    /// Queues `job` on one of the read connections and does not wait for it. A job refused
    /// (the queue is full, the threads are gone) is dropped unrun.
    pub(super) fn detach(
        &self,
        job: impl FnOnce(&Connection) + Send + 'static,
    ) -> Result<(), StoreError> {
        self.send(Box::new(job))
    }

    fn send(&self, job: ReadJob) -> Result<(), StoreError> {
        let mut jobs = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
        let sender = match jobs.as_ref() {
            Some(sender) => sender,
            None => jobs.insert(self.start()?),
        };
        match sender.try_send(job) {
            Ok(()) => Ok(()),
            Err(mpsc::TrySendError::Full(_)) => Err(StoreError::Unavailable {
                message: format!(
                    "the SQLite store has {} {} waiting; try again shortly",
                    self.queue, self.name
                ),
                source: None,
            }),
            Err(mpsc::TrySendError::Disconnected(_)) => {
                // The threads are gone; the next read starts others.
                *jobs = None;
                Err(self.stopped())
            }
        }
    }

    /// Opens the read connections and starts their threads, which end when every clone of
    /// the store has been dropped.
    fn start(&self) -> Result<mpsc::SyncSender<ReadJob>, StoreError> {
        // The writer has created the file and applied the migrations.
        let flags = OpenFlags::default().difference(OpenFlags::SQLITE_OPEN_CREATE);
        let (sender, jobs) = mpsc::sync_channel::<ReadJob>(self.queue);
        // One queue for every thread: std's receiver is taken by one thread at a time.
        let jobs = Arc::new(Mutex::new(jobs));
        for _ in 0..self.threads {
            let conn = Connection::open_with_flags(&self.path, flags)
                .and_then(|conn| {
                    conn.busy_timeout(self.busy_timeout)?;
                    conn.pragma_update(None, "query_only", true)?;
                    Ok(conn)
                })
                .map_err(|e| open_error(&self.path, e))?;
            let jobs = jobs.clone();
            thread::Builder::new()
                .name(format!("idem-sqlite-{}", self.name))
                .spawn(move || {
                    let mut batch = Vec::new();
                    loop {
                        {
                            let jobs = jobs.lock().unwrap_or_else(PoisonError::into_inner);
                            match jobs.recv() {
                                Ok(job) => batch.push(job),
                                Err(_) => return,
                            }
                            batch.extend(jobs.try_iter().take(MAX_BATCH - 1));
                        }
                        run_batch(&conn, &mut batch);
                    }
                })
                .map_err(|e| StoreError::backend("cannot start a SQLite reader thread", e))?;
        }
        Ok(sender)
    }

    fn stopped(&self) -> StoreError {
        StoreError::Unavailable {
            message: format!("the SQLite {} threads have stopped", self.name),
            source: None,
        }
    }
}
