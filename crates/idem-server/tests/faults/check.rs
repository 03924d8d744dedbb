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
        self.events
            .lock()
            .unwrap()
            .iter()
            .map(|(_, e)| e.clone())
            .collect()
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
        for v in &self.violations {
            write!(f, "\n  {v}")?;
        }
        Ok(())
    }
}

/// The fence an answer of the ledger names.
fn fence_of(body: &str) -> Option<u64> {
    let rest = body.split("\"fence\":").nth(1)?;
    rest.trim_end_matches('}').trim().parse().ok()
}

/// Per key: every 2xx answer any client got is the same (the first stored answer), and it is
/// the answer of the effect the ledger counts; no two writes the ledger took share a fence
/// (two attempts that both believed they held the key); no key answered without its effect.
pub(crate) fn check(history: &History, ledger: &Entries) -> Report {
    let mut r = Report::default();
    let mut answers: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for e in history.events() {
        match e {
            Event::Invoke { .. } => r.requests += 1,
            Event::Fault { .. } => r.faults += 1,
            Event::Complete { key, answer } => match answer {
                Some((200..=299, replayed, body)) => {
                    r.answered += 1;
                    r.replays += usize::from(replayed);
                    answers.entry(key).or_default().push(body);
                }
                Some((409, _, body)) if body.contains("outcome_unknown") => {
                    answers.entry(key).or_default();
                }
                _ => {}
            },
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
    fn an_answer_without_its_effect_is_flagged() {
        let h = History::default();
        answered(&h, "lost", "{\"key\":\"lost\",\"fence\":7000}");
        let r = check(&h, &ledger(&[]));
        assert_eq!(r.violations.len(), 1, "{r}");
    }
}
