//! `idem id`: new ids on standard output.

use std::sync::Arc;

use idem_core::SystemClock;

use super::open_store_once;

#[derive(clap::Args)]
pub(crate) struct IdArgs {
    /// What to print: uuid7, snowflake, segment (with --tag) or token (128 random bits in
    /// hex).
    #[arg(long, default_value = "uuid7", value_parser = ["uuid7", "snowflake", "segment", "token"])]
    kind: String,

    /// The segment sequence to take ids from (--kind segment). The command line's sequences
    /// are its own: `idem serve` keeps each caller's apart from them.
    #[arg(long, required_if_eq("kind", "segment"))]
    tag: Option<String>,

    /// How many (1 to 1,000,000).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    count: u32,

    /// The store Snowflake worker ids are leased from and segment sequences live in.
    #[arg(long, env = "IDEM_STORE", default_value = "sqlite://idem.db")]
    store: String,

    /// The Snowflake id space.
    #[arg(long, env = "IDEM_ID_SPACE", default_value = "default")]
    id_space: String,
}

pub(crate) async fn print_ids(args: &IdArgs) -> Result<(), String> {
    use std::io::Write;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let mut line = |text: &str| writeln!(out, "{text}").map_err(|e| format!("cannot write: {e}"));
    match args.kind.as_str() {
        "snowflake" => {
            let store = open_store_once(&args.store).await?;
            let pool = idem_id::WorkerPool::new(store, Arc::new(SystemClock), &args.id_space);
            let g = pool
                .claim(
                    idem_id::Layout::default(),
                    idem_id::SnowflakeOptions::default(),
                )
                .await
                .map_err(|e| e.to_string())?;
            // The first ids come once no earlier holder of the worker id may still stamp (at
            // most idem_id::ISSUE_WINDOW after the claim), and only while the lease is renewed.
            let heartbeat = g.spawn_heartbeat();
            let mut issued = Ok(());
            let mut left = args.count;
            while left > 0 && issued.is_ok() {
                issued = match g.try_next() {
                    Ok(id) => {
                        left -= 1;
                        line(&id.to_string())
                    }
                    Err(
                        idem_id::IdError::Starting { retry_after }
                        | idem_id::IdError::Exhausted { retry_after },
                    ) => {
                        tokio::time::sleep(retry_after).await;
                        Ok(())
                    }
                    Err(e) => Err(e.to_string()),
                };
            }
            heartbeat.abort();
            g.release().await.map_err(|e| e.to_string())?;
            issued?;
        }
        "segment" => {
            let store = open_store_once(&args.store).await?;
            let tag = args.tag.as_deref().unwrap_or_default();
            // One range of exactly `count`, and no range fetched ahead: nothing is wasted.
            let options = idem_id::SegmentOptions {
                initial_step: u64::from(args.count),
                min_step: u64::from(args.count),
                prefetch_at: 2.0,
                ..idem_id::SegmentOptions::default()
            };
            let segments =
                idem_id::Segments::new(store, tag, options).map_err(|e| e.to_string())?;
            for _ in 0..args.count {
                let id = segments.next().await.map_err(|e| e.to_string())?;
                line(&id.to_string())?;
            }
        }
        "token" => (0..args.count).try_for_each(|_| line(&idem_id::token()))?,
        _ => (0..args.count).try_for_each(|_| line(&idem_id::uuid7().to_string()))?,
    }
    out.flush().map_err(|e| format!("cannot write: {e}"))
}
