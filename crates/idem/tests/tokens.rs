//! One-time tokens: one winner among racing consumers, and a distinct refusal for a second
//! use, an expired token, another purpose, another caller and a made-up token.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem::{ManualClock, MemoryStore, SharedStore, TokenError, Tokens};
use idem_testkit::{Fault, FaultyStore, Op, Stall, within};

fn tokens() -> (Tokens, ManualClock) {
    let store: SharedStore = Arc::new(MemoryStore::new());
    let clock = ManualClock::starting_now();
    (Tokens::new(store, Arc::new(clock.clone())), clock)
}

/// 500 consumers race for one token: exactly one wins, every other is told it was used.
async fn of_500_racing_consumers_exactly_one_wins(tokens: Tokens) {
    let t = tokens
        .issue("shop", "order-form", Duration::from_secs(600))
        .await
        .unwrap();
    let wins = Arc::new(AtomicUsize::new(0));
    let racers: Vec<_> = (0..500)
        .map(|_| {
            let (tokens, token, wins) = (tokens.clone(), t.token.clone(), wins.clone());
            tokio::spawn(async move {
                match tokens.consume("shop", &token, "order-form").await {
                    Ok(()) => {
                        wins.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(TokenError::AlreadyUsed) => {}
                    Err(e) => panic!("unexpected refusal: {e}"),
                }
            })
        })
        .collect();
    for r in racers {
        r.await.unwrap();
    }
    assert_eq!(wins.load(Ordering::SeqCst), 1);
    assert!(matches!(
        tokens.consume("shop", &t.token, "order-form").await,
        Err(TokenError::AlreadyUsed)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn of_racing_consumers_exactly_one_wins_in_memory() {
    of_500_racing_consumers_exactly_one_wins(tokens().0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn of_racing_consumers_exactly_one_wins_on_redis() {
    let Some(url) = idem_testkit::services::REDIS.url() else {
        return;
    };
    let options = idem_store::RedisOptions {
        prefix: "idem-test:".into(),
        ..idem_store::RedisOptions::default()
    };
    let store = idem_store::RedisStore::connect(&url, options)
        .await
        .unwrap();
    let tokens = Tokens::new(Arc::new(store), Arc::new(idem::SystemClock));
    of_500_racing_consumers_exactly_one_wins(tokens).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn of_racing_consumers_exactly_one_wins_on_postgres() {
    let Some(url) = idem_testkit::services::POSTGRES.url() else {
        return;
    };
    let options = idem_store::PostgresOptions {
        table: "idem_test_tokens".into(),
        ..idem_store::PostgresOptions::default()
    };
    let store = idem_store::PostgresStore::connect_with(&url, options)
        .await
        .unwrap();
    let tokens = Tokens::new(Arc::new(store), Arc::new(idem::SystemClock));
    of_500_racing_consumers_exactly_one_wins(tokens).await;
}

#[tokio::test]
async fn each_refusal_has_its_own_reason() {
    let (tokens, clock) = tokens();
    let t = tokens
        .issue("shop", "order-form", Duration::from_secs(60))
        .await
        .unwrap();
    // Another purpose or caller is refused and consumes nothing.
    assert!(matches!(
        tokens.consume("shop", &t.token, "password-reset").await,
        Err(TokenError::WrongPurpose)
    ));
    assert!(matches!(
        tokens.consume("bank", &t.token, "order-form").await,
        Err(TokenError::WrongScope)
    ));
    assert!(matches!(
        tokens
            .consume("shop", "0123456789abcdef0123456789abcdef", "order-form")
            .await,
        Err(TokenError::Unknown)
    ));
    assert!(matches!(
        tokens.consume("shop", "not a token", "order-form").await,
        Err(TokenError::Unknown)
    ));
    // Tokens are case-insensitive hex.
    tokens
        .consume("shop", &t.token.to_ascii_uppercase(), "order-form")
        .await
        .unwrap();
    // Used, it is still another caller's token to anyone else, not "already used".
    assert!(matches!(
        tokens.consume("bank", &t.token, "order-form").await,
        Err(TokenError::WrongScope)
    ));

    let late = tokens
        .issue("shop", "order-form", Duration::from_secs(60))
        .await
        .unwrap();
    clock.advance(Duration::from_secs(61));
    assert!(matches!(
        tokens.consume("shop", &late.token, "order-form").await,
        Err(TokenError::Expired)
    ));
    // Long after (past the grace period) it is simply unknown.
    clock.advance(Duration::from_secs(2 * 3600));
    assert!(matches!(
        tokens.consume("shop", &late.token, "order-form").await,
        Err(TokenError::Unknown)
    ));
    assert!(matches!(
        tokens
            .issue("shop", "bad purpose", Duration::from_secs(1))
            .await,
        Err(TokenError::Invalid("purpose"))
    ));
    // Any caller's scope may hold tokens: up to 255 characters, as a key's scope.
    let long = "s".repeat(255);
    let t = tokens
        .issue(&long, "order-form", Duration::from_secs(60))
        .await
        .unwrap();
    tokens.consume(&long, &t.token, "order-form").await.unwrap();
    assert!(matches!(
        tokens
            .issue(&"s".repeat(256), "order-form", Duration::from_secs(60))
            .await,
        Err(TokenError::Invalid("scope"))
    ));
}

#[tokio::test]
async fn the_store_never_holds_the_token_itself() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let store: SharedStore = Arc::new(idem::SqliteStore::open(&path).unwrap());
    let tokens = Tokens::new(store, Arc::new(idem::SystemClock));
    let t = tokens
        .issue("shop", "order-form", Duration::from_secs(60))
        .await
        .unwrap();
    // Nothing the store wrote (database and write-ahead log) contains the token.
    let mut written = Vec::new();
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        written.extend(std::fs::read(entry.unwrap().path()).unwrap());
    }
    // The record is in what was read: its purpose is stored in plain text.
    assert!(
        written.windows(10).any(|w| w == b"order-form"),
        "the token's record is not in the files read"
    );
    assert!(
        !written
            .windows(t.token.len())
            .any(|w| w == t.token.as_bytes()),
        "the token is stored in plain text"
    );
    tokens
        .consume("shop", &t.token, "order-form")
        .await
        .unwrap();
}

/// Tokens over a memory store that can be stalled.
fn stallable() -> (Arc<FaultyStore<MemoryStore>>, Tokens) {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let shared: SharedStore = store.clone();
    let tokens = Tokens::new(shared, Arc::new(ManualClock::starting_now()));
    (store, tokens)
}

fn consume(tokens: &Tokens, token: &str) -> impl Future<Output = ()> + Send + 'static {
    let (tokens, token) = (tokens.clone(), token.to_owned());
    async move {
        let _ = tokens.consume("shop", &token, "order-form").await;
    }
}

/// Already so: a consumer that gives up while the store is stalled leaves the token usable
/// (its use had not reached the store) or used (it had), never half used, never twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_gives_up_leaves_the_token_usable_or_used_once() {
    let (store, tokens) = stallable();
    let ttl = Duration::from_secs(600);
    let t = tokens.issue("shop", "order-form", ttl).await.unwrap();
    let stall = store.stall_next(Op::Reopen);
    stall.abandon(consume(&tokens, &t.token)).await;
    stall.release();
    tokens
        .consume("shop", &t.token, "order-form")
        .await
        .unwrap();

    let t = tokens.issue("shop", "order-form", ttl).await.unwrap();
    let stall = Stall::new();
    store.fail_next(Op::Reopen, Fault::StallThenLand(stall.clone()));
    stall.abandon(consume(&tokens, &t.token)).await;
    stall.release();
    within("the use to land", stall.landed()).await;
    assert!(matches!(
        tokens.consume("shop", &t.token, "order-form").await,
        Err(TokenError::AlreadyUsed)
    ));
}

/// Already so: an issuer that gives up while the store is stalled, before or after its
/// record was written, leaves nothing in anyone's way (its token was never handed out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_issuer_that_gives_up_leaves_nothing_in_the_way() {
    let (store, tokens) = stallable();
    for op in [Op::Begin, Op::Complete] {
        let stall = Stall::new();
        store.fail_next(op, Fault::StallThenLand(stall.clone()));
        let issuer = tokens.clone();
        stall
            .abandon(async move {
                let _ = issuer
                    .issue("shop", "order-form", Duration::from_secs(600))
                    .await;
            })
            .await;
        stall.release();
        within("the issue to land", stall.landed()).await;
        let t = tokens
            .issue("shop", "order-form", Duration::from_secs(600))
            .await
            .unwrap();
        tokens
            .consume("shop", &t.token, "order-form")
            .await
            .unwrap();
    }
}
