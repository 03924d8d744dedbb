//! What a source reading a partitioned log (Kafka) holds: the records fetched and not yet
//! done, which of them may be handed out, and how far each partition may be committed. No
//! broker here, so that the rules are tested alone, and the delivery model runs this very
//! code (it is built without the `kafka` feature for that).
//!
//! A partition's records are *slots* by offset: waiting (fetched, or given back to be retried
//! once due), running (handed out), or done (settled for good). The commit position is the
//! first offset not done: a record still running or waiting holds it back, however many after
//! it are done, so a crash or a rebalance never skips it.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

/// A topic and one of its partitions.
pub type Tp = (Arc<str>, i32);

/// Which records of one partition may run at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Order {
    /// One at a time, in offset order: a record is handed out once every record before it in
    /// its partition is done. The default: what a Kafka consumer expects of a partition.
    #[default]
    Partition,
    /// Records with one Kafka key run one at a time, in offset order; records with different
    /// keys, or no key, run side by side. For handlers whose order matters per entity (the
    /// record key) and not across entities.
    Key,
}

/// A record handed out: where it is, and how many times this source has handed it out.
#[derive(Debug)]
pub struct Handout<R> {
    /// Its partition.
    pub tp: Tp,
    /// The assignment it was handed out under: a settle under another is stale.
    pub generation: u64,
    /// Its offset.
    pub offset: i64,
    /// The record.
    pub record: R,
    /// How many times it has been handed out, this time included (1 the first).
    pub handed: u32,
}

/// What [`Book::take`] found.
#[derive(Debug)]
pub enum Take<R> {
    /// A record to hand out.
    Ready(Handout<R>),
    /// Nothing may run now; a retry falls due at this instant, if any waits.
    Wait(Option<Instant>),
}

/// How a handed-out record ended.
#[derive(Debug)]
pub enum Settled<R> {
    /// Done for good (acked, or dead-lettered): the commit may pass it.
    Done,
    /// Given back, to be handed out again once `due`.
    Retry {
        /// The record, back from its delivery.
        record: R,
        /// Not before then.
        due: Instant,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Slot<R> {
    Waiting {
        key: Option<Bytes>,
        record: R,
        due: Option<Instant>,
        handed: u32,
    },
    Running {
        key: Option<Bytes>,
        handed: u32,
    },
    Done,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Part<R> {
    generation: u64,
    slots: BTreeMap<i64, Slot<R>>,
    /// Every offset below is done: the position to commit. `None` before the first record.
    done_below: Option<i64>,
    /// The position last committed (or found on assignment, taken as committed).
    committed: Option<i64>,
    /// Waiting slots: the records this partition holds in memory.
    held: usize,
    paused: bool,
}

impl<R> Part<R> {
    fn new(generation: u64) -> Self {
        Self {
            generation,
            slots: BTreeMap::new(),
            done_below: None,
            committed: None,
            held: 0,
            paused: false,
        }
    }

    /// The offset of the first slot that may run now, under `order`, and the earliest instant
    /// a waiting retry falls due.
    fn eligible(&self, order: Order, now: Instant) -> (Option<i64>, Option<Instant>) {
        let mut due_next: Option<Instant> = None;
        let mut busy: HashSet<&Bytes> = HashSet::new();
        for (&offset, slot) in &self.slots {
            match slot {
                Slot::Done => {}
                Slot::Running { key, .. } => {
                    if order == Order::Partition {
                        return (None, due_next);
                    }
                    if let Some(key) = key {
                        busy.insert(key);
                    }
                }
                Slot::Waiting { key, due, .. } => {
                    let ready = due.is_none_or(|due| due <= now);
                    if !ready {
                        due_next = Some(
                            due_next.map_or(due.unwrap_or(now), |d| d.min(due.unwrap_or(now))),
                        );
                    }
                    let free = key.as_ref().is_none_or(|k| !busy.contains(k));
                    if ready && free {
                        return (Some(offset), due_next);
                    }
                    if order == Order::Partition {
                        return (None, due_next);
                    }
                    if let Some(key) = key {
                        busy.insert(key);
                    }
                }
            }
        }
        (None, due_next)
    }

    /// Drops the done slots at the front, moving the commit position past them.
    fn advance(&mut self) {
        while let Some(entry) = self.slots.first_entry() {
            if !matches!(entry.get(), Slot::Done) {
                break;
            }
            let offset = *entry.key();
            entry.remove();
            self.done_below = Some(offset + 1);
        }
        if let Some((&first, _)) = self.slots.first_key_value() {
            self.done_below = Some(first);
        }
    }
}

/// The records of every partition assigned to one source.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Book<R> {
    parts: BTreeMap<Tp, Part<R>>,
    order: Order,
    max_held: usize,
    generation: u64,
    /// Where the next [`Book::take`] starts looking, so every partition gets its turn.
    cursor: usize,
}

impl<R> Book<R> {
    /// An empty book: records handed out under `order`, a partition paused once it holds
    /// `max_held` records not yet running (at least 1).
    pub fn new(order: Order, max_held: usize) -> Self {
        Self {
            parts: BTreeMap::new(),
            order,
            max_held: max_held.max(1),
            generation: 0,
            cursor: 0,
        }
    }

    /// Partition `tp` is now this source's, with nothing fetched yet. A settle of a record
    /// handed out under an earlier assignment of it is stale from now on.
    pub fn assign(&mut self, tp: Tp) {
        self.generation += 1;
        self.parts.insert(tp, Part::new(self.generation));
    }

    /// Partition `tp` is no longer this source's: what it held is dropped (the next owner
    /// fetches it again from the commit position), and the position to commit is returned,
    /// whether or not it was committed before: a commit sent on the timer may not have
    /// reached the broker, and committing one position twice is harmless.
    pub fn revoke(&mut self, tp: &Tp) -> Option<i64> {
        self.parts.remove(tp)?.done_below
    }

    /// Every partition dropped, nothing to commit: the group's assignment failed, and this
    /// member may own none of them.
    pub fn revoke_all(&mut self) {
        self.parts.clear();
    }

    /// The partitions assigned.
    pub fn assigned(&self) -> impl Iterator<Item = &Tp> {
        self.parts.keys()
    }

    /// A record fetched at `offset` of `tp`, with its Kafka `key`. Returns false (the record
    /// dropped) when the partition is not assigned, or the offset is already held or done: a
    /// fetch that repeats itself adds nothing.
    pub fn push(&mut self, tp: &Tp, offset: i64, key: Option<Bytes>, record: R) -> bool {
        let Some(part) = self.parts.get_mut(tp) else {
            return false;
        };
        if part.done_below.is_some_and(|below| offset < below) || part.slots.contains_key(&offset) {
            return false;
        }
        if part.done_below.is_none() {
            // The first record of an assignment is where the group's position stood.
            part.done_below = Some(offset);
            part.committed = Some(offset);
        }
        part.slots.insert(
            offset,
            Slot::Waiting {
                key,
                record,
                due: None,
                handed: 0,
            },
        );
        part.held += 1;
        true
    }

    /// The next record that may run now, each partition in turn; or when to look again.
    pub fn take(&mut self, now: Instant) -> Take<R> {
        let n = self.parts.len();
        let mut due_next: Option<Instant> = None;
        for i in 0..n {
            let at = (self.cursor + i) % n;
            let Some((tp, part)) = self.parts.iter_mut().nth(at) else {
                break;
            };
            let (offset, due) = part.eligible(self.order, now);
            if let Some(due) = due {
                due_next = Some(due_next.map_or(due, |d| d.min(due)));
            }
            let Some(offset) = offset else { continue };
            let slot = part.slots.get_mut(&offset).expect("an eligible slot");
            let Slot::Waiting { key, handed, .. } = slot else {
                unreachable!("only a waiting slot is eligible");
            };
            let (key, handed) = (key.take(), *handed + 1);
            let Slot::Waiting { record, .. } =
                std::mem::replace(slot, Slot::Running { key, handed })
            else {
                unreachable!("checked above");
            };
            part.held -= 1;
            self.cursor = (at + 1) % n;
            return Take::Ready(Handout {
                tp: tp.clone(),
                generation: part.generation,
                offset,
                record,
                handed,
            });
        }
        Take::Wait(due_next)
    }

    /// A handed-out record ended. Returns false when the settle is stale (the partition was
    /// revoked, or assigned again, since): it changes nothing.
    pub fn settle(&mut self, tp: &Tp, generation: u64, offset: i64, how: Settled<R>) -> bool {
        let Some(part) = self.parts.get_mut(tp) else {
            return false;
        };
        if part.generation != generation {
            return false;
        }
        let Some(slot) = part.slots.get_mut(&offset) else {
            return false;
        };
        let Slot::Running { key, handed } = slot else {
            return false;
        };
        match how {
            Settled::Done => {
                *slot = Slot::Done;
                part.advance();
            }
            Settled::Retry { record, due } => {
                *slot = Slot::Waiting {
                    key: key.take(),
                    record,
                    due: Some(due),
                    handed: *handed,
                };
                part.held += 1;
            }
        }
        true
    }

    /// The commit positions that moved since the last call, taken as committed.
    pub fn to_commit(&mut self) -> Vec<(Tp, i64)> {
        let mut out = Vec::new();
        for (tp, part) in &mut self.parts {
            if let Some(at) = part.done_below
                && part.committed != Some(at)
            {
                part.committed = Some(at);
                out.push((tp.clone(), at));
            }
        }
        out
    }

    /// A commit of `tp` at `at` failed: the next [`Book::to_commit`] tries again.
    pub fn uncommitted(&mut self, tp: &Tp, at: i64) {
        if let Some(part) = self.parts.get_mut(tp)
            && part.committed == Some(at)
        {
            part.committed = None;
        }
    }

    /// The partitions to pause (they hold `max_held` records or more) and to resume (they
    /// hold half that or fewer), each reported once per change.
    pub fn flow(&mut self) -> (Vec<Tp>, Vec<Tp>) {
        let (mut pause, mut resume) = (Vec::new(), Vec::new());
        for (tp, part) in &mut self.parts {
            if !part.paused && part.held >= self.max_held {
                part.paused = true;
                pause.push(tp.clone());
            } else if part.paused && part.held <= self.max_held / 2 {
                part.paused = false;
                resume.push(tp.clone());
            }
        }
        (pause, resume)
    }

    /// Records handed out and not yet settled.
    #[cfg(test)]
    fn running(&self) -> usize {
        self.parts
            .values()
            .flat_map(|p| p.slots.values())
            .filter(|s| matches!(s, Slot::Running { .. }))
            .count()
    }

    /// Records held and not running (fetched, or waiting for a retry).
    #[cfg(test)]
    fn held(&self) -> usize {
        self.parts.values().map(|p| p.held).sum()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn tp(p: i32) -> Tp {
        (Arc::from("t"), p)
    }

    fn ready<R>(book: &mut Book<R>, now: Instant) -> Handout<R> {
        match book.take(now) {
            Take::Ready(h) => h,
            Take::Wait(_) => panic!("expected a record to be ready"),
        }
    }

    fn nothing<R: std::fmt::Debug>(book: &mut Book<R>, now: Instant) -> Option<Instant> {
        match book.take(now) {
            Take::Wait(due) => due,
            Take::Ready(h) => panic!("expected nothing ready, got offset {}", h.offset),
        }
    }

    fn key(k: &str) -> Option<Bytes> {
        Some(Bytes::copy_from_slice(k.as_bytes()))
    }

    #[test]
    fn a_partition_runs_one_record_at_a_time_in_offset_order() {
        let now = Instant::now();
        let mut book = Book::new(Order::Partition, 100);
        book.assign(tp(0));
        for offset in 5..8 {
            assert!(book.push(&tp(0), offset, None, offset));
        }
        let first = ready(&mut book, now);
        assert_eq!((first.offset, first.record, first.handed), (5, 5, 1));
        nothing(&mut book, now);
        assert!(book.settle(&tp(0), first.generation, 5, Settled::Done));
        assert_eq!(ready(&mut book, now).offset, 6);
    }

    #[test]
    fn the_commit_stops_at_the_first_record_not_done() {
        let now = Instant::now();
        let mut book = Book::new(Order::Key, 100);
        book.assign(tp(0));
        for (offset, k) in [(10, "a"), (11, "b"), (12, "c")] {
            book.push(&tp(0), offset, key(k), offset);
        }
        assert_eq!(
            book.to_commit(),
            vec![],
            "nothing done: the position stands"
        );
        let a = ready(&mut book, now);
        let b = ready(&mut book, now);
        let c = ready(&mut book, now);
        assert_eq!((a.offset, b.offset, c.offset), (10, 11, 12));
        book.settle(&tp(0), b.generation, 11, Settled::Done);
        book.settle(&tp(0), c.generation, 12, Settled::Done);
        assert_eq!(
            book.to_commit(),
            vec![],
            "10 still runs: done records after it are not committed"
        );
        book.settle(&tp(0), a.generation, 10, Settled::Done);
        assert_eq!(book.to_commit(), vec![(tp(0), 13)]);
        assert_eq!(book.to_commit(), vec![], "reported once");
    }

    #[test]
    fn a_retry_holds_its_partition_and_no_other() {
        let now = Instant::now();
        let mut book = Book::new(Order::Partition, 100);
        book.assign(tp(0));
        book.assign(tp(1));
        book.push(&tp(0), 0, None, "p0-0");
        book.push(&tp(0), 1, None, "p0-1");
        book.push(&tp(1), 0, None, "p1-0");
        let h = ready(&mut book, now);
        assert_eq!(h.record, "p0-0");
        let due = now + Duration::from_secs(5);
        book.settle(
            &h.tp,
            h.generation,
            h.offset,
            Settled::Retry {
                record: h.record,
                due,
            },
        );
        let other = ready(&mut book, now);
        assert_eq!(other.record, "p1-0", "the other partition goes on");
        assert_eq!(
            nothing(&mut book, now),
            Some(due),
            "p0-1 waits behind the retry"
        );
        let again = ready(&mut book, due);
        assert_eq!((again.record, again.handed), ("p0-0", 2));
        assert_eq!(
            book.to_commit(),
            vec![],
            "a retried record holds the commit"
        );
    }

    #[test]
    fn with_order_by_key_only_records_of_one_key_wait_for_each_other() {
        let now = Instant::now();
        let mut book = Book::new(Order::Key, 100);
        book.assign(tp(0));
        book.push(&tp(0), 0, key("a"), 0);
        book.push(&tp(0), 1, key("a"), 1);
        book.push(&tp(0), 2, key("b"), 2);
        book.push(&tp(0), 3, None, 3);
        book.push(&tp(0), 4, None, 4);
        let taken: Vec<i64> = (0..4)
            .map_while(|_| match book.take(now) {
                Take::Ready(h) => Some(h.offset),
                Take::Wait(_) => None,
            })
            .collect();
        assert_eq!(taken, vec![0, 2, 3, 4], "1 waits for 0, its key's elder");
    }

    #[test]
    fn a_settle_from_an_earlier_assignment_changes_nothing() {
        let now = Instant::now();
        let mut book = Book::new(Order::Partition, 100);
        book.assign(tp(0));
        book.push(&tp(0), 0, None, ());
        let old = ready(&mut book, now);
        assert_eq!(
            book.revoke(&tp(0)),
            Some(0),
            "nothing done: the position it started at"
        );
        book.assign(tp(0));
        book.push(&tp(0), 0, None, ());
        assert!(!book.settle(&tp(0), old.generation, 0, Settled::Done));
        let new = ready(&mut book, now);
        assert_eq!(new.handed, 1);
        assert!(book.settle(&tp(0), new.generation, 0, Settled::Done));
        assert_eq!(book.revoke(&tp(0)), Some(1));
    }

    #[test]
    fn records_of_a_partition_not_assigned_or_seen_before_are_dropped() {
        let now = Instant::now();
        let mut book = Book::new(Order::Partition, 100);
        assert!(!book.push(&tp(0), 0, None, ()));
        book.assign(tp(0));
        assert!(book.push(&tp(0), 3, None, ()));
        assert!(!book.push(&tp(0), 3, None, ()), "held already");
        let h = ready(&mut book, now);
        book.settle(&h.tp, h.generation, 3, Settled::Done);
        assert!(!book.push(&tp(0), 3, None, ()), "done already");
        assert!(!book.push(&tp(0), 2, None, ()), "below the position");
    }

    #[test]
    fn a_partition_is_paused_when_full_and_resumed_at_half() {
        let now = Instant::now();
        let mut book = Book::new(Order::Key, 4);
        book.assign(tp(0));
        for offset in 0..4 {
            book.push(&tp(0), offset, None, ());
        }
        assert_eq!(book.flow(), (vec![tp(0)], vec![]));
        assert_eq!(book.flow(), (vec![], vec![]), "reported once");
        ready(&mut book, now);
        assert_eq!(book.flow(), (vec![], vec![]), "3 held: still above half");
        ready(&mut book, now);
        assert_eq!(book.flow(), (vec![], vec![tp(0)]));
        assert_eq!((book.held(), book.running()), (2, 2));
    }

    #[test]
    fn a_failed_commit_is_offered_again() {
        let now = Instant::now();
        let mut book = Book::new(Order::Partition, 10);
        book.assign(tp(0));
        book.push(&tp(0), 0, None, ());
        let h = ready(&mut book, now);
        book.settle(&h.tp, h.generation, 0, Settled::Done);
        assert_eq!(book.to_commit(), vec![(tp(0), 1)]);
        book.uncommitted(&tp(0), 1);
        assert_eq!(book.to_commit(), vec![(tp(0), 1)]);
    }
}
