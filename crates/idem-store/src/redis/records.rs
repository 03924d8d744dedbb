//! The store's operations on records: the [`Store`] calls, their batched forms (group commit)
//! and the one-record `begin` and settle they fall back to.

use std::time::Duration;

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Counters, Key, Lease, LeaseError, Record, RecordAdmin,
    Replay, StaleLease, Status, Step, StepError, Store, StoreError, Timestamp,
};
use redis::Value;

use super::error::{corrupt, error, may_have_run, transient};
use super::format::{bytes, exact, int, millis, native_ttl, pack, status_byte, text, unpack};
use super::plain::{Claim, refused_ifeq};
use super::{Conn, EXPIRY_MARGIN, RedisStore};
use crate::group_commit::{Acquired, BeginJob, CompleteJob, Fresh, GroupCommit, Many, ManyAtOnce};
use crate::reread;

impl Store for RedisStore {
    fn kind(&self) -> &'static str {
        match self.conn {
            Conn::Single(_) => "redis",
            Conn::Cluster(_) => "redis-cluster",
        }
    }

    async fn begin(&self, req: &BeginRequest, now: Timestamp) -> Result<BeginOutcome, StoreError> {
        crate::group_commit::begin(self, req, now).await
    }

    async fn complete(
        &self,
        key: &Key,
        lease: &Lease,
        response: Bytes,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        crate::group_commit::complete(self, key, lease, response, now).await
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
        if let Some(claim) = self.plain.take(key, lease, now) {
            let mut next = claim.record.clone();
            if let Ok(renewed) = next.renew_in_place(lease, length, now) {
                let value = Bytes::from(pack(&next));
                if self.set_if_claimed(&claim, &next, &value, now).await? {
                    let key = claim.key;
                    self.plain.claimed(Claim {
                        record: next,
                        key,
                        value,
                    });
                    return Ok(renewed);
                }
            }
        }
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

    async fn record_step(
        &self,
        key: &Key,
        lease: &Lease,
        step: &Step,
        now: Timestamp,
    ) -> Result<(), StepError> {
        // The record changes: a settle of this lease goes by the script.
        self.plain.forget(lease);
        // Read, decide by the pure rules, then write only if the record and its steps are
        // still as read (the script checks): the rules stay in one place, not in Lua.
        for _ in 0..reread::ROUNDS {
            let Some(write) = reread::step_write(self.load(key).await?, lease, step, now)? else {
                return Ok(());
            };
            let done: i64 = self
                .scripts
                .step
                .key(self.redis_key(key))
                .arg(exact(now.as_millis()))
                .arg(&lease.id.to_bytes()[..])
                .arg(lease.fence)
                .arg(write.read_len)
                .arg(write.steps)
                .invoke_async(&mut self.conn.clone())
                .await
                .map_err(|e| error("cannot record the step", e))?;
            if done == 1 {
                return Ok(());
            }
        }
        Err(reread::kept_changing().into())
    }

    async fn get(&self, key: &Key, now: Timestamp) -> Result<Option<Record>, StoreError> {
        Ok(self.load(key).await?.filter(|r| r.is_live(now)))
    }

    async fn purge_expired(&self, _now: Timestamp, _limit: usize) -> Result<u64, StoreError> {
        // Redis deletes expired records by itself (see the module's notes).
        Ok(0)
    }

    fn admin(&self) -> Option<&dyn RecordAdmin> {
        Some(self)
    }
}

impl Counters for RedisStore {
    async fn advance(&self, key: &Key, by: u64) -> Result<u64, StoreError> {
        if let Some(why) = &self.volatile_counters {
            return Err(StoreError::Backend {
                message: why.to_string(),
                source: None,
            });
        }
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
}

impl RedisStore {
    /// The record at `key` with its steps, live or not.
    async fn load(&self, key: &Key) -> Result<Option<Record>, StoreError> {
        let record_key = self.redis_key(key);
        let steps_key = format!("{record_key}:s");
        // Two GETs rather than one MGET: GET refuses a key of another type (WRONGTYPE), which
        // MGET would answer as absent. Each answer is taken apart, so that refusal keeps its code.
        let answers: Vec<redis::RedisResult<Option<Vec<u8>>>> = redis::pipe()
            .ignore_errors()
            .cmd("GET")
            .arg(record_key)
            .cmd("GET")
            .arg(steps_key)
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| error("cannot read the record", e))?;
        let [value, steps]: [_; 2] = answers
            .try_into()
            .map_err(|_| corrupt("answer to the record's reads"))?;
        let read = |r: redis::RedisResult<_>| r.map_err(|e| error("cannot read the record", e));
        let (Some(value), steps) = (read(value)?, read(steps)?) else {
            return Ok(None);
        };
        let mut record = unpack(key, &value)?;
        record.steps = idem_core::step::decode(steps.as_deref().unwrap_or_default())?;
        Ok(Some(record))
    }
}

impl ManyAtOnce for RedisStore {
    fn group_commit(&self) -> Option<&GroupCommit> {
        self.batches.as_ref()
    }

    async fn begin_alone(
        &self,
        req: &BeginRequest,
        now: Timestamp,
    ) -> Result<BeginOutcome, StoreError> {
        let (lease, fresh) = Record::acquired(
            req,
            now,
            Lease::first_fence(now),
            idem_core::LeaseId::generate(),
        );
        self.begin_as(&fresh, lease, now).await
    }

    async fn complete_alone(&self, job: CompleteJob) -> Result<(), LeaseError> {
        let (key, lease) = (&job.key, &job.lease);
        self.settle_as(key, lease, Status::Completed, Some(job.response), job.now)
            .await
    }

    /// Writes the fresh record of every key Redis does not have, with one pipeline of plain
    /// `SET … NX PX` (measured as fast as one script over every key on Redis 7, and faster
    /// on Valkey 9, whose scripts cost more); the others are left to `begin_alone`. A call
    /// that fails may still run (as `begin_as` says), so every lease it carried is given
    /// back, and every job fails with its error.
    async fn begin_many(&self, jobs: &[BeginJob], fresh: &[Fresh]) -> Many<Acquired> {
        let keys: Vec<String> = fresh.iter().map(|(_, r)| self.redis_key(&r.key)).collect();
        let values: Vec<Vec<u8>> = fresh.iter().map(|(_, r)| pack(r)).collect();
        let mut pipe = redis::pipe();
        for (((job, (_, record)), key), value) in jobs.iter().zip(fresh).zip(&keys).zip(&values) {
            pipe.cmd("SET")
                .arg(key)
                .arg(value)
                .arg("NX")
                .arg("PX")
                .arg(native_ttl(record.expires_at, job.now));
        }
        // Each answer on its own: a server that refuses some writes (out of memory, say)
        // still wrote the others, which are acquired; a refused one goes to `begin_alone`.
        let sent = pipe
            .ignore_errors()
            .query_async::<Vec<Value>>(&mut self.conn.clone())
            .await
            .map(|answers| {
                let set = |a: &Value| i64::from(matches!(a, Value::Okay));
                answers.iter().map(set).collect()
            });
        let got: Vec<i64> = match sent {
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
                .zip(keys.into_iter().zip(values))
                .filter(|((_, got), _)| *got == 1)
                .map(|(((lease, record), _), (key, value))| {
                    if self.plain.enabled() {
                        self.plain.claimed(Claim {
                            record: record.clone(),
                            key,
                            value: Bytes::from(value),
                        });
                    }
                    (
                        lease.id.to_bytes().to_vec(),
                        i64::try_from(lease.fence).unwrap_or(i64::MAX),
                    )
                })
                .collect(),
        ))
    }

    /// Completes every job's record its lease still holds: those this instance claimed and
    /// that are still as claimed with one pipelined `SET … IFEQ` each (see `super::plain`),
    /// the others in one script call. A script that failed part way (a key holding a value
    /// this store did not write) leaves its jobs to `complete_alone`, which finds those it
    /// completed done; without the server every job fails with the error.
    async fn complete_many(&self, jobs: &[CompleteJob]) -> Many<bool> {
        let mut done = vec![false; jobs.len()];
        let mut pipe = redis::pipe();
        // Which jobs went as plain commands.
        let mut plain = vec![false; jobs.len()];
        for (i, job) in jobs.iter().enumerate() {
            let Some(claim) = self.plain.take(&job.key, &job.lease, job.now) else {
                continue;
            };
            let Ok(Some(next)) = Record::complete(
                Some(&claim.record),
                &job.lease,
                job.response.clone(),
                job.now,
            ) else {
                continue;
            };
            let value = pack(&next);
            pipe.add_command(set_if_claimed_command(&claim, &next, &value, job.now));
            plain[i] = true;
        }
        if plain.contains(&true) {
            let answers: Vec<redis::RedisResult<Value>> = pipe
                .ignore_errors()
                .query_async(&mut self.conn.clone())
                .await
                .map_err(|e| error("cannot complete the records", e))?;
            let sent = plain
                .iter()
                .enumerate()
                .filter(|(_, p)| **p)
                .map(|(i, _)| i);
            for (i, answer) in sent.zip(answers) {
                match answer {
                    Ok(Value::Okay) => done[i] = true,
                    Err(e) if refused_ifeq(&e) => self.plain.disable(),
                    // Moved on, or refused: `complete_alone` decides.
                    _ => {}
                }
            }
        }
        let rest: Vec<&CompleteJob> = jobs
            .iter()
            .zip(&plain)
            .filter(|(_, p)| !**p)
            .map(|(j, _)| j)
            .collect();
        if rest.is_empty() {
            return Ok(Some(done));
        }
        let mut call = self.scripts.complete_many.call(rest.len());
        for job in &rest {
            call.arg(self.redis_key(&job.key));
        }
        call.arg(millis(EXPIRY_MARGIN));
        for job in &rest {
            call.arg(exact(job.now.as_millis()))
                .arg(&job.lease.id.to_bytes()[..])
                .arg(job.lease.fence)
                .arg(&job.response[..]);
        }
        match call.invoke_async::<Vec<i64>>(&mut self.conn.clone()).await {
            Ok(by_script) if by_script.len() == rest.len() => {
                let unsettled = done.iter_mut().zip(&plain).filter(|(_, p)| !**p);
                for ((d, _), s) in unsettled.zip(by_script) {
                    *d = s == 1;
                }
                Ok(Some(done))
            }
            // Those the plain path completed are done; `complete_alone` decides the others.
            Ok(_) => Ok(Some(done)),
            Err(e) if transient(&e) => Err(error("cannot complete the records", e)),
            Err(_) => Ok(Some(done)),
        }
    }
}

impl RedisStore {
    /// `begin` with the fresh record and lease it would write: a call sent again after its
    /// answer was lost carries the same ones.
    pub(super) async fn begin_as(
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
        // One plain command claims a key Redis does not have (the common case) and, on a taken
        // key, brings back what it holds: a replay, a mismatch or an attempt in flight is then
        // decided here by the core's rules, in this one round trip. The value was read
        // atomically with the refused write, and deciding on it changes nothing, so the answer
        // is the one the script would have given at that moment.
        let set: Value = redis::cmd("SET")
            .arg(&key)
            .arg(&packed)
            .arg("NX")
            .arg("GET")
            .arg("PX")
            .arg(ttl)
            .query_async(&mut self.conn.clone())
            .await
            .map_err(failed)?;
        match set {
            Value::Nil => {
                if self.plain.enabled() {
                    self.plain.claimed(Claim {
                        record: fresh.clone(),
                        key,
                        value: Bytes::from(packed),
                    });
                }
                return Ok(BeginOutcome::Acquired(lease));
            }
            Value::BulkString(held) => {
                if let Some(outcome) = decided_without_writing(fresh, &lease, &held, now) {
                    return Ok(outcome);
                }
            }
            _ => return Err(corrupt("SET answer")),
        }
        // What is left writes (a released key, a lease that ran out), or is this very `begin`
        // sent again, or a value the core cannot read: the script decides it atomically.
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
            Some("replay") if parts.len() == 5 => {
                let completed_at = Timestamp::from_millis(int(&parts[3], "update time")?);
                let expires_at = Timestamp::from_millis(int(&parts[4], "expiry")?);
                let fence = int(&parts[2], "fence")?;
                let response = bytes(parts.swap_remove(1), "response")?;
                Ok(BeginOutcome::Replay(Replay {
                    response: Bytes::from(response),
                    fence,
                    completed_at,
                    expires_at,
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
    pub(super) fn give_back(&self, key: &str, lease: &Lease, now: Timestamp) {
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

    pub(super) async fn settle_as(
        &self,
        key: &Key,
        lease: &Lease,
        to: Status,
        response: Option<Bytes>,
        now: Timestamp,
    ) -> Result<(), LeaseError> {
        if let Some(claim) = self.plain.take(key, lease, now) {
            let next = match to {
                Status::Completed => Record::complete(
                    Some(&claim.record),
                    lease,
                    response.clone().unwrap_or_default(),
                    now,
                ),
                _ => Record::release(Some(&claim.record), lease, now),
            };
            if let Ok(Some(next)) = next
                && self
                    .set_if_claimed(&claim, &next, &pack(&next), now)
                    .await?
            {
                return Ok(());
            }
        }
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

impl RedisStore {
    /// Writes `next` (packed as `value`) over the record of `claim` if it still holds exactly
    /// the claimed value, with one `SET … IFEQ` (see `super::plain`): `true` if it did;
    /// `false` if the record moved on or the server refused the option (then the script
    /// decides).
    async fn set_if_claimed(
        &self,
        claim: &Claim,
        next: &Record,
        value: &[u8],
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let answer = set_if_claimed_command(claim, next, value, now)
            .query_async::<Value>(&mut self.conn.clone())
            .await;
        match answer {
            Ok(Value::Okay) => Ok(true),
            Ok(Value::Nil) => Ok(false),
            Ok(_) => Err(corrupt("SET IFEQ answer")),
            Err(e) if refused_ifeq(&e) => {
                self.plain.disable();
                Ok(false)
            }
            Err(e) => Err(error("cannot settle the record", e)),
        }
    }
}

/// `SET key value IFEQ claimed PX ttl`: `next`, packed as `value`, over the record of `claim`
/// if it holds exactly the claimed value, kept by Redis as long as `next` lives by `now`.
fn set_if_claimed_command(
    claim: &Claim,
    next: &Record,
    value: &[u8],
    now: Timestamp,
) -> redis::Cmd {
    let mut cmd =
        redis::Cmd::with_capacity(7, claim.key.len() + value.len() + claim.value.len() + 32);
    cmd.arg("SET")
        .arg(&claim.key)
        .arg(value)
        .arg("IFEQ")
        .arg(&claim.value[..])
        .arg("PX")
        .arg(native_ttl(next.expires_at, now));
    cmd
}

/// The answer to a `begin` of `fresh` under `lease` on a key found holding `held`, when it
/// needs no write: a replay, a mismatch, or another attempt in flight. `None` for everything
/// else: a takeover, this very `begin` resent (its own lease id is in the record), or a value
/// this store cannot read, all left to the `begin` script.
fn decided_without_writing(
    fresh: &Record,
    lease: &Lease,
    held: &[u8],
    now: Timestamp,
) -> Option<BeginOutcome> {
    let record = unpack(&fresh.key, held).ok()?;
    if record.lease_id == lease.id {
        return None;
    }
    let req = BeginRequest::new(fresh.key.clone(), fresh.fingerprint);
    let step = Record::begin(Some(&record), &req, now, lease.id);
    step.write.is_none().then_some(step.outcome)
}
