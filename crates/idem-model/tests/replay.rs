//! Random traces of the model, replayed against the real memory and SQLite stores: every
//! answer and every record the stores keep must be the model's, so the model cannot drift
//! from what ships.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;

use idem_core::{
    BeginOutcome, Bytes, Lease, LeaseError, RecordState, Repair, Shown, Store, Timestamp,
};
use idem_model::record::{key, request, step};
use idem_model::{Action, Answer, Bounds, RecordModel, State};
use idem_store::{MemoryStore, SqliteStore};
use stateright::Model;

/// A small generator for the walks (xorshift): the seeds are printed, so a failing walk can be
/// run again.
struct Walk(u64);

impl Walk {
    fn pick(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        usize::try_from(self.0 % n as u64).expect("small")
    }
}

/// What `action` answers on the real `store`, given the model's state before it and the
/// leases the store handed each client.
async fn on_store(
    store: &dyn idem_core::DynStore,
    before: &State,
    action: Action,
    leases: &mut HashMap<u8, Lease>,
) -> Answer {
    let key = key();
    let at = |c: u8| Timestamp::from_millis(before.now + before.clients[usize::from(c)].skew);
    let settled = |r: Result<(), LeaseError>| match r {
        Ok(()) => Answer::Done(true),
        Err(LeaseError::Stale(_)) => Answer::Done(false),
        Err(e) => panic!("the store failed: {e}"),
    };
    match action {
        Action::Begin(c) => match store.begin(&request(), at(c)).await.unwrap() {
            BeginOutcome::Acquired(lease) => {
                leases.insert(c, lease);
                Answer::Acquired(lease.fence)
            }
            BeginOutcome::Replay(r) => Answer::Replay(r.response, r.fence),
            BeginOutcome::InProgress { .. } => Answer::InProgress,
            BeginOutcome::Mismatch => Answer::Mismatch,
        },
        Action::Step(c) => {
            let done = store.record_step(&key, &leases[&c], &step(c), at(c)).await;
            Answer::Done(done.is_ok())
        }
        Action::Complete(c) => {
            let lease = leases.remove(&c).expect("a lease");
            settled(
                store
                    .complete(&key, &lease, Bytes::from(vec![c]), at(c))
                    .await,
            )
        }
        Action::Release(c) => {
            let lease = leases.remove(&c).expect("a lease");
            settled(store.release(&key, &lease, at(c)).await)
        }
        Action::Crash(c) => {
            leases.remove(&c);
            Answer::Nothing
        }
        Action::Delete => {
            let now = Timestamp::from_millis(before.now);
            let r = before.record.as_ref().expect("a record to delete");
            let shown = Shown {
                state: RecordState::of(r, now),
                fence: r.fence,
            };
            let admin = store.admin().expect("an operator's view");
            Answer::Done(
                admin
                    .repair(&key, shown, Repair::Delete, now)
                    .await
                    .unwrap(),
            )
        }
        Action::Reopen => {
            let now = Timestamp::from_millis(before.now);
            let fence = before.record.as_ref().expect("a record").fence;
            Answer::Done(store.reopen(&key, fence, now).await.unwrap())
        }
        Action::Write(_) | Action::Expire | Action::JumpClock(_) | Action::Purge => Answer::Nothing,
    }
}

/// Runs `walks` random walks of the model against the store `open` gives, one store per walk.
async fn replay<S: Store + 'static>(walks: u64, open: impl Fn() -> S) {
    let model = RecordModel::new(Bounds::SMALL);
    let mut actions = Vec::new();
    for seed in 1..=walks {
        let store = open();
        let mut walk = Walk(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let mut state = model.start();
        let mut leases = HashMap::new();
        for _ in 0..40 {
            actions.clear();
            model.actions(&state, &mut actions);
            let possible: Vec<(Action, State, Answer)> = actions
                .iter()
                .filter_map(|&a| model.apply(&state, a).map(|(s, answer)| (a, s, answer)))
                .collect();
            if possible.is_empty() {
                break;
            }
            let (action, next, expected) = possible[walk.pick(possible.len())].clone();
            let got = on_store(&store, &state, action, &mut leases).await;
            if action == Action::Purge {
                let now = Timestamp::from_millis(next.now);
                store.purge_expired(now, 1000).await.unwrap();
            }
            assert_eq!(got, expected, "walk {seed}: {action:?} from {state:?}");
            // The record the store keeps is the model's, as far as anyone can see it.
            let now = Timestamp::from_millis(next.now);
            let kept = store.get(&key(), now).await.unwrap();
            let modelled = next.record.clone().filter(|r| r.is_live(now));
            let view = |r: &idem_core::Record| {
                (
                    r.status,
                    r.fence,
                    r.response.clone(),
                    r.lease_expires_at,
                    r.steps.len(),
                )
            };
            assert_eq!(
                kept.as_ref().map(view),
                modelled.as_ref().map(view),
                "walk {seed}: the record after {action:?}"
            );
            state = next;
        }
    }
}

#[tokio::test]
async fn the_memory_store_answers_as_the_model_does() {
    replay(400, MemoryStore::new).await;
}

#[tokio::test]
async fn the_sqlite_store_answers_as_the_model_does() {
    let dir = tempfile::tempdir().unwrap();
    let n = std::sync::atomic::AtomicUsize::new(0);
    replay(60, || {
        let i = n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        SqliteStore::open(dir.path().join(format!("walk-{i}.db"))).unwrap()
    })
    .await;
}
