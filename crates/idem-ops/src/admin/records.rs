//! Records as operators see them, in the shapes the command line and the admin endpoints
//! share: a filter read from text, a listed record and counts as JSON, and bulk repairs that
//! touch only what was shown, applied here for both ([`apply`]).

use std::time::Duration;

use idem_core::{
    Bytes, Key, Listed, Namespace, RecordAdmin, RecordFilter, RecordState, Repair, Scope,
    SharedStore, Shown, StoreError, Timestamp,
};
use idem_http::operator::{self, RecordState as HttpState, UNKNOWN_PREFIX};
use tracing::info;

/// The most records one bulk repair may name.
pub const MAX_BULK: usize = 1000;

/// What a listing selects by, besides scope and namespace: one of the store's states, or the
/// completed records that hold an unknown outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Selector {
    /// Records in this state.
    State(RecordState),
    /// Completed records holding an unknown outcome.
    Unknown,
}

impl Selector {
    /// Reads `in_progress`, `stuck`, `completed`, `released`, `expired` or `unknown`.
    pub fn parse(s: &str) -> Result<Self, String> {
        if s == "unknown" {
            return Ok(Self::Unknown);
        }
        s.parse::<RecordState>().map(Self::State).map_err(|_| {
            "the state must be one of in_progress, stuck, completed, released, expired, \
                 unknown"
                .to_owned()
        })
    }
}

/// A filter from its parts as text; the error says which part is wrong.
pub fn filter(
    scope: Option<&str>,
    namespace: Option<&str>,
    state: Option<Selector>,
    older_than: Option<Duration>,
    now: Timestamp,
) -> Result<RecordFilter, String> {
    let scope = scope
        .map(|s| Scope::new(s).map_err(|e| format!("invalid scope: {e}")))
        .transpose()?;
    let namespace = namespace
        .map(|n| Namespace::new(n).map_err(|e| format!("invalid namespace: {e}")))
        .transpose()?;
    let (state, response_prefix) = match state {
        None => (None, None),
        Some(Selector::State(s)) => (Some(s), None),
        Some(Selector::Unknown) => (
            Some(RecordState::Completed),
            Some(Bytes::from_static(UNKNOWN_PREFIX)),
        ),
    };
    Ok(RecordFilter {
        scope,
        namespace,
        state,
        created_before: older_than.map(|d| now.saturating_sub(d)),
        response_prefix,
    })
}

/// Whether `key` is one of idem's own records (scope `idem.…`: each server's Snowflake worker
/// lease, one-time tokens). They are listed, never repaired: deleting or releasing a live
/// worker lease lets a second server take the same worker id and issue the same ids, and an
/// expired one is taken over by the next server that needs it without anyone's help.
pub fn is_internal(key: &Key) -> bool {
    key.scope()
        .as_str()
        .starts_with(super::RESERVED_SCOPE_PREFIX)
}

/// Why a repair is refused before it touches anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// It names this many of idem's own records ([`is_internal`]).
    Internal(usize),
    /// It names this many attempts in progress (their lease runs: they may still be working,
    /// and a retry let in beside one runs the work twice), without force.
    InProgress(usize),
}

/// The check every repair passes first, on the command line and over HTTP: idem's own records
/// are never repaired, and attempts shown in progress only with `force`.
pub fn check(targets: &[Target], force: bool) -> Result<(), Refused> {
    let internal = targets.iter().filter(|t| is_internal(&t.key)).count();
    if internal > 0 {
        return Err(Refused::Internal(internal));
    }
    let running = targets
        .iter()
        .filter(|t| t.shown.state == RecordState::InProgress)
        .count();
    if running > 0 && !force {
        return Err(Refused::InProgress(running));
    }
    Ok(())
}

/// One record named for a repair, with what was shown of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The record's key.
    pub key: Key,
    /// Its state and fence when shown.
    pub shown: Shown,
}

impl Target {
    /// The target a listed record makes.
    pub fn of(l: &Listed) -> Self {
        Self {
            key: l.key.clone(),
            shown: Shown {
                state: l.state,
                fence: l.fence,
            },
        }
    }
}

/// What a bulk repair did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, utoipa::ToSchema)]
pub struct Repaired {
    /// Records repaired.
    pub applied: u64,
    /// Records left alone: they had moved on since they were shown (another state, another
    /// fence, gone) or the repair does not apply to them.
    pub skipped: u64,
}

/// Every record matching `filter`, page by page, up to `max` of them; `Err` with the count
/// seen so far once more than `max` match.
pub async fn collect(
    admin: &dyn RecordAdmin,
    filter: &RecordFilter,
    max: usize,
    now: Timestamp,
) -> Result<Result<Vec<Listed>, usize>, StoreError> {
    let mut out = Vec::new();
    let mut after = None;
    loop {
        let page = admin
            .list(filter, after.as_ref(), idem_core::admin::MAX_PAGE, now)
            .await?;
        out.extend(page.records);
        if out.len() > max {
            return Ok(Err(out.len()));
        }
        match page.next {
            Some(next) => after = Some(next),
            None => return Ok(Ok(out)),
        }
    }
}

/// How many of `listed` are in each state, for a question put to an operator:
/// `2 completed, 1 in_progress`.
pub fn states(listed: &[Listed]) -> String {
    let mut counts: Vec<(RecordState, usize)> = Vec::new();
    for l in listed {
        match counts.iter_mut().find(|(s, _)| *s == l.state) {
            Some((_, n)) => *n += 1,
            None => counts.push((l.state, 1)),
        }
    }
    counts
        .iter()
        .map(|(s, n)| format!("{n} {s}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// How long ago `t` was at `now`, for people (`42s`, `3m`, `2h`, `5d`).
pub fn age(now: Timestamp, t: Timestamp) -> String {
    let secs = now.saturating_since(t).as_secs();
    match secs {
        0..120 => format!("{secs}s"),
        120..7200 => format!("{}m", secs / 60),
        7200..172_800 => format!("{}h", secs / 3600),
        _ => format!("{}d", secs / 86_400),
    }
}

/// A repair an operator asks for by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Give the key back (an attempt that is gone, an answer that must not stand).
    Release,
    /// Give back the key of an unknown outcome, and of nothing else.
    Reopen,
    /// Forget the record.
    Delete,
}

impl Action {
    /// Reads `release`, `reopen` or `delete`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "release" => Ok(Self::Release),
            "reopen" => Ok(Self::Reopen),
            "delete" => Ok(Self::Delete),
            _ => Err("the action must be release, reopen or delete".to_owned()),
        }
    }

    /// The action's name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Release => "release",
            Self::Reopen => "reopen",
            Self::Delete => "delete",
        }
    }

    /// The store's repair.
    pub const fn repair(self) -> Repair {
        match self {
            Self::Release | Self::Reopen => Repair::Release,
            Self::Delete => Repair::Delete,
        }
    }
}

/// Applies `action` to each target that is still as shown; `reopen` first checks that the
/// record holds an unknown outcome (its fence and state then pin that very completion, so the
/// check and the fenced repair cannot be split by a change). Logs and counts each repair.
pub async fn apply(
    store: &SharedStore,
    admin: &dyn RecordAdmin,
    targets: &[Target],
    action: Action,
    now: Timestamp,
    who: &str,
) -> Result<Repaired, (Repaired, idem_core::StoreError)> {
    let mut done = Repaired::default();
    for target in targets {
        let eligible = match action {
            Action::Reopen => match operator::inspect(&**store, &target.key, now).await {
                Ok(Some(view)) => {
                    target.shown.state == RecordState::Completed
                        && view.fence == target.shown.fence
                        && matches!(view.state, HttpState::Unknown { .. })
                }
                Ok(None) => false,
                Err(e) => return Err((done, e)),
            },
            Action::Release | Action::Delete => true,
        };
        let applied = if eligible {
            match admin
                .repair(&target.key, target.shown, action.repair(), now)
                .await
            {
                Ok(applied) => applied,
                Err(e) => return Err((done, e)),
            }
        } else {
            false
        };
        let result = if applied { "applied" } else { "skipped" };
        metrics::counter!("idem_record_repairs_total", "action" => action.as_str(), "result" => result)
            .increment(1);
        if applied {
            done.applied += 1;
            info!(
                action = action.as_str(),
                key = %target.key.log_tag(),
                namespace = %target.key.namespace(),
                fence = target.shown.fence,
                shown = %target.shown.state,
                operator = who,
                "an operator repaired a record"
            );
        } else {
            done.skipped += 1;
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_read_from_text() {
        let now = Timestamp::from_millis(100_000);
        let f = filter(
            Some("tenant-1"),
            Some("pay"),
            Some(Selector::parse("unknown").unwrap()),
            Some(Duration::from_secs(60)),
            now,
        )
        .unwrap();
        assert_eq!(f.state, Some(RecordState::Completed));
        assert_eq!(f.response_prefix.as_deref(), Some(UNKNOWN_PREFIX));
        assert_eq!(f.created_before, Some(Timestamp::from_millis(40_000)));
        assert_eq!(
            Selector::parse("stuck").unwrap(),
            Selector::State(RecordState::Stuck)
        );
        assert!(Selector::parse("done").is_err());
        assert!(filter(Some("bad scope"), None, None, None, now).is_err());
        assert!(filter(None, Some("bad/ns"), None, None, now).is_err());
    }

    #[test]
    fn repairs_leave_internal_records_alone_and_running_ones_without_force() {
        let target = |scope: &str, state| Target {
            key: Key::parse(scope, "ns", "k").unwrap(),
            shown: Shown { state, fence: 1 },
        };
        let stuck = target("tenant", RecordState::Stuck);
        let running = target("tenant", RecordState::InProgress);
        let worker = target("idem.ids", RecordState::InProgress);
        assert_eq!(check(std::slice::from_ref(&stuck), false), Ok(()));
        assert_eq!(
            check(&[stuck.clone(), running.clone()], false),
            Err(Refused::InProgress(1))
        );
        assert_eq!(check(&[stuck, running], true), Ok(()));
        assert_eq!(check(&[worker], true), Err(Refused::Internal(1)));
    }
}
