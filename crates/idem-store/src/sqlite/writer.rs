//! The writer thread: it owns the connection, takes every operation waiting (up to a batch
//! limit), runs them in one `BEGIN IMMEDIATE` transaction, commits once and answers each caller.

use std::sync::{Arc, mpsc};
use std::time::Duration;

use idem_core::{BeginOutcome, Key, Lease, LeaseError, Timestamp};
use rusqlite::{Connection, TransactionBehavior};
use tokio::sync::oneshot;

use super::known::KnownKeys;
use super::ops::{Answer, Op, Request, Responder, apply};

pub(super) struct Writer {
    pub(super) conn: Connection,
    pub(super) max_batch: usize,
    /// Taught the key of every `begin` this thread commits (none: no key filter).
    pub(super) known: Option<Arc<KnownKeys>>,
}

/// How long a key claimed for a caller that left waits before it is given back again, when
/// the last try failed and no other write comes first.
const RELEASE_RETRY: Duration = Duration::from_millis(100);

impl Writer {
    pub(super) fn run(mut self, rx: &mpsc::Receiver<Op>) {
        // Keys claimed for callers that stopped waiting, not given back yet.
        let mut unreleased: Vec<(Key, Lease, Timestamp)> = Vec::new();
        let mut warned = false;
        loop {
            let first = if unreleased.is_empty() {
                rx.recv().ok()
            } else {
                // Given back with the next batch, or after a pause if none comes.
                match rx.recv_timeout(RELEASE_RETRY) {
                    Ok(op) => Some(op),
                    Err(mpsc::RecvTimeoutError::Timeout) => None,
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        self.give_back(&mut unreleased, &mut warned);
                        return;
                    }
                }
            };
            if let Some(first) = first {
                let mut batch = Vec::with_capacity(self.max_batch);
                batch.push(first);
                while batch.len() < self.max_batch {
                    match rx.try_recv() {
                        Ok(op) => batch.push(op),
                        Err(_) => break,
                    }
                }
                unreleased.extend(self.run_batch(batch));
            } else if unreleased.is_empty() {
                return; // every SqliteStore clone has been dropped
            }
            if !unreleased.is_empty() {
                self.give_back(&mut unreleased, &mut warned);
            }
        }
    }

    /// Gives back keys claimed for callers that stopped waiting (a timeout, a dropped
    /// request), at once rather than held for a whole lease. What the store could not give
    /// back stays in `claimed` to be tried again, until its lease has run out by itself.
    fn give_back(&mut self, claimed: &mut Vec<(Key, Lease, Timestamp)>, warned: &mut bool) {
        let (ops, answers): (Vec<Op>, Vec<_>) = claimed
            .iter()
            .map(|(key, lease, now)| {
                let (tx, rx) = oneshot::channel();
                let op = Op {
                    request: Request::Release(key.clone(), *lease, *now),
                    responder: Responder::Lease(tx),
                };
                (op, rx)
            })
            .unzip();
        self.run_batch(ops);
        let now = Timestamp::now();
        let mut answers = answers.into_iter();
        claimed.retain(|(_, lease, _)| {
            // Given back, or given up (taken over, or no longer held): done.
            let failed = matches!(
                answers.next().map(|mut rx| rx.try_recv()),
                Some(Ok(Err(LeaseError::Store(_))))
            );
            failed && lease.expires_at > now
        });
        // Said once, when keys first stay (they are tried again every `RELEASE_RETRY`).
        if !claimed.is_empty() && !*warned {
            tracing::warn!(
                keys = claimed.len(),
                "the SQLite store could not give back keys claimed for callers that left; \
                 trying again until their leases run out"
            );
        }
        *warned = !claimed.is_empty();
    }

    /// Runs `batch` in one transaction and answers every caller. Returns the leases acquired
    /// for callers that stopped waiting before the answer came.
    fn run_batch(&mut self, batch: Vec<Op>) -> Vec<(Key, Lease, Timestamp)> {
        // A caller that stopped waiting before its claim, lock or read ran needs none of them;
        // writes of a result (complete, release) are made regardless: the work is done.
        let batch: Vec<Op> = batch
            .into_iter()
            .filter(|op| !(op.responder.is_closed() && op.request.only_for_its_caller()))
            .collect();
        let mut answers = Vec::with_capacity(batch.len());
        let result = (|| {
            let tx = self
                .conn
                .transaction_with_behavior(TransactionBehavior::Immediate)?;
            for op in &batch {
                answers.push(apply(&tx, &op.request)?);
            }
            tx.commit()
        })();
        let mut orphans = Vec::new();
        match result {
            Ok(()) => {
                // Before any caller hears: a record a `begin` wrote (or found) is in the table
                // from this commit on, whether its caller is still there or not.
                if let Some(known) = &self.known {
                    for op in &batch {
                        if let Request::Begin(req, _) = &op.request {
                            known.learn(&req.key);
                        }
                    }
                }
                for (op, answer) in batch.into_iter().zip(answers) {
                    let returned = op.responder.send(answer);
                    if let (
                        Request::Begin(req, now),
                        Some(Answer::Begin(Ok(BeginOutcome::Acquired(lease)))),
                    ) = (op.request, returned)
                    {
                        orphans.push((req.key, lease, now));
                    }
                }
            }
            Err(e) => {
                // Nothing of this batch was committed: every caller gets the error (fail closed).
                for op in batch {
                    op.responder.fail(&e);
                }
            }
        }
        orphans
    }
}
