//! The user guide is an mdBook in `docs/` (`mdbook build docs`). Every chapter, and the
//! README, is included here as the documentation of an item that exists only for doctests, so
//! `cargo test --workspace` compiles each Rust example against the crates as they are, and
//! runs those that need no server (`no_run` marks the others). A chapter added to
//! `docs/SUMMARY.md` gets a line here too.

/// One item per chapter; the path is the chapter's, from the repository's root.
macro_rules! chapters {
    ($($name:ident = $path:literal;)*) => {
        $(
            #[doc = include_str!(concat!("../../../", $path))]
            #[cfg(doctest)]
            pub struct $name;
        )*
    };
}

chapters! {
    Readme = "README.md";
    Introduction = "docs/introduction.md";
    Library = "docs/guide/library.md";
    Layer = "docs/guide/layer.md";
    Grpc = "docs/guide/grpc.md";
    Gateway = "docs/guide/gateway.md";
    Serve = "docs/guide/serve.md";
    IdsTokensLocks = "docs/guide/ids-tokens-locks.md";
    Python = "docs/guide/python.md";
    TypeScript = "docs/guide/typescript.md";
    AdminPage = "docs/guide/admin-page.md";
    Consumers = "docs/guide/consumers.md";
    Kafka = "docs/guide/kafka.md";
    Relay = "docs/guide/relay.md";
    Client = "docs/guide/client.md";
    Guards = "docs/guide/guards.md";
    ShopBank = "docs/guide/shop-bank.md";
    Configuration = "docs/operations/configuration.md";
    Cli = "docs/operations/cli.md";
    Metrics = "docs/operations/metrics.md";
    Records = "docs/operations/records.md";
    Migrations = "docs/operations/migrations.md";
    Failure = "docs/failure.md";
    Guarantees = "docs/guarantees.md";
    Stores = "docs/stores.md";
    ProblemCodes = "docs/reference/problem-codes.md";
    Design = "docs/design.md";
    DesignStores = "docs/design/stores.md";
    DesignFailure = "docs/design/failure.md";
    DesignRunOnce = "docs/design/run-once.md";
    DesignMessages = "docs/design/messages.md";
    DesignOperators = "docs/design/operators.md";
    DesignHttp = "docs/design/http.md";
    DesignIdsLocks = "docs/design/ids-locks.md";
    DesignGuardsClient = "docs/design/guards-client.md";
    Glossary = "docs/glossary.md";
    Testing = "docs/testing.md";
    BenchmarksHistory = "docs/benchmarks-history.md";
}
