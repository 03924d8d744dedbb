//! The conformance suite, run unchanged against every store in this crate.

#![allow(clippy::unwrap_used)]

mod memory {
    use idem_store::MemoryStore;
    use idem_testkit::conformance::Fixture;

    idem_testkit::conformance_tests!(async { Fixture::new(MemoryStore::new()) });

    mod locks {
        use std::sync::Arc;

        use idem_core::SharedLockStore;
        use idem_store::MemoryStore;

        idem_testkit::lock_conformance_tests!(async {
            Arc::new(MemoryStore::new()) as SharedLockStore
        });
    }
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use idem_store::SqliteStore;
    use idem_testkit::conformance::Fixture;

    async fn fixture() -> Fixture<SqliteStore> {
        let dir = tempfile::tempdir().expect("temporary directory");
        let store = SqliteStore::open(dir.path().join("idem.db")).expect("open SQLite store");
        Fixture::with_guard(store, dir)
    }

    idem_testkit::conformance_tests!(fixture());

    mod locks {
        use std::sync::Arc;

        use idem_core::SharedLockStore;

        idem_testkit::lock_conformance_tests!(async {
            let fixture = super::fixture().await;
            let store = Arc::new(fixture.store.clone()) as SharedLockStore;
            Some((store, fixture))
        });
    }
}

/// The type-erased store the server uses passes too.
mod shared {
    use idem_testkit::conformance::Fixture;

    idem_testkit::conformance_tests!(async {
        Fixture::new(idem_store::open("memory://").await.expect("open memory://"))
    });
}

/// A store behind a replay cache answers as the store does.
mod cached {
    use idem_store::{MemoryStore, ReplayCache, ReplayCacheLimits};
    use idem_testkit::conformance::Fixture;

    idem_testkit::conformance_tests!(async {
        Fixture::new(ReplayCache::new(
            MemoryStore::new(),
            ReplayCacheLimits::default(),
        ))
    });
}
