//! Idempotency records in Redis, single node or Cluster.
//!
//! A record is one string: a fixed-width header and the response. A `begin` first tries a
//! plain `SET … NX PX` of the fresh record, which succeeds exactly when Redis has no record
//! for the key; otherwise, and for every other operation, one Lua script decides, which Redis
//! runs atomically: the `begin` script reads the record, applies the rules of `Record::begin`
//! and writes the new lease in the same step, so of any number of concurrent `begin`s exactly
//! one acquires. A value the store did not write (another layout, another type) fails every
//! operation and is left alone.
//!
//! **Group commit** (one server): `begin`s and `complete`s that arrive while others are in
//! flight go together, as one script call over many keys (`crate::batch`): the batched
//! `begin` writes each fresh record as the plain `SET … NX PX` would, the batched `complete`
//! runs the one-record settle logic per key; anything else is decided by the one-record call.
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

use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Fingerprint, Key, Lease, LeaseError, LeaseId, Record,
    Replay, StaleLease, Status, Store, StoreError, Timestamp,
};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Script, Value};

use crate::batch::{Acquired, BeginJob, CompleteJob, GroupCommit, ManyAtOnce};

/// Added to every native TTL, so that a record outlives its logical expiry by this much.
pub const EXPIRY_MARGIN: Duration = Duration::from_secs(5);

/// The largest timestamp or duration the scripts handle exactly (Lua numbers are doubles).
const MAX_EXACT: u64 = (1 << 53) - 1;

// A record is one string: a fixed-width header, then the response of a completed record.
// Numbers are zero-padded decimal, which Lua reads with `tonumber`. Positions (1-based, as
// Lua's `string.sub` takes them):
//
//   1 format ('1')   2 status (p, c, r)   3-34 fingerprint   35-50 lease id   51-70 fence
//   71-86 lease end   87-102 ttl   103-118 created   119-134 updated   135-150 expires
//   151- response
//
// A string rather than a hash so that `begin` on a fresh key is one plain `SET … NX PX`,
// which costs Redis a third of a script; the scripts below handle every other case.

/// The header's length; the response follows.
const HEADER: usize = 150;

/// The record format this store writes and reads (byte 1 of every record).
const FORMAT: u8 = b'1';

/// Put before every record script: `record(key)` reads the record at `key` and answers nil, or
/// its value, state, fence, lease end, TTL and expiry. A value of any other shape raises
/// [`FOREIGN`]; a key of another type, Redis's `WRONGTYPE`. Expiries the scripts compute are
/// kept to `MAX` (as `exact` does in the client), so that they fit in their 16 digits.
const RECORD: &str = r"
local MAX = 9007199254740991
local function record(key)
  local v = redis.call('GET', key)
  if not v then return nil end
  local st = string.sub(v, 2, 2)
  local fence, lexp = tonumber(string.sub(v, 51, 70)), tonumber(string.sub(v, 71, 86))
  local ttl, exp = tonumber(string.sub(v, 87, 102)), tonumber(string.sub(v, 135, 150))
  if #v < 150 or string.sub(v, 1, 1) ~= '1' or not (fence and lexp and ttl and exp)
      or not (tonumber(string.sub(v, 103, 118)) and tonumber(string.sub(v, 119, 134)))
      or not (st == 'c' or ((st == 'p' or st == 'r') and #v == 150)) then
    error('idem: the key holds a value this store did not write')
  end
  return v, st, fence, lexp, ttl, exp
end
";

/// What a record script raises on a value it did not write.
const FOREIGN: &str = "idem: the key holds a value this store did not write";

/// ARGV = now, fingerprint, lease id, the fresh record (fence 1), its native TTL. Run when
/// the plain `SET … NX` found the key taken.
const BEGIN: &str = r"
local now = tonumber(ARGV[1])
local v, st, fence, lexp, _, exp = record(KEYS[1])
local f = 1
if v then
  f = fence + 1
  if exp > now then
    local same = string.sub(v, 3, 34) == ARGV[2]
    if st == 'c' then
      if same then return {'replay', string.sub(v, 151), fence, tonumber(string.sub(v, 119, 134))} end
      return {'mismatch'}
    elseif st == 'p' then
      if not same then return {'mismatch'} end
      -- This very begin, sent again after its answer was lost: it holds the lease.
      if string.sub(v, 35, 50) == ARGV[3] then return {'acquired', fence} end
      if lexp > now then return {'in_progress', lexp} end
    end
  end
end
redis.call('SET', KEYS[1], string.sub(ARGV[4], 1, 50) .. string.format('%020d', f)
  .. string.sub(ARGV[4], 71), 'PX', ARGV[5])
return {'acquired', f}
";

/// Put after [`RECORD`] before the settle scripts: `settle(key, now, lease id, fence, margin,
/// target state, response)` moves the record at `key` from in progress under that lease to
/// the target state (`c` with the response, or `r`), answering `ok` or `stale`; a repeated
/// settle is `ok` only with the response already stored.
const SETTLE_FN: &str = r"
local function settle(key, now, id, fence, margin, to, response)
  local v, st, f, _, ttl, exp = record(key)
  if not v or exp <= now or string.sub(v, 35, 50) ~= id or f ~= fence then
    return 'stale'
  end
  if st == to then
    if st == 'c' and string.sub(v, 151) ~= response then return 'stale' end
    return 'ok'
  end
  if st ~= 'p' then return 'stale' end
  exp = math.min(now + ttl, MAX)
  redis.call('SET', key, '1' .. to .. string.sub(v, 3, 118)
    .. string.format('%016d%016d', now, exp) .. (response or ''), 'PX', exp - now + margin)
  return 'ok'
end
";

/// Complete or release one record: ARGV = now, lease id, fence, margin, target state (`c` or
/// `r`), response (complete only).
const SETTLE: &str = r"
return settle(KEYS[1], tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]),
  ARGV[5], ARGV[6])
";

/// Complete every record of `KEYS` (group commit): ARGV = margin, then now, lease id, fence
/// and response of each key in turn. Answers, per key, 1 if it is completed with that
/// response, else 0 (the one-record call then decides it).
const COMPLETE_MANY: &str = r"
local margin = tonumber(ARGV[1])
local done = {}
for i, key in ipairs(KEYS) do
  local a = 4 * i - 2
  done[i] = settle(key, tonumber(ARGV[a]), ARGV[a + 1], tonumber(ARGV[a + 2]), margin, 'c',
    ARGV[a + 3]) == 'ok' and 1 or 0
end
return done
";

/// Begin every record of `KEYS` that Redis does not have (group commit): ARGV = the fresh
/// record and its native TTL of each key in turn. Answers, per key, 1 if it wrote the fresh
/// record (as the plain `SET … NX PX` would), else 0 (the one-record call then decides it).
const BEGIN_NEW: &str = r"
local got = {}
for i, key in ipairs(KEYS) do
  got[i] = redis.call('SET', key, ARGV[2 * i - 1], 'NX', 'PX', ARGV[2 * i]) and 1 or 0
end
return got
";

/// Gives back what a `begin` may have taken though its caller was told it failed (it timed
/// out, or its connection broke): ARGV = now, lease id, margin. Releases the record if it is
/// in progress under that lease id, whatever its fence (a takeover's fence is not known to
/// the client); answers 1 if it did. Where the `begin` took nothing, no record holds that
/// random 128-bit id, and nothing changes. Sent with `EVAL`, not `EVALSHA`: it must run on the
/// first try even on a server that has not loaded it (see [`RedisStore::give_back`]).
const GIVE_BACK: &str = r"
local now = tonumber(ARGV[1])
local v, st, _, _, ttl, exp = record(KEYS[1])
if not v or st ~= 'p' or exp <= now or string.sub(v, 35, 50) ~= ARGV[2] then return 0 end
exp = math.min(now + ttl, MAX)
redis.call('SET', KEYS[1], '1r' .. string.sub(v, 3, 118) .. string.format('%016d%016d', now, exp),
  'PX', exp - now + tonumber(ARGV[3]))
return 1
";

/// ARGV = now, lease id, fence, new lease end, margin. Answers 1 if it renewed the lease.
const RENEW: &str = r"
local now = tonumber(ARGV[1])
local v, st, fence, _, ttl, exp = record(KEYS[1])
if not v or st ~= 'p' or exp <= now or string.sub(v, 35, 50) ~= ARGV[2]
    or fence ~= tonumber(ARGV[3]) then
  return 0
end
local lexp = tonumber(ARGV[4])
exp = math.min(lexp + ttl, MAX)
redis.call('SET', KEYS[1], string.sub(v, 1, 70) .. string.format('%016d', lexp)
  .. string.sub(v, 87, 118) .. string.format('%016d%016d', now, exp),
  'PX', exp - now + tonumber(ARGV[5]))
return 1
";

/// ARGV = the value to raise to (as text, exact). Answers the counter's value.
const RAISE: &str = r"
local cur = redis.call('GET', KEYS[1])
if not cur or string.len(cur) < string.len(ARGV[1])
    or (string.len(cur) == string.len(ARGV[1]) and cur < ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
  return ARGV[1]
end
return cur
";

/// ARGV = now, fence, margin. Answers 1 if it reopened the record.
const REOPEN: &str = r"
local now = tonumber(ARGV[1])
local v, st, fence, _, ttl, exp = record(KEYS[1])
if not v or st ~= 'c' or exp <= now or fence ~= tonumber(ARGV[2]) then return 0 end
exp = math.min(now + ttl, MAX)
redis.call('SET', KEYS[1], '1r' .. string.sub(v, 3, 118) .. string.format('%016d%016d', now, exp),
  'PX', exp - now + tonumber(ARGV[3]))
return 1
";

/// A connection to one Redis server or to a Cluster; both reconnect by themselves.
#[derive(Clone)]
pub(crate) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

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
    /// The most records one script call begins or completes (group commit, one server only):
    /// calls that arrive while one is in flight wait and then go together, up to this many
    /// per call; 1 sends every call on its own; at most 1024. A Cluster sends every call on its
    /// own (a script may only touch keys of one slot). Default 64.
    pub max_batch: usize,
}

impl Default for RedisOptions {
    fn default() -> Self {
        Self {
            prefix: "idem:".to_owned(),
            response_timeout: Duration::from_secs(5),
            allow_eviction: false,
            max_batch: 64,
        }
    }
}

/// Idempotency records in Redis. Clones share one connection.
#[derive(Clone)]
pub struct RedisStore {
    pub(crate) conn: Conn,
    pub(crate) prefix: String,
    /// A client of one server (of the Cluster's first node given), for the lock release
    /// feed's own connection.
    pub(crate) client: Option<redis::Client>,
    /// Shared by every clone: the run-once claim clones its store for each `begin`, and a
    /// script's text and hash would otherwise be copied each time.
    pub(crate) locks: Arc<crate::redis_locks::LockScripts>,
    scripts: Arc<RecordScripts>,
    /// `None` when every call goes on its own (`max_batch` 1, or a Cluster).
    batches: Option<GroupCommit>,
}

/// The record scripts, loaded once per store.
struct RecordScripts {
    begin: Script,
    settle: Script,
    begin_new: Script,
    complete_many: Script,
    renew: Script,
    reopen: Script,
    raise: Script,
    /// [`GIVE_BACK`] with [`RECORD`] before it, sent whole with `EVAL`.
    give_back: String,
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
        store.client = Some(client);
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
            .and_then(|n| redis::Client::open(n.as_str()).ok());
        store.checked(&options).await
    }

    fn with(conn: Conn, options: RedisOptions) -> Self {
        // Two lanes: one batch's script call on the wire while the next one gathers.
        let batches = match conn {
            Conn::Single(_) => GroupCommit::with_lanes(2, options.max_batch),
            Conn::Cluster(_) => None,
        };
        Self {
            batches,
            conn,
            prefix: options.prefix,
            client: None,
            locks: Arc::new(crate::redis_locks::LockScripts::new()),
            scripts: Arc::new(RecordScripts {
                begin: record_script(BEGIN),
                settle: Script::new(&format!("{RECORD}{SETTLE_FN}{SETTLE}")),
                begin_new: Script::new(BEGIN_NEW),
                complete_many: Script::new(&format!("{RECORD}{SETTLE_FN}{COMPLETE_MANY}")),
                renew: record_script(RENEW),
                reopen: record_script(REOPEN),
                raise: Script::new(RAISE),
                give_back: format!("{RECORD}{GIVE_BACK}"),
            }),
        }
    }

    /// Checks the options, and that the server will not evict records.
    async fn checked(self, options: &RedisOptions) -> Result<Self, StoreError> {
        if self.prefix.contains(['{', '}']) {
            return Err(StoreError::Backend {
                message: "the Redis key prefix may not contain { or }: they would make it the \
                          hash tag and put every record in one Cluster slot"
                    .into(),
                source: None,
            });
        }
        if !options.allow_eviction {
            // Servers that disable CONFIG (some managed services) cannot be asked; go on.
            let config: Result<Vec<String>, _> = redis::cmd("CONFIG")
                .arg("GET")
                .arg("maxmemory*")
                .query_async(&mut self.conn.clone())
                .await;
            if let Ok(pairs) = config {
                let get = |name: &str| {
                    pairs
                        .chunks(2)
                        .find(|p| p[0] == name)
                        .and_then(|p| p.get(1).cloned())
                };
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
        Ok(self)
    }

    /// The Redis key of a record: the prefix, then a 128-bit digest as its own hash tag.
    pub fn redis_key(&self, key: &Key) -> String {
        format!("{}{{{}}}", self.prefix, &key.sha256().to_hex()[..32])
    }
}

fn record_script(body: &str) -> Script {
    Script::new(&format!("{RECORD}{body}"))
}

/// A timestamp or duration as the scripts take it.
fn exact(v: u64) -> u64 {
    v.min(MAX_EXACT)
}

fn millis(d: Duration) -> u64 {
    exact(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// How long Redis keeps a record that expires at `at`, seen at `now`.
fn native_ttl(at: Timestamp, now: Timestamp) -> u64 {
    millis(at.saturating_since(now) + EXPIRY_MARGIN).max(1)
}

/// Whether a command that failed with `e` may have run on the server, or may still run
/// there: it was given up on while in flight (a response timeout) or its connection broke.
/// An error the server answered, or a connection never made, means it did not run.
fn may_have_run(e: &redis::RedisError) -> bool {
    (e.is_io_error() || e.is_timeout() || e.is_connection_dropped()) && !e.is_connection_refusal()
}

/// Redis errors: the connection or the server being unreachable, busy or failing over may
/// pass; anything else (a script error, a wrong type at the key) is a backend error.
pub(crate) fn error(what: &str, e: redis::RedisError) -> StoreError {
    if e.code() == Some("WRONGTYPE") || e.to_string().contains(FOREIGN) {
        return StoreError::Corrupt(format!(
            "{what}: the Redis key holds a value this store did not write"
        ));
    }
    let message = format!("{what}: {e}");
    if transient(&e) {
        StoreError::unavailable(message, e)
    } else {
        StoreError::backend(message, e)
    }
}

/// Whether `e` may pass: the connection or the server being unreachable, busy or failing over.
fn transient(e: &redis::RedisError) -> bool {
    e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_cluster_error()
        || matches!(
            e.kind(),
            redis::ErrorKind::Server(
                redis::ServerErrorKind::BusyLoading
                    | redis::ServerErrorKind::TryAgain
                    | redis::ServerErrorKind::ClusterDown
                    | redis::ServerErrorKind::MasterDown
                    | redis::ServerErrorKind::ReadOnly
            )
        )
}

pub(crate) fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt(format!("the Redis record has a bad {what}"))
}

fn int(v: &Value, what: &str) -> Result<u64, StoreError> {
    match v {
        Value::Int(i) => u64::try_from(*i).map_err(|_| corrupt(what)),
        Value::BulkString(b) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| corrupt(what)),
        _ => Err(corrupt(what)),
    }
}

fn bytes(v: Value, what: &str) -> Result<Vec<u8>, StoreError> {
    match v {
        Value::BulkString(b) => Ok(b),
        _ => Err(corrupt(what)),
    }
}

fn text(v: &Value) -> Option<&str> {
    match v {
        Value::BulkString(b) => std::str::from_utf8(b).ok(),
        Value::SimpleString(s) => Some(s),
        _ => None,
    }
}

fn status_byte(status: Status) -> u8 {
    match status {
        Status::InProgress => b'p',
        Status::Completed => b'c',
        Status::Released => b'r',
    }
}

/// A record as the scripts read it (see the layout above [`HEADER`]).
fn pack(r: &Record) -> Vec<u8> {
    use std::io::Write as _;
    let response = r.response.as_deref().unwrap_or_default();
    let mut v = Vec::with_capacity(HEADER + response.len());
    v.extend([FORMAT, status_byte(r.status)]);
    v.extend_from_slice(r.fingerprint.as_bytes());
    v.extend_from_slice(&r.lease_id.to_bytes());
    let ms = |t: Timestamp| exact(t.as_millis());
    // Writing to a Vec cannot fail.
    let _ = write!(
        v,
        "{:020}{:016}{:016}{:016}{:016}{:016}",
        r.fence,
        ms(r.lease_expires_at),
        exact(r.ttl_ms),
        ms(r.created_at),
        ms(r.updated_at),
        ms(r.expires_at)
    );
    debug_assert_eq!(v.len(), HEADER);
    v.extend_from_slice(response);
    v
}

/// Reads what [`pack`] and the scripts write.
fn unpack(key: &Key, v: &[u8]) -> Result<Record, StoreError> {
    if v.len() < HEADER || v[0] != FORMAT {
        return Err(corrupt("format"));
    }
    let num = |at: usize, len: usize, what: &str| -> Result<u64, StoreError> {
        std::str::from_utf8(&v[at..at + len])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| corrupt(what))
    };
    let ts = |at: usize, what: &str| num(at, 16, what).map(Timestamp::from_millis);
    let status = match v[1] {
        b'p' => Status::InProgress,
        b'c' => Status::Completed,
        b'r' => Status::Released,
        _ => return Err(corrupt("status")),
    };
    let mut fingerprint = [0; 32];
    fingerprint.copy_from_slice(&v[2..34]);
    let mut lease_id = [0; 16];
    lease_id.copy_from_slice(&v[34..50]);
    let tail = &v[HEADER..];
    if status != Status::Completed && !tail.is_empty() {
        return Err(corrupt("response"));
    }
    Ok(Record {
        key: key.clone(),
        status,
        fingerprint: Fingerprint::from_bytes(fingerprint),
        fence: num(50, 20, "fence")?,
        lease_id: LeaseId::from_bytes(lease_id),
        lease_expires_at: ts(70, "lease expiry")?,
        response: (status == Status::Completed).then(|| Bytes::copy_from_slice(tail)),
        ttl_ms: num(86, 16, "ttl")?,
        created_at: ts(102, "creation time")?,
        updated_at: ts(118, "update time")?,
        expires_at: ts(134, "expiry")?,
    })
}

impl Store for RedisStore {
    fn kind(&self) -> &'static str {
        match self.conn {
            Conn::Single(_) => "redis",
            Conn::Cluster(_) => "redis-cluster",
        }
    }

    async fn begin(&self, req: &BeginRequest, now: Timestamp) -> Result<BeginOutcome, StoreError> {
        match &self.batches {
            Some(batches) => batches.begin(self, req, now).await,
            None => self.begin_alone(req, now).await,
        }
    }

    async fn complete(
        &self,
        key: &Key,
        lease: &Lease,
        response: Bytes,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        match &self.batches {
            Some(batches) => batches.complete(self, key, lease, response, now).await,
            None => self.complete_alone(key, lease, response, now).await,
        }
    }

    async fn release(&self, key: &Key, lease: &Lease, now: Timestamp) -> Result<(), LeaseError> {
        self.settle_as(key, lease, Status::Released, None, now)
            .await
    }

    async fn renew(
        &self,
        key: &Key,
        lease: &Lease,
        length: Duration,
        now: Timestamp,
    ) -> Result<Lease, LeaseError> {
        let renewed = lease.renewed(length, now);
        let ends = renewed.expires_at;
        let done: i64 = self
            .scripts
            .renew
            .key(self.redis_key(key))
            .arg(exact(now.as_millis()))
            .arg(&lease.id.to_bytes()[..])
            .arg(lease.fence)
            .arg(exact(ends.as_millis()))
            .arg(millis(EXPIRY_MARGIN))
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| error("cannot renew the lease", e))?;
        (done == 1)
            .then_some(renewed)
            .ok_or_else(|| StaleLease.into())
    }

    async fn reopen(&self, key: &Key, fence: u64, now: Timestamp) -> Result<bool, StoreError> {
        let done: i64 = self
            .scripts
            .reopen
            .key(self.redis_key(key))
            .arg(exact(now.as_millis()))
            .arg(fence)
            .arg(millis(EXPIRY_MARGIN))
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| error("cannot reopen the record", e))?;
        Ok(done == 1)
    }

    async fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>, StoreError> {
        let value: Option<Vec<u8>> = redis::cmd("GET")
            .arg(self.redis_key(key))
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| error("cannot read the record", e))?;
        let Some(value) = value else {
            return Ok(None);
        };
        let record = unpack(key, &value)?;
        Ok(record.is_live(now).then_some(record))
    }

    async fn advance(&self, key: &Key, by: u64) -> Result<u64, StoreError> {
        // A key of its own beside the record's, in the same hash slot; no TTL.
        let value: i64 = redis::cmd("INCRBY")
            .arg(format!("{}:n", self.redis_key(key)))
            .arg(idem_core::counter_step(by)?)
            .query_async(&mut self.conn.clone())
            .await
            // Past i64::MAX Redis refuses the increment (a backend error).
            .map_err(|e| error("cannot advance the counter", e))?;
        u64::try_from(value).map_err(|_| corrupt("counter"))
    }

    async fn raise(&self, key: &Key, to: u64) -> Result<u64, StoreError> {
        // Compared as decimal text in the script: Lua's numbers are doubles, exact only to
        // 2^53, and counters go to 2^63.
        let to = to.min(idem_core::MAX_COUNTER).to_string();
        let value: String = self
            .scripts
            .raise
            .key(format!("{}:n", self.redis_key(key)))
            .arg(to)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| error("cannot raise the counter", e))?;
        value.parse().map_err(|_| corrupt("counter"))
    }

    async fn purge_expired(&self, _now: Timestamp, _limit: usize) -> Result<u64, StoreError> {
        // Redis deletes expired records by itself (see the module's notes).
        Ok(0)
    }
}

impl ManyAtOnce for RedisStore {
    async fn begin_alone(
        &self,
        req: &BeginRequest,
        now: Timestamp,
    ) -> Result<BeginOutcome, StoreError> {
        let (lease, fresh) = Record::acquired(req, now, 1, idem_core::LeaseId::generate());
        self.begin_as(&fresh, lease, now).await
    }

    async fn complete_alone(
        &self,
        key: &Key,
        lease: &Lease,
        response: Bytes,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        self.settle_as(key, lease, Status::Completed, Some(response), now)
            .await
    }

    /// Writes the fresh record of every key Redis does not have, in one script call; the
    /// others are left to `begin_alone`. A call that fails may still run (as `begin_as`
    /// says), so every lease it carried is given back, and every job fails with its error.
    async fn begin_many(
        &self,
        jobs: &[BeginJob],
        fresh: &[(Lease, Record)],
    ) -> Result<Option<Vec<Acquired>>, StoreError> {
        let keys: Vec<String> = fresh.iter().map(|(_, r)| self.redis_key(&r.key)).collect();
        let mut call = self.scripts.begin_new.prepare_invoke();
        for ((job, (_, record)), key) in jobs.iter().zip(fresh).zip(&keys) {
            call.key(key)
                .arg(pack(record))
                .arg(native_ttl(record.expires_at, job.now));
        }
        let got: Vec<i64> = match call.invoke_async(&mut self.conn.clone()).await {
            Ok(got) => got,
            Err(e) => {
                if may_have_run(&e) {
                    for ((job, (lease, _)), key) in jobs.iter().zip(fresh).zip(&keys) {
                        self.give_back(key, lease, job.now);
                    }
                }
                return Err(error("cannot begin the records", e));
            }
        };
        if got.len() != jobs.len() {
            return Err(corrupt("batched begin answer"));
        }
        Ok(Some(
            fresh
                .iter()
                .zip(got)
                .filter(|(_, got)| *got == 1)
                .map(|((lease, _), _)| (lease.id.to_bytes().to_vec(), 1))
                .collect(),
        ))
    }

    /// Completes every job's record its lease still holds, in one script call. A script that
    /// failed part way (a key holding a value this store did not write) leaves every job to
    /// `complete_alone`, which finds those it completed done; without the server every job
    /// fails with the error.
    async fn complete_many(&self, jobs: &[CompleteJob]) -> Result<Option<Vec<bool>>, StoreError> {
        let mut call = self.scripts.complete_many.prepare_invoke();
        call.arg(millis(EXPIRY_MARGIN));
        for job in jobs {
            call.key(self.redis_key(&job.key))
                .arg(exact(job.now.as_millis()))
                .arg(&job.lease.id.to_bytes()[..])
                .arg(job.lease.fence)
                .arg(&job.response[..]);
        }
        match call.invoke_async::<Vec<i64>>(&mut self.conn.clone()).await {
            Ok(done) if done.len() == jobs.len() => {
                Ok(Some(done.iter().map(|d| *d == 1).collect()))
            }
            Ok(_) => Ok(None),
            Err(e) if transient(&e) => Err(error("cannot complete the records", e)),
            Err(_) => Ok(None),
        }
    }
}

impl RedisStore {
    /// `begin` with the fresh record and lease it would write: a call sent again after its
    /// answer was lost carries the same ones.
    async fn begin_as(
        &self,
        fresh: &Record,
        lease: Lease,
        now: Timestamp,
    ) -> Result<BeginOutcome, StoreError> {
        let key = self.redis_key(&fresh.key);
        let packed = pack(fresh);
        let ttl = native_ttl(fresh.expires_at, now);
        // Either command may run on the server after its answer was given up on (a response
        // timeout, a broken connection); then what it took is given back.
        let failed = |e: redis::RedisError| {
            if may_have_run(&e) {
                self.give_back(&key, &lease, now);
            }
            error("cannot begin the record", e)
        };
        // A key Redis does not have is the common case: claim it with one plain command.
        let set: Value = redis::cmd("SET")
            .arg(&key)
            .arg(&packed)
            .arg("NX")
            .arg("PX")
            .arg(ttl)
            .query_async(&mut self.conn.clone())
            .await
            .map_err(failed)?;
        match set {
            Value::Okay => return Ok(BeginOutcome::Acquired(lease)),
            Value::Nil => {}
            _ => return Err(corrupt("SET answer")),
        }
        let answer: Value = self
            .scripts
            .begin
            .key(&key)
            .arg(exact(now.as_millis()))
            .arg(&fresh.fingerprint.as_bytes()[..])
            .arg(&lease.id.to_bytes()[..])
            .arg(packed)
            .arg(ttl)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(failed)?;
        let Value::Array(mut parts) = answer else {
            return Err(corrupt("begin answer"));
        };
        let tag = parts.first().and_then(text).map(str::to_owned);
        match tag.as_deref() {
            Some("acquired") if parts.len() == 2 => Ok(BeginOutcome::Acquired(Lease {
                fence: int(&parts[1], "fence")?,
                ..lease
            })),
            Some("in_progress") if parts.len() == 2 => Ok(BeginOutcome::InProgress {
                lease_expires_at: Timestamp::from_millis(int(&parts[1], "lease expiry")?),
            }),
            Some("mismatch") => Ok(BeginOutcome::Mismatch),
            Some("replay") if parts.len() == 4 => {
                let completed_at = Timestamp::from_millis(int(&parts[3], "update time")?);
                let fence = int(&parts[2], "fence")?;
                let response = bytes(parts.swap_remove(1), "response")?;
                Ok(BeginOutcome::Replay(Replay {
                    response: Bytes::from(response),
                    fence,
                    completed_at,
                }))
            }
            _ => Err(corrupt("begin answer")),
        }
    }

    /// Gives back what a failed `begin` under `lease` may still take: releases the record at
    /// `key` if it is in progress under that lease id, whenever the server gets to it.
    ///
    /// The first attempt is queued on the connection before this returns: a single Redis
    /// connection carries commands in order and the server runs them in that order, so on a
    /// server that stalled, the give-back runs right after the late `begin` (and before
    /// anything this store sends afterwards), however long the stall. If that attempt fails
    /// too (the server is still stalled or away), a task repeats it, backing off from 100 ms
    /// to 5 s, until it is answered or the lease has run out: if the connection broke and was
    /// replaced meanwhile, a `begin` that ran before the break is given back once the server
    /// is reachable again. Only a `begin` that ran on the old connection after the new one
    /// was answered (a server that read it late from a connection the client had already
    /// dropped) escapes; it then holds the key until its lease ends.
    fn give_back(&self, key: &str, lease: &Lease, now: Timestamp) {
        let mut call = redis::cmd("EVAL");
        call.arg(&self.scripts.give_back)
            .arg(1)
            .arg(key)
            .arg(exact(now.as_millis()))
            .arg(&lease.id.to_bytes()[..])
            .arg(millis(EXPIRY_MARGIN));
        let mut conn = self.conn.clone();
        let lasts = lease.expires_at.saturating_since(now);
        let mut attempts = Box::pin(async move {
            let until = tokio::time::Instant::now() + lasts;
            let mut pause = Duration::from_millis(100);
            loop {
                match call.query_async::<Value>(&mut conn).await {
                    // Not answered, or the server not ready (still loading, failing over).
                    Err(e) if transient(&e) => {}
                    // Answered (done, or nothing to give back), or refused for good.
                    _ => return,
                }
                if tokio::time::Instant::now() + pause >= until {
                    return;
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(5));
            }
        });
        // Polled once here, which queues the first attempt on the connection.
        let waker = std::task::Waker::noop();
        let first = attempts
            .as_mut()
            .poll(&mut std::task::Context::from_waker(waker));
        if first.is_pending() {
            // Without a runtime to carry on, the queued attempt still goes out.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(attempts);
            }
        }
    }

    async fn settle_as(
        &self,
        key: &Key,
        lease: &Lease,
        to: Status,
        response: Option<Bytes>,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        let mut call = self.scripts.settle.key(self.redis_key(key));
        call.arg(exact(now.as_millis()))
            .arg(&lease.id.to_bytes()[..])
            .arg(lease.fence)
            .arg(millis(EXPIRY_MARGIN))
            .arg(&[status_byte(to)][..]);
        if let Some(r) = &response {
            call.arg(&r[..]);
        }
        let answer: String = call
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| error("cannot settle the record", e))?;
        match answer.as_str() {
            "ok" => Ok(()),
            "stale" => Err(StaleLease.into()),
            _ => Err(corrupt("settle answer").into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_packed_record_reads_back_field_for_field() {
        let key = Key::parse("s", "n", "k").unwrap();
        let req = BeginRequest::new(key.clone(), Fingerprint::of_bytes(b"body"));
        let now = Timestamp::from_millis(1_700_000_000_123);
        let (_, mut r) = Record::acquired(&req, now, 1, idem_core::LeaseId::generate());
        r.fence = u64::MAX;
        r.status = Status::Completed;
        r.response = Some(Bytes::from_static(b"\0{\"ok\":true}\xff"));
        let v = pack(&r);
        // The positions the scripts read, 1-based there.
        assert_eq!(&v[50..70], b"18446744073709551615");
        assert_eq!(
            &v[134..150],
            format!("{:016}", r.expires_at.as_millis()).as_bytes()
        );
        let back = unpack(&key, &v).unwrap();
        assert_eq!(back.status, r.status);
        assert_eq!(back.fingerprint, r.fingerprint);
        assert_eq!(back.fence, r.fence);
        assert_eq!(back.lease_id, r.lease_id);
        assert_eq!(back.lease_expires_at, r.lease_expires_at);
        assert_eq!(back.response, r.response);
        assert_eq!(back.ttl_ms, r.ttl_ms);
        assert_eq!(back.created_at, r.created_at);
        assert_eq!(back.updated_at, r.updated_at);
        assert_eq!(back.expires_at, r.expires_at);
    }

    /// A store on the project's Redis, or `None` if there is none.
    async fn shared_store() -> Option<RedisStore> {
        let url = idem_testkit::services::REDIS.url()?;
        let options = RedisOptions {
            prefix: "idem-test:".into(),
            ..RedisOptions::default()
        };
        Some(RedisStore::connect(&url, options).await.unwrap())
    }

    /// A `begin` whose answer was lost and which is sent again (the client retries on a
    /// dropped connection) holds the lease it was first given, whichever way it first went.
    #[test]
    fn a_begin_sent_again_holds_its_lease() {
        idem_testkit::block_on(async {
            let Some(store) = shared_store().await else {
                return;
            };
            let now = Timestamp::now();
            let scope = format!("resend-{}-{}", std::process::id(), now.as_millis());
            let req = |k: &str| {
                BeginRequest::new(
                    Key::parse(&scope, "n", k).unwrap(),
                    Fingerprint::of_bytes(b"b"),
                )
            };
            // Once by the plain SET, and once after a release, by the script.
            let (lease, fresh) =
                Record::acquired(&req("a"), now, 1, idem_core::LeaseId::generate());
            let first = store.begin_as(&fresh, lease, now).await.unwrap();
            let again = store.begin_as(&fresh, lease, now).await.unwrap();
            assert_eq!(first, BeginOutcome::Acquired(lease));
            assert_eq!(again, first);
            store.release(&fresh.key, &lease, now).await.unwrap();
            let (lease, fresh) =
                Record::acquired(&req("a"), now, 1, idem_core::LeaseId::generate());
            let first = store.begin_as(&fresh, lease, now).await.unwrap();
            let again = store.begin_as(&fresh, lease, now).await.unwrap();
            let taken_over = Lease { fence: 2, ..lease };
            assert_eq!(first, BeginOutcome::Acquired(taken_over));
            assert_eq!(again, first);
            // Another attempt is not the same call.
            let (other, fresh) =
                Record::acquired(&req("a"), now, 1, idem_core::LeaseId::generate());
            assert!(matches!(
                store.begin_as(&fresh, other, now).await.unwrap(),
                BeginOutcome::InProgress { .. }
            ));
        });
    }

    /// The give-back of a failed `begin` releases what that `begin` took, by a plain `SET`
    /// or by the script's takeover, and nothing else. (The tests in `tests/late_claims.rs`
    /// stall a server to make a `begin` fail and land late; a stall cannot fall between the
    /// `SET` and the script, so the takeover's give-back is tested here directly.)
    #[test]
    fn a_give_back_releases_only_what_its_lease_took() {
        idem_testkit::block_on(async {
            let Some(store) = shared_store().await else {
                return;
            };
            let now = Timestamp::now();
            let scope = format!("give-back-{}-{}", std::process::id(), now.as_millis());
            let req = BeginRequest::new(
                Key::parse(&scope, "n", "k").unwrap(),
                Fingerprint::of_bytes(b"b"),
            );
            let key = store.redis_key(&req.key);
            let (first, fresh) = Record::acquired(&req, now, 1, idem_core::LeaseId::generate());
            store.begin_as(&fresh, first, now).await.unwrap();
            // Another lease's give-back leaves the holder's record alone.
            let (stranger, _) = Record::acquired(&req, now, 1, idem_core::LeaseId::generate());
            store.give_back(&key, &stranger, now);
            store.give_back(
                &key,
                &Lease {
                    fence: 1,
                    ..stranger
                },
                now,
            );
            // The plain `SET`'s record, given back.
            store.give_back(&key, &first, now);
            let (second, fresh) = Record::acquired(&req, now, 1, idem_core::LeaseId::generate());
            let taken = store.begin_as(&fresh, second, now).await.unwrap();
            assert_eq!(taken, BeginOutcome::Acquired(Lease { fence: 2, ..second }));
            // The script's takeover, given back; the record keeps its fence.
            store.give_back(&key, &second, now);
            let record = store.get(&req.key, now).await.unwrap().unwrap();
            assert_eq!((record.status, record.fence), (Status::Released, 2));
            let (third, fresh) = Record::acquired(&req, now, 1, idem_core::LeaseId::generate());
            let taken = store.begin_as(&fresh, third, now).await.unwrap();
            assert_eq!(taken, BeginOutcome::Acquired(Lease { fence: 3, ..third }));
            // A completed record is not given back.
            store
                .complete(
                    &req.key,
                    &Lease { fence: 3, ..third },
                    Bytes::from_static(b"r"),
                    now,
                )
                .await
                .unwrap();
            store.give_back(&key, &third, now);
            let record = store.get(&req.key, now).await.unwrap().unwrap();
            assert_eq!(record.status, Status::Completed);
        });
    }

    #[test]
    fn a_value_of_another_shape_is_corrupt() {
        let key = Key::parse("s", "n", "k").unwrap();
        let req = BeginRequest::new(key.clone(), Fingerprint::of_bytes(b"body"));
        let (_, r) = Record::acquired(
            &req,
            Timestamp::from_millis(5),
            1,
            idem_core::LeaseId::generate(),
        );
        let good = pack(&r);
        let mut other_format = good.clone();
        other_format[0] = b'2';
        let mut bad_number = good.clone();
        bad_number[60] = b'x';
        let mut tail_on_in_progress = good.clone();
        tail_on_in_progress.push(b'r');
        for bad in [
            &good[..HEADER - 1],
            &other_format,
            &bad_number,
            &tail_on_in_progress,
        ] {
            assert!(matches!(unpack(&key, bad), Err(StoreError::Corrupt(_))));
        }
        assert!(unpack(&key, &good).is_ok());
    }
}
