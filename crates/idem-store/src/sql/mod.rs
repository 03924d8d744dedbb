//! The server-based SQL stores (PostgreSQL, MySQL/MariaDB), written once: the store and its
//! options (`store`), its records path over the hooks of each [`Server`] (`records`), what it
//! needs of sqlx's driver (`driver`), table names, versioned migrations (`migrate`), the
//! [`Dialect`] each server is spoken in and the classification of its errors (`error`), the
//! columns of a row and reading them, the decisions `begin` and a settle make from a row as
//! read, and the operator's view of the records (`admin`). The backend folders keep what is
//! each server's own: its statements, connecting, migrations, batches and errors.

use std::fmt;

use idem_core::{
    BeginOutcome, BeginRequest, Bytes, Lease, LeaseError, LeaseId, Record, StaleLease, StoreError,
    Timestamp,
};

use crate::row::RawRow;

mod admin;
pub(crate) mod driver;
mod error;
pub(crate) mod migrate;
pub(crate) mod records;
mod store;

pub(crate) use error::error;
pub(crate) use migrate::Dialect;
pub(crate) use records::{Server, Spelling};
pub use store::{SqlOptions, SqlStore};

/// The columns [`RawRow`] is read from, in its order.
pub(crate) const COLUMNS: &str = "fingerprint, status, fence, lease_id, lease_expires_at, response,
    ttl_ms, created_at, updated_at, expires_at, steps";

/// A table name safe to put into SQL text: one or two (schema-qualified) identifiers of ASCII
/// letters, digits and `_`, not starting with a digit, at most 48 characters each (room for
/// the suffixes of the index and migrations table).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TableName(String);

impl TableName {
    pub(crate) fn parse(name: &str) -> Result<Self, StoreError> {
        let ident_ok = |part: &str| {
            !part.is_empty()
                && part.len() <= 48
                && !part.starts_with(|c: char| c.is_ascii_digit())
                && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        };
        let parts: Vec<&str> = name.split('.').collect();
        if parts.len() > 2 || !parts.iter().all(|p| ident_ok(p)) {
            return Err(StoreError::Backend {
                message: format!(
                    "table name {name:?} must be letters, digits and _ (optionally schema.table), \
                     at most 48 characters each"
                ),
                source: None,
            });
        }
        Ok(Self(name.to_owned()))
    }

    /// A migration statement with `{table}` (the name as given) and `{name}` (its last
    /// part, for naming indexes, which cannot be schema-qualified) filled in.
    pub(crate) fn fill(&self, statement: &str) -> String {
        let name = self.0.rsplit('.').next().unwrap_or(&self.0);
        statement
            .replace("{table}", &self.0)
            .replace("{name}", name)
    }

    /// The table that lists applied migrations: `<table>_migrations`.
    pub(crate) fn migrations_table(&self) -> String {
        format!("{}_migrations", self.0)
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One schema version: statements with `{table}` standing for the records table.
pub(crate) struct Migration {
    pub(crate) version: i64,
    pub(crate) description: &'static str,
    pub(crate) statements: &'static [&'static str],
}

/// The migrations not yet in `applied`, in order. A database that has a version this build
/// does not know was migrated by a newer idem: refused rather than guessed at.
pub(crate) fn pending<'m>(
    all: &'m [Migration],
    applied: &[i64],
) -> Result<Vec<&'m Migration>, StoreError> {
    let newest = all.iter().map(|m| m.version).max().unwrap_or(0);
    if let Some(v) = applied.iter().find(|v| **v > newest) {
        return Err(StoreError::Backend {
            message: format!(
                "the records table is at schema version {v}, newer than this idem knows \
                 ({newest}); upgrade idem"
            ),
            source: None,
        });
    }
    Ok(all
        .iter()
        .filter(|m| !applied.contains(&m.version))
        .collect())
}

/// After `begin`'s upsert acquired nothing, decides from the row as read: the answer, or `None`
/// if the row as read may be acquired after all (it changed after the upsert: try again).
pub(crate) fn refused_begin(
    existing: Option<&Record>,
    req: &BeginRequest,
    now: Timestamp,
) -> Option<BeginOutcome> {
    let step = Record::begin(existing, req, now, LeaseId::generate());
    (!matches!(step.outcome, BeginOutcome::Acquired(_))).then_some(step.outcome)
}

/// After a lease-conditioned update changed nothing, decides from the row as read: none is a
/// stale lease; a repeat by the same lease of what it already did (for a `complete`, with the
/// same response bytes) is `Ok`, anything else is stale. If the row as read would change after
/// all, it moved between the update and the read: try again. `response` is `Some` for a
/// `complete`.
pub(crate) fn repeated_settle(
    record: Option<Record>,
    lease: &Lease,
    response: Option<Bytes>,
    now: Timestamp,
) -> Result<(), LeaseError> {
    let Some(mut record) = record else {
        return Err(StaleLease.into());
    };
    let would_change = if let Some(response) = response {
        record.complete_in_place(lease, response, now)?
    } else {
        record.release_in_place(lease, now)?
    };
    if would_change {
        return Err(StoreError::Unavailable {
            message: "the record changed while it was settled; try again".into(),
            source: None,
        }
        .into());
    }
    Ok(())
}

/// Reads a row of the records table's columns in [`RawRow`]'s order.
pub(crate) fn raw<R: sqlx::Row>(r: &R) -> Result<RawRow, StoreError>
where
    usize: sqlx::ColumnIndex<R>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let bad = |e| StoreError::backend("the records table has an unexpected shape", e);
    Ok(RawRow {
        fingerprint: r.try_get(0).map_err(bad)?,
        status: r.try_get(1).map_err(bad)?,
        fence: r.try_get(2).map_err(bad)?,
        lease_id: r.try_get(3).map_err(bad)?,
        lease_expires_at: r.try_get(4).map_err(bad)?,
        response: r.try_get(5).map_err(bad)?,
        ttl_ms: r.try_get(6).map_err(bad)?,
        created_at: r.try_get(7).map_err(bad)?,
        updated_at: r.try_get(8).map_err(bad)?,
        expires_at: r.try_get(9).map_err(bad)?,
        steps: r.try_get(10).map_err(bad)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_plain_identifiers() {
        for ok in ["idem_records", "idem.records", "t1", "_x"] {
            assert!(TableName::parse(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "1t",
            "a.b.c",
            "idem records",
            "t;drop table x",
            "t\"",
            "a.",
            &"x".repeat(49),
        ] {
            assert!(TableName::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn pending_migrations_skip_applied_and_refuse_newer_schemas() {
        const ALL: &[Migration] = &[
            Migration {
                version: 1,
                description: "one",
                statements: &[],
            },
            Migration {
                version: 2,
                description: "two",
                statements: &[],
            },
        ];
        let versions = |applied: &[i64]| -> Vec<i64> {
            pending(ALL, applied)
                .unwrap()
                .iter()
                .map(|m| m.version)
                .collect()
        };
        assert_eq!(versions(&[]), [1, 2]);
        assert_eq!(versions(&[1]), [2]);
        assert!(versions(&[1, 2]).is_empty());
        let e = pending(ALL, &[1, 2, 3]).err().unwrap().to_string();
        assert!(e.contains("newer"), "{e}");
    }
}
