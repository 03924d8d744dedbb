//! The row layout the SQL stores share: every column as the database hands it back, turned
//! into a [`Record`] with every value checked.

use idem_core::{Bytes, Fingerprint, Key, LeaseId, Record, Status, StoreError, Timestamp};

/// SQL integers are signed 64-bit; timestamps beyond `i64::MAX` ms (292 million years)
/// are stored as `i64::MAX`.
pub(crate) fn sql_int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

pub(crate) struct RawRow {
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) status: String,
    pub(crate) fence: i64,
    pub(crate) lease_id: Vec<u8>,
    pub(crate) lease_expires_at: i64,
    pub(crate) response: Option<Vec<u8>>,
    pub(crate) ttl_ms: i64,
    pub(crate) created_at: i64,
    pub(crate) updated_at: i64,
    pub(crate) expires_at: i64,
    /// The steps in `idem_core::step::encode`'s form; `NULL` or empty for none.
    pub(crate) steps: Option<Vec<u8>>,
}

impl RawRow {
    pub(crate) fn into_record(self, key: &Key) -> Result<Record, StoreError> {
        let corrupt =
            |what: &str| StoreError::Corrupt(format!("the stored record has a bad {what}"));
        let uint = |v: i64, what: &str| u64::try_from(v).map_err(|_| corrupt(what));
        let ts = |v: i64, what: &str| uint(v, what).map(Timestamp::from_millis);
        let status = Status::parse(&self.status).ok_or_else(|| corrupt("status"))?;
        let response = self.response.map(Bytes::from);
        if (status == Status::Completed) != response.is_some() {
            return Err(corrupt("response"));
        }
        Ok(Record {
            key: key.clone(),
            fingerprint: Fingerprint::from_bytes(
                self.fingerprint
                    .try_into()
                    .map_err(|_| corrupt("fingerprint"))?,
            ),
            status,
            fence: uint(self.fence, "fence")?,
            lease_id: LeaseId::from_bytes(
                self.lease_id.try_into().map_err(|_| corrupt("lease id"))?,
            ),
            lease_expires_at: ts(self.lease_expires_at, "lease expiry")?,
            response,
            ttl_ms: uint(self.ttl_ms, "ttl")?,
            created_at: ts(self.created_at, "creation time")?,
            updated_at: ts(self.updated_at, "update time")?,
            expires_at: ts(self.expires_at, "expiry")?,
            steps: idem_core::step::decode(self.steps.as_deref().unwrap_or_default())?,
        })
    }
}

/// A lock row's name, fence and lease end, as a listing of held locks shows them.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) fn held_lock(
    name: &str,
    fence: i64,
    expires_at: i64,
) -> Result<idem_core::HeldLock, StoreError> {
    let corrupt = || StoreError::Corrupt("a lock row is unreadable".into());
    Ok(idem_core::HeldLock {
        name: idem_core::LockName::new(name).map_err(|_| corrupt())?,
        fence: u64::try_from(fence).map_err(|_| corrupt())?,
        expires_at: Timestamp::from_millis(u64::try_from(expires_at).map_err(|_| corrupt())?),
    })
}
