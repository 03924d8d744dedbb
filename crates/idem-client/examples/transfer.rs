//! Sends one transfer through a server that honours `Idempotency-Key`, retrying safely, and
//! sends it again with the same key to show the replay.
//!
//! ```sh
//! idem gateway --upstream http://127.0.0.1:8080 --listen 127.0.0.1:7080 &
//! cargo run -p idem-client --example transfer -- http://127.0.0.1:7080/v1/transfers
//! ```

#![allow(clippy::print_stdout)]

use std::time::Duration;

use idem_client::{Error, Retries, RetryPolicy};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "http://127.0.0.1:7080/v1/transfers".to_owned());
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    let retries = Retries::new(RetryPolicy::default().total_time(Duration::from_secs(30)));
    // One logical operation, one key: made here so that the second send can reuse it.
    let key = idem_client::new_key();
    for _ in 0..2 {
        let request = http
            .post(&url)
            .header("Idempotency-Key", format!("\"{key}\""))
            .header("Authorization", "Bearer example-caller")
            .header("Content-Type", "application/json")
            .body(r#"{"from":"alice","to":"bob","amount":100}"#);
        match retries.send(&http, request).await {
            Ok(answer) => {
                let (status, report) = (answer.response.status(), answer.report);
                let body = answer.response.text().await?;
                println!(
                    "{status} after {} attempt(s), replayed: {}: {body}",
                    report.attempts, report.replayed
                );
            }
            Err(Error::OutcomeUnknown { detail, .. }) => {
                println!("outcome unknown: {}", detail.unwrap_or_default());
                break;
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}
