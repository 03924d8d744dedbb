//! Record keys: `(scope, namespace, client_key)`.
//!
//! Every part is validated when it is built and is never truncated: a value that does not fit
//! is rejected with a [`KeyError`] that names the part and the rule it broke, but never echoes
//! the value itself (keys are secrets of a kind: they must not end up in logs).

use std::fmt;
use std::hash::{BuildHasher, Hash, Hasher, RandomState};
use std::sync::{Arc, OnceLock};

/// The longest client key accepted, in bytes (the IETF Idempotency-Key draft and Stripe use 255).
pub const MAX_CLIENT_KEY_LEN: usize = 255;
/// The longest scope accepted, in bytes.
pub const MAX_SCOPE_LEN: usize = 255;
/// The longest namespace accepted, in bytes.
pub const MAX_NAMESPACE_LEN: usize = 128;

/// Which part of a key a [`KeyError`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyPart {
    /// The scope (tenant or principal).
    Scope,
    /// The namespace (the operation, `biz_type`).
    Namespace,
    /// The caller's key (`Idempotency-Key`, order number, message id).
    ClientKey,
}

impl fmt::Display for KeyPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KeyPart::Scope => "scope",
            KeyPart::Namespace => "namespace",
            KeyPart::ClientKey => "key",
        })
    }
}

/// Why a key part was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The part is empty.
    #[error("{part} must not be empty")]
    Empty {
        /// The part that was empty.
        part: KeyPart,
    },
    /// The part is longer than its limit; it is rejected, never truncated.
    #[error("{part} is {len} bytes long; at most {max} are allowed")]
    TooLong {
        /// The part that was too long.
        part: KeyPart,
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The part holds a character outside its alphabet.
    #[error("{part} has a character that is not allowed at byte {position}: {rule}")]
    InvalidChar {
        /// The part with the bad character.
        part: KeyPart,
        /// Byte offset of the first bad character.
        position: usize,
        /// The rule the part must follow.
        rule: &'static str,
    },
}

const VISIBLE_ASCII: &str = "only visible ASCII characters (0x21 to 0x7E) are allowed";
const NAMESPACE_CHARS: &str = "only ASCII letters, digits and . _ : - are allowed";

fn check(
    part: KeyPart,
    value: &str,
    max: usize,
    allowed: fn(u8) -> bool,
    rule: &'static str,
) -> Result<(), KeyError> {
    if value.is_empty() {
        return Err(KeyError::Empty { part });
    }
    if value.len() > max {
        return Err(KeyError::TooLong {
            part,
            len: value.len(),
            max,
        });
    }
    if let Some(position) = value.bytes().position(|b| !allowed(b)) {
        return Err(KeyError::InvalidChar {
            part,
            position,
            rule,
        });
    }
    Ok(())
}

fn visible_ascii(b: u8) -> bool {
    b.is_ascii_graphic()
}

fn namespace_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-')
}

macro_rules! key_part {
    ($(#[$doc:meta])* $name:ident($store:ty), $part:expr, $max:expr, $allowed:expr, $rule:expr) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name($store);

        impl $name {
            /// Validates `value` and wraps it.
            pub fn new(value: impl Into<String>) -> Result<Self, KeyError> {
                let value = value.into();
                check($part, &value, $max, $allowed, $rule)?;
                Ok(Self(value.into()))
            }

            /// The validated value.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&self.0, f)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl TryFrom<&str> for $name {
            type Error = KeyError;
            fn try_from(value: &str) -> Result<Self, KeyError> {
                Self::new(value)
            }
        }

        impl TryFrom<String> for $name {
            type Error = KeyError;
            fn try_from(value: String) -> Result<Self, KeyError> {
                Self::new(value)
            }
        }
    };
}

key_part!(
    /// The tenant or principal that owns a record: keys never collide or replay across scopes.
    /// 1 to 255 visible ASCII characters. Cloning is cheap (the text is shared).
    Scope(Arc<str>),
    KeyPart::Scope,
    MAX_SCOPE_LEN,
    visible_ascii,
    VISIBLE_ASCII
);
key_part!(
    /// The operation a key belongs to (`transfer`, `orders.create`): 1 to 128 ASCII letters,
    /// digits, `.`, `_`, `:` or `-`. Cloning is cheap (the text is shared).
    Namespace(Arc<str>),
    KeyPart::Namespace,
    MAX_NAMESPACE_LEN,
    namespace_char,
    NAMESPACE_CHARS
);
key_part!(
    /// The caller's unique request id (an `Idempotency-Key`, an order number, a message id):
    /// 1 to 255 visible ASCII characters.
    ClientKey(String),
    KeyPart::ClientKey,
    MAX_CLIENT_KEY_LEN,
    visible_ascii,
    VISIBLE_ASCII
);

/// The identity of one idempotency record.
///
/// Cloning is cheap (the parts are shared), and so is hashing: the key is hashed once when it
/// is built (SipHash with a per-process random key, as `HashMap` does), and `Hash` feeds only
/// that digest, so a map of keys pays for the long strings once. The `Debug` output hides the
/// client key (it shows a hash), so a key can be logged safely.
#[derive(Clone)]
pub struct Key {
    // Kept beside the pointer, not behind it: rehashing a large map then touches no parts.
    digest: u64,
    parts: Arc<Parts>,
}

struct Parts {
    scope: Scope,
    namespace: Namespace,
    client_key: ClientKey,
}

fn digest(scope: &Scope, namespace: &Namespace, client_key: &ClientKey) -> u64 {
    static SEED: OnceLock<RandomState> = OnceLock::new();
    SEED.get_or_init(RandomState::new)
        .hash_one((scope, namespace, client_key))
}

impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.digest == other.digest
            && (Arc::ptr_eq(&self.parts, &other.parts) || self.parts() == other.parts())
    }
}

impl Eq for Key {}

impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.digest);
    }
}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Key {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.parts().cmp(&other.parts())
    }
}

impl Key {
    /// Builds a key from validated parts.
    pub fn new(scope: Scope, namespace: Namespace, client_key: ClientKey) -> Self {
        Self {
            digest: digest(&scope, &namespace, &client_key),
            parts: Arc::new(Parts {
                scope,
                namespace,
                client_key,
            }),
        }
    }

    /// The key's 64-bit digest: SipHash of its parts under a per-process random key (the
    /// same value `Hash` feeds). Stable within a process only; for spreading keys over shards.
    pub fn digest(&self) -> u64 {
        self.digest
    }

    fn parts(&self) -> (&Scope, &Namespace, &ClientKey) {
        (
            &self.parts.scope,
            &self.parts.namespace,
            &self.parts.client_key,
        )
    }

    /// Validates three strings and builds a key.
    pub fn parse(scope: &str, namespace: &str, client_key: &str) -> Result<Self, KeyError> {
        Ok(Self::new(
            Scope::new(scope)?,
            Namespace::new(namespace)?,
            ClientKey::new(client_key)?,
        ))
    }

    /// The scope.
    pub fn scope(&self) -> &Scope {
        &self.parts.scope
    }

    /// The namespace.
    pub fn namespace(&self) -> &Namespace {
        &self.parts.namespace
    }

    /// The client key.
    pub fn client_key(&self) -> &ClientKey {
        &self.parts.client_key
    }

    /// SHA-256 over the three parts (each framed by its length): stable across processes and
    /// versions, for naming the key where its text must not appear (logs, Redis key names).
    pub fn sha256(&self) -> crate::Fingerprint {
        crate::Fingerprint::builder()
            .part(self.scope().as_str().as_bytes())
            .part(self.namespace().as_str().as_bytes())
            .part(self.client_key().as_str().as_bytes())
            .finish()
    }

    /// A short, stable, non-reversible tag of the whole key for logs and metrics
    /// (the first 8 bytes of [`Key::sha256`], in hex).
    pub fn log_tag(&self) -> String {
        let mut tag = String::with_capacity(16);
        self.sha256().write_hex(8, &mut tag);
        tag
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Key")
            .field("scope", self.scope())
            .field("namespace", self.namespace())
            .field("client_key_tag", &self.log_tag())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn accepts_visible_ascii_up_to_255() {
        let k = "a".repeat(255);
        assert_eq!(ClientKey::new(k.clone()).map(|c| c.0), Ok(k));
        assert_eq!(Scope::new("s").unwrap().as_str(), "s");
        assert!(ClientKey::new("!~Az09-_./:?#%").is_ok());
    }

    #[test]
    fn rejects_empty_long_and_invisible_without_truncating() {
        assert_eq!(
            ClientKey::new(""),
            Err(KeyError::Empty {
                part: KeyPart::ClientKey
            })
        );
        assert_eq!(
            ClientKey::new("a".repeat(256)),
            Err(KeyError::TooLong {
                part: KeyPart::ClientKey,
                len: 256,
                max: 255
            })
        );
        for bad in ["a b", "tab\t", "é", "nl\n", "\u{7f}"] {
            assert!(
                matches!(
                    ClientKey::new(bad),
                    Err(KeyError::InvalidChar {
                        part: KeyPart::ClientKey,
                        ..
                    })
                ),
                "{bad:?} accepted"
            );
        }
    }

    #[test]
    fn namespace_alphabet_is_narrow() {
        assert!(Namespace::new("orders.create:v2_x-y").is_ok());
        assert!(Namespace::new("a/b").is_err());
        assert!(Namespace::new("a".repeat(129)).is_err());
    }

    #[test]
    fn keys_compare_by_all_parts() {
        use std::collections::HashSet;
        let a = Key::parse("s", "n", "k").unwrap();
        assert_eq!(a, Key::parse("s", "n", "k").unwrap());
        let others = [
            Key::parse("t", "n", "k").unwrap(),
            Key::parse("s", "m", "k").unwrap(),
            Key::parse("s", "n", "j").unwrap(),
        ];
        let mut set: HashSet<Key> = others.iter().cloned().collect();
        assert!(!set.contains(&a));
        assert!(set.insert(a.clone()));
        assert!(!set.insert(Key::parse("s", "n", "k").unwrap()));
        assert!(others.iter().all(|o| *o != a));
        assert!(Key::parse("a", "n", "k").unwrap() < Key::parse("b", "a", "a").unwrap());
    }

    #[test]
    fn errors_never_echo_the_value() {
        let err = ClientKey::new("secret value").unwrap_err().to_string();
        assert!(!err.contains("secret"), "{err}");
        let debug = format!("{:?}", Key::parse("s", "n", "secret-key").unwrap());
        assert!(!debug.contains("secret-key"), "{debug}");
    }

    proptest! {
        #[test]
        fn client_key_accepts_exactly_the_rule(s in "\\PC{0,300}") {
            let ok = !s.is_empty() && s.len() <= 255 && s.bytes().all(|b| (0x21..=0x7e).contains(&b));
            let got = ClientKey::new(s.clone());
            prop_assert_eq!(got.is_ok(), ok);
            if let Ok(k) = got { prop_assert_eq!(k.as_str(), s.as_str()); }
        }
    }
}
