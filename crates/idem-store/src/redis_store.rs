//! Idempotency records in Redis, single node or Cluster.
//!
//! A record is one hash. Every operation that decides something is one Lua script, which Redis
//! runs atomically: `begin` reads the hash, applies the rules of `Record::begin` and writes the
//! new lease in the same step, so of any number of concurrent `begin`s exactly one acquires.
//!
//! **Keys.** A record's Redis key is `<prefix>{<digest>}`, the digest being 128 bits of SHA-256
//! over scope, namespace and client key. Each record is a single key, and the braces make it
//! its own hash tag, so on a Cluster every operation touches exactly one slot; client keys of
//! any shape (braces, spaces, 255 bytes) never leak into key names.
//!
//! **Expiry** is decided by the caller's clock (`now`), as in every store: a record past its
//! `expires_at` is absent to the scripts even if Redis still has it. Redis's own TTL only
//! reclaims the memory: each write sets `PEXPIRE` to the time left by the caller's clock plus
//! [`EXPIRY_MARGIN`], so servers whose clocks differ a little never see a record vanish early.
//! `purge_expired` has nothing to do.
//!
//! **Eviction** would forget records: a server with `maxmemory` set and a policy other than
//! `noeviction` is refused at connect unless [`RedisOptions::allow_eviction`] says otherwise.
//!
//! **Durability** is Redis's: with `appendonly yes` and `appendfsync always` a completed record
//! survives a crash of the server; with the defaults the last second may be lost, and with a
//! replica failover the last writes may be lost too. Choose the store for what it may forget.

use std::time::Duration;

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Fingerprint, Key, Lease, LeaseError, LeaseId, Record,
    Replay, StaleLease, Status, Store, StoreError, Timestamp,
};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Script, Value};

/// Added to every native TTL, so that a record outlives its logical expiry by this much.
pub const EXPIRY_MARGIN: Duration = Duration::from_secs(5);

/// The largest timestamp or duration the scripts handle exactly (Lua numbers are doubles).
const MAX_EXACT: u64 = (1 << 53) - 1;

const BEGIN: &str = r"
local k = KEYS[1]
local now = tonumber(ARGV[1])
local r = redis.call('HMGET', k, 'st', 'fp', 'fence', 'lexp', 'exp', 'resp', 'uat', 'lid')
local st, fence, lexp, exp = r[1], tonumber(r[3]), tonumber(r[4]), tonumber(r[5])
if st and exp > now then
  if st == 'completed' then
    if r[2] == ARGV[2] then return {'replay', r[6], fence, tonumber(r[7])} end
    return {'mismatch'}
  elseif st == 'in_progress' then
    if r[2] ~= ARGV[2] then return {'mismatch'} end
    -- This very begin, sent again after its answer was lost: it holds the lease.
    if r[8] == ARGV[3] then return {'acquired', fence} end
    if lexp > now then return {'in_progress', lexp} end
  end
end
local f = (fence or 0) + 1
redis.call('HSET', k, 'st', 'in_progress', 'fp', ARGV[2], 'fence', f, 'lid', ARGV[3],
  'lexp', ARGV[4], 'ttl', ARGV[5], 'cat', ARGV[1], 'uat', ARGV[1], 'exp', ARGV[6])
if st then redis.call('HDEL', k, 'resp') end
redis.call('PEXPIRE', k, ARGV[7])
return {'acquired', f}
";

/// Shared by complete and release: ARGV = now, lease id, fence, margin, target state,
/// response (complete only). Answers `ok` or `stale`.
const SETTLE: &str = r"
local k = KEYS[1]
local now = tonumber(ARGV[1])
local r = redis.call('HMGET', k, 'st', 'lid', 'fence', 'exp', 'ttl')
if not r[1] or tonumber(r[4]) <= now or r[2] ~= ARGV[2] or tonumber(r[3]) ~= tonumber(ARGV[3]) then
  return 'stale'
end
if r[1] == ARGV[5] then return 'ok' end
if r[1] ~= 'in_progress' then return 'stale' end
local exp = now + tonumber(r[5])
if ARGV[5] == 'completed' then
  redis.call('HSET', k, 'st', ARGV[5], 'uat', ARGV[1], 'exp', exp, 'resp', ARGV[6])
else
  redis.call('HSET', k, 'st', ARGV[5], 'uat', ARGV[1], 'exp', exp)
end
redis.call('PEXPIRE', k, exp - now + tonumber(ARGV[4]))
return 'ok'
";

/// ARGV = now, lease id, fence, new lease end, margin. Answers 1 if it renewed the lease.
const RENEW: &str = r"
local k = KEYS[1]
local now = tonumber(ARGV[1])
local r = redis.call('HMGET', k, 'st', 'lid', 'fence', 'exp', 'ttl')
if r[1] ~= 'in_progress' or tonumber(r[4]) <= now or r[2] ~= ARGV[2]
    or tonumber(r[3]) ~= tonumber(ARGV[3]) then
  return 0
end
local lexp = tonumber(ARGV[4])
local exp = lexp + tonumber(r[5])
redis.call('HSET', k, 'lexp', lexp, 'exp', exp, 'uat', ARGV[1])
redis.call('PEXPIRE', k, exp - now + tonumber(ARGV[5]))
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
local k = KEYS[1]
local now = tonumber(ARGV[1])
local r = redis.call('HMGET', k, 'st', 'fence', 'exp', 'ttl')
if r[1] ~= 'completed' or tonumber(r[3]) <= now or tonumber(r[2]) ~= tonumber(ARGV[2]) then
  return 0
end
local exp = now + tonumber(r[4])
redis.call('HSET', k, 'st', 'released', 'uat', ARGV[1], 'exp', exp)
redis.call('HDEL', k, 'resp')
redis.call('PEXPIRE', k, exp - now + tonumber(ARGV[3]))
return 1
";

/// The hash fields `get` reads, in this order.
const FIELDS: [&str; 10] = [
    "st", "fp", "fence", "lid", "lexp", "resp", "ttl", "cat", "uat", "exp",
];

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
}

impl Default for RedisOptions {
    fn default() -> Self {
        Self {
            prefix: "idem:".to_owned(),
            response_timeout: Duration::from_secs(5),
            allow_eviction: false,
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
    pub(crate) locks: crate::redis_locks::LockScripts,
    begin: Script,
    settle: Script,
    renew: Script,
    reopen: Script,
    raise: Script,
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
        Self {
            conn,
            prefix: options.prefix,
            client: None,
            locks: crate::redis_locks::LockScripts::new(),
            begin: Script::new(BEGIN),
            settle: Script::new(SETTLE),
            renew: Script::new(RENEW),
            reopen: Script::new(REOPEN),
            raise: Script::new(RAISE),
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

/// Redis errors: the connection or the server being unreachable, busy or failing over may
/// pass; anything else (a script error, a wrong type at the key) is a backend error.
pub(crate) fn error(what: &str, e: redis::RedisError) -> StoreError {
    let transient = e.is_io_error()
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
        );
    let message = format!("{what}: {e}");
    if transient {
        StoreError::unavailable(message, e)
    } else {
        StoreError::backend(message, e)
    }
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

impl Store for RedisStore {
    fn kind(&self) -> &'static str {
        match self.conn {
            Conn::Single(_) => "redis",
            Conn::Cluster(_) => "redis-cluster",
        }
    }

    async fn begin(&self, req: &BeginRequest, now: Timestamp) -> Result<BeginOutcome, StoreError> {
        let (lease, fresh) = Record::acquired(req, now, 1);
        let answer: Value = self
            .begin
            .key(self.redis_key(&req.key))
            .arg(exact(now.as_millis()))
            .arg(&fresh.fingerprint.as_bytes()[..])
            .arg(&lease.id.to_bytes()[..])
            .arg(exact(lease.expires_at.as_millis()))
            .arg(exact(fresh.ttl_ms))
            .arg(exact(fresh.expires_at.as_millis()))
            .arg(native_ttl(fresh.expires_at, now))
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| error("cannot begin the record", e))?;
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

    async fn complete(
        &self,
        key: &Key,
        lease: &Lease,
        response: Bytes,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        self.settle_as(key, lease, Status::Completed, Some(response), now)
            .await
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
        let values: Vec<Value> = redis::cmd("HMGET")
            .arg(self.redis_key(key))
            .arg(&FIELDS[..])
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| error("cannot read the record", e))?;
        let [st, fp, fence, lid, lexp, resp, ttl, cat, uat, exp]: [Value; 10] =
            values.try_into().map_err(|_| corrupt("field list"))?;
        if st == Value::Nil {
            return Ok(None);
        }
        let ts = |v: &Value, what| int(v, what).map(Timestamp::from_millis);
        let record = Record {
            key: key.clone(),
            status: text(&st)
                .and_then(Status::parse)
                .ok_or_else(|| corrupt("status"))?,
            fingerprint: Fingerprint::from_bytes(
                bytes(fp, "fingerprint")?
                    .try_into()
                    .map_err(|_| corrupt("fingerprint"))?,
            ),
            fence: int(&fence, "fence")?,
            lease_id: LeaseId::from_bytes(
                bytes(lid, "lease id")?
                    .try_into()
                    .map_err(|_| corrupt("lease id"))?,
            ),
            lease_expires_at: ts(&lexp, "lease expiry")?,
            response: match resp {
                Value::Nil => None,
                v => Some(Bytes::from(bytes(v, "response")?)),
            },
            ttl_ms: int(&ttl, "ttl")?,
            created_at: ts(&cat, "creation time")?,
            updated_at: ts(&uat, "update time")?,
            expires_at: ts(&exp, "expiry")?,
        };
        if (record.status == Status::Completed) != record.response.is_some() {
            return Err(corrupt("response"));
        }
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

impl RedisStore {
    async fn settle_as(
        &self,
        key: &Key,
        lease: &Lease,
        to: Status,
        response: Option<Bytes>,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        let mut call = self.settle.key(self.redis_key(key));
        call.arg(exact(now.as_millis()))
            .arg(&lease.id.to_bytes()[..])
            .arg(lease.fence)
            .arg(millis(EXPIRY_MARGIN))
            .arg(to.as_str());
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
