//! The Lua scripts: Redis runs each atomically, so each decides and writes in one step. The
//! record scripts read and write the layout of `super::format`; the lock scripts apply
//! [`LockState`](idem_core::LockState)'s rules with the server's clock.

use super::conn::Lua;

/// Put before every record script: `record(key)` reads the record at `key` and answers nil, or
/// its value, state, fence, lease end, TTL, expiry and key (with its length; empty in format
/// 1), the response starting right after the key. A value of any other shape raises
/// [`FOREIGN`]; a key of another type, Redis's `WRONGTYPE`. Expiries the scripts compute are
/// kept to `MAX` (as `exact` does in the client), so that they fit in their 16 digits.
/// `rewrite(key, v, to, ttl, kb, now, margin, response)` writes a read record back in another
/// state, keeping its format byte and its key.
///
/// A record's steps (`idem_core::step::encode`'s form) are a string of their own beside it,
/// at the record's key and `:s`: in the same hash slot, named here rather than passed, and
/// always given the record's own deadline when either is written, so they never outlive it
/// (a fresh record finds none).
pub(super) const RECORD: &str = r"
local MAX = 9007199254740991
local function record(key)
  local v = redis.call('GET', key)
  if not v then return nil end
  local st, format, kb = string.sub(v, 2, 2), string.sub(v, 1, 1), ''
  if format == '2' then
    local n = tonumber(string.sub(v, 151, 154)) or 0
    kb = string.sub(v, 151, 154 + n)
    if #kb ~= 4 + n or not string.match(kb, '^%d%d%d%d[!-~]+ [!-~]+ [!-~]+$') then
      format = ''
    end
  end
  local fence, lexp = tonumber(string.sub(v, 51, 70)), tonumber(string.sub(v, 71, 86))
  local ttl, exp = tonumber(string.sub(v, 87, 102)), tonumber(string.sub(v, 135, 150))
  if #v < 150 + #kb or not (format == '1' or format == '2')
      or not (fence and lexp and ttl and exp)
      or not (tonumber(string.sub(v, 103, 118)) and tonumber(string.sub(v, 119, 134)))
      or not (st == 'c' or ((st == 'p' or st == 'r') and #v == 150 + #kb)) then
    error('idem: the key holds a value this store did not write')
  end
  return v, st, fence, lexp, ttl, exp, kb
end
-- Rewrites the record `v` at `key` (its TTL `ttl` and key `kb` as `record` read them) in state
-- `to` at `now`, with `response` if any: updated now, retention from now.
local function rewrite(key, v, to, ttl, kb, now, margin, response)
  local exp = math.min(now + ttl, MAX)
  redis.call('SET', key, string.sub(v, 1, 1) .. to .. string.sub(v, 3, 118)
    .. string.format('%016d%016d', now, exp) .. kb .. (response or ''), 'PX', exp - now + margin)
  redis.call('PEXPIRE', key .. ':s', exp - now + margin)
end
";

/// What a record script raises on a value it did not write.
pub(super) const FOREIGN: &str = "idem: the key holds a value this store did not write";

/// ARGV = now, fingerprint, lease id, the fresh record (with `Lease::first_fence`), its native
/// TTL; a takeover's fence is `Lease::next_fence` of the record's. Run when
/// the plain `SET … NX GET` found the key taken by a record that needs a write (or that the
/// client could not read).
pub(super) const BEGIN: &str = r"
local now = tonumber(ARGV[1])
local v, st, fence, lexp, _, exp, kb = record(KEYS[1])
local steps = KEYS[1] .. ':s'
local f = tonumber(string.sub(ARGV[4], 51, 70))
if v then
  f = fence + 1
  if f % 1000 == 0 then f = f + 1 end
  if exp <= now then
    -- Expired: the key starts afresh, without the steps of the last request.
    redis.call('DEL', steps)
  else
    local same = string.sub(v, 3, 34) == ARGV[2]
    if st == 'c' then
      if same then
        return {'replay', string.sub(v, 151 + #kb), fence, tonumber(string.sub(v, 119, 134)),
          exp}
      end
      return {'mismatch'}
    elseif st == 'p' then
      if not same then return {'mismatch'} end
      -- This very begin, sent again after its answer was lost: it holds the lease.
      if string.sub(v, 35, 50) == ARGV[3] then return {'acquired', fence} end
      if lexp > now then return {'in_progress', lexp} end
    elseif not same and redis.call('EXISTS', steps) == 1 then
      -- Released with steps taken: only the same request may resume them.
      return {'mismatch'}
    end
  end
end
redis.call('SET', KEYS[1], string.sub(ARGV[4], 1, 50) .. string.format('%020d', f)
  .. string.sub(ARGV[4], 71), 'PX', ARGV[5])
redis.call('PEXPIRE', steps, ARGV[5])
return {'acquired', f}
";

/// Put after [`RECORD`] before the settle scripts: `settle(key, now, lease id, fence, margin,
/// target state, response)` moves the record at `key` from in progress under that lease to
/// the target state (`c` with the response, or `r`), answering `ok` or `stale`; a repeated
/// settle is `ok` only with the response already stored.
pub(super) const SETTLE_FN: &str = r"
local function settle(key, now, id, fence, margin, to, response)
  local v, st, f, _, ttl, exp, kb = record(key)
  if not v or exp <= now or string.sub(v, 35, 50) ~= id or f ~= fence then
    return 'stale'
  end
  if st == to then
    if st == 'c' and string.sub(v, 151 + #kb) ~= response then return 'stale' end
    return 'ok'
  end
  if st ~= 'p' then return 'stale' end
  rewrite(key, v, to, ttl, kb, now, margin, response)
  return 'ok'
end
";

/// Complete or release one record: ARGV = now, lease id, fence, margin, target state (`c` or
/// `r`), response (complete only).
pub(super) const SETTLE: &str = r"
return settle(KEYS[1], tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]),
  ARGV[5], ARGV[6])
";

/// Complete every record of `KEYS` (group commit): ARGV = margin, then now, lease id, fence
/// and response of each key in turn. Answers, per key, 1 if it is completed with that
/// response, else 0 (the one-record call then decides it).
pub(super) const COMPLETE_MANY: &str = r"
local margin = tonumber(ARGV[1])
local done = {}
for i, key in ipairs(KEYS) do
  local a = 4 * i - 2
  done[i] = settle(key, tonumber(ARGV[a]), ARGV[a + 1], tonumber(ARGV[a + 2]), margin, 'c',
    ARGV[a + 3]) == 'ok' and 1 or 0
end
return done
";

/// Gives back what a `begin` may have taken though its caller was told it failed (it timed
/// out, or its connection broke): ARGV = now, lease id, margin. Releases the record if it is
/// in progress under that lease id, whatever its fence (a takeover's fence is not known to
/// the client); answers 1 if it did. Where the `begin` took nothing, no record holds that
/// random 128-bit id, and nothing changes. Sent with `EVAL`, not `EVALSHA`: it must run on the
/// first try even on a server that has not loaded it (see
/// [`RedisStore::give_back`](super::RedisStore::give_back)).
pub(super) const GIVE_BACK: &str = r"
local now = tonumber(ARGV[1])
local v, st, _, _, ttl, exp, kb = record(KEYS[1])
if not v or st ~= 'p' or exp <= now or string.sub(v, 35, 50) ~= ARGV[2] then return 0 end
rewrite(KEYS[1], v, 'r', ttl, kb, now, tonumber(ARGV[3]))
return 1
";

/// ARGV = now, lease id, fence, new lease end, margin. Answers 1 if it renewed the lease.
pub(super) const RENEW: &str = r"
local now = tonumber(ARGV[1])
local v, st, fence, _, ttl, exp, kb = record(KEYS[1])
if not v or st ~= 'p' or exp <= now or string.sub(v, 35, 50) ~= ARGV[2]
    or fence ~= tonumber(ARGV[3]) then
  return 0
end
local lexp = tonumber(ARGV[4])
exp = math.min(lexp + ttl, MAX)
redis.call('SET', KEYS[1], string.sub(v, 1, 70) .. string.format('%016d', lexp)
  .. string.sub(v, 87, 118) .. string.format('%016d%016d', now, exp) .. kb,
  'PX', exp - now + tonumber(ARGV[5]))
redis.call('PEXPIRE', KEYS[1] .. ':s', exp - now + tonumber(ARGV[5]))
return 1
";

/// Records steps: ARGV = now, lease id, fence, how long the steps were as the client read
/// them, the steps after it. Answers 1 if the record is in progress under that lease and its
/// steps are still as read (then they are written, with the record's deadline), else 0 (the
/// client reads again and decides).
pub(super) const STEP: &str = r"
local now = tonumber(ARGV[1])
local v, st, fence, _, _, exp = record(KEYS[1])
if not v or st ~= 'p' or exp <= now or string.sub(v, 35, 50) ~= ARGV[2]
    or fence ~= tonumber(ARGV[3]) then
  return 0
end
local steps = KEYS[1] .. ':s'
if redis.call('STRLEN', steps) ~= tonumber(ARGV[4]) then return 0 end
local updated = math.max(now, tonumber(string.sub(v, 119, 134)) + 1)
redis.call('SET', KEYS[1], string.sub(v, 1, 118) .. string.format('%016d', updated)
  .. string.sub(v, 135), 'KEEPTTL')
local left = redis.call('PTTL', KEYS[1])
if left > 0 then
  redis.call('SET', steps, ARGV[5], 'PX', left)
else
  redis.call('SET', steps, ARGV[5])
end
return 1
";

/// ARGV = the value to raise to (as text, exact). Answers the counter's value.
pub(super) const RAISE: &str = r"
local cur = redis.call('GET', KEYS[1])
if not cur or string.len(cur) < string.len(ARGV[1])
    or (string.len(cur) == string.len(ARGV[1]) and cur < ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
  return ARGV[1]
end
return cur
";

/// ARGV = now, fence, margin. Answers 1 if it reopened the record.
pub(super) const REOPEN: &str = r"
local now = tonumber(ARGV[1])
local v, st, fence, _, ttl, exp, kb = record(KEYS[1])
if not v or st ~= 'c' or exp <= now or fence ~= tonumber(ARGV[2]) then return 0 end
redis.call('DEL', KEYS[1] .. ':s')
rewrite(KEYS[1], v, 'r', ttl, kb, now, tonumber(ARGV[3]))
return 1
";

/// An operator's repair, fenced: ARGV = now, the state shown (as `RecordState` names it), the
/// fence shown, the repair (`release` or `delete`), margin. Answers 1 if the record was still in
/// that state with that fence, and was released (as a settle to `r` does, response dropped) or
/// deleted; else 0. The state is `RecordState::of`'s, read at `now`.
pub(super) const REPAIR: &str = r"
local now = tonumber(ARGV[1])
local v, st, fence, lexp, ttl, exp, kb = record(KEYS[1])
if not v or fence ~= tonumber(ARGV[3]) then return 0 end
local state = 'expired'
if st == 'p' and lexp > now then state = 'in_progress'
elseif exp > now then
  state = (st == 'p' and 'stuck') or (st == 'c' and 'completed') or 'released'
end
if state ~= ARGV[2] then return 0 end
if ARGV[4] == 'delete' or st == 'c' then
  -- A completed record released by an operator runs again from its start, as a reopen does.
  redis.call('DEL', KEYS[1] .. ':s')
end
if ARGV[4] == 'delete' then
  redis.call('DEL', KEYS[1])
  return 1
end
rewrite(KEYS[1], v, 'r', ttl, kb, now, tonumber(ARGV[5]))
return 1
";

// The lock scripts, each run after `CLOCK`.

/// The server's time as `now` (ms) and `nowus` (µs). Numbers written to the hash go through
/// `%d`: Lua would print a 16-digit number in exponent form.
pub(super) const CLOCK: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local nowus = tonumber(t[1]) * 1000000 + tonumber(t[2])
";

/// The lock state at a key, one string `<fence> <lease end ms> <owner> <name>` (see
/// `super::locks`): `state(key)` answers the owner, the fence as its decimal text, the lease
/// end and the name, or nothing; a hash (the layout before states were strings, fields `o`,
/// `f`, `e`, `n`) is read too, and rewritten as a string by the next write; any other value
/// fails the call, and is left alone. `put` writes one with its native TTL.
pub(super) const LOCK_STATE: &str = r"
local function state(k)
  local v = redis.pcall('GET', k)
  if type(v) == 'table' and v.err then
    local r = redis.call('HMGET', k, 'o', 'f', 'e', 'n')
    return r[1], r[2], tonumber(r[3]), r[4] or ''
  end
  if not v then return nil end
  local f, e, o, n = string.match(v, '^(%d+) (%d+) (%x+) (.*)$')
  if not f then error('idem: the lock key holds a value this store did not write') end
  return o, f, tonumber(e), n
end
local function put(k, o, f, e, n, px)
  redis.call('SET', k, string.format('%d %d %s %s', tonumber(f), e, o, n), 'PX', px)
end
";

/// ARGV = owner, lease ms, retention ms, name. Answers {1, fence, expires} or {0, until}. The
/// name is kept in the state for listings of held locks.
pub(super) const LOCK_ACQUIRE: &str = r"
local o, f, e = state(KEYS[1])
if e and e > now then
  if o ~= ARGV[1] then return {0, e} end
else
  f = math.max((tonumber(f) or 0) + 1, nowus)
end
local exp = now + tonumber(ARGV[2])
put(KEYS[1], ARGV[1], f, exp, ARGV[4], tonumber(ARGV[2]) + tonumber(ARGV[3]))
return {1, tonumber(f), exp}
";

/// ARGV = owner, fence, lease ms, retention ms. Answers the new lease end, or -1.
pub(super) const LOCK_RENEW: &str = r"
local o, f, e, n = state(KEYS[1])
if o ~= ARGV[1] or f ~= ARGV[2] or not e or e <= now then return -1 end
local exp = now + tonumber(ARGV[3])
put(KEYS[1], o, f, exp, n, tonumber(ARGV[3]) + tonumber(ARGV[4]))
return exp
";

/// ARGV = owner, fence, retention ms, channel, name. Answers 1 (released), 0 (already was),
/// or -1 (not the owner).
pub(super) const LOCK_RELEASE: &str = r"
local o, f, e, n = state(KEYS[1])
if o ~= ARGV[1] or f ~= ARGV[2] then return -1 end
if e <= now then return 0 end
put(KEYS[1], o, f, now, n, tonumber(ARGV[3]))
redis.call('PUBLISH', ARGV[4], ARGV[5])
return 1
";

/// ARGV = fence, value. Answers {1} (stored) or {0, highest fence}.
pub(super) const FENCED_SET: &str = r"
local f = tonumber(redis.call('HGET', KEYS[1], 'fence') or '0')
if f > tonumber(ARGV[1]) then return {0, f} end
redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'value', ARGV[2])
return {1}
";

/// A record script: [`RECORD`] and then `body`.
pub(super) fn record_script(body: &str) -> Lua {
    Lua::new(&format!("{RECORD}{body}"))
}
