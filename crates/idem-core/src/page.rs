//! Where a listing starts and how much one page holds: the bounds every store checks before it
//! reads anything ([`InvalidListing`]), and the [`Cursor`] a client hands back for the next page.

use std::fmt;
use std::str::FromStr;

use crate::Key;

/// The most records one page may ask for.
pub const MAX_PAGE: usize = 1000;

/// How many leading bytes of a stored response a listing returns (enough to tell what kind of
/// answer it is, as a listing's filter by response prefix does).
pub const RESPONSE_HEAD: usize = 32;
/// A listing request that no store answers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidListing {
    /// The page size is 0 or above [`MAX_PAGE`].
    #[error("a page holds 1 to {MAX_PAGE} records")]
    PageSize,
    /// The response prefix is longer than [`RESPONSE_HEAD`] bytes.
    #[error("a response prefix is at most {RESPONSE_HEAD} bytes")]
    PrefixTooLong,
    /// The cursor was not made by a listing (or by another kind of store).
    #[error("the cursor is not one a listing handed out")]
    Cursor,
}

/// Where the next page starts. Its text form ([`Display`](fmt::Display), [`FromStr`]) is
/// URL-safe, to hand to a client and take back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cursor {
    /// After this key, in the store's key order (tables and the memory store).
    After(Key),
    /// A keyspace scan's position (Redis `SCAN`), never 0.
    Scan(u64),
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::After(key) => {
                f.write_str("k")?;
                let parts = [
                    key.scope().as_str(),
                    key.namespace().as_str(),
                    key.client_key().as_str(),
                ];
                for (i, part) in parts.into_iter().enumerate() {
                    if i > 0 {
                        f.write_str("-")?;
                    }
                    for b in part.bytes() {
                        write!(f, "{b:02x}")?;
                    }
                }
                Ok(())
            }
            Self::Scan(at) => write!(f, "s{at}"),
        }
    }
}

impl FromStr for Cursor {
    type Err = InvalidListing;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        // Bounded: the longest key's cursor is about 2 × 1,300 characters.
        if s.len() > 4096 {
            return Err(InvalidListing::Cursor);
        }
        if let Some(at) = s.strip_prefix('s') {
            return match at.parse::<u64>() {
                // Only the canonical form: no sign, no leading zeros.
                Ok(n) if n != 0 && n.to_string() == at => Ok(Self::Scan(n)),
                _ => Err(InvalidListing::Cursor),
            };
        }
        let hex = s.strip_prefix('k').ok_or(InvalidListing::Cursor)?;
        let parts: Vec<String> = hex
            .split('-')
            .map(unhex)
            .collect::<Option<_>>()
            .ok_or(InvalidListing::Cursor)?;
        let [scope, namespace, client_key] = parts.as_slice() else {
            return Err(InvalidListing::Cursor);
        };
        Key::parse(scope, namespace, client_key)
            .map(Self::After)
            .map_err(|_| InvalidListing::Cursor)
    }
}

fn unhex(s: &str) -> Option<String> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    let bytes = (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect::<Option<Vec<u8>>>()?;
    String::from_utf8(bytes).ok()
}
