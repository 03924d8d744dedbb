//! Idempotency records in Redis, single node or Cluster.
//!
//! A record is one string: a fixed-width header, its key and the response. A `begin` first
//! sends a plain `SET … NX GET PX` of the fresh record, which writes it exactly when Redis has
//! no record for the key and otherwise hands back the record it holds: a replay, a mismatch or
//! an attempt in flight is then decided from that value by `Record::begin`, in the same round
//! trip. What needs a write (a takeover), and every other operation, is decided by one Lua
//! script, which Redis runs atomically: the `begin` script reads the record, applies the rules
//! of `Record::begin` and writes the new lease in the same step, so of any number of
//! concurrent `begin`s exactly one acquires. A value the store did not write (another layout, another type) fails every
//! operation and is left alone.
//!
//! **Group commit** (one server): `begin`s and `complete`s that arrive while others are in
//! flight go together (`crate::group_commit`): the batched `begin` is one pipeline of plain
//! `SET … NX PX`, one per fresh record; the batched `complete` is one script call over many
//! keys running the one-record settle logic per key (or, with plain settles, a pipeline);
//! anything else is decided by the one-record call.
//!
//! **Keys.** A record's Redis key is `<prefix>{<digest>}`, the digest being 128 bits of SHA-256
//! over scope, namespace and client key. Each record is a single key, and the braces make it
//! its own hash tag, so on a Cluster every operation touches exactly one slot; client keys of
//! any shape (braces, spaces, 255 bytes) never leak into key names.
//!
//! **Expiry** is decided by the caller's clock (`now`), as in every store: a record past its
//! `expires_at` is absent to the scripts even if Redis still has it. Redis's own TTL only
//! reclaims the memory: each write sets it (`PX`) to the time left by the caller's clock plus
//! [`EXPIRY_MARGIN`], so servers whose clocks differ a little never see a record vanish early.
//! `purge_expired` has nothing to do.
//!
//! **A `begin` that fails** (its answer not back within [`RedisOptions::response_timeout`], or
//! its connection broken) may still run when the server gets to it; what it took then is
//! given back by a release under its lease id, queued on the same connection right behind it
//! (see `RedisStore::give_back`), so a failed `begin` leaves the key free.
//!
//! **Eviction** would forget records: a server with `maxmemory` set and a policy other than
//! `noeviction` is refused at connect unless [`RedisOptions::allow_eviction`] says otherwise.
//!
//! **Durability** is Redis's: with `appendonly yes` and `appendfsync always` a completed record
//! survives a crash of the server; with the defaults the last second may be lost, and with a
//! replica failover the last writes may be lost too. Choose the store for what it may forget.
//!
//! **Listing** (`admin`): `SCAN` over the record keys' pattern (on each primary of a Cluster),
//! reading each found record's header, key and the head of its response, pipelined. A
//! record's key name is a digest, so the record keeps its key in its value for the listing to
//! show; scope and namespace filters are applied to what is read, not to key names.
//!
//! **Plain settles.** On a server that compares and sets a value (`SET … IFEQ`: Valkey 8.1
//! and later, Redis 8.4 and later), a record this instance claimed with the plain `SET … NX`
//! is completed, released or renewed with one plain `SET … IFEQ` against the value it wrote,
//! and by the script only when the record has moved on since (see `plain`).
//!
//! The Lua scripts are in `scripts`, the record's layout in `format`, the record operations in
//! `records`, the plain settles in `plain`, the operator's view in `admin`, the locks in
//! `locks`.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{Key, StoreError};
use redis::aio::ConnectionManagerConfig;

use crate::group_commit::GroupCommit;

mod admin;
mod conn;
mod error;
mod format;
mod locks;
mod plain;
mod records;
mod scripts;
#[cfg(test)]
mod tests;

pub use conn::Conn;
pub(crate) use conn::Lua;
use error::error;
pub use locks::lock_scripts;
use scripts::{
    BEGIN, COMPLETE_MANY, GIVE_BACK, RAISE, RECORD, RENEW, REOPEN, REPAIR, SETTLE, SETTLE_FN, STEP,
    record_script,
};

/// Added to every native TTL, so that a record outlives its logical expiry by this much.
pub const EXPIRY_MARGIN: Duration = Duration::from_secs(5);

/// How a [`RedisStore`] connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisOptions {
    /// Put before every record's key; default `idem:`.
    pub prefix: String,
    /// How long a command waits for its answer before failing with
    /// [`StoreError::Unavailable`]. Default 5 s.
    pub response_timeout: Duration,
    /// Accept a server that may evict keys when full (`maxmemory` set with a policy other
    /// than `noeviction`). An evicted record is a key forgotten: its work runs again. Default
    /// false: such a server is refused at connect.
    pub allow_eviction: bool,
    /// Accept counters (`Counters::advance`, behind segment ids) on a server that keeps
    /// nothing on disk (`appendonly no`): a restart resets them, and segment ids repeat.
    /// Default false: such a server refuses `advance` with a message saying why, and says so
    /// once at connect.
    pub allow_volatile_counters: bool,
    /// The most records one batch begins or completes (group commit, one server only): calls
    /// that arrive while one is in flight wait and then go together, up to this many per
    /// batch; 1 sends every call on its own; at most 1024. A Cluster sends every call on its
    /// own (a script may only touch keys of one slot). Default 64.
    pub max_batch: usize,
}

impl Default for RedisOptions {
    fn default() -> Self {
        Self {
            prefix: "idem:".to_owned(),
            response_timeout: Duration::from_secs(5),
            allow_eviction: false,
            allow_volatile_counters: false,
            max_batch: 64,
        }
    }
}

/// Idempotency records in Redis. Clones share one connection.
///
/// Every field is shared by the clones: the run-once engine clones its store for each call
/// (a `begin` and a settle that must finish even if their caller goes away), so a clone is a
/// few reference counts, never a copy of a string.
#[derive(Clone)]
pub struct RedisStore {
    pub(crate) conn: Conn,
    pub(crate) prefix: Arc<str>,
    /// A client of one server (of the Cluster's first node given), for the lock release
    /// feed's own connection.
    pub(crate) client: Option<Arc<redis::Client>>,
    /// The lock scripts and the lock release feed.
    pub(crate) locks: Arc<locks::LockScripts>,
    /// The record scripts.
    pub(super) scripts: Arc<RecordScripts>,
    /// `None` when every call goes on its own (`max_batch` 1, or a Cluster).
    pub(super) batches: Option<GroupCommit>,
    /// Why counters are refused: the server keeps nothing on disk (see
    /// [`RedisOptions::allow_volatile_counters`]).
    pub(super) volatile_counters: Option<Arc<str>>,
    /// Settles as plain `SET … IFEQ` commands, where the server takes them.
    pub(super) plain: Arc<plain::Plain>,
}

/// The record scripts, loaded once per store.
pub(super) struct RecordScripts {
    pub(super) begin: Lua,
    pub(super) settle: Lua,
    pub(super) complete_many: Lua,
    pub(super) renew: Lua,
    pub(super) reopen: Lua,
    pub(super) raise: Lua,
    pub(super) repair: Lua,
    pub(super) step: Lua,
    /// [`GIVE_BACK`] with [`RECORD`] before it, sent whole with `EVAL`.
    pub(super) give_back: String,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.conn {
            Conn::Single(_) => "single",
            Conn::Cluster(_) => "cluster",
        };
        f.debug_struct("RedisStore")
            .field("mode", &kind)
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl RedisStore {
    /// Connects to one server (`redis://host:port/db`).
    pub async fn connect(url: &str, options: RedisOptions) -> Result<Self, StoreError> {
        let client = redis::Client::open(url)
            .map_err(|e| StoreError::backend(format!("the Redis URL is not valid: {e}"), e))?;
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(options.response_timeout))
            .set_connection_timeout(Some(options.response_timeout))
            .set_number_of_retries(2);
        let conn = client
            .get_connection_manager_with_config(config)
            .await
            .map_err(|e| error("cannot connect to Redis", e))?;
        let mut store = Self::with(Conn::Single(conn), options.clone());
        store.client = Some(Arc::new(client));
        store.checked(&options).await
    }

    /// Connects to a Cluster through any of its nodes (`redis://host:port` each).
    pub async fn connect_cluster(
        nodes: &[String],
        options: RedisOptions,
    ) -> Result<Self, StoreError> {
        let client = redis::cluster::ClusterClient::builder(nodes.iter().map(String::as_str))
            .response_timeout(options.response_timeout)
            .connection_timeout(options.response_timeout)
            .build()
            .map_err(|e| {
                StoreError::backend(format!("the Redis Cluster URL is not valid: {e}"), e)
            })?;
        let conn = client
            .get_async_connection()
            .await
            .map_err(|e| error("cannot connect to the Redis Cluster", e))?;
        let mut store = Self::with(Conn::Cluster(conn), options.clone());
        // A Cluster delivers every PUBLISH to every node, so the lock release feed listens on
        // the first node given.
        store.client = nodes
            .first()
            .and_then(|n| redis::Client::open(n.as_str()).ok())
            .map(Arc::new);
        store.checked(&options).await
    }

    fn with(conn: Conn, options: RedisOptions) -> Self {
        // Two lanes: one batch on the wire while the next one gathers.
        let batches = match conn {
            Conn::Single(_) => GroupCommit::with_lanes(2, options.max_batch),
            Conn::Cluster(_) => None,
        };
        Self {
            batches,
            conn,
            prefix: options.prefix.into(),
            client: None,
            volatile_counters: None,
            plain: Arc::new(plain::Plain::new(false)),
            locks: Arc::new(locks::LockScripts::new()),
            scripts: Arc::new(RecordScripts {
                begin: record_script(BEGIN),
                settle: Lua::new(&format!("{RECORD}{SETTLE_FN}{SETTLE}")),
                complete_many: Lua::new(&format!("{RECORD}{SETTLE_FN}{COMPLETE_MANY}")),
                renew: record_script(RENEW),
                reopen: record_script(REOPEN),
                raise: Lua::new(RAISE),
                repair: record_script(REPAIR),
                step: record_script(STEP),
                give_back: format!("{RECORD}{GIVE_BACK}"),
            }),
        }
    }

    /// Checks the options, that the server will not evict records, and whether it keeps
    /// counters across a restart.
    async fn checked(mut self, options: &RedisOptions) -> Result<Self, StoreError> {
        if self.prefix.contains(['{', '}']) {
            return Err(StoreError::Backend {
                message: "the Redis key prefix may not contain { or }: they would make it the \
                          hash tag and put every record in one Cluster slot"
                    .into(),
                source: None,
            });
        }
        // `begin` sends `SET … NX GET`, which Redis accepts from 7.0 on. Servers that hide
        // INFO cannot be asked; go on.
        let info: Result<String, _> = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut self.conn.clone())
            .await;
        if let Some(version) = info.ok().as_deref().and_then(server_version)
            && version < (7, 0)
        {
            return Err(StoreError::Backend {
                message: format!(
                    "this Redis is version {}.{}: idem needs Redis 7.0 or later (or Valkey)",
                    version.0, version.1
                ),
                source: None,
            });
        }
        self.plain = Arc::new(plain::Plain::new(self.compares_values().await));
        if !options.allow_eviction {
            let config = self.config("maxmemory*").await;
            if let Some(get) = config.as_ref() {
                let get = |name: &str| get.get(name).cloned();
                let limited = get("maxmemory").is_some_and(|m| m != "0");
                let policy = get("maxmemory-policy").unwrap_or_default();
                if limited && policy != "noeviction" {
                    return Err(StoreError::Backend {
                        message: format!(
                            "this Redis evicts keys when full (maxmemory-policy {policy}): an \
                             evicted record would let its work run again; set \
                             maxmemory-policy noeviction, or allow eviction explicitly"
                        ),
                        source: None,
                    });
                }
            }
        }
        if !options.allow_volatile_counters {
            let config = self.config("appendonly").await;
            if config.is_some_and(|c| c.get("appendonly").is_some_and(|v| v == "no")) {
                let why = "this Redis keeps no append-only file (appendonly no): a restart would \
                           reset its counters and segment ids would repeat, so counters are \
                           refused; set appendonly yes (with appendfsync always), or allow \
                           volatile counters explicitly";
                tracing::warn!("{why}");
                self.volatile_counters = Some(why.into());
            }
        }
        Ok(self)
    }

    /// Whether the server takes `SET … IFEQ` (see `plain`).
    ///
    /// One server is asked with one on a key no record uses, which sets nothing where the
    /// option is known and is refused where not. On a Cluster a keyed command reaches only
    /// the node of its slot, so each primary is asked what it takes (`COMMAND DOCS SET`
    /// lists the option's token): a Cluster part way through an upgrade, or one whose nodes
    /// hide that command, settles by script.
    async fn compares_values(&self) -> bool {
        if let Conn::Cluster(_) = self.conn {
            let Ok(nodes) = self.nodes().await else {
                return false;
            };
            for node in nodes {
                let mut docs = redis::cmd("COMMAND");
                docs.arg("DOCS").arg("SET");
                match self.on_node(node, docs).await {
                    Ok(docs) if names(&docs, "IFEQ") => {}
                    _ => return false,
                }
            }
            return true;
        }
        let probe = format!("{}{{ifeq-probe}}", self.prefix);
        redis::cmd("SET")
            .arg(probe)
            .arg("")
            .arg("IFEQ")
            .arg("")
            .query_async::<redis::Value>(&mut self.conn.clone())
            .await
            .is_ok()
    }

    /// The server's settings matching `pattern` (`CONFIG GET`), or `None` where it cannot be
    /// asked (some managed services disable CONFIG): then the checks go on without them.
    async fn config(&self, pattern: &str) -> Option<std::collections::HashMap<String, String>> {
        let pairs: Vec<String> = redis::cmd("CONFIG")
            .arg("GET")
            .arg(pattern)
            .query_async(&mut self.conn.clone())
            .await
            .ok()?;
        Some(
            pairs
                .chunks_exact(2)
                .map(|p| (p[0].clone(), p[1].clone()))
                .collect(),
        )
    }

    /// The Redis key of a record: the prefix, then a 128-bit digest as its own hash tag.
    pub fn redis_key(&self, key: &Key) -> String {
        let mut name = String::with_capacity(self.prefix.len() + 34);
        name.push_str(&self.prefix);
        name.push('{');
        key.sha256().write_hex(16, &mut name);
        name.push('}');
        name
    }
}

/// Whether `value` holds, anywhere in it, a string that is exactly `word` (any case).
fn names(value: &redis::Value, word: &str) -> bool {
    use redis::Value;
    match value {
        Value::BulkString(b) => b.eq_ignore_ascii_case(word.as_bytes()),
        Value::SimpleString(s) => s.eq_ignore_ascii_case(word),
        Value::Array(items) | Value::Set(items) => items.iter().any(|v| names(v, word)),
        Value::Map(pairs) => pairs.iter().any(|(k, v)| names(k, word) || names(v, word)),
        _ => false,
    }
}

/// The major and minor version in the answer of `INFO server`.
fn server_version(info: &str) -> Option<(u32, u32)> {
    let version = info
        .lines()
        .find_map(|line| line.strip_prefix("redis_version:"))?;
    let mut parts = version.trim().split('.').map(|p| p.parse::<u32>().ok());
    Some((parts.next()??, parts.next()??))
}
