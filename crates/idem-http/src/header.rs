//! The `Idempotency-Key` request header.
//!
//! The IETF httpapi draft defines the field as an RFC 8941 structured-field *String*
//! (`Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"`), while Stripe's client
//! libraries and most browsers' fetch code send a bare value
//! (`Idempotency-Key: 8e03978e-40d5-43e8-bc93-6894a57f9324`). Both are accepted and yield the
//! same key. A key is 1 to 255 visible ASCII characters (`!` to `~`).
//!
//! A client sending a key it did not choose (the relay, with a message id) writes it with
//! [`encode_key`], the other half of [`parse_key`]: always the quoted form, which reads back
//! as exactly the key, where the bare form would not (`a,b` is two items, `"q"` is `q`).
//!
//! Written by hand rather than with a structured-field crate: only one item type (a string,
//! with parameters ignored as RFC 8941 requires) is needed, the bare-token form is outside
//! RFC 8941 anyway, and the parser must never allocate more than the 255-byte key.

use http::{HeaderMap, HeaderName, HeaderValue};

/// `Idempotency-Key`.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// `Idem-Fence`: the fence of the attempt a guarded request belongs to, which the gateway and
/// the relay send on, higher for every attempt that takes the key. A service that remembers the
/// highest fence it accepted for a key, and refuses a lower one, turns away an attempt that
/// stalled past its lease and was overtaken (see docs/guarantees.md).
pub const FENCE_HEADER: HeaderName = HeaderName::from_static("idem-fence");

/// `Idempotent-Replayed`, set to `true` on every replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The longest accepted key, in characters (the engine's limit on a client key).
pub const MAX_KEY_LEN: usize = idem_core::key::MAX_CLIENT_KEY_LEN;

/// Why an `Idempotency-Key` header was refused. Messages never repeat the value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyHeaderError {
    /// The request carries the header more than once.
    #[error("the request has more than one Idempotency-Key header")]
    Repeated,
    /// The header is empty (or an empty quoted string).
    #[error("the Idempotency-Key header is empty")]
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`].
    #[error("the Idempotency-Key header is longer than 255 characters")]
    TooLong,
    /// The header is neither a quoted string nor a bare token of visible ASCII characters.
    #[error(
        "the Idempotency-Key header must be a quoted string (\"key\") or a bare key of \
         visible ASCII characters without spaces or commas"
    )]
    Malformed,
    /// A key to send has a character outside visible ASCII, which an RFC 8941 string (and so
    /// the header) cannot carry.
    #[error(
        "the key has a character outside visible ASCII (`!` to `~`), which an \
         Idempotency-Key header cannot carry"
    )]
    Unsendable,
}

/// The key of a request: `Ok(None)` if it has no `Idempotency-Key` header.
pub fn key_from_headers(headers: &HeaderMap) -> Result<Option<String>, KeyHeaderError> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyHeaderError::Repeated);
    }
    parse_key(first.as_bytes()).map(Some)
}

/// Parses one header value: an RFC 8941 string (parameters allowed and ignored) or a bare
/// key. Surrounding spaces and tabs are ignored.
pub fn parse_key(value: &[u8]) -> Result<String, KeyHeaderError> {
    let value = trim_ows(value);
    let key = match value.first() {
        None => return Err(KeyHeaderError::Empty),
        Some(b'"') => {
            let (key, rest) = parse_sf_string(value)?;
            parse_parameters(rest)?;
            key
        }
        // A comma would be ambiguous: intermediaries may join repeated fields with commas.
        Some(_) if value.iter().all(|&b| is_visible(b) && b != b',') => value.to_vec(),
        Some(_) => return Err(KeyHeaderError::Malformed),
    };
    if key.is_empty() {
        return Err(KeyHeaderError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyHeaderError::TooLong);
    }
    // Every byte is visible ASCII, so this cannot fail.
    String::from_utf8(key).map_err(|_| KeyHeaderError::Malformed)
}

/// The header value that carries `key`: an RFC 8941 string, `"` then the key with `"` and `\`
/// escaped, then `"`. [`parse_key`], and any server that reads the field as the IETF draft
/// defines it, reads back exactly `key`; two different keys never read back the same.
///
/// Refused (never truncated): an empty key, one longer than [`MAX_KEY_LEN`], and one with a
/// character outside visible ASCII ([`KeyHeaderError::Unsendable`]).
///
/// ```
/// use idem_http::header::{encode_key, parse_key};
/// let sent = encode_key(r#"a,"b"\c"#).unwrap();
/// assert_eq!(sent, r#""a,\"b\"\\c""#);
/// assert_eq!(parse_key(sent.as_bytes()).unwrap(), r#"a,"b"\c"#);
/// assert!(encode_key("caf\u{e9}").is_err());
/// ```
pub fn encode_key(key: &str) -> Result<HeaderValue, KeyHeaderError> {
    if key.is_empty() {
        return Err(KeyHeaderError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyHeaderError::TooLong);
    }
    let mut out = Vec::with_capacity(key.len() + 2);
    out.push(b'"');
    for b in key.bytes() {
        if !is_visible(b) {
            return Err(KeyHeaderError::Unsendable);
        }
        if matches!(b, b'"' | b'\\') {
            out.push(b'\\');
        }
        out.push(b);
    }
    out.push(b'"');
    // Visible ASCII only, so this cannot fail.
    HeaderValue::from_bytes(&out).map_err(|_| KeyHeaderError::Unsendable)
}

fn is_visible(b: u8) -> bool {
    b.is_ascii_graphic()
}

fn trim_ows(mut v: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = v {
        v = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = v {
        v = rest;
    }
    v
}

/// RFC 8941 §4.2.5: `"` then printable ASCII with `\"` and `\\` escapes, then `"`. The
/// content must also be a key (no spaces). Returns the content and what follows.
fn parse_sf_string(v: &[u8]) -> Result<(Vec<u8>, &[u8]), KeyHeaderError> {
    let mut out = Vec::new();
    let mut i = 1;
    loop {
        let b = *v.get(i).ok_or(KeyHeaderError::Malformed)?;
        i += 1;
        match b {
            b'"' => return Ok((out, &v[i..])),
            b'\\' => match v.get(i) {
                Some(&e @ (b'"' | b'\\')) => {
                    i += 1;
                    out.push(e);
                }
                _ => return Err(KeyHeaderError::Malformed),
            },
            _ if is_visible(b) => out.push(b),
            _ => return Err(KeyHeaderError::Malformed),
        }
        if out.len() > MAX_KEY_LEN {
            return Err(KeyHeaderError::TooLong);
        }
    }
}

/// RFC 8941 §4.2.3.2 parameters after an item: `;` OWS key [ `=` bare-item ], repeated. None
/// is defined for this field, so they are checked for form and ignored.
fn parse_parameters(mut v: &[u8]) -> Result<(), KeyHeaderError> {
    loop {
        match v {
            [] => return Ok(()),
            [b';', rest @ ..] => v = rest,
            _ => return Err(KeyHeaderError::Malformed),
        }
        while let [b' ', rest @ ..] = v {
            v = rest;
        }
        // key = ( lcalpha / "*" ) *( lcalpha / DIGIT / "_" / "-" / "." / "*" )
        match v.first() {
            Some(b) if b.is_ascii_lowercase() || *b == b'*' => {}
            _ => return Err(KeyHeaderError::Malformed),
        }
        let end = v
            .iter()
            .position(|&b| !(b.is_ascii_lowercase() || b.is_ascii_digit() || b"_-.*".contains(&b)))
            .unwrap_or(v.len());
        v = &v[end..];
        if let [b'=', rest @ ..] = v {
            v = skip_bare_item(rest)?;
        }
    }
}

/// Skips a bare item (string, token, number, boolean or byte sequence) at the start of `v`.
fn skip_bare_item(v: &[u8]) -> Result<&[u8], KeyHeaderError> {
    match v.first() {
        Some(b'"') => {
            let mut i = 1;
            loop {
                match v.get(i) {
                    Some(b'"') => return Ok(&v[i + 1..]),
                    Some(b'\\') if matches!(v.get(i + 1), Some(b'"' | b'\\')) => i += 2,
                    Some(&b) if b == b' ' || is_visible(b) && b != b'\\' => i += 1,
                    _ => return Err(KeyHeaderError::Malformed),
                }
            }
        }
        Some(_) => {
            // tokens, numbers, `?0`/`?1` and `:base64:` are all runs of these characters
            let end = v
                .iter()
                .position(|&b| !(b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/?=".contains(&b)))
                .unwrap_or(v.len());
            if end == 0 {
                return Err(KeyHeaderError::Malformed);
            }
            Ok(&v[end..])
        }
        None => Err(KeyHeaderError::Malformed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use proptest::prelude::*;

    #[test]
    fn accepts_both_forms() {
        assert_eq!(parse_key(b"abc-123").unwrap(), "abc-123");
        assert_eq!(parse_key(b"\"abc-123\"").unwrap(), "abc-123");
        assert_eq!(parse_key(b"  \"abc\"\t").unwrap(), "abc");
        assert_eq!(parse_key(br#""a\"b\\c""#).unwrap(), r#"a"b\c"#);
        assert_eq!(parse_key(b"\"abc\";foo=1;bar;baz=\"x y\"").unwrap(), "abc");
        assert_eq!(parse_key(b"\"abc\"; *x=?1").unwrap(), "abc");
        // a bare key may contain characters that are special in structured fields
        assert_eq!(parse_key(b"a;b=c").unwrap(), "a;b=c");
    }

    #[test]
    fn refuses_bad_values() {
        use KeyHeaderError::*;
        for (v, e) in [
            (&b""[..], Empty),
            (b"   ", Empty),
            (b"\"\"", Empty),
            (b"a b", Malformed),
            (b"a,b", Malformed),
            (b"\"a\", \"b\"", Malformed),
            (b"\"a b\"", Malformed),
            (b"\"abc", Malformed),
            (b"\"a\\x\"", Malformed),
            (b"\"abc\"x", Malformed),
            (b"\"abc\";", Malformed),
            (b"\"abc\";Up=1", Malformed),
            (b"\"abc\";a=", Malformed),
            (b"caf\xc3\xa9", Malformed),
            (b"a\x7f", Malformed),
        ] {
            assert_eq!(parse_key(v), Err(e), "{:?}", String::from_utf8_lossy(v));
        }
        assert_eq!(parse_key(&[b'k'; 256]), Err(TooLong));
        assert_eq!(parse_key(&[b'k'; 255]).unwrap().len(), 255);
        let mut quoted = vec![b'"'];
        quoted.extend([b'k'; 300]);
        quoted.push(b'"');
        assert_eq!(parse_key(&quoted), Err(TooLong));
    }

    #[test]
    fn keys_that_read_alike_bare_are_sent_apart() {
        let read = |k: &str| parse_key(encode_key(k).unwrap().as_bytes()).unwrap();
        for k in ["a,b", "\"q\"", "q", "\\", "\"", "a;b=c", "\"a\";x"] {
            assert_eq!(read(k), k);
        }
        assert_ne!(encode_key("\"q\"").unwrap(), encode_key("q").unwrap());
        use KeyHeaderError::*;
        assert_eq!(encode_key(""), Err(Empty));
        assert_eq!(encode_key(&"k".repeat(256)), Err(TooLong));
        assert_eq!(encode_key("a b"), Err(Unsendable));
        assert_eq!(encode_key("caf\u{e9}"), Err(Unsendable));
        let longest = "\"".repeat(255);
        assert_eq!(
            read(&longest),
            longest,
            "escaping does not count against the length"
        );
    }

    #[test]
    fn repeated_header_is_refused() {
        let mut h = HeaderMap::new();
        assert_eq!(key_from_headers(&h), Ok(None));
        h.append(IDEMPOTENCY_KEY, HeaderValue::from_static("a"));
        assert_eq!(key_from_headers(&h), Ok(Some("a".into())));
        h.append(IDEMPOTENCY_KEY, HeaderValue::from_static("a"));
        assert_eq!(key_from_headers(&h), Err(KeyHeaderError::Repeated));
    }

    fn key_strategy() -> impl Strategy<Value = String> {
        proptest::collection::vec(0x21u8..=0x7e, 1..=255)
            .prop_map(|v| String::from_utf8(v).unwrap())
    }

    proptest! {
        /// Every valid key round-trips through the structured-field form `encode_key` writes.
        #[test]
        fn sf_string_round_trips(key in key_strategy()) {
            let sent = encode_key(&key).unwrap();
            prop_assert_eq!(parse_key(sent.as_bytes()).unwrap(), key);
        }

        /// Any string either encodes to a value that reads back as it, or is refused.
        #[test]
        fn any_string_encodes_exactly_or_not_at_all(key in ".{0,300}") {
            match encode_key(&key) {
                Ok(sent) => prop_assert_eq!(parse_key(sent.as_bytes()).unwrap(), key),
                Err(_) => prop_assert!(
                    key.is_empty() || key.len() > MAX_KEY_LEN || !key.bytes().all(is_visible)
                ),
            }
        }

        /// A bare key without commas or a leading quote is taken as it is.
        #[test]
        fn bare_key_round_trips(key in key_strategy()) {
            prop_assume!(!key.contains(',') && !key.starts_with('"'));
            prop_assert_eq!(parse_key(key.as_bytes()).unwrap(), key);
        }

        /// Arbitrary bytes never panic, and anything accepted is a valid key.
        #[test]
        fn arbitrary_bytes(v in proptest::collection::vec(any::<u8>(), 0..300)) {
            if let Ok(key) = parse_key(&v) {
                prop_assert!((1..=MAX_KEY_LEN).contains(&key.len()));
                prop_assert!(key.bytes().all(is_visible));
            }
        }
    }
}
