//! The commands that do not serve: readable errors, help, migrations, ids.

use super::*;

#[test]
fn bad_flags_and_stores_get_readable_errors() {
    let dir = tempfile::tempdir().unwrap();
    let not_db = dir.path().join("not.db");
    std::fs::write(&not_db, vec![b'x'; 4096]).unwrap();
    let not_db = format!("sqlite://{}", not_db.display());
    fails_with(&["serve", "--store", "mongodb://x"], "unknown store scheme");
    fails_with(
        &["migrate", "--store", "mongodb://x"],
        "unknown store scheme",
    );
    fails_with(&["migrate", "--store", &not_db], "not a SQLite database");
    fails_with(&["serve", "--store", "idem.db"], "has no scheme");
    fails_with(
        &["serve", "--store", "sqlite:///nonexistent-dir/x/idem.db"],
        "cannot open the file",
    );
    fails_with(&["serve", "--store", &not_db], "not a SQLite database");
    fails_with(&["serve", "--listen", "everywhere"], "invalid value");
    fails_with(&["serve", "--ttl", "soon"], "invalid value");
    fails_with(&["serve", "--lease", "1000y"], "at most");
    fails_with(
        &["serve", "--listen", "0.0.0.0:0", "--store", "memory://"],
        "refusing to serve",
    );
    fails_with(
        &["serve", "--api-keys", "/nonexistent/keys"],
        "cannot read API keys file",
    );
    // A scope another way in gives its callers is refused at start, by name (before the
    // store, which here cannot be opened: nothing is left running either way).
    for scope in ["anonymous", "cred-3f9a0b", "relay", "mq", "idem.ids"] {
        let keys = dir.path().join("keys");
        std::fs::write(&keys, format!("{scope} 0123456789abcdef0123\n")).unwrap();
        let keys = keys.display().to_string();
        fails_with(
            &[
                "serve",
                "--store",
                "sqlite:///nonexistent-dir/x/idem.db",
                "--api-keys",
                &keys,
            ],
            "line 1: the scope is reserved",
        );
    }
    fails_with(&["frobnicate"], "unrecognized subcommand");
    fails_with(&["gateway", "--store", "memory://"], "no upstream");
    fails_with(
        &["gateway", "--upstream", "https://api.example"],
        "must be an http:// URL",
    );
    fails_with(
        &[
            "gateway",
            "--upstream",
            "http://127.0.0.1:1",
            "--config",
            "/nonexistent.toml",
        ],
        "cannot read /nonexistent.toml",
    );
    let config = dir.path().join("gateway.toml");
    let token = dir.path().join("token");
    std::fs::write(&token, "short\n").unwrap();
    let short_token = format!("admin_token_file = {:?}", token.display());
    for (text, expected) in [
        (
            "upstream_timeout = \"60s\"\n[defaults]\nlease = \"30s\"",
            "longer than upstream_timeout",
        ),
        ("[[route]]\npath = \"orders\"", "must start with /"),
        (
            "[[route]]\npath = \"/a\"\nkey = \"sometimes\"",
            "route]] #1",
        ),
        ("upstream = 5", "invalid type"),
        ("admin_prefix = \"/\"", "admin prefix"),
        ("[defaults]\npath = \"/a\"", "[defaults] takes no path"),
        ("[[route]]\nkey = \"required\"", "needs a path"),
        ("scope_header = \"bad header\"", "not a header name"),
        ("upstream_timeout = \"300000000000y\"", "upstream_timeout"),
        ("upstream_timeout = \"2h\"", "at most"),
        ("purge_interval = \"often\"", "purge_interval"),
        (
            "admin_token_file = \"/nonexistent-token\"",
            "cannot read admin token file",
        ),
        (&short_token, "at least 16 characters"),
    ] {
        std::fs::write(&config, text).unwrap();
        let config = config.to_str().unwrap();
        fails_with(
            &[
                "gateway",
                "--upstream",
                "http://127.0.0.1:1",
                "--store",
                "memory://",
                "--config",
                config,
            ],
            expected,
        );
    }
}

/// A store URL's credentials never appear in what `idem` prints: passwords typed with `/`, `?`,
/// `@`, `#` or `:` unencoded (which a driver may misread, and its error quote), and
/// credentials in the query (`sslpassword`, which the PostgreSQL driver would echo in a
/// warning). The stores are the machine's, on loopback; each URL fails or opens, and
/// neither prints the secret.
#[test]
fn no_credential_of_a_store_url_is_ever_printed() {
    let mut urls = Vec::new();
    for password in [
        "S3c/retPW",
        "S3c?retPW",
        "S3c@retPW",
        "S3c#retPW",
        "S3c:ret/@PW",
    ] {
        urls.push(format!(
            "postgres://idem_nobody:{password}@127.0.0.1:5432/test"
        ));
        urls.push(format!(
            "mysql://idem_nobody:{password}@127.0.0.1:3306/test"
        ));
        urls.push(format!("redis://idem_nobody:{password}@127.0.0.1:6379"));
        urls.push(format!(
            "redis+cluster://:{password}@127.0.0.1:1,127.0.0.1:2"
        ));
    }
    for query in [
        "sslpassword=S3cretPW",
        "password=S3cretPW",
        "sslmode=disable&pass%77ord=S3cretPW",
    ] {
        urls.push(format!(
            "postgres://idem_nobody@127.0.0.1:5432/test?{query}"
        ));
        urls.push(format!("mysql://idem_nobody@127.0.0.1:3306/test?{query}"));
    }
    for url in &urls {
        prints_no_secret(&["migrate", "--store", url]);
        prints_no_secret(&["serve", "--store", url, "--listen", "127.0.0.1:1"]);
    }
}

/// No credential of `--from`, `--to` or `--store` appears in what `idem relay` prints, at
/// start or when it cannot connect.
#[test]
fn the_relay_never_prints_a_credential_of_its_urls() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite = format!("sqlite://{}", dir.path().join("relay.db").display());
    let cases = [
        // Unreachable broker, a target with credentials in its user part and query.
        [
            "amqp://guest:S3c/ret?PW@127.0.0.1:1/%2f",
            "http://u:S3c@retPW@127.0.0.1:1/x?token=S3cretPW",
            sqlite.as_str(),
        ],
        // A store whose URL the driver would have warned about, with its value.
        [
            "amqp://guest:S3c#retPW@127.0.0.1:1/%2f",
            "http://127.0.0.1:1/x",
            "postgres://u:S3c/retPW@127.0.0.1:1/db?sslpassword=S3cretPW",
        ],
    ];
    for [from, to, store] in cases {
        prints_no_secret(&[
            "relay", "--from", from, "--queue", "q", "--to", to, "--store", store,
        ]);
    }
}

/// Runs `idem` with `args` (logging everything), which must fail without printing any part
/// of the secret the test URLs carry (`S3c…retPW`) or panicking.
fn prints_no_secret(args: &[&str]) {
    let out = idem().args(args).env("IDEM_LOG", "debug").output().unwrap();
    assert!(
        !out.status.success() || args[0] == "migrate",
        "{args:?} succeeded"
    );
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !printed.contains("S3c") && !printed.contains("retPW"),
        "{args:?}: {printed}"
    );
    assert!(!printed.contains("panicked"), "{args:?}: {printed}");
}

#[test]
fn help_explains_each_command() {
    let out = idem().arg("--help").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(text.contains("serve"), "{text}");
    let out = idem().args(["serve", "--help"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--store",
        "--listen",
        "--api-keys",
        "IDEM_STORE",
        "sqlite://idem.db",
        "127.0.0.1:7070",
    ] {
        assert!(text.contains(flag), "serve --help lacks {flag}");
    }
}

#[test]
fn migrate_creates_the_schema_and_exits() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("idem.db");
    let out = idem()
        .args(["migrate", "--store", &format!("sqlite://{}", db.display())])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("up to date"));
    let conn = rusqlite::Connection::open(&db).unwrap();
    let tables: i64 = conn
        .query_row(
            "SELECT COUNT(*) FROM sqlite_master WHERE name = 'idem_records'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(tables, 1);
}

#[test]
fn id_prints_ids_one_per_line() {
    let out = idem().args(["id", "--count", "3"]).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let ids: Vec<&str> = text.lines().collect();
    assert_eq!(ids.len(), 3);
    assert!(
        ids.iter()
            .all(|u| u.len() == 36 && u.as_bytes()[14] == b'7')
    );
    assert!(ids.windows(2).all(|w| w[0] < w[1]));

    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("ids.db").display());
    let out = idem()
        .args([
            "id",
            "--kind",
            "snowflake",
            "--count",
            "1000",
            "--store",
            &store,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ids: Vec<u64> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(ids.len(), 1000);
    assert!(ids.windows(2).all(|w| w[0] < w[1]));
    // Two runs of one segment sequence continue it.
    let segment = |n: &str| {
        let out = idem()
            .args([
                "id", "--kind", "segment", "--tag", "orders", "--count", n, "--store", &store,
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| l.parse::<u64>().unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(segment("3"), [1, 2, 3]);
    assert_eq!(segment("2"), [4, 5]);
    fails_with(&["id", "--kind", "segment"], "--tag");
    fails_with(&["id", "--count", "0"], "invalid value");
    fails_with(&["id", "--kind", "ulid"], "invalid value");
}

/// Four processes sharing one SQLite store issue a million Snowflake ids each: no id twice,
/// and each process under a worker id of its own.
#[test]
fn four_processes_on_one_store_never_issue_the_same_id() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("ids.db").display());
    let children: Vec<_> = (0..4)
        .map(|_| {
            idem()
                .args([
                    "id",
                    "--kind",
                    "snowflake",
                    "--count",
                    "1000000",
                    "--store",
                    &store,
                ])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let layout = idem_id::Layout::default();
    let mut all = std::collections::HashSet::with_capacity(4_000_000);
    let mut workers = std::collections::HashSet::new();
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        let mut worker = None;
        let mut count = 0;
        for line in text.lines() {
            let id: u64 = line.parse().unwrap();
            assert!(all.insert(id), "id {id} issued twice");
            let w = layout.decode(id).worker;
            assert_eq!(*worker.get_or_insert(w), w, "one process, two worker ids");
            count += 1;
        }
        assert_eq!(count, 1_000_000);
        assert!(
            workers.insert(worker.unwrap()),
            "two processes shared a worker id"
        );
    }
    assert_eq!(all.len(), 4_000_000);
}
