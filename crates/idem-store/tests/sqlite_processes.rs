//! Several processes on one SQLite file: every key is acquired by exactly one of them.
//!
//! The test re-runs its own binary as the child processes (selected by an environment
//! variable), so each child is a real, separate process with its own connection.

#![cfg(feature = "sqlite")]
#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::collections::HashSet;
use std::process::Command;
use std::sync::Arc;

use idem_core::{BeginOutcome, BeginRequest, Bytes, Fingerprint, Key, Store, Timestamp};
use idem_store::SqliteStore;

const CHILD_ENV: &str = "IDEM_TEST_SQLITE_CHILD_DB";
const PROCESSES: usize = 4;
const TASKS_PER_PROCESS: usize = 8;
const KEYS: usize = 300;
const MARK: &str = "IDEM-CHILD-ACQUIRED";

fn key(i: usize) -> Key {
    Key::parse("procs", "storm", &format!("key-{i}")).unwrap()
}

#[test]
fn several_processes_share_one_file() {
    if let Ok(db) = std::env::var(CHILD_ENV) {
        return child(&db);
    }
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("shared.db");
    drop(SqliteStore::open(&db).unwrap());

    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..PROCESSES)
        .map(|_| {
            Command::new(&exe)
                .args(["--exact", "several_processes_share_one_file", "--nocapture"])
                .env(CHILD_ENV, &db)
                .output()
        })
        .collect();

    let mut winners = HashSet::new();
    for out in children {
        let out = out.unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "child failed: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let line = stdout
            .lines()
            .find(|l| l.starts_with(MARK))
            .expect("child reported its keys");
        for k in line.split_whitespace().skip(1) {
            assert!(
                winners.insert(k.to_owned()),
                "{k} acquired by two processes"
            );
        }
    }
    assert_eq!(winners.len(), KEYS, "every key acquired exactly once");

    // Every record is completed and replays its single winner's answer.
    let store = SqliteStore::open(&db).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        for i in 0..KEYS {
            let req = BeginRequest::new(key(i), Fingerprint::of_bytes(b"same"));
            match store.begin(&req, Timestamp::now()).await.unwrap() {
                BeginOutcome::Replay(r) => {
                    assert_eq!(&r.response[..], format!("key-{i}").as_bytes());
                }
                other => panic!("key-{i}: {other:?}"),
            }
        }
    });
}

fn child(db: &str) {
    let store = SqliteStore::open(db).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let won = rt.block_on(async {
        let store = Arc::new(store);
        let tasks: Vec<_> = (0..TASKS_PER_PROCESS)
            .map(|t| {
                let store = store.clone();
                tokio::spawn(async move {
                    let mut won = Vec::new();
                    // Every task walks all keys, starting at a different place.
                    for j in 0..KEYS {
                        let i = (j + t * KEYS / TASKS_PER_PROCESS) % KEYS;
                        let req = BeginRequest::new(key(i), Fingerprint::of_bytes(b"same"));
                        let now = Timestamp::now();
                        match store.begin(&req, now).await.unwrap() {
                            BeginOutcome::Acquired(lease) => {
                                let body = Bytes::from(format!("key-{i}"));
                                store.complete(&req.key, &lease, body, now).await.unwrap();
                                won.push(format!("key-{i}"));
                            }
                            BeginOutcome::InProgress { .. } | BeginOutcome::Replay(_) => {}
                            BeginOutcome::Mismatch => panic!("mismatch with one fingerprint"),
                        }
                    }
                    won
                })
            })
            .collect();
        let mut won = Vec::new();
        for t in tasks {
            won.extend(t.await.unwrap());
        }
        won
    });
    println!("{MARK} {}", won.join(" "));
}
