//! Kafka's offset rule, through the Kafka source's own bookkeeping: a group whose members
//! crash and whose partition moves at any point, checked exhaustively in both orders.

use std::time::Instant;

use idem_model::kafka::{ALL_COMMITTED, COMMITTED_DONE, KafkaBounds, KafkaModel, ONE_RUN};
use idem_mq::offsets::Order;
use stateright::{Checker, Model};

#[test]
fn the_offset_rule_holds_in_every_interleaving() {
    for order in [Order::Partition, Order::Key] {
        let started = Instant::now();
        let checker = KafkaModel::new(order, KafkaBounds::SMALL)
            .checker()
            .spawn_bfs()
            .join();
        println!(
            "{order:?}: {} states ({} unique), depth {}, {:.1?}",
            checker.state_count(),
            checker.unique_state_count(),
            checker.max_depth(),
            started.elapsed()
        );
        checker.assert_properties();
        for property in [COMMITTED_DONE, ONE_RUN, ALL_COMMITTED] {
            assert!(checker.discovery(property).is_none(), "{property}");
        }
    }
}
