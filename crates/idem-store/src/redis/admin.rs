//! The operator's view of a [`RedisStore`]: a listing that pages by `SCAN`, counts by state, and
//! fenced repairs (one script call each).
//!
//! A listing scans the pattern of record keys, `<prefix>{<32 characters>}`, which lock keys
//! (`<prefix>lock:{…}`) and counters (`…}:n`) never match, and reads each batch of keys found in
//! one pipeline of `GETRANGE` and `STRLEN`: every record's header, key and the first
//! [`RESPONSE_HEAD`] bytes of its response (a few hundred bytes at most), never a whole
//! response. Key names are digests, so every filter, scope and namespace too, applies to what
//! is read: a narrow filter over a large keyspace reads further to fill a page, up to a bound
//! (`MIN_REACH` keys, or ten per record asked for), and may return it short. A count reads
//! every record key's header and key (no `STRLEN`): it costs a pass over the records, for
//! dashboards that poll now and then.
//!
//! On a Cluster each primary is scanned in turn, in the order of the first slot it serves; the
//! cursor carries the node's place in that order (its low `NODE_BITS` bits) and the node's own
//! `SCAN` cursor. A resharding during a listing may show a moved record twice, or miss it.
//!
//! `SCAN` returns every key present throughout at least once, and returns one twice only if the
//! keyspace is resized meanwhile: a page never holds a key twice, but two pages may then (and a
//! count may count it twice).
//!
//! A value this store did not write at a record's key (another type, another layout), and a
//! record of format 1, which does not keep its key, are skipped by listings and counts (not
//! reported as corrupt): one stray key must not hide every record from the operator. The record
//! operations still refuse such a value.

use std::collections::{BTreeMap, HashMap, HashSet};

use idem_core::admin::{RESPONSE_HEAD, check_listing};
use idem_core::{
    BoxFuture, Counts, Cursor, InvalidListing, Key, Listed, Page, Record, RecordAdmin,
    RecordFilter, RecordState, Repair, Shown, StoreError, Timestamp,
};
use redis::Value;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};

use super::error::{corrupt, error};
use super::format::{MAX_HEAD, exact, millis, unpack_named};
use super::{Conn, EXPIRY_MARGIN, RedisStore};

/// The most keys one `SCAN` call asks for, and one read covers.
pub(super) const BATCH: usize = 1000;

/// How many keys a page's scan may cover, at least, before it returns short.
const MIN_REACH: usize = 10_000;

/// The low bits of a Cluster's cursor, which carry the node's place.
const NODE_BITS: u32 = 10;

/// How many records past the one asked for a page may hold: a stretch of the scan that finds
/// more is scanned again, shorter.
fn slack(limit: usize) -> usize {
    limit / 4 + 16
}

/// One node to scan: `None` for the one server, or a slot its Cluster primary serves.
pub(super) type Node = Option<Route>;

/// Where a scan is: the node's place, and its `SCAN` cursor there.
#[derive(Debug, Clone, Copy)]
struct At {
    node: usize,
    scan: u64,
}

impl RecordAdmin for RedisStore {
    fn list<'a>(
        &'a self,
        filter: &'a RecordFilter,
        after: Option<&'a Cursor>,
        limit: usize,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<Page, StoreError>> {
        Box::pin(async move {
            check_listing(filter, limit)?;
            let nodes = self.nodes().await?;
            let mut at = match after {
                None => At { node: 0, scan: 0 },
                Some(Cursor::Scan(c)) => decode(*c, nodes.len())?,
                Some(Cursor::After(_)) => return Err(InvalidListing::Cursor.into()),
            };
            let most = limit.saturating_mul(10).max(MIN_REACH);
            let (mut records, mut seen) = (Vec::new(), HashSet::new());
            // Keys the page's scan covered, and, of those in batches that did not end a node's
            // scan, how many were asked for and how many matched.
            let (mut reach, mut asked, mut found) = (0, 0, 0);
            loop {
                // As many keys as should fill the rest of the page, judging by how many of
                // those scanned so far matched.
                let wanted = limit - records.len();
                let count = (wanted * (asked + 1) / (found + 1)).max(wanted).min(BATCH);
                let (next, count, matched) = self
                    .batch(
                        nodes[at.node],
                        at.scan,
                        count,
                        wanted + slack(limit),
                        |record| filter.matches(record, now),
                    )
                    .await?;
                reach += count;
                if next != 0 {
                    asked += count;
                    found += matched.len();
                }
                for (key, record, len) in matched {
                    if seen.insert(key) {
                        let mut listed = Listed::of(&record, now);
                        listed.response_len = listed.response_len.map(|_| len);
                        records.push(listed);
                    }
                }
                at = match next {
                    0 if at.node + 1 == nodes.len() => {
                        return Ok(Page {
                            records,
                            next: None,
                        });
                    }
                    0 => At {
                        node: at.node + 1,
                        scan: 0,
                    },
                    scan => At { scan, ..at },
                };
                if records.len() >= limit || reach >= most {
                    let next = Some(Cursor::Scan(encode(at, nodes.len())?));
                    return Ok(Page { records, next });
                }
            }
        })
    }

    fn count<'a>(
        &'a self,
        filter: &'a RecordFilter,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<Counts, StoreError>> {
        Box::pin(async move {
            let head = if filter.response_prefix.is_some() {
                RESPONSE_HEAD
            } else {
                0
            };
            let mut counts = Counts::default();
            for node in self.nodes().await? {
                let mut scan = 0;
                loop {
                    let (next, keys) = self.scan(node, &self.key_pattern(""), scan, BATCH).await?;
                    for (record, _) in self
                        .heads(node, &keys, head, false)
                        .await?
                        .into_iter()
                        .flatten()
                    {
                        if filter.matches_ignoring_state(&record) {
                            counts.add(RecordState::of(&record, now), record.created_at);
                        }
                    }
                    scan = next;
                    if scan == 0 {
                        break;
                    }
                }
            }
            Ok(counts)
        })
    }

    fn repair<'a>(
        &'a self,
        key: &'a Key,
        shown: Shown,
        repair: Repair,
        now: Timestamp,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            if !idem_core::repair::may_apply(repair, shown) {
                return Ok(false);
            }
            let done: i64 = self
                .scripts
                .repair
                .key(self.redis_key(key))
                .arg(exact(now.as_millis()))
                .arg(shown.state.as_str())
                .arg(shown.fence)
                .arg(repair.as_str())
                .arg(millis(EXPIRY_MARGIN))
                .invoke_async(&mut self.conn.clone())
                .await
                .map_err(|e| error("cannot repair the record", e))?;
            Ok(done == 1)
        })
    }
}

impl RedisStore {
    /// The nodes a scan covers: the one server, or each Cluster primary, in the order of the
    /// first slot it serves.
    pub(super) async fn nodes(&self) -> Result<Vec<Node>, StoreError> {
        let Conn::Cluster(conn) = &self.conn else {
            return Ok(vec![None]);
        };
        let slots = conn
            .clone()
            .route_command(
                redis::cmd("CLUSTER").arg("SLOTS").clone(),
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
            )
            .await
            .map_err(|e| error("cannot read the Cluster's slots", e))?;
        let bad = || corrupt("answer to CLUSTER SLOTS");
        let Value::Array(ranges) = slots else {
            return Err(bad());
        };
        // Each primary (by address) and the first slot it serves.
        let mut firsts: BTreeMap<Vec<u8>, u16> = BTreeMap::new();
        for range in ranges {
            let Value::Array(parts) = range else {
                return Err(bad());
            };
            let (Some(Value::Int(start)), Some(Value::Array(primary))) =
                (parts.first(), parts.get(2))
            else {
                return Err(bad());
            };
            let start = u16::try_from(*start).map_err(|_| bad())?;
            let (Some(Value::BulkString(host)), Some(Value::Int(port))) =
                (primary.first(), primary.get(1))
            else {
                return Err(bad());
            };
            let address = [&host[..], b":", port.to_string().as_bytes()].concat();
            let first = firsts.entry(address).or_insert(start);
            *first = (*first).min(start);
        }
        let mut starts: Vec<u16> = firsts.into_values().collect();
        starts.sort_unstable();
        if starts.is_empty() || starts.len() >= 1 << NODE_BITS {
            return Err(StoreError::Backend {
                message: format!(
                    "a listing covers 1 to {} Cluster primaries; this Cluster has {}",
                    (1 << NODE_BITS) - 1,
                    starts.len()
                ),
                source: None,
            });
        }
        Ok(starts
            .into_iter()
            .map(|s| Some(Route::new(s, SlotAddr::Master)))
            .collect())
    }

    /// One `SCAN` call on `node` over the keys matching `pattern`: the next cursor and the
    /// keys found.
    pub(super) async fn scan(
        &self,
        node: Node,
        pattern: &str,
        at: u64,
        count: usize,
    ) -> Result<(u64, Vec<String>), StoreError> {
        let mut cmd = redis::cmd("SCAN");
        cmd.arg(at)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(count);
        let answer = self
            .on_node(node, cmd)
            .await
            .map_err(|e| error("cannot scan the keys", e))?;
        redis::from_redis_value(answer).map_err(|_| corrupt("answer to SCAN"))
    }

    /// `cmd` (one that names no key) sent to `node`.
    pub(super) async fn on_node(&self, node: Node, cmd: redis::Cmd) -> redis::RedisResult<Value> {
        match (&self.conn, node) {
            (Conn::Cluster(conn), Some(route)) => {
                let routing = SingleNodeRoutingInfo::SpecificNode(route);
                conn.clone()
                    .route_command(cmd, RoutingInfo::SingleNode(routing))
                    .await
            }
            _ => cmd.query_async(&mut self.conn.clone()).await,
        }
    }

    /// One stretch of a listing's scan on `node` from `at`, of about `count` keys: the next
    /// cursor, the count asked for, and the records found that pass `keep`, with their Redis
    /// keys and response lengths. A stretch holding more than `most` of them is scanned again,
    /// shorter: from the same cursor, `SCAN` walks the same order (unless the keyspace is
    /// resized meanwhile), so the shorter stretch is the start of the longer one, and its
    /// records are not read again.
    async fn batch(
        &self,
        node: Node,
        at: u64,
        mut count: usize,
        most: usize,
        keep: impl Fn(&Record) -> bool,
    ) -> Result<(u64, usize, Vec<(String, Record, u64)>), StoreError> {
        let mut read: HashMap<String, Option<(Record, u64)>> = HashMap::new();
        loop {
            let (next, keys) = self.scan(node, &self.key_pattern(""), at, count).await?;
            let new: Vec<String> = keys
                .iter()
                .filter(|k| !read.contains_key(*k))
                .cloned()
                .collect();
            let heads = self.heads(node, &new, RESPONSE_HEAD, true).await?;
            read.extend(new.into_iter().zip(heads));
            let matched: Vec<(String, Record, u64)> = keys
                .into_iter()
                .filter_map(|k| {
                    let (record, len) = read.get(&k)?.as_ref()?;
                    keep(record).then(|| (k, record.clone(), *len))
                })
                .collect();
            if matched.len() <= most || count == 1 {
                return Ok((next, count, matched));
            }
            count = (count * most / matched.len()).max(1);
        }
    }

    /// What a listing reads of the records at `keys` on `node`: each one's record (its response
    /// cut to its first `response` bytes, or a few more) and, if `lengths`, the whole
    /// response's length (else 0), in the order of `keys`; `None` for a key gone since the
    /// scan, or holding a value this store did not write.
    async fn heads(
        &self,
        node: Node,
        keys: &[String],
        response: usize,
        lengths: bool,
    ) -> Result<Vec<Option<(Record, u64)>>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        // Plain reads of each key, as far as the longest key reaches, sent together: a
        // Cluster refuses a script over keys of many slots, and on one server a script that
        // reads exactly the bytes needed costs Redis more than these commands.
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for key in keys {
            pipe.cmd("GETRANGE")
                .arg(key)
                .arg(0)
                .arg(MAX_HEAD + response - 1);
            if lengths {
                pipe.cmd("STRLEN").arg(key);
            }
        }
        let per_key = if lengths { 2 } else { 1 };
        let values = self
            .pipeline(node, pipe, per_key * keys.len())
            .await
            .map_err(|e| error("cannot read the records", e))?;
        Ok(values
            .chunks(per_key)
            .map(|read| {
                // A key gone since the scan reads as empty; one of another type, as an error.
                let (v, len) = match read {
                    [Value::BulkString(v), Value::Int(len)] => (v, u64::try_from(*len).ok()?),
                    [Value::BulkString(v)] => (v, 0),
                    _ => return None,
                };
                let (record, at) = unpack_named(v).ok()?;
                Some((record, len.saturating_sub(at as u64)))
            })
            .collect())
    }

    /// The answers of the `count` commands of `pipe`, sent to `node`.
    pub(super) async fn pipeline(
        &self,
        node: Node,
        pipe: redis::Pipeline,
        count: usize,
    ) -> redis::RedisResult<Vec<Value>> {
        match (&self.conn, node) {
            (Conn::Cluster(conn), Some(route)) => {
                let to = SingleNodeRoutingInfo::SpecificNode(route);
                conn.clone().route_pipeline(pipe, 0, count, to).await
            }
            _ => pipe.query_async(&mut self.conn.clone()).await,
        }
    }

    /// The `SCAN` pattern of the keys `<prefix><infix>{<32 characters>}`: the prefix (its
    /// pattern characters escaped), `infix`, then a digest as its hash tag. Record keys (see
    /// [`RedisStore::redis_key`]) have no infix, lock keys `lock:`.
    pub(super) fn key_pattern(&self, infix: &str) -> String {
        let mut pattern = String::with_capacity(self.prefix.len() + 40);
        for c in self.prefix.chars() {
            if matches!(c, '*' | '?' | '[' | ']' | '\\') {
                pattern.push('\\');
            }
            pattern.push(c);
        }
        pattern.push_str(infix);
        pattern.push('{');
        pattern.push_str(&"?".repeat(32));
        pattern.push('}');
        pattern
    }
}

/// A scan's place as a cursor: the `SCAN` cursor on one server; on a Cluster, that shifted
/// past the node's place.
fn encode(at: At, nodes: usize) -> Result<u64, StoreError> {
    if nodes == 1 {
        return Ok(at.scan);
    }
    let node = at.node as u64;
    (at.scan.leading_zeros() >= NODE_BITS)
        .then_some((at.scan << NODE_BITS) | node)
        .ok_or_else(|| StoreError::Backend {
            message: "a Cluster node's SCAN cursor is too large to carry in a listing's cursor"
                .into(),
            source: None,
        })
}

/// The place a cursor made by [`encode`] names.
fn decode(cursor: u64, nodes: usize) -> Result<At, StoreError> {
    if nodes == 1 {
        return Ok(At {
            node: 0,
            scan: cursor,
        });
    }
    let node = usize::try_from(cursor & ((1 << NODE_BITS) - 1)).unwrap_or(usize::MAX);
    if node >= nodes {
        return Err(InvalidListing::Cursor.into());
    }
    Ok(At {
        node,
        scan: cursor >> NODE_BITS,
    })
}
