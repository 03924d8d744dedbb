//! `idem records`: list, count, show and repair records straight against a store, with no
//! server running.

use std::io::{BufRead, IsTerminal, Write};
use std::time::Duration;

use idem_core::{
    Key, Listed, RecordAdmin, RecordFilter, RecordState, SharedStore, Store, Timestamp,
};
use idem_http::operator;
use idem_ops::admin::answers::{counts_json, listed_json, steps_json};
use idem_ops::admin::records::{self, Action, Refused, Selector, Target, age, apply};

/// Writes a line to standard output, or returns the error (a closed pipe ends the command
/// instead of panicking).
macro_rules! say {
    ($($arg:tt)*) => {
        writeln!(std::io::stdout().lock(), $($arg)*).map_err(|e| format!("cannot write: {e}"))?
    };
}

#[derive(clap::Args)]
pub(crate) struct RecordsArgs {
    /// The store: sqlite://PATH, memory://, postgres://…, mysql://…, redis://… (an existing
    /// one: a missing SQLite file is not created); before or after the subcommand
    #[arg(
        long,
        env = "IDEM_STORE",
        default_value = "sqlite://idem.db",
        global = true
    )]
    store: String,

    #[command(subcommand)]
    command: RecordsCommand,
}

/// The records' scope, namespace, state and age, as the command line gives them.
#[derive(clap::Args, Clone)]
pub(crate) struct FilterArgs {
    /// Only this scope's records (`anonymous`, `cred-…` as logged, or an API key's scope).
    #[arg(long)]
    scope: Option<String>,

    /// Only this namespace's records (a gateway route's, a queue's, an API caller's).
    #[arg(long)]
    namespace: Option<String>,

    /// Only records in this state: in_progress, stuck, completed, released, expired, or
    /// unknown (completed with an unknown outcome).
    #[arg(long, value_parser = Selector::parse)]
    state: Option<Selector>,

    /// Only records whose latest attempt started at least this long ago (10m, 2h).
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    older_than: Option<Duration>,
}

impl FilterArgs {
    fn is_empty(&self) -> bool {
        self.scope.is_none()
            && self.namespace.is_none()
            && self.state.is_none()
            && self.older_than.is_none()
    }

    fn filter(&self, now: Timestamp) -> Result<RecordFilter, String> {
        records::filter(
            self.scope.as_deref(),
            self.namespace.as_deref(),
            self.state,
            self.older_than,
            now,
        )
    }
}

/// One record named by its key.
#[derive(clap::Args, Clone)]
pub(crate) struct KeyArgs {
    /// The record's scope.
    #[arg(long)]
    scope: String,
    /// The record's namespace.
    #[arg(long)]
    namespace: String,
    /// The record's client key (an Idempotency-Key value, a message id).
    key: String,
}

impl KeyArgs {
    fn key(&self) -> Result<Key, String> {
        Key::parse(&self.scope, &self.namespace, &self.key).map_err(|e| format!("invalid key: {e}"))
    }
}

#[derive(clap::Subcommand)]
pub(crate) enum RecordsCommand {
    /// List records, a page at a time (newest cursor last), as a table or JSON.
    List {
        #[command(flatten)]
        filter: FilterArgs,
        /// Records per page (1 to 1000).
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u16).range(1..=1000))]
        limit: u16,
        /// Start after this cursor (printed at the end of the previous page).
        #[arg(long)]
        after: Option<String>,
        /// Every page, not just one (JSON: one record per line).
        #[arg(long)]
        all: bool,
        /// JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Count records by state (unknown outcomes among the completed), and the oldest attempt.
    Counts {
        #[command(flatten)]
        filter: FilterArgs,
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Show one live record, with the answer it replays.
    Show {
        #[command(flatten)]
        key: KeyArgs,
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Let the next retry run an unknown outcome's work again: only once you know the first
    /// attempt did not take effect.
    Reopen(RepairArgs),
    /// Give back the keys of attempts that are gone (stuck by default; `--state in_progress`
    /// with `--force` for attempts whose lease still runs).
    Release(RepairArgs),
    /// Forget records, as a purge would.
    Delete(RepairArgs),
}

/// Which records a repair touches: one key, or every record a filter shows.
#[derive(clap::Args)]
pub(crate) struct RepairArgs {
    #[command(flatten)]
    filter: FilterArgs,
    /// Just this record (with --scope and --namespace).
    #[arg(long, requires_all = ["scope", "namespace"])]
    key: Option<String>,
    /// Do not ask before changing records.
    #[arg(long, short = 'y')]
    yes: bool,
    /// Also repair attempts whose lease is still running (they may still be working); without
    /// it a repair that would touch one changes nothing.
    #[arg(long)]
    force: bool,
    /// Refuse to touch more records than this at once.
    #[arg(long, default_value_t = 10_000)]
    max: usize,
}

/// Runs `idem records` against the store its flags name, which must exist.
pub(crate) async fn records(args: RecordsArgs) -> Result<(), String> {
    let store = super::open_existing_store(&args.store).await?;
    run(store, args.command).await
}

async fn run(store: SharedStore, command: RecordsCommand) -> Result<(), String> {
    let admin = Store::admin(&store)
        .ok_or_else(|| format!("the {} store does not list records", Store::kind(&store)))?;
    let now = Timestamp::now();
    let fail = |e: idem_core::StoreError| format!("the store failed: {e}");
    match command {
        RecordsCommand::List {
            filter,
            limit,
            after,
            all,
            json,
        } => {
            list(
                admin,
                &filter.filter(now)?,
                usize::from(limit),
                after,
                all,
                json,
                now,
            )
            .await
        }
        RecordsCommand::Counts { filter, json } => {
            let c = operator::counts(admin, &filter.filter(now)?, now)
                .await
                .map_err(fail)?;
            if json {
                say!("{}", counts_json(&c, now));
            } else {
                let r = &c.records;
                say!("in_progress  {}", r.in_progress);
                say!("stuck        {}", r.stuck);
                say!(
                    "completed    {} (unknown outcomes: {})",
                    r.completed,
                    c.unknown
                );
                say!("released     {}", r.released);
                say!("expired      {} (not yet purged)", r.expired);
                say!("total        {}", r.total());
                if let Some(t) = r.oldest_in_progress {
                    say!("oldest attempt started {} ago", age(now, t));
                }
            }
            Ok(())
        }
        RecordsCommand::Show { key, json } => {
            let key = key.key()?;
            let record = store
                .get(&key, now)
                .await
                .map_err(fail)?
                .ok_or("there is no live record under this key")?;
            let mut v = listed_json(&Listed::of(&record, now));
            v["steps"] = steps_json(&record);
            let answer = operator::stored_answer(&record);
            if let Some(a) = &answer {
                v["answer"] = serde_json::json!({
                    "status": a.status.as_u16(),
                    "body_bytes": a.body.len(),
                });
            }
            if json {
                say!("{v}");
                return Ok(());
            }
            print_table(&[Listed::of(&record, now)], now)?;
            if let Some(steps) = v["steps"].as_array().filter(|s| !s.is_empty()) {
                say!("\nsteps:");
                for s in steps {
                    match s["output_bytes"].as_u64() {
                        Some(n) => say!("  {} done ({n} bytes)", s["step"].as_str().unwrap_or("")),
                        None => say!("  {} unknown", s["step"].as_str().unwrap_or("")),
                    }
                }
            }
            if let Some(a) = answer {
                say!("\nanswer: {}", a.status);
                // Control characters escaped: a stored answer must not drive the terminal (a
                // header value may hold bytes that decode to C1 controls).
                for (name, value) in &a.headers {
                    say!(
                        "{name}: {}",
                        printable(&String::from_utf8_lossy(value.as_bytes()))
                    );
                }
                match std::str::from_utf8(&a.body) {
                    Ok(text) => say!("\n{}", printable(text)),
                    Err(_) => say!("\n({} bytes, not text)", a.body.len()),
                }
            }
            Ok(())
        }
        RecordsCommand::Reopen(args) => repair(&store, admin, args, Action::Reopen, now).await,
        RecordsCommand::Release(args) => repair(&store, admin, args, Action::Release, now).await,
        RecordsCommand::Delete(args) => repair(&store, admin, args, Action::Delete, now).await,
    }
}

async fn list(
    admin: &dyn RecordAdmin,
    filter: &RecordFilter,
    limit: usize,
    after: Option<String>,
    all: bool,
    json: bool,
    now: Timestamp,
) -> Result<(), String> {
    let mut after = after
        .map(|a| a.parse().map_err(|e| format!("--after: {e}")))
        .transpose()?;
    let mut shown = 0usize;
    loop {
        let page = admin
            .list(filter, after.as_ref(), limit, now)
            .await
            .map_err(|e| format!("the store failed: {e}"))?;
        shown += page.records.len();
        let next = page.next.as_ref().map(ToString::to_string);
        match (json, all) {
            (true, true) => {
                for l in &page.records {
                    say!("{}", listed_json(l));
                }
            }
            (true, false) => {
                let records: Vec<_> = page.records.iter().map(listed_json).collect();
                say!("{}", serde_json::json!({"records": records, "next": next}));
            }
            (false, _) => print_table(&page.records, now)?,
        }
        match (page.next, all) {
            (Some(cursor), true) => after = Some(cursor),
            (Some(_), false) => {
                if !json {
                    let next = next.unwrap_or_default();
                    say!("\n{shown} shown; more with --after {next} (or --all)");
                }
                return Ok(());
            }
            (None, _) => {
                if !json {
                    say!("\n{shown} records");
                }
                return Ok(());
            }
        }
    }
}

fn print_table(records: &[Listed], now: Timestamp) -> Result<(), String> {
    if records.is_empty() {
        return Ok(());
    }
    say!(
        "{:<11} {:<10} {:>16} {:>6} {:>8}  {:<14} {:<16} KEY",
        "STATE",
        "HOLDS",
        "FENCE",
        "AGE",
        "EXPIRES",
        "SCOPE",
        "NAMESPACE"
    );
    for l in records {
        let holds = match operator::listed_state(l) {
            operator::RecordState::Stored { status } => status.as_u16().to_string(),
            operator::RecordState::TooLarge { status } => format!("{} large", status.as_u16()),
            operator::RecordState::Unknown { .. } => "unknown".to_owned(),
            // Written through the JSON API or by a program of the user's.
            operator::RecordState::Foreign => "value".to_owned(),
            _ => "-".to_owned(),
        };
        let expires = if l.expires_at > now {
            age(l.expires_at, now)
        } else {
            "-".to_owned()
        };
        say!(
            // Fences are a creation millisecond × 1000 and up: 16 digits.
            "{:<11} {:<10} {:>16} {:>6} {:>8}  {:<14} {:<16} {}",
            l.state.as_str(),
            holds,
            l.fence,
            age(now, l.created_at),
            expires,
            l.key.scope().as_str(),
            l.key.namespace().as_str(),
            l.key.client_key().as_str(),
        );
    }
    Ok(())
}

async fn repair(
    store: &SharedStore,
    admin: &dyn RecordAdmin,
    args: RepairArgs,
    action: Action,
    now: Timestamp,
) -> Result<(), String> {
    let fail = |e: idem_core::StoreError| format!("the store failed: {e}");
    let state = match (action, args.filter.state) {
        (Action::Reopen, None | Some(Selector::Unknown)) => Some(Selector::Unknown),
        (Action::Reopen, Some(_)) => return Err("reopen takes only unknown outcomes".into()),
        (Action::Release, None) => Some(Selector::State(RecordState::Stuck)),
        (_, state) => state,
    };
    let filter = FilterArgs {
        state,
        ..args.filter.clone()
    };
    let mut shown: Vec<Listed> = match &args.key {
        Some(key) => {
            let key = Key::parse(
                filter.scope.as_deref().unwrap_or_default(),
                filter.namespace.as_deref().unwrap_or_default(),
                key,
            )
            .map_err(|e| format!("invalid key: {e}"))?;
            let record = store.get(&key, now).await.map_err(fail)?;
            let f = filter.filter(now)?;
            record
                .filter(|r| f.matches(r, now))
                .map(|r| Listed::of(&r, now))
                .into_iter()
                .collect()
        }
        None => {
            if args.filter.is_empty() && action == Action::Delete {
                return Err(
                    "delete needs --key or a filter (--scope, --namespace, --state, \
                            --older-than)"
                        .into(),
                );
            }
            match records::collect(admin, &filter.filter(now)?, args.max, now)
                .await
                .map_err(fail)?
            {
                Ok(shown) => shown,
                Err(seen) => {
                    return Err(format!(
                        "more than --max {} records match (at least {seen}); narrow the filter \
                         or raise --max",
                        args.max
                    ));
                }
            }
        }
    };
    // A filter leaves idem's own records out; a key names one on purpose, and is refused below.
    if args.key.is_none() {
        let all = shown.len();
        shown.retain(|l| !records::is_internal(&l.key));
        if shown.len() < all {
            say!(
                "left out {} of idem's own records (scope idem.…), which no repair touches",
                all - shown.len()
            );
        }
    }
    if shown.is_empty() {
        say!("no records match; nothing changed");
        return Ok(());
    }
    let targets: Vec<Target> = shown.iter().map(Target::of).collect();
    match records::check(&targets, args.force) {
        Ok(()) => {}
        Err(Refused::Internal(_)) => {
            return Err(
                "this is one of idem's own records (scope idem.…: a server's Snowflake worker \
                 lease, a one-time token), which no repair touches"
                    .into(),
            );
        }
        Err(Refused::InProgress(n)) => {
            return Err(format!(
                "{n} of the {} records are attempts in progress: their lease runs, so they may \
                 still be working; add --force to {} them too, or narrow the filter \
                 (--state stuck); nothing changed",
                shown.len(),
                action.as_str()
            ));
        }
    }
    print_table(&shown[..shown.len().min(20)], now)?;
    if shown.len() > 20 {
        say!("… and {} more", shown.len() - 20);
    }
    let question = format!(
        "{} {} records ({})?",
        action.as_str(),
        shown.len(),
        records::states(&shown)
    );
    if !args.yes && !confirm(&question)? {
        say!("nothing changed");
        return Ok(());
    }
    // Judged now, not when they were listed: the operator may have been asked for minutes.
    let now = Timestamp::now();
    let who = std::env::var("USER").map_or_else(|_| "cli".to_owned(), |u| format!("cli {u}"));
    match apply(store, admin, &targets, action, now, &who).await {
        Ok(done) => {
            say!(
                "{}: {} applied, {} skipped (they had changed since they were shown)",
                action.as_str(),
                done.applied,
                done.skipped
            );
            Ok(())
        }
        Err((done, e)) => Err(format!(
            "the store failed after {} applied and {} skipped: {e}",
            done.applied, done.skipped
        )),
    }
}

/// `text` with control characters other than line breaks and tabs escaped (`\u{1b}`), so a
/// stored body cannot drive the operator's terminal.
fn printable(text: &str) -> String {
    text.chars()
        .map(|c| match c {
            '\n' | '\t' => c.to_string(),
            c if c.is_control() => c.escape_unicode().to_string(),
            c => c.to_string(),
        })
        .collect()
}

/// Asks on the terminal; without one, refuses (a script must say --yes).
fn confirm(question: &str) -> Result<bool, String> {
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        return Err(format!(
            "{question} There is no terminal to ask: add --yes to go ahead"
        ));
    }
    write!(std::io::stdout().lock(), "{question} [y/N] ").map_err(|e| e.to_string())?;
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    let mut line = String::new();
    stdin
        .lock()
        .read_line(&mut line)
        .map_err(|e| e.to_string())?;
    Ok(matches!(line.trim(), "y" | "Y" | "yes"))
}
