//! The consumer's and relay's order (claim, handle, record, ack) under redelivery and crashes,
//! checked exhaustively at small bounds in plain and inbox mode; planted bugs caught.

use std::time::Instant;

use idem_model::delivery::{ACKED_RECORDED, ONE_EFFECT};
use idem_model::{DeliveryBounds, DeliveryBug, DeliveryModel, Mode};
use stateright::{Checker, HasDiscoveries, Model};

/// `IDEM_MODEL=large` explores [`DeliveryBounds::LARGE`] (build with `--release`).
fn bounds() -> DeliveryBounds {
    match std::env::var("IDEM_MODEL").as_deref() {
        Ok("large") => DeliveryBounds::LARGE,
        _ => DeliveryBounds::SMALL,
    }
}

#[test]
fn the_consumer_order_keeps_its_guarantees_in_every_interleaving() {
    for mode in [Mode::Plain, Mode::Inbox] {
        let started = Instant::now();
        let checker = DeliveryModel::new(mode, bounds())
            .checker()
            .spawn_bfs()
            .join();
        println!(
            "{mode:?} {:?}: {} states ({} unique), depth {}, {:.1?}",
            bounds(),
            checker.state_count(),
            checker.unique_state_count(),
            checker.max_depth(),
            started.elapsed()
        );
        checker.assert_properties();
    }
}

/// Each planted bug breaks the property that names it; the counterexample is printed.
#[test]
fn planted_consumer_bugs_are_caught() {
    for (mode, bug, property) in [
        (Mode::Plain, DeliveryBug::AckBeforeRecord, ACKED_RECORDED),
        (Mode::Inbox, DeliveryBug::AckBeforeRecord, ACKED_RECORDED),
        (Mode::Plain, DeliveryBug::AckWhileInProgress, ACKED_RECORDED),
        (Mode::Inbox, DeliveryBug::AckWhileInProgress, ACKED_RECORDED),
        (Mode::Inbox, DeliveryBug::CommitApart, ONE_EFFECT),
        (Mode::Plain, DeliveryBug::PostWithoutFence, ONE_EFFECT),
        (Mode::Plain, DeliveryBug::AckNotRecorded, ACKED_RECORDED),
        (Mode::Inbox, DeliveryBug::AckNotRecorded, ACKED_RECORDED),
    ] {
        let model = DeliveryModel::new(mode, DeliveryBounds::SMALL).with_bug(bug);
        let checker = model
            .checker()
            .finish_when(HasDiscoveries::AnyOf([property].into()))
            .spawn_bfs()
            .join();
        let path = checker
            .discovery(property)
            .unwrap_or_else(|| panic!("{mode:?} {bug:?} was not caught by {property:?}"));
        println!(
            "{mode:?} {bug:?} breaks {property:?}: {:?}",
            path.into_actions()
        );
    }
}
