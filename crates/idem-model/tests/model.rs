//! The record protocol, checked exhaustively at small bounds; planted bugs caught; the
//! clock assumption shown to be needed.

use std::time::Instant;

use idem_model::record::LEASE_MS;
use idem_model::{Bounds, Bug, RecordModel};
use stateright::{Checker, HasDiscoveries, Model};

/// `IDEM_MODEL=large` explores [`Bounds::LARGE`] (build with `--release`).
fn bounds() -> Bounds {
    match std::env::var("IDEM_MODEL").as_deref() {
        Ok("large") => Bounds::LARGE,
        _ => Bounds::SMALL,
    }
}

#[test]
fn the_record_protocol_keeps_its_guarantees_in_every_interleaving() {
    let started = Instant::now();
    let checker = RecordModel::new(bounds()).checker().spawn_bfs().join();
    println!(
        "{:?}: {} states ({} unique), depth {}, {:.1?}",
        bounds(),
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        started.elapsed()
    );
    checker.assert_properties();
}

/// The first counterexample to `property` in `model`, if any (the search stops there).
fn counterexample(model: RecordModel, property: &'static str) -> Option<String> {
    let checker = model
        .checker()
        .finish_when(HasDiscoveries::AnyOf([property].into()))
        .spawn_bfs()
        .join();
    checker
        .discovery(property)
        .map(|path| format!("{:?}", path.into_actions()))
}

const SAME_FENCE: &str = "no two attempts hold the key with one fence";
const STALE_SETTLE: &str = "a stale lease never completes, releases or steps";
const ORDERED_WRITES: &str =
    "a fenced resource never takes an older attempt's write after a newer one's";

/// Each planted bug breaks the property that names it; the counterexample is printed.
#[test]
fn planted_bugs_are_caught() {
    for (bug, property) in [
        (Bug::TakeoverKeepsFence, SAME_FENCE),
        (Bug::CompleteWithoutLeaseCheck, STALE_SETTLE),
        (Bug::FencesRestartAtOne, ORDERED_WRITES),
    ] {
        let model = RecordModel::new(Bounds::SMALL).with_bug(bug);
        let path = counterexample(model, property)
            .unwrap_or_else(|| panic!("{bug:?} was not caught by {property:?}"));
        println!("{bug:?} breaks {property:?}: {path}");
    }
}

/// The one assumption of fences after a delete: the record is created again later than the
/// clients' clocks disagree. A client whose clock runs a lease ahead, and a delete faster than
/// that, let a fence go back.
#[test]
fn fences_after_a_delete_need_clocks_closer_than_the_delete_takes() {
    let hasty = Bounds {
        delete_gap: LEASE_MS - 1,
        ..Bounds::SMALL
    };
    let path = counterexample(RecordModel::new(hasty), ORDERED_WRITES)
        .expect("a fence went back after a delete on skewed clocks");
    println!(
        "clocks a lease apart, a delete of {} ms: {path}",
        LEASE_MS - 1
    );
    let in_step = Bounds {
        clock_jumps: 0,
        delete_gap: 1,
        ..Bounds::SMALL
    };
    assert_eq!(
        counterexample(RecordModel::new(in_step), ORDERED_WRITES),
        None,
        "clocks in step: fences rise after any delete"
    );
}
