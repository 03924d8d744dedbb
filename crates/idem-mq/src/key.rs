//! Where a message's idempotency key comes from.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use crate::Delivery;

/// A read-only view of a message, for a [`KeyFrom::Function`].
pub trait MessageView {
    /// The publisher's message id.
    fn message_id(&self) -> Option<&str>;
    /// A header, as text.
    fn header(&self, name: &str) -> Option<Cow<'_, str>>;
    /// The body.
    fn payload(&self) -> &[u8];
}

impl<D: Delivery> MessageView for D {
    fn message_id(&self) -> Option<&str> {
        Delivery::message_id(self)
    }
    fn header(&self, name: &str) -> Option<Cow<'_, str>> {
        Delivery::header(self, name)
    }
    fn payload(&self) -> &[u8] {
        Delivery::payload(self)
    }
}

/// A function that finds a message's key.
pub type KeyFn = Arc<dyn Fn(&dyn MessageView) -> Option<String> + Send + Sync>;

/// Where the consumer finds each message's key.
#[derive(Clone, Default)]
#[non_exhaustive]
pub enum KeyFrom {
    /// The message id the publisher set: AMQP's `message_id` property, JetStream's
    /// `Nats-Msg-Id` header. The default.
    #[default]
    MessageId,
    /// A header of this name.
    Header(String),
    /// A JSON pointer (RFC 6901, `/order/id`) into the payload, which must be JSON. A string
    /// is taken as it is; a number or a boolean as its JSON text; anything else is no key.
    JsonPointer(String),
    /// A function of the message.
    Function(KeyFn),
}

impl KeyFrom {
    /// A key made by `f`.
    pub fn function(
        f: impl Fn(&dyn MessageView) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        Self::Function(Arc::new(f))
    }

    /// Checks what can be checked before any message arrives: a [`KeyFrom::JsonPointer`] must
    /// be an RFC 6901 pointer (empty, or `/` and reference tokens in which `~` is only `~0` or
    /// `~1`); anything else would find no key in any message. The message names the pointer
    /// (configuration, not a key) and shows the right form.
    ///
    /// ```
    /// use idem_mq::KeyFrom;
    /// assert!(KeyFrom::JsonPointer("/order/id".into()).check().is_ok());
    /// assert!(KeyFrom::JsonPointer("order/id".into()).check().is_err());
    /// ```
    pub fn check(&self) -> Result<(), String> {
        let KeyFrom::JsonPointer(pointer) = self else {
            return Ok(());
        };
        if !pointer.is_empty() && !pointer.starts_with('/') {
            return Err(format!(
                "{pointer:?} is not a JSON pointer: it must start with \"/\", as in /order/id"
            ));
        }
        let mut rest = pointer.as_str();
        while let Some(at) = rest.find('~') {
            rest = &rest[at + 1..];
            if !rest.starts_with(['0', '1']) {
                return Err(format!(
                    "{pointer:?} is not a JSON pointer: \"~\" must be followed by 0 (for ~) or 1 \
                     (for /)"
                ));
            }
        }
        Ok(())
    }

    /// The key of `message`, if it has one. An empty value is no key.
    pub fn find(&self, message: &dyn MessageView) -> Option<String> {
        let found = match self {
            KeyFrom::MessageId => message.message_id().map(str::to_owned),
            KeyFrom::Header(name) => message.header(name).map(Cow::into_owned),
            KeyFrom::JsonPointer(pointer) => {
                let value: serde_json::Value = serde_json::from_slice(message.payload()).ok()?;
                match value.pointer(pointer)? {
                    serde_json::Value::String(s) => Some(s.clone()),
                    v @ (serde_json::Value::Number(_) | serde_json::Value::Bool(_)) => {
                        Some(v.to_string())
                    }
                    _ => None,
                }
            }
            KeyFrom::Function(f) => f(message),
        };
        found.filter(|k| !k.is_empty())
    }
}

impl fmt::Debug for KeyFrom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyFrom::MessageId => f.write_str("MessageId"),
            KeyFrom::Header(h) => f.debug_tuple("Header").field(h).finish(),
            KeyFrom::JsonPointer(p) => f.debug_tuple("JsonPointer").field(p).finish(),
            KeyFrom::Function(_) => f.write_str("Function(..)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct M {
        id: Option<&'static str>,
        payload: &'static [u8],
    }

    impl MessageView for M {
        fn message_id(&self) -> Option<&str> {
            self.id
        }
        fn header(&self, name: &str) -> Option<Cow<'_, str>> {
            (name == "x-order").then_some(Cow::Borrowed("o-9"))
        }
        fn payload(&self) -> &[u8] {
            self.payload
        }
    }

    #[test]
    fn each_source_of_a_key_finds_it_or_reports_none() {
        let m = M {
            id: Some("m-1"),
            payload: br#"{"order":{"id":"o-1","n":42,"x":null}}"#,
        };
        assert_eq!(KeyFrom::MessageId.find(&m).as_deref(), Some("m-1"));
        assert_eq!(
            KeyFrom::Header("x-order".into()).find(&m).as_deref(),
            Some("o-9")
        );
        assert_eq!(KeyFrom::Header("other".into()).find(&m), None);
        let at = |p: &str| KeyFrom::JsonPointer(p.into()).find(&m);
        assert_eq!(at("/order/id").as_deref(), Some("o-1"));
        assert_eq!(at("/order/n").as_deref(), Some("42"));
        assert_eq!(at("/order/x"), None);
        assert_eq!(at("/order"), None);
        assert_eq!(at("/missing"), None);
        let f = KeyFrom::function(|m| m.message_id().map(|id| format!("{id}-f")));
        assert_eq!(f.find(&m).as_deref(), Some("m-1-f"));

        let bare = M {
            id: Some(""),
            payload: b"not json",
        };
        assert_eq!(KeyFrom::MessageId.find(&bare), None, "empty is no key");
        assert_eq!(KeyFrom::JsonPointer("/a".into()).find(&bare), None);
    }

    #[test]
    fn only_a_json_pointer_passes_the_check() {
        for good in ["", "/", "/order/id", "/a~1b/~0c", "/0"] {
            assert_eq!(
                KeyFrom::JsonPointer(good.into()).check(),
                Ok(()),
                "{good:?}"
            );
        }
        for bad in ["no-slash", "order/id", "/a~2", "/a~"] {
            let e = KeyFrom::JsonPointer(bad.into()).check().unwrap_err();
            assert!(e.contains("is not a JSON pointer"), "{bad:?}: {e}");
        }
        assert_eq!(KeyFrom::MessageId.check(), Ok(()));
    }
}
