//! The lock with renewal and fences, checked exhaustively at small bounds; planted bugs caught;
//! the conditions under which a lease alone keeps two holders apart shown to be needed.

use std::time::Instant;

use idem_model::lock::{EXCLUSION, JUMP_MS, ONE_FENCE, ORDERED, STALE_CALL};
use idem_model::{LockBounds, LockBug, LockModel};
use stateright::{Checker, Expectation, HasDiscoveries, Model};

/// `IDEM_MODEL=large` explores [`LockBounds::LARGE`] (build with `--release`).
fn bounds() -> LockBounds {
    match std::env::var("IDEM_MODEL").as_deref() {
        Ok("large") => LockBounds::LARGE,
        _ => LockBounds::SMALL,
    }
}

/// The bounds without a clock jump.
fn in_step() -> LockBounds {
    LockBounds {
        clock_jumps: 0,
        ..bounds()
    }
}

/// Explores all of `model`, and says how much.
fn explore(model: LockModel) -> (impl Checker<LockModel>, String) {
    let started = Instant::now();
    let checker = model.checker().spawn_bfs().join();
    let size = format!(
        "{:?}: {} states ({} unique), depth {}, {:.1?}",
        model.bounds,
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        started.elapsed()
    );
    (checker, size)
}

/// The first counterexample to `property` in `model`, if any (the search stops there).
fn counterexample(model: LockModel, property: &'static str) -> Option<String> {
    let checker = model
        .checker()
        .finish_when(HasDiscoveries::AnyOf([property].into()))
        .spawn_bfs()
        .join();
    checker
        .discovery(property)
        .map(|path| format!("{:?}", path.into_actions()))
}

/// With the backend's clock jumping ahead and its state lost, fences and owner checks hold; only
/// the belief of holding the lock may overlap, which is what the fences are for.
#[test]
fn the_lock_keeps_its_fences_in_every_interleaving() {
    let model = LockModel::new(bounds());
    let (checker, size) = explore(model);
    println!("{size}");
    for p in model.properties() {
        let found = checker.discovery(p.name);
        match p.expectation {
            Expectation::Always if p.name == EXCLUSION => {
                assert!(
                    found.is_some(),
                    "a clock jump or a lost state lets beliefs overlap"
                );
            }
            Expectation::Always => {
                assert!(
                    found.is_none(),
                    "{:?} broken: {:?}",
                    p.name,
                    found.map(|f| f.into_actions())
                );
            }
            _ => assert!(found.is_some(), "{:?} never reached", p.name),
        }
    }
}

/// With the backend's clock in step with the clients', a lease alone keeps holders apart: a
/// guard's deadline, counted from before it asked, ends before the backend's lease does.
#[test]
fn with_clocks_in_step_one_client_believes_it_holds_the_lock() {
    let (checker, size) = explore(LockModel::new(in_step()));
    println!("{size}");
    checker.assert_properties();
}

/// A jump of the backend's clock by more than a guard allows for (1% and 2 ms) lets two clients
/// believe they hold the lock at once.
#[test]
fn a_clock_jump_lets_two_clients_believe_they_hold_the_lock() {
    let bounds = LockBounds {
        clock_jumps: 1,
        ..in_step()
    };
    let path = counterexample(LockModel::new(bounds), EXCLUSION)
        .expect("a clock jump lets beliefs overlap");
    println!("the backend's clock jumps {JUMP_MS} ms: {path}");
}

/// Each planted bug breaks the property that names it; the counterexample is printed.
#[test]
fn planted_lock_bugs_are_caught() {
    for (bug, property) in [
        (LockBug::TakeoverKeepsFence, ONE_FENCE),
        (LockBug::RenewWithoutOwnerCheck, STALE_CALL),
        (LockBug::ReleaseWithoutOwnerCheck, STALE_CALL),
        (LockBug::FencesWithoutClockTerm, ORDERED),
    ] {
        let model = LockModel::new(LockBounds::SMALL).with_bug(bug);
        let path = counterexample(model, property)
            .unwrap_or_else(|| panic!("{bug:?} was not caught by {property:?}"));
        println!("{bug:?} breaks {property:?}: {path}");
    }
}
