//! A transfer in three steps that survives the process dying half way.
//!
//! ```sh
//! cargo run -p idem --example transfer_steps -- --die-after debit   # exits after the debit
//! cargo run -p idem --example transfer_steps                        # resumes: bank, credit
//! cargo run -p idem --example transfer_steps                        # replays the answer
//! ```
//!
//! The record lives in `transfer-steps.db` (SQLite) in the current directory; the lease is two
//! seconds, so the second run waits that long for the dead attempt's lease before it resumes.
//! Every step prints when its work runs: across the three runs each runs once.

#![allow(clippy::print_stdout)] // an example prints what it did

use std::time::Duration;

use idem::{Idempotency, InFlight, Key, SqliteStore};

#[derive(Debug, serde::Serialize, serde::Deserialize)]
enum TransferError {
    Declined,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let die_after = args
        .iter()
        .position(|a| a == "--die-after")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let idem = Idempotency::new(SqliteStore::open("transfer-steps.db")?);
    let key = Key::parse("example", "transfer", "t-1")?;
    let die = |step: &str| {
        if die_after.as_deref() == Some(step) {
            println!("  (the process dies after {step})");
            std::process::exit(3);
        }
    };
    let done = idem
        .once(&key)
        .input(&("alice", "bob", 100))?
        .lease(Duration::from_secs(2))
        .in_flight(InFlight::Wait(Duration::from_secs(5)))
        .steps(|s| async move {
            println!(
                "attempt with fence {}, resuming after {} step(s)",
                s.lease().fence,
                s.resumed()
            );
            let hold: String = s
                .step("debit", |_| async {
                    println!("  debit: hold 100 on alice");
                    Ok::<_, TransferError>("hold-7".to_owned())
                })
                .await?;
            die("debit");
            let receipt: String = s
                .step("bank", |cx| async move {
                    // A real bank would get cx.key() as its idempotency key.
                    println!("  bank: transfer {hold} with key {}", cx.key());
                    Ok::<_, TransferError>(format!("bank-tx-for-{hold}"))
                })
                .await?;
            die("bank");
            s.step("credit", |_| async move {
                println!("  credit: bob gets 100 ({receipt})");
                Ok::<_, TransferError>(format!("done: {receipt}"))
            })
            .await
        })
        .await?;
    println!(
        "answer: {} ({})",
        done.value,
        if done.replayed {
            "replayed"
        } else {
            "this run"
        }
    );
    Ok(())
}
