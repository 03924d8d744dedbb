//! Fenced writes: a resource that refuses a lock holder whose fence is lower than one it has
//! already accepted.
//!
//! A lease lock alone cannot stop a holder that paused past its lease from writing after
//! another has taken the lock. The fix is at the resource: every write carries the holder's
//! fence, the resource remembers the highest fence it has accepted, and refuses lower ones.
//! Equal fences pass, so one holder may write many times.
//!
//! - **SQL, a fence column on the row itself** (the simplest, when the protected data is one
//!   row): `UPDATE accounts SET balance = $1, fence = $2 WHERE id = $3 AND fence <= $2`, and
//!   treat "0 rows" as refused.
//! - **SQL, a fence table** ([`SqlFences`]): for writes to many rows or tables, check the fence
//!   of a named resource *inside the same transaction* as the writes, and roll back on
//!   [`Fenced::Stale`]. The check takes the resource row's lock until commit, so two holders'
//!   transactions on one resource are also serialized.
//! - **Redis** ([`RedisStore::fenced_set`](crate::RedisStore::fenced_set)): a value stored with
//!   its fence, replaced only by an equal or higher one, in one script.
//!
//! A fence is at most [`MAX_FENCE`] (2^53 - 1): past it Lua would round two fences to one.

/// The answer of a fenced write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fenced {
    /// The fence is at least the highest seen: the write goes ahead (and the fence is now the
    /// highest).
    Accepted,
    /// A higher fence was accepted before: the writer has lost its lock. Roll back.
    Stale {
        /// The highest fence accepted so far.
        highest: u64,
    },
}

/// The highest fence a fenced write takes: 2^53 - 1, the largest that Redis's Lua numbers (and
/// every SQL `BIGINT`) hold exactly. A larger one would be rounded or capped, and two different
/// fences compared as equal, so the lower one would pass; it is refused instead. The fences idem
/// hands out (a record's, a lock's) stay far below it.
pub const MAX_FENCE: u64 = (1 << 53) - 1;

/// Refuses a fence past [`MAX_FENCE`].
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "redis"))]
fn checked(fence: u64) -> Result<u64, String> {
    if fence > MAX_FENCE {
        return Err(format!(
            "fence {fence} is past the largest a fenced write takes exactly ({MAX_FENCE})"
        ));
    }
    Ok(fence)
}

/// [`checked`], as a store error.
#[cfg(any(feature = "postgres", feature = "redis"))]
pub(crate) fn checked_fence(fence: u64) -> Result<u64, idem_core::StoreError> {
    checked(fence).map_err(|message| idem_core::StoreError::Backend {
        message,
        source: None,
    })
}

impl Fenced {
    /// Whether the write may go ahead.
    pub fn is_accepted(self) -> bool {
        self == Fenced::Accepted
    }
}

/// A table of resources and the highest fence each has accepted, in the database where the
/// protected data lives. `CREATE TABLE <name> (resource TEXT PRIMARY KEY, fence BIGINT NOT
/// NULL)`: see [`SqlFences::create_table_sql`].
#[cfg(any(feature = "postgres", feature = "sqlite"))]
#[derive(Debug, Clone)]
pub struct SqlFences {
    table: String,
}

#[cfg(any(feature = "postgres", feature = "sqlite"))]
impl SqlFences {
    /// Fences in `table` (letters, digits and `_`, optionally `schema.table`).
    pub fn new(table: &str) -> Result<Self, idem_core::StoreError> {
        let valid = !table.is_empty()
            && table.len() <= 100
            && table.split('.').count() <= 2
            && table.split('.').all(|p| {
                !p.is_empty()
                    && !p.starts_with(|c: char| c.is_ascii_digit())
                    && p.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            });
        if !valid {
            return Err(idem_core::StoreError::Backend {
                message: format!("fence table name {table:?} must be letters, digits and _"),
                source: None,
            });
        }
        Ok(Self {
            table: table.to_owned(),
        })
    }

    /// The statement that creates the table (the same for PostgreSQL and SQLite).
    pub fn create_table_sql(&self) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} (resource TEXT PRIMARY KEY, fence BIGINT NOT NULL)",
            self.table
        )
    }

    /// The check: `$1` resource, `$2` fence; a row back means accepted.
    fn check_sql(&self) -> String {
        format!(
            "INSERT INTO {t} (resource, fence) VALUES ($1, $2)
             ON CONFLICT (resource) DO UPDATE SET fence = excluded.fence
                 WHERE {t}.fence <= excluded.fence
             RETURNING fence",
            t = self.table
        )
    }

    fn highest_sql(&self) -> String {
        format!("SELECT fence FROM {} WHERE resource = $1", self.table)
    }

    /// Checks `fence` for `resource` inside the caller's PostgreSQL transaction `tx`, and
    /// records it as the highest if it is. On [`Fenced::Stale`], roll back.
    #[cfg(feature = "postgres")]
    pub async fn check_pg(
        &self,
        tx: &mut sqlx::PgConnection,
        resource: &str,
        fence: u64,
    ) -> Result<Fenced, idem_core::StoreError> {
        use sqlx::AssertSqlSafe;
        let fail = |e| crate::postgres::error("cannot check the fence", e);
        let fence = crate::row::sql_int(checked_fence(fence)?);
        let accepted: Option<i64> = sqlx::query_scalar(AssertSqlSafe(self.check_sql()))
            .bind(resource)
            .bind(fence)
            .fetch_optional(&mut *tx)
            .await
            .map_err(fail)?;
        if accepted.is_some() {
            return Ok(Fenced::Accepted);
        }
        let highest: i64 = sqlx::query_scalar(AssertSqlSafe(self.highest_sql()))
            .bind(resource)
            .fetch_one(&mut *tx)
            .await
            .map_err(fail)?;
        Ok(Fenced::Stale {
            highest: u64::try_from(highest).unwrap_or(0),
        })
    }

    /// Checks `fence` for `resource` inside the caller's SQLite transaction, and records it as
    /// the highest if it is. On [`Fenced::Stale`], roll back.
    #[cfg(feature = "sqlite")]
    pub fn check_sqlite(
        &self,
        tx: &rusqlite::Connection,
        resource: &str,
        fence: u64,
    ) -> Result<Fenced, rusqlite::Error> {
        use rusqlite::OptionalExtension;
        let fence =
            checked(fence).map_err(|m| rusqlite::Error::ToSqlConversionFailure(m.into()))?;
        let fence = crate::row::sql_int(fence);
        let accepted: Option<i64> = tx
            .prepare_cached(&self.check_sql())?
            .query_row(rusqlite::params![resource, fence], |r| r.get(0))
            .optional()?;
        if accepted.is_some() {
            return Ok(Fenced::Accepted);
        }
        let highest: i64 = tx
            .prepare_cached(&self.highest_sql())?
            .query_row([resource], |r| r.get(0))?;
        Ok(Fenced::Stale {
            highest: u64::try_from(highest).unwrap_or(0),
        })
    }
}
