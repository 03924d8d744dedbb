//! The record format: one string, a fixed-width header, the record's key and then the
//! response, which the scripts read and write in place.

use std::time::Duration;

use idem_core::{Bytes, Fingerprint, Key, LeaseId, Record, Status, StoreError, Timestamp};
use redis::Value;

use super::EXPIRY_MARGIN;
use super::error::corrupt;

/// The largest timestamp or duration the scripts handle exactly (Lua numbers are doubles).
const MAX_EXACT: u64 = (1 << 53) - 1;

// A record is one string: a fixed-width header, the key, then the response of a completed
// record. Numbers are zero-padded decimal, which Lua reads with `tonumber`. Positions (1-based, as
// Lua's `string.sub` takes them):
//
//   1 format ('1')   2 status (p, c, r)   3-34 fingerprint   35-50 lease id   51-70 fence
//   71-86 lease end   87-102 ttl   103-118 created   119-134 updated   135-150 expires
//   151-154 the key's length n   155-(154+n) the key: scope, namespace and client key, each
//   apart by one space (none of them holds one)   (155+n)- response
//
// A string rather than a hash so that `begin` is one plain `SET … NX GET PX`, which costs
// Redis a third of a script: it writes a fresh key, or brings back a taken key's record for a
// replay to be decided from; the scripts (`super::scripts`) handle every write past that.
// The Redis key name is a digest (see `RedisStore::redis_key`), so the key is kept in the value
// for a listing to show. Format 1, written before, had no key (the response at 151); such
// records are still read and written in their format, but a listing cannot name them.

/// The header's length; the key follows.
pub(super) const HEADER: usize = 150;

/// The record format this store writes (byte 1 of every record).
const FORMAT: u8 = b'2';

/// The record format before keys were kept in the value; still read.
const FORMAT_KEYLESS: u8 = b'1';

/// How many digits give the key's length.
const KEY_LEN_DIGITS: usize = 4;

/// The longest key in a record: three parts and two spaces.
pub(super) const MAX_KEY: usize = idem_core::key::MAX_SCOPE_LEN
    + idem_core::key::MAX_NAMESPACE_LEN
    + idem_core::key::MAX_CLIENT_KEY_LEN
    + 2;

/// The header and the longest key with its length: what a listing reads before the response.
pub(super) const MAX_HEAD: usize = HEADER + KEY_LEN_DIGITS + MAX_KEY;

/// A timestamp or duration as the scripts take it.
pub(super) fn exact(v: u64) -> u64 {
    v.min(MAX_EXACT)
}

pub(super) fn millis(d: Duration) -> u64 {
    exact(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// How long Redis keeps a record that expires at `at`, seen at `now`.
pub(super) fn native_ttl(at: Timestamp, now: Timestamp) -> u64 {
    millis(at.saturating_since(now) + EXPIRY_MARGIN).max(1)
}

pub(super) fn int(v: &Value, what: &str) -> Result<u64, StoreError> {
    match v {
        Value::Int(i) => u64::try_from(*i).map_err(|_| corrupt(what)),
        Value::BulkString(b) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| corrupt(what)),
        _ => Err(corrupt(what)),
    }
}

pub(super) fn bytes(v: Value, what: &str) -> Result<Vec<u8>, StoreError> {
    match v {
        Value::BulkString(b) => Ok(b),
        _ => Err(corrupt(what)),
    }
}

pub(super) fn text(v: &Value) -> Option<&str> {
    match v {
        Value::BulkString(b) => std::str::from_utf8(b).ok(),
        Value::SimpleString(s) => Some(s),
        _ => None,
    }
}

pub(super) fn status_byte(status: Status) -> u8 {
    match status {
        Status::InProgress => b'p',
        Status::Completed => b'c',
        Status::Released => b'r',
    }
}

/// A record as the scripts read it (see the layout above [`HEADER`]).
pub(super) fn pack(r: &Record) -> Vec<u8> {
    use std::io::Write as _;
    let response = r.response.as_deref().unwrap_or_default();
    let (scope, namespace, client_key) = (
        r.key.scope().as_str(),
        r.key.namespace().as_str(),
        r.key.client_key().as_str(),
    );
    let named = scope.len() + namespace.len() + client_key.len() + 2;
    let len = HEADER + KEY_LEN_DIGITS + named + response.len();
    let mut v = Vec::with_capacity(len);
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
    let width = KEY_LEN_DIGITS;
    let _ = write!(v, "{named:0width$}{scope} {namespace} {client_key}");
    v.extend_from_slice(response);
    debug_assert_eq!(v.len(), len);
    v
}

/// Reads what [`pack`] and the scripts write, the record under `key`.
pub(super) fn unpack(key: &Key, v: &[u8]) -> Result<Record, StoreError> {
    let (named, at) = named(v)?;
    if named.is_some_and(|named| &named != key) {
        return Err(corrupt("key"));
    }
    unpack_at(key.clone(), v, at)
}

/// Reads a record and the key it names (format 2), for a listing: `v` may stop after the
/// first bytes of the response (which is then cut short).
pub(super) fn unpack_named(v: &[u8]) -> Result<(Record, usize), StoreError> {
    let (named, at) = named(v)?;
    let key = named.ok_or_else(|| corrupt("key (a record of format 1 names none)"))?;
    Ok((unpack_at(key, v, at)?, at))
}

/// The key a record names (none in format 1) and where its response starts.
fn named(v: &[u8]) -> Result<(Option<Key>, usize), StoreError> {
    match v.first() {
        Some(&FORMAT_KEYLESS) => return Ok((None, HEADER)),
        Some(&FORMAT) if v.len() >= HEADER + KEY_LEN_DIGITS => {}
        _ => return Err(corrupt("format")),
    }
    let bad = || corrupt("key");
    let len: usize = std::str::from_utf8(&v[HEADER..HEADER + KEY_LEN_DIGITS])
        .ok()
        .filter(|s| s.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|s| s.parse().ok())
        .filter(|len| *len <= MAX_KEY)
        .ok_or_else(bad)?;
    let at = HEADER + KEY_LEN_DIGITS + len;
    let text = v
        .get(HEADER + KEY_LEN_DIGITS..at)
        .and_then(|b| std::str::from_utf8(b).ok())
        .ok_or_else(bad)?;
    let mut parts = text.splitn(3, ' ');
    let (Some(scope), Some(namespace), Some(client_key)) =
        (parts.next(), parts.next(), parts.next())
    else {
        return Err(bad());
    };
    let key = Key::parse(scope, namespace, client_key).map_err(|_| bad())?;
    Ok((Some(key), at))
}

/// Reads the header of `v`, whose response starts at `at`.
fn unpack_at(key: Key, v: &[u8], at: usize) -> Result<Record, StoreError> {
    if v.len() < at {
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
    let tail = &v[at..];
    if status != Status::Completed && !tail.is_empty() {
        return Err(corrupt("response"));
    }
    Ok(Record {
        key,
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
        // Kept beside the record (see `super::scripts::RECORD`); read by `get`.
        steps: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use idem_core::BeginRequest;

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
}
