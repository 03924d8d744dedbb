//! The history of a run, and the checker that reads it with the ledger.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Mutex;
use std::time::Instant;

use crate::ledger::Entries;

/// What happened, in the order it was seen.
// Every field goes to the history file, whether the checker reads it or not.
#[allow(dead_code)]
#[derive(Debug, Clone)]
pub(crate) enum Event {
    /// A client sent a request for `key` to gateway `gateway`.
    Invoke { key: String, gateway: usize },
    /// Its answer (status, replayed, body), or none in time.
    Complete {
        key: String,
        answer: Option<(u16, bool, String)>,
    },
    /// The nemesis struck.
    Fault { fault: String, gateway: usize },
    /// The fault that struck last is over; what it reached on the way to the store (chunks
    /// held or delayed, connections cut), for the kinds that strike there.
    Healed { touched: u64 },
    /// What happened in a relay run (`relay.rs`).
    Relay(RelayEvent),
    /// What a burst of large answers at gateway `gateway`, its store stalled, cost it: the
    /// bytes the burst asked for, the gateway's budget for unstored answers, its resident
    /// memory before and at most during the stall, the most its gauge said it kept, and what
    /// the gauge still said some seconds after the store came back.
    Memory {
        gateway: usize,
        asked: usize,
        budget: usize,
        rss_before: usize,
        rss_peak: usize,
        kept_peak: usize,
        kept_after: usize,
    },
}

/// How many times the bytes a burst asks for a gateway's resident memory may grow by in it,
/// beside its budget and [`MEMORY_SLACK`]: each answer is held by its request, read from the
/// upstream, copied into the store client's `complete` and into its replay, and the
/// allocator keeps what it freed (debug builds grew by 36–47 MiB for 6 MiB of answers). A
/// bound on gross growth only; what is kept for the store is checked against the budget
/// exactly, from the gateway's gauge.
const MEMORY_PER_BYTE_ASKED: usize = 8;

/// What a gateway's resident memory may grow by in a burst beyond its answers' share: the
/// allocator's own, and what else runs.
const MEMORY_SLACK: usize = 16 << 20;

/// What happened in a relay run.
#[allow(dead_code)]
#[derive(Debug, Clone)]
pub(crate) enum RelayEvent {
    /// The publisher published a message with this id (once per copy).
    Published { id: String },
    /// The nemesis struck relay `relay`.
    Fault { fault: String, relay: usize },
}

pub(crate) struct History {
    started: Instant,
    events: Mutex<Vec<(u128, Event)>>,
}

impl Default for History {
    fn default() -> Self {
        Self {
            started: Instant::now(),
            events: Mutex::new(Vec::new()),
        }
    }
}

impl History {
    pub(crate) fn push(&self, event: Event) {
        let at = self.started.elapsed().as_micros();
        self.events.lock().unwrap().push((at, event));
    }

    pub(crate) fn events(&self) -> Vec<Event> {
        self.timed().into_iter().map(|(_, e)| e).collect()
    }

    /// Every event with its time, in microseconds since the start.
    pub(crate) fn timed(&self) -> Vec<(u128, Event)> {
        self.events.lock().unwrap().clone()
    }

    /// One line per event: microseconds since the start, then the event.
    pub(crate) fn save(&self, path: &str) {
        let lines: Vec<String> = self
            .events
            .lock()
            .unwrap()
            .iter()
            .map(|(at, e)| format!("{at} {e:?}"))
            .collect();
        std::fs::write(path, lines.join("\n")).unwrap();
    }
}

/// What one kind of fault did in a run.
#[derive(Debug, Default)]
pub(crate) struct Struck {
    /// How many times it struck.
    pub(crate) times: usize,
    /// Requests answered 5xx, or not in time, while it lasted or within [`AFTERMATH`] of its
    /// end (a 409, 425 or 429 is the protocol at work, faults or not, and is not counted).
    pub(crate) failed: usize,
    /// What it reached on the way to the store: chunks held or delayed, connections cut, a
    /// burst's answers kept.
    pub(crate) touched: u64,
}

/// What a run shows.
#[derive(Debug, Default)]
pub(crate) struct Report {
    pub(crate) requests: usize,
    pub(crate) answered: usize,
    pub(crate) replays: usize,
    pub(crate) faults: usize,
    pub(crate) keys: usize,
    /// Writes the ledger took that a later attempt's higher fence superseded: the work ran
    /// again after a lease ran out, and the fence kept the later one.
    pub(crate) superseded: usize,
    /// Writes the ledger refused for a lower fence: overtaken attempts turned away.
    pub(crate) refused: usize,
    /// Keys whose outcome the gateways hold as unknown (409 `outcome_unknown`).
    pub(crate) unknown: usize,
    /// Bursts of large answers at a stalled store; the most any gateway kept for its store,
    /// and the most its resident memory grew in one.
    pub(crate) bursts: usize,
    pub(crate) kept_peak: usize,
    pub(crate) rss_growth: usize,
    /// Answers by status (0: none in time).
    pub(crate) statuses: BTreeMap<u16, usize>,
    /// Per kind of fault, what it did.
    pub(crate) kinds: BTreeMap<String, Struck>,
    pub(crate) violations: Vec<String>,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} requests ({} answered 2xx, {} replays), {} faults, {} keys; ledger: {} writes \
             superseded by a higher fence, {} refused as stale; {} keys held unknown; {} \
             violations",
            self.requests,
            self.answered,
            self.replays,
            self.faults,
            self.keys,
            self.superseded,
            self.refused,
            self.unknown,
            self.violations.len()
        )?;
        let statuses: Vec<String> = self
            .statuses
            .iter()
            .map(|(s, n)| {
                if *s == 0 {
                    format!("{n} none")
                } else {
                    format!("{n} {s}")
                }
            })
            .collect();
        write!(f, "; answers: {}", statuses.join(", "))?;
        let kinds: Vec<String> = self
            .kinds
            .iter()
            .map(|(k, s)| {
                format!(
                    "{k} {}× ({} requests failed, {} reached at the store)",
                    s.times, s.failed, s.touched
                )
            })
            .collect();
        write!(f, "; faults: {}", kinds.join(", "))?;
        if self.bursts > 0 {
            write!(
                f,
                "; {} bursts of large answers at a stalled store: at most {} KiB kept, resident \
                 memory grown by at most {} MiB",
                self.bursts,
                self.kept_peak >> 10,
                self.rss_growth >> 20
            )?;
        }
        for v in &self.violations {
            write!(f, "\n  {v}")?;
        }
        Ok(())
    }
}

/// How long after a fault ends the requests that fail are still put down to it: a client's
/// timeout, and a little more.
const AFTERMATH: u128 = 2_000_000;

/// Statuses a client may be answered under faults without anything being wrong: a key in
/// progress or held unknown (409), too early (425), too busy (429), and any 5xx (the store or
/// the upstream failed, or an answer was not stored). Any other 4xx says the request was
/// misread, which these clients' requests never deserve.
fn expected(status: u16) -> bool {
    matches!(status, 200..=299 | 409 | 425 | 429 | 500..=599)
}

/// The fence an answer of the ledger names.
pub(crate) fn fence_of(body: &str) -> Option<u64> {
    let rest = body.split("\"fence\":").nth(1)?;
    rest.trim_end_matches('}').trim().parse().ok()
}

/// Per key: every 2xx answer any client got is the same (the first stored answer), and it is
/// the answer of the effect the ledger counts; no two writes the ledger took share a fence
/// (two attempts that both believed they held the key); no key answered without its effect.
pub(crate) fn check(history: &History, ledger: &Entries) -> Report {
    let mut r = Report::default();
    let mut answers: BTreeMap<String, Vec<String>> = BTreeMap::new();
    // The fault striking, or the last one, and when it began and ended.
    let mut window: Option<(String, u128, Option<u128>)> = None;
    for (at, e) in history.timed() {
        match e {
            Event::Invoke { .. } => r.requests += 1,
            Event::Fault { fault, .. } => {
                r.faults += 1;
                r.kinds.entry(fault.clone()).or_default().times += 1;
                window = Some((fault, at, None));
            }
            Event::Healed { touched } => {
                if let Some((kind, _, end)) = &mut window {
                    *end = Some(at);
                    r.kinds.entry(kind.clone()).or_default().touched += touched;
                }
            }
            Event::Relay(_) => {}
            Event::Memory {
                gateway,
                asked,
                budget,
                rss_before,
                rss_peak,
                kept_peak,
                kept_after,
            } => {
                let grown = rss_peak.saturating_sub(rss_before);
                r.bursts += 1;
                r.kept_peak = r.kept_peak.max(kept_peak);
                r.rss_growth = r.rss_growth.max(grown);
                if let Some((kind, _, _)) = &window {
                    r.kinds.entry(kind.clone()).or_default().touched +=
                        u64::try_from(kept_peak).unwrap_or(u64::MAX);
                }
                // The stall outlasts the gateway's store timeout (1 s): answers on their way
                // back find the store stalled and are kept to offer again.
                if kept_peak == 0 {
                    r.violations.push(format!(
                        "gateway {gateway} kept nothing for a store stalled past its store \
                         timeout"
                    ));
                }
                if kept_after > 0 {
                    r.violations.push(format!(
                        "gateway {gateway} still counted {kept_after} bytes kept for its store \
                         after the store came back"
                    ));
                }
                if kept_peak > budget {
                    r.violations.push(format!(
                        "gateway {gateway} kept {kept_peak} bytes for its store, past its budget \
                         of {budget}"
                    ));
                }
                if grown > MEMORY_PER_BYTE_ASKED * asked + budget + MEMORY_SLACK {
                    r.violations.push(format!(
                        "gateway {gateway} grew by {} MiB in a burst of {} KiB of answers",
                        grown >> 20,
                        asked >> 10
                    ));
                }
            }
            Event::Complete { key, answer } => {
                let status = answer.as_ref().map_or(0, |a| a.0);
                *r.statuses.entry(status).or_default() += 1;
                let within = window
                    .as_ref()
                    .filter(|(_, _, end)| end.is_none_or(|end| at <= end + AFTERMATH));
                if let Some((kind, _, _)) = within
                    && matches!(status, 0 | 500..=599)
                {
                    r.kinds.entry(kind.clone()).or_default().failed += 1;
                }
                if let Some((status, _, body)) = answer.as_ref().filter(|a| !expected(a.0)) {
                    r.violations
                        .push(format!("{key}: answered {status} {body}"));
                }
                match answer {
                    Some((200..=299, replayed, body)) => {
                        r.answered += 1;
                        r.replays += usize::from(replayed);
                        answers.entry(key).or_default().push(body);
                    }
                    Some((409, _, body)) if body.contains("outcome_unknown") => {
                        answers.entry(key).or_default();
                    }
                    _ => {}
                }
            }
        }
    }
    let mut writes: HashMap<(&str, u64), usize> = HashMap::new();
    let mut per_key: HashMap<&str, usize> = HashMap::new();
    for (key, fence) in &ledger.accepted {
        *writes.entry((key, *fence)).or_default() += 1;
        *per_key.entry(key).or_default() += 1;
    }
    for ((key, fence), n) in &writes {
        if *n > 1 {
            r.violations
                .push(format!("{key}: {n} writes under one fence {fence}"));
        }
    }
    r.superseded = per_key.values().map(|n| n - 1).sum();
    r.refused = ledger.refused.len();
    r.keys = per_key.len();
    // A fault that changed nothing shows nothing about the guarantees: every kind that struck
    // must have failed a request or reached the store's traffic.
    for (kind, s) in &r.kinds {
        if s.failed == 0 && s.touched == 0 {
            r.violations.push(format!(
                "{kind} struck {}× without effect: no request failed while it lasted, and it \
                 reached nothing on the way to the store",
                s.times
            ));
        }
    }
    for (key, bodies) in &answers {
        let Some(first) = bodies.first() else {
            r.unknown += 1;
            continue;
        };
        if let Some(other) = bodies.iter().find(|b| *b != first) {
            r.violations
                .push(format!("{key}: answered {first} and {other}"));
        }
        let counted = ledger.counted.get(key.as_str()).copied();
        if fence_of(first) != counted {
            r.violations.push(format!(
                "{key}: answered {first}, the ledger counts fence {counted:?}"
            ));
        }
    }
    r
}

/// What the broker held once a relay run had drained.
#[derive(Debug, Default)]
pub(crate) struct Drained {
    /// Messages still in the queue, or waiting to go back to it: never acked.
    pub(crate) left: u64,
    /// The dead letters: each one's message id and reason.
    pub(crate) dead: Vec<(String, String)>,
}

/// What a relay run shows.
#[derive(Debug, Default)]
pub(crate) struct RelayReport {
    /// Distinct message ids published.
    pub(crate) messages: usize,
    /// Ids published a second time (a redelivery the records must drop).
    pub(crate) duplicates: usize,
    pub(crate) faults: usize,
    /// Ids whose effect the ledger counts.
    pub(crate) effects: usize,
    /// Writes the ledger took that a later attempt's higher fence superseded.
    pub(crate) superseded: usize,
    /// Writes the ledger refused for a lower fence.
    pub(crate) refused: usize,
    pub(crate) dead_letters: usize,
    pub(crate) violations: Vec<String>,
}

impl fmt::Display for RelayReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} messages ({} published twice), {} faults; ledger: {} effects, {} writes \
             superseded by a higher fence, {} refused as stale; {} dead letters; {} violations",
            self.messages,
            self.duplicates,
            self.faults,
            self.effects,
            self.superseded,
            self.refused,
            self.dead_letters,
            self.violations.len()
        )?;
        for v in &self.violations {
            write!(f, "\n  {v}")?;
        }
        Ok(())
    }
}

/// Per message id published in a relay run: the ledger counts its effect (none lost), no two
/// writes it took share a fence (no double effect), and the broker holds nothing of it once
/// the run drained: no message left unacked, and no dead letter (the ledger answers 2xx, or
/// 409 to an attempt overtaken by a higher fence). The ledger's keys are the message ids.
pub(crate) fn check_relay(history: &History, ledger: &Entries, drained: &Drained) -> RelayReport {
    let mut r = RelayReport::default();
    let mut copies: BTreeMap<String, usize> = BTreeMap::new();
    for e in history.events() {
        match e {
            Event::Relay(RelayEvent::Published { id }) => *copies.entry(id).or_default() += 1,
            Event::Relay(RelayEvent::Fault { .. }) => r.faults += 1,
            _ => {}
        }
    }
    r.messages = copies.len();
    r.duplicates = copies.values().filter(|n| **n > 1).count();
    let mut writes: HashMap<(&str, u64), usize> = HashMap::new();
    let mut per_key: HashMap<&str, usize> = HashMap::new();
    for (key, fence) in &ledger.accepted {
        *writes.entry((key, *fence)).or_default() += 1;
        *per_key.entry(key).or_default() += 1;
    }
    let mut doubled: Vec<_> = writes.iter().filter(|(_, n)| **n > 1).collect();
    doubled.sort();
    for ((key, fence), n) in doubled {
        r.violations.push(format!(
            "{key}: {n} writes under one fence {fence} (a double effect)"
        ));
    }
    r.superseded = per_key.values().map(|n| n - 1).sum();
    r.refused = ledger.refused.len();
    r.effects = ledger.counted.len();
    r.dead_letters = drained.dead.len();
    let mut strangers: Vec<_> = ledger
        .counted
        .keys()
        .filter(|k| !copies.contains_key(*k))
        .collect();
    strangers.sort();
    for key in strangers {
        r.violations
            .push(format!("{key}: an effect for a message nobody published"));
    }
    let dead: BTreeMap<&str, &str> = drained
        .dead
        .iter()
        .map(|(id, why)| (id.as_str(), why.as_str()))
        .collect();
    for (id, n) in &copies {
        let counted = ledger.counted.get(id);
        match (counted, dead.get(id.as_str())) {
            (None, None) => r.violations.push(format!(
                "{id}: lost: published {n} times, no effect at the ledger, no dead letter"
            )),
            (None, Some(why)) => r.violations.push(format!(
                "{id}: dead-lettered ({why}), no effect at the ledger"
            )),
            (Some(fence), Some(why)) => r.violations.push(format!(
                "{id}: dead-lettered ({why}) though the ledger counts its effect (fence {fence})"
            )),
            (Some(_), None) => {}
        }
    }
    if drained.left > 0 {
        r.violations.push(format!(
            "{} messages left in the broker, never acked",
            drained.left
        ));
    }
    r
}

#[cfg(test)]
mod planted {
    use super::*;

    fn ledger(accepted: &[(&str, u64)]) -> Entries {
        let mut e = Entries::default();
        for (k, f) in accepted {
            e.accepted.push(((*k).to_owned(), *f));
            e.counted.insert((*k).to_owned(), *f);
        }
        e
    }

    fn answered(history: &History, key: &str, body: &str) {
        history.push(Event::Complete {
            key: key.to_owned(),
            answer: Some((201, false, body.to_owned())),
        });
    }

    /// A kind that failed no request and reached nothing at the store is flagged; one that
    /// did either is not, nor are 409s (the protocol at work, faults or not).
    #[test]
    fn a_kind_that_struck_without_effect_is_flagged() {
        let h = History::default();
        let strike = |kind: &str, touched: u64, answer: Option<u16>| {
            h.push(Event::Fault {
                fault: kind.into(),
                gateway: 0,
            });
            if let Some(status) = answer {
                h.push(Event::Complete {
                    key: "busy".into(),
                    answer: Some((status, false, "in_progress".into())),
                });
            }
            h.push(Event::Healed { touched });
        };
        strike("cut", 3, None);
        strike("kill", 0, Some(503));
        strike("jitter", 0, Some(409));
        let r = check(&h, &ledger(&[]));
        assert_eq!(r.violations.len(), 1, "{r}");
        assert!(
            r.violations[0].starts_with("jitter struck 1× without effect"),
            "{r}"
        );
        assert_eq!((r.kinds["cut"].touched, r.kinds["kill"].failed), (3, 1));
    }

    #[test]
    fn a_double_effect_is_flagged() {
        let h = History::default();
        answered(&h, "k", "{\"key\":\"k\",\"fence\":5000}");
        let r = check(&h, &ledger(&[("k", 5000), ("k", 5000)]));
        assert_eq!(r.violations.len(), 1, "{r}");
        assert!(r.violations[0].contains("2 writes under one fence"), "{r}");
    }

    #[test]
    fn a_replay_that_differs_or_names_an_effect_that_does_not_count_is_flagged() {
        let h = History::default();
        answered(&h, "k", "{\"key\":\"k\",\"fence\":5000}");
        answered(&h, "k", "{\"key\":\"k\",\"fence\":5001}");
        let r = check(&h, &ledger(&[("k", 5000), ("k", 5001)]));
        assert_eq!(r.violations.len(), 2, "{r}");
        assert_eq!(r.superseded, 1);
    }

    #[test]
    fn an_answer_no_client_deserves_is_flagged() {
        let h = History::default();
        for (status, body) in [
            (503, "answer_not_stored"),
            (409, "in_progress"),
            (422, "mismatch"),
        ] {
            h.push(Event::Complete {
                key: "k".into(),
                answer: Some((status, false, body.into())),
            });
        }
        let r = check(&h, &ledger(&[]));
        assert_eq!(r.violations, ["k: answered 422 mismatch"], "{r}");
    }

    #[test]
    fn an_answer_without_its_effect_is_flagged() {
        let h = History::default();
        answered(&h, "lost", "{\"key\":\"lost\",\"fence\":7000}");
        let r = check(&h, &ledger(&[]));
        assert_eq!(r.violations.len(), 1, "{r}");
    }

    #[test]
    fn a_gateway_keeping_nothing_past_its_budget_or_growing_without_bound_is_flagged() {
        let h = History::default();
        let burst = |kept_peak, rss_peak, kept_after| Event::Memory {
            gateway: 0,
            asked: 6 << 20,
            budget: 1 << 20,
            rss_before: 40 << 20,
            rss_peak,
            kept_peak,
            kept_after,
        };
        h.push(burst(1 << 20, 70 << 20, 0));
        let r = check(&h, &ledger(&[]));
        assert!(r.violations.is_empty(), "{r}");
        h.push(burst((1 << 20) + 1, 70 << 20, 0));
        h.push(burst(1, 120 << 20, 0));
        h.push(burst(0, 40 << 20, 0));
        h.push(burst(1 << 20, 70 << 20, 4096));
        let r = check(&h, &ledger(&[]));
        assert_eq!(r.violations.len(), 4, "{r}");
        assert!(r.violations[0].contains("past its budget"), "{r}");
        assert!(r.violations[1].contains("grew by 80 MiB"), "{r}");
        assert!(r.violations[2].contains("kept nothing"), "{r}");
        assert!(r.violations[3].contains("still counted 4096 bytes"), "{r}");
    }

    fn published(history: &History, ids: &[&str]) {
        for id in ids {
            history.push(Event::Relay(RelayEvent::Published {
                id: (*id).to_owned(),
            }));
        }
    }

    #[test]
    fn a_relay_run_with_every_effect_counted_once_passes() {
        let h = History::default();
        published(&h, &["a", "b", "b"]);
        // b ran again after its lease ran out: superseded, not doubled.
        let r = check_relay(
            &h,
            &ledger(&[("a", 10), ("b", 10), ("b", 11)]),
            &Drained::default(),
        );
        assert!(r.violations.is_empty(), "{r}");
        assert_eq!(
            (r.messages, r.duplicates, r.effects, r.superseded),
            (2, 1, 2, 1)
        );
    }

    #[test]
    fn a_lost_message_is_flagged() {
        let h = History::default();
        published(&h, &["a", "lost"]);
        let r = check_relay(&h, &ledger(&[("a", 10)]), &Drained::default());
        assert_eq!(r.violations.len(), 1, "{r}");
        assert!(r.violations[0].starts_with("lost: lost"), "{r}");
    }

    #[test]
    fn a_double_effect_of_a_message_is_flagged() {
        let h = History::default();
        published(&h, &["a", "a"]);
        let r = check_relay(&h, &ledger(&[("a", 10), ("a", 10)]), &Drained::default());
        assert_eq!(r.violations.len(), 1, "{r}");
        assert!(r.violations[0].contains("a double effect"), "{r}");
    }

    #[test]
    fn dead_letters_and_messages_left_unacked_are_flagged() {
        let h = History::default();
        published(&h, &["a", "b"]);
        let drained = Drained {
            left: 1,
            dead: vec![
                ("a".into(), "refused".into()),
                ("b".into(), "refused".into()),
            ],
        };
        let r = check_relay(&h, &ledger(&[("a", 10)]), &drained);
        assert_eq!(r.violations.len(), 3, "{r}");
        assert!(
            r.violations[0].contains("though the ledger counts its effect"),
            "{r}"
        );
        assert!(r.violations[1].contains("no effect at the ledger"), "{r}");
        assert!(r.violations[2].contains("never acked"), "{r}");
    }
}
