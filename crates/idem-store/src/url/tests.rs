//! The URL forms `open` accepts, parsed.

use super::*;

#[test]
fn parses_the_documented_forms() {
    assert_eq!(
        "memory://".parse(),
        Ok(StoreUrl::Memory(crate::MemoryLimits::DEFAULT))
    );
    assert!("memory://x".parse::<StoreUrl>().is_err());
    assert!("idem.db".parse::<StoreUrl>().is_err());
    assert!("redis2://x".parse::<StoreUrl>().is_err());
}

#[cfg(feature = "sqlite")]
#[test]
fn parses_memory_bounds() {
    assert_eq!(
        "memory://?max_records=10&max_bytes=4096".parse(),
        Ok(StoreUrl::Memory(crate::MemoryLimits::new(10, 4096)))
    );
    assert_eq!(
        "memory://?max_bytes=1".parse(),
        Ok(StoreUrl::Memory(crate::MemoryLimits::new(100_000, 1)))
    );
    for (url, says) in [
        (
            "memory://?max_records=0",
            "max_records=\"0\" is not a positive",
        ),
        (
            "memory://?max_records=-1",
            "max_records=\"-1\" is not a positive",
        ),
        (
            "memory://?max_bytes=1M",
            "max_bytes=\"1M\" is not a positive",
        ),
        ("memory://?max_bytes", "max_bytes=\"\" is not a positive"),
        (
            "memory://?max_keys=1",
            "unknown memory:// option \"max_keys\"",
        ),
        ("memory://x?max_bytes=1", "takes no path"),
    ] {
        let e = url.parse::<StoreUrl>().unwrap_err().to_string();
        assert!(e.contains(says), "{url}: {e}");
    }
}

#[test]
fn parses_sqlite_paths_and_options() {
    assert_eq!(
        "sqlite:///var/lib/idem.db?synchronous=normal&busy_timeout_ms=10&key_filter=off".parse(),
        Ok(StoreUrl::Sqlite {
            path: "/var/lib/idem.db".into(),
            synchronous: crate::Synchronous::Normal,
            busy_timeout_ms: 10,
            key_filter: false,
            create: true,
        })
    );
    assert!(matches!(
        "sqlite://idem.db?key_filter=FALSE".parse(),
        Ok(StoreUrl::Sqlite {
            key_filter: false,
            ..
        })
    ));
    assert!(matches!(
        "sqlite://idem.db".parse(),
        Ok(StoreUrl::Sqlite { path, synchronous: crate::Synchronous::Full, key_filter: true, .. }) if path == std::path::Path::new("idem.db")
    ));
    for bad in [
        "sqlite://",
        "sqlite://x.db?synchronous=off",
        "sqlite://x.db?busy_timeout_ms=soon",
        "sqlite://x.db?key_filter=yes",
        "sqlite://x.db?journal=delete",
    ] {
        let e = bad.parse::<StoreUrl>().unwrap_err();
        assert!(!e.to_string().is_empty(), "{bad}");
    }
}

#[cfg(feature = "postgres")]
#[test]
fn parses_postgres_urls_and_takes_out_idem_options() {
    let parsed =
        "postgres://u@db/app?sslmode=disable&idem_table=idem.records&idem_pool=4&idem_batch=1"
            .parse::<StoreUrl>()
            .unwrap();
    let StoreUrl::Postgres { url, options } = parsed else {
        panic!("not postgres: {parsed:?}");
    };
    assert_eq!(url, "postgres://u@db/app?sslmode=disable");
    assert_eq!(options.table, "idem.records");
    assert_eq!(options.max_connections, 4);
    assert_eq!(options.max_batch, 1);
    assert!(matches!(
        "postgresql://db/app".parse(),
        Ok(StoreUrl::Postgres { url, .. }) if url == "postgresql://db/app"
    ));
    for bad in [
        "postgres://db/app?idem_pool=0",
        "postgres://db/app?idem_batch=0",
        "postgres://db/app?idem_batch=-1",
        "postgres://db/app?idem_batch=1025",
        "postgres://db/app?idem_color=red",
    ] {
        assert!(bad.parse::<StoreUrl>().is_err(), "{bad}");
    }
}

#[cfg(feature = "redis")]
#[test]
fn parses_redis_and_cluster_urls() {
    let parsed = "redis://:pw@cache:6380/2?idem_prefix=app:&idem_batch=8"
        .parse::<StoreUrl>()
        .unwrap();
    let StoreUrl::Redis {
        nodes,
        cluster,
        options,
    } = parsed
    else {
        panic!("not redis: {parsed:?}");
    };
    assert_eq!(nodes, ["redis://:pw@cache:6380/2"]);
    assert!(!cluster);
    assert_eq!(options.prefix, "app:");
    assert_eq!(options.max_batch, 8);
    assert!("redis://cache?idem_batch=0".parse::<StoreUrl>().is_err());
    assert!("redis://cache?idem_batch=1025".parse::<StoreUrl>().is_err());
    let parsed = "redis+cluster://a:7000,b:7001".parse::<StoreUrl>().unwrap();
    let StoreUrl::Redis { nodes, cluster, .. } = parsed else {
        panic!("not redis: {parsed:?}");
    };
    assert_eq!(nodes, ["redis://a:7000", "redis://b:7001"]);
    assert!(cluster);
    let parsed = "redis+cluster://:pw@a:7000,b:7001"
        .parse::<StoreUrl>()
        .unwrap();
    let StoreUrl::Redis { nodes, .. } = parsed else {
        panic!("not redis: {parsed:?}");
    };
    assert_eq!(nodes, ["redis://:pw@a:7000", "redis://:pw@b:7001"]);
    for bad in [
        "redis://",
        "redis+cluster://a:1/0",
        "redis://a?idem_x=1",
        "redis+cluster://a:1,",
    ] {
        assert!(bad.parse::<StoreUrl>().is_err(), "{bad}");
    }
}

#[cfg(feature = "mysql")]
#[test]
fn parses_mysql_and_mariadb_urls() {
    let parsed = "mariadb://root@db/app?idem_table=t&ssl-mode=disabled"
        .parse::<StoreUrl>()
        .unwrap();
    let StoreUrl::MySql { url, options } = parsed else {
        panic!("not mysql: {parsed:?}");
    };
    assert_eq!(url, "mysql://root@db/app?ssl-mode=disabled");
    assert_eq!(options.table, "t");
    assert_eq!(options.max_batch, 64);
    assert!("mysql://db/app?idem_pool=x".parse::<StoreUrl>().is_err());
    assert!("mysql://db/app?idem_batch=x".parse::<StoreUrl>().is_err());
}

/// `?key_filter=off` reaches the store: it opens without the filter, and with it by default.
#[cfg(feature = "sqlite")]
#[test]
fn the_sqlite_key_filter_follows_the_url() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("", true),
        ("?key_filter=off", false),
        ("?key_filter=on", true),
    ];
    for (i, (query, filtered)) in cases.into_iter().enumerate() {
        let url: StoreUrl = format!("sqlite://x.db{query}").parse().unwrap();
        let StoreUrl::Sqlite {
            synchronous,
            busy_timeout_ms,
            key_filter,
            ..
        } = url
        else {
            panic!("not sqlite")
        };
        let options = super::sqlite_options(synchronous, busy_timeout_ms, key_filter);
        let path = dir.path().join(format!("k{i}.db"));
        let store = crate::SqliteStore::open_with(path, options).unwrap();
        assert_eq!(store.has_key_filter(), filtered, "{query:?}");
    }
    // No read connections, nothing to skip: no filter either.
    let options = crate::SqliteOptions {
        read_connections: 0,
        ..crate::SqliteOptions::default()
    };
    let store = crate::SqliteStore::open_with(dir.path().join("r0.db"), options).unwrap();
    assert!(!store.has_key_filter());
}

/// Passwords as people type them (with `/`, `?`, `@`, `#`, `:` unencoded) and credentials in
/// the query never survive redaction, whatever the scheme.
#[test]
fn redaction_hides_every_credential_a_url_can_carry() {
    let secret = "S3cretPW";
    for password in [
        "S3c/retPW",
        "S3c?retPW",
        "S3c@retPW",
        "S3c#retPW",
        "S3c:ret/?@#PW",
    ] {
        for scheme in ["postgres", "mysql", "redis", "amqp", "nats", "http"] {
            let url = format!("{scheme}://u:{password}@db.example:5432/app?sslmode=require");
            let shown = redact(&url);
            assert!(!shown.contains("ret"), "{url} -> {shown}");
            assert!(shown.starts_with(&format!("{scheme}://u:***@")), "{shown}");
        }
    }
    for query in [
        "password",
        "sslpassword",
        "PASSWORD",
        "passwd",
        "pwd",
        "auth_token",
        "token",
        "secret",
        "client-secret",
        "api_key",
        "ssl%70assword",
    ] {
        let url = format!("postgres://db/app?user=app&{query}={secret}&sslmode=require");
        let shown = redact(&url);
        assert!(!shown.contains(secret), "{url} -> {shown}");
        assert!(
            shown.contains("user=app") && shown.contains("sslmode=require"),
            "{shown}"
        );
    }
    // A `#` in a query credential belongs to its value.
    assert!(!redact("postgres://db/app?password=S3c#retPW").contains("ret"));
    // A lone user part is a name for the SQL, Redis and AMQP schemes and a token otherwise.
    assert_eq!(redact("postgres://app@db/x"), "postgres://app@db/x");
    assert_eq!(redact("nats://S3cretPW@h:4222"), "nats://***@h:4222");
    assert_eq!(redact("http://S3cretPW@h/x"), "http://***@h/x");
    // Without a scheme, the same rules.
    assert_eq!(redact("u:S3c/retPW@db/app"), "u:***@db/app");
    // A parsed URL's debug form too.
    #[cfg(all(feature = "postgres", feature = "mysql", feature = "redis"))]
    for url in [
        "postgres://u:S3c/retPW@db/app",
        "mysql://u:S3c@retPW@db/app",
        "redis+cluster://:S3c?retPW@a:1,b:2",
    ] {
        let parsed: StoreUrl = url.parse().unwrap();
        let shown = format!("{parsed:?}");
        assert!(!shown.contains("ret"), "{shown}");
    }
}

/// An option the PostgreSQL driver does not read is refused by name: the driver would print
/// its value in a warning (`sslpassword` is a secret), and ignore it.
#[cfg(feature = "postgres")]
#[test]
fn postgres_options_the_driver_ignores_are_refused_without_their_value() {
    for url in [
        "postgres://u@db/app?sslpassword=S3cretPW",
        "postgres://u@db/app?sslmode=require&ssl%70assword=S3cretPW",
        "postgres://u@db/app?connect_timeout=S3cretPW",
        "postgres://u@db/app?S3cretPW",
    ] {
        let e = url.parse::<StoreUrl>().unwrap_err().to_string();
        assert!(e.contains("is not one the driver reads"), "{url}: {e}");
        assert!(!e.contains("S3cretPW"), "{url}: {e}");
    }
    for url in [
        "postgres://u@db/app?sslmode=disable&application_name=a&options[search_path]=x",
        "postgres://db/app?user=u&password=p&idem_pool=2",
    ] {
        assert!(url.parse::<StoreUrl>().is_ok(), "{url}");
    }
}

/// `existing_only` opens a SQLite file that is there and refuses, plainly, one that is not,
/// creating nothing.
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn an_existing_only_url_does_not_create_a_sqlite_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("typo.db");
    let url: StoreUrl = format!("sqlite://{}", missing.display()).parse().unwrap();
    let Err(err) = url.clone().existing_only().open().await else {
        panic!("a missing file opened")
    };
    assert!(err.to_string().contains("there is no such file"), "{err}");
    assert!(!missing.exists(), "a file was created");
    // Created the usual way, it then opens as an existing store.
    drop(url.clone().open().await.map_err(|e| e.to_string()).unwrap());
    let opened = url.existing_only().open().await;
    assert!(opened.is_ok(), "{:?}", opened.err());
}
