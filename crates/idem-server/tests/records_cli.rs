//! `idem records` as a user runs it: against a SQLite file with no server, listing, counting,
//! and repairs that ask first and refuse to guess.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Fingerprint, Key, Step, StepName, Store, Timestamp,
};
use idem_store::SqliteStore;
use serde_json::Value;

fn idem(db: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("records")
        .arg("--store")
        .arg(format!("sqlite://{}", db.display()))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `done` completed, `stuck-1` and `stuck-2` with leases that ran out, `running` in progress.
async fn populate(db: &Path) {
    let store = SqliteStore::open(db).unwrap();
    let now = Timestamp::now();
    let req = |k: &str, lease: Duration| {
        BeginRequest::new(
            Key::parse("tenant-a", "pay", k).unwrap(),
            Fingerprint::of_bytes(b"x"),
        )
        .with_lease(lease)
    };
    let BeginOutcome::Acquired(lease) = store
        .begin(&req("done", Duration::from_secs(60)), now)
        .await
        .unwrap()
    else {
        panic!("acquired")
    };
    let debit = Step::done(StepName::new("debit").unwrap(), &b"abc"[..]).unwrap();
    let done = req("done", Duration::ZERO).key;
    store.record_step(&done, &lease, &debit, now).await.unwrap();
    store
        .complete(
            &req("done", Duration::ZERO).key,
            &lease,
            Bytes::from_static(b"ok"),
            now,
        )
        .await
        .unwrap();
    for k in ["stuck-1", "stuck-2"] {
        store
            .begin(&req(k, Duration::from_millis(1)), now)
            .await
            .unwrap();
    }
    store
        .begin(&req("running", Duration::from_secs(600)), now)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
}

#[tokio::test]
async fn an_operator_lists_counts_and_releases_stuck_attempts() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("idem.db");
    populate(&db).await;

    let out = idem(&db, &["counts", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let counts: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(
        (counts["stuck"].clone(), counts["in_progress"].clone()),
        (2.into(), 1.into())
    );

    let out = idem(&db, &["list", "--state", "stuck"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let table = stdout(&out);
    assert!(
        table.contains("stuck-1") && table.contains("stuck-2") && !table.contains("running"),
        "{table}"
    );

    // Pages by cursor as JSON: one record a page, each once.
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let mut args = vec!["list", "--namespace", "pay", "--limit", "1", "--json"];
        if let Some(a) = &after {
            args.extend(["--after", a.as_str()]);
        }
        let out = idem(&db, &args);
        assert!(out.status.success(), "{}", stderr(&out));
        let page: Value = serde_json::from_str(&stdout(&out)).unwrap();
        for r in page["records"].as_array().unwrap() {
            seen.push(r["key"].as_str().unwrap().to_owned());
        }
        match page["next"].as_str() {
            Some(next) => after = Some(next.to_owned()),
            None => break,
        }
    }
    assert_eq!(seen, ["done", "running", "stuck-1", "stuck-2"]);

    // No terminal to ask and no --yes: nothing changes.
    let out = idem(&db, &["release"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("add --yes"), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("release 2 records (2 stuck)?"),
        "{}",
        stderr(&out)
    );
    // A running attempt is not released without --force.
    let out = idem(&db, &["release", "--state", "in_progress", "--yes"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--force"), "{}", stderr(&out));
    // Delete needs a filter or a key.
    let out = idem(&db, &["delete", "--yes"]);
    assert!(!out.status.success());

    let out = idem(&db, &["release", "--yes"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("release: 2 applied, 0 skipped"),
        "{}",
        stdout(&out)
    );
    let out = idem(&db, &["counts", "--json"]);
    let counts: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(
        (counts["stuck"].clone(), counts["released"].clone()),
        (0.into(), 2.into())
    );

    // One record by its key, shown and deleted.
    let out = idem(
        &db,
        &["show", "--scope", "tenant-a", "--namespace", "pay", "done"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("completed"), "{}", stdout(&out));
    assert!(
        stdout(&out).contains("debit done (3 bytes)"),
        "{}",
        stdout(&out)
    );
    let out = idem(
        &db,
        &[
            "show",
            "--scope",
            "tenant-a",
            "--namespace",
            "pay",
            "done",
            "--json",
        ],
    );
    let shown: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let steps = serde_json::json!([{"step": "debit", "outcome": "done", "output_bytes": 3}]);
    assert_eq!(shown["steps"], steps);
    let out = idem(
        &db,
        &[
            "delete",
            "--scope",
            "tenant-a",
            "--namespace",
            "pay",
            "--key",
            "done",
            "--yes",
        ],
    );
    assert!(
        stdout(&out).contains("delete: 1 applied"),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    let out = idem(
        &db,
        &["show", "--scope", "tenant-a", "--namespace", "pay", "done"],
    );
    assert!(!out.status.success());

    // Bad input: a clear message, not a panic.
    for args in [
        &["list", "--state", "done"][..],
        &["list", "--after", "nonsense"],
        &["list", "--scope", "has space"],
        &["list", "--older-than", "soon"],
    ] {
        let out = idem(&db, args);
        assert!(!out.status.success(), "{args:?}");
        let err = stderr(&out);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(!err.is_empty(), "{args:?}");
    }
}

/// A mistyped store path is an error that says so, and leaves no new, empty database behind
/// to answer later commands with zeros.
#[test]
fn the_records_tools_open_an_existing_store_only() {
    let dir = tempfile::tempdir().unwrap();
    let typo = dir.path().join("typo.db");
    for args in [&["counts"][..], &["list"], &["release", "--yes"]] {
        let out = idem(&typo, args);
        assert!(!out.status.success(), "{args:?}: {}", stdout(&out));
        let err = stderr(&out);
        assert!(err.contains("there is no such file"), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(!typo.exists(), "{args:?} created {}", typo.display());
    }
}

/// `--store` is taken before or after the subcommand, the same store either way.
#[tokio::test]
async fn the_store_is_named_on_either_side_of_the_subcommand() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("idem.db");
    populate(&db).await;
    let before = idem(&db, &["counts", "--json"]);
    let after = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["records", "counts", "--json", "--store"])
        .arg(format!("sqlite://{}", db.display()))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(after.status.success(), "{}", stderr(&after));
    let counts = |o: &Output| {
        let mut v: Value = serde_json::from_str(&stdout(o)).unwrap();
        // The one figure that moves between the two runs.
        v.as_object_mut()
            .unwrap()
            .remove("oldest_in_progress_seconds");
        v
    };
    assert_eq!(counts(&after), counts(&before));
    assert_eq!(counts(&after)["total"], 4);
}

/// A repair that would touch an attempt still in progress changes nothing without --force; a
/// filter leaves idem's own records out, and naming one by its key is refused.
#[tokio::test]
async fn repairs_need_force_for_running_attempts_and_leave_idems_own_records_alone() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("idem.db");
    populate(&db).await;
    // A server's Snowflake worker lease, as idem keeps it.
    let worker = BeginRequest::new(
        Key::parse("idem.ids", "snowflake.default", "7").unwrap(),
        Fingerprint::of_bytes(b"worker"),
    )
    .with_lease(Duration::from_secs(600));
    let store = SqliteStore::open(&db).unwrap();
    store.begin(&worker, Timestamp::now()).await.unwrap();
    drop(store);
    let total = |db: &Path| -> Value {
        let out = idem(db, &["counts", "--json"]);
        serde_json::from_str::<Value>(&stdout(&out)).unwrap()["total"].clone()
    };
    assert_eq!(total(&db), 5);

    let out = idem(&db, &["delete", "--namespace", "pay", "--yes"]);
    assert!(!out.status.success(), "{}", stdout(&out));
    assert!(stderr(&out).contains("--force"), "{}", stderr(&out));
    assert!(stderr(&out).contains("1 of the 4"), "{}", stderr(&out));
    assert_eq!(total(&db), 5, "nothing was deleted");

    let by_key = [
        "delete",
        "--scope",
        "idem.ids",
        "--namespace",
        "snowflake.default",
        "--key",
        "7",
        "--force",
        "--yes",
    ];
    let out = idem(&db, &by_key);
    assert!(!out.status.success(), "{}", stdout(&out));
    assert!(stderr(&out).contains("idem's own"), "{}", stderr(&out));

    let out = idem(
        &db,
        &["delete", "--state", "in_progress", "--force", "--yes"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("left out 1 of idem's own records"),
        "{}",
        stdout(&out)
    );
    assert!(
        stdout(&out).contains("delete: 1 applied"),
        "{}",
        stdout(&out)
    );
    assert_eq!(total(&db), 4, "the worker lease is still there");
}
