//! One spelling per path.
//!
//! Routes are chosen, keys namespaced and requests fingerprinted on the path; the upstream
//! routes on the path too, usually after normalising it. If the gateway and the upstream read
//! one path two ways, a request can reach a guarded handler under another route's policy (or
//! none). So every request path is brought to one normal form before anything looks at it, and
//! that form is what the upstream receives; a path that servers are known to read differently
//! is refused instead.
//!
//! The normal form (RFC 3986 §6.2.2, plus merged slashes):
//!
//! - percent-encoded unreserved characters (`A-Z a-z 0-9 - . _ ~`) are decoded, other
//!   percent-encodings get upper-case hex, and characters a path may not hold raw (`"`, `{`,
//!   `|`, non-ASCII, …) are percent-encoded;
//! - `.` and `..` segments are removed as RFC 3986 §5.2.4 says;
//! - empty segments (doubled slashes) are dropped; a final slash is kept.
//!
//! Refused ([`AmbiguousPath`]): an encoded `/` or `\` (`%2F`, `%5C`) and a raw `\`, which some
//! servers split on and others do not; an encoded dot segment (`%2e`, `.%2E`), which some
//! servers resolve after decoding; path parameters (`;`, raw or `%3B`), which some servers
//! strip and others keep; control characters, raw or encoded (`%00`); a malformed
//! percent-encoding; and a `..` that climbs above the root.

use std::fmt::Write as _;

/// Why a path has no single reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AmbiguousPath {
    /// Not an absolute path (`/…`).
    #[error("the request target is not an absolute path")]
    NotAbsolute,
    /// `%2F` or `%5C`: a separator some servers split on after decoding and others do not.
    #[error(
        "the path holds an encoded slash or backslash (%2F, %5C), which servers read differently"
    )]
    EncodedSeparator,
    /// A raw `\`, which some servers take for `/`.
    #[error("the path holds a backslash, which some servers take for a slash")]
    Backslash,
    /// `%2E` in a segment that decodes to `.` or `..`.
    #[error(
        "the path holds an encoded dot segment (%2E), which some servers resolve after decoding"
    )]
    EncodedDotSegment,
    /// `;` or `%3B`: path parameters, which some servers strip before routing.
    #[error(
        "the path holds a semicolon (path parameters), which some servers strip before routing"
    )]
    Parameters,
    /// A control character, raw or percent-encoded.
    #[error("the path holds a control character")]
    Control,
    /// `%` not followed by two hexadecimal digits.
    #[error("the path holds a malformed percent-encoding")]
    BadEscape,
    /// A `..` segment with nothing left to remove.
    #[error("the path climbs above the root with ..")]
    AboveRoot,
}

/// The normal form of an absolute path, or why it has none. Normalising a normal form gives
/// it back unchanged.
pub fn normalize(path: &str) -> Result<String, AmbiguousPath> {
    let rest = path.strip_prefix('/').ok_or(AmbiguousPath::NotAbsolute)?;
    let mut segments: Vec<String> = Vec::new();
    let mut final_slash = false;
    for raw in rest.split('/') {
        let (segment, encoded_dot) = segment(raw)?;
        final_slash = true;
        match segment.as_str() {
            "" => {}
            "." | ".." if encoded_dot => return Err(AmbiguousPath::EncodedDotSegment),
            "." => {}
            ".." => {
                segments.pop().ok_or(AmbiguousPath::AboveRoot)?;
            }
            _ => {
                segments.push(segment);
                final_slash = false;
            }
        }
    }
    let mut out = String::with_capacity(path.len());
    for s in &segments {
        out.push('/');
        out.push_str(s);
    }
    if final_slash || out.is_empty() {
        out.push('/');
    }
    Ok(out)
}

/// One segment in normal form, and whether it held an encoded dot.
fn segment(raw: &str) -> Result<(String, bool), AmbiguousPath> {
    let mut out = String::with_capacity(raw.len());
    let mut encoded_dot = false;
    let mut bytes = raw.bytes();
    while let Some(b) = bytes.next() {
        match b {
            b'%' => {
                let (Some(h), Some(l)) = (
                    bytes.next().and_then(hex_value),
                    bytes.next().and_then(hex_value),
                ) else {
                    return Err(AmbiguousPath::BadEscape);
                };
                let v = h << 4 | l;
                match v {
                    b'/' | b'\\' => return Err(AmbiguousPath::EncodedSeparator),
                    b';' => return Err(AmbiguousPath::Parameters),
                    _ if is_control(v) => return Err(AmbiguousPath::Control),
                    _ if is_unreserved(v) => {
                        encoded_dot |= v == b'.';
                        out.push(char::from(v));
                    }
                    _ => escape(&mut out, v),
                }
            }
            b'\\' => return Err(AmbiguousPath::Backslash),
            b';' => return Err(AmbiguousPath::Parameters),
            _ if is_control(b) => return Err(AmbiguousPath::Control),
            _ if is_unreserved(b) || b"!$&'()*+,=:@".contains(&b) => out.push(char::from(b)),
            _ => escape(&mut out, b),
        }
    }
    Ok((out, encoded_dot))
}

fn escape(out: &mut String, b: u8) {
    // Writing to a String cannot fail.
    let _ = write!(out, "%{b:02X}");
}

/// RFC 3986 `unreserved`.
fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn is_control(b: u8) -> bool {
    b < 0x20 || b == 0x7f
}

fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// The bytes a segment in normal form stands for, every percent-encoding decoded. In a normal
/// form no encoding decodes to a separator, so comparing decoded segments is safe.
pub(crate) fn decoded(segment: &str) -> Vec<u8> {
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if let [b'%', h, l, ..] = bytes[i..]
            && let (Some(h), Some(l)) = (hex_value(h), hex_value(l))
        {
            out.push(h << 4 | l);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    out
}

/// Whether `path` (in normal form) is `prefix` or lies under it, ignoring ASCII case: the
/// reserved prefix keeps every spelling, since some upstreams route without regard to case.
pub(crate) fn under_prefix(path: &str, prefix: &str) -> bool {
    let (p, q) = (path.as_bytes(), prefix.as_bytes());
    p.len() >= q.len()
        && p[..q.len()].eq_ignore_ascii_case(q)
        && matches!(p.get(q.len()), None | Some(b'/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_forms() {
        for (raw, want) in [
            ("/", "/"),
            ("/v1/payments/charge", "/v1/payments/charge"),
            ("/v1/./payments/charge", "/v1/payments/charge"),
            ("/v1/x/../payments/charge", "/v1/payments/charge"),
            ("//v1//payments///charge", "/v1/payments/charge"),
            ("/v1/%70ayments/%63harge", "/v1/payments/charge"),
            ("/v1/payments/charge/", "/v1/payments/charge/"),
            ("/v1/payments/charge/.", "/v1/payments/charge/"),
            ("/v1/payments/charge/x/..", "/v1/payments/charge/"),
            ("/v1/..", "/"),
            ("/a/%c3%a9", "/a/%C3%A9"),
            ("/a/caf\u{e9}", "/a/caf%C3%A9"),
            ("/a/%7e%2D%5f%2e", "/a/~-_."),
            ("/a/b%2ec", "/a/b.c"),
            ("/a/...", "/a/..."),
            ("/a/%25", "/a/%25"),
            ("/a/%21!", "/a/%21!"),
            ("/a/\"{|}^", "/a/%22%7B%7C%7D%5E"),
            ("/a:b@c/*$&'()+,=", "/a:b@c/*$&'()+,="),
        ] {
            assert_eq!(normalize(raw).as_deref(), Ok(want), "{raw}");
            assert_eq!(
                normalize(want).as_deref(),
                Ok(want),
                "{want} is a normal form"
            );
        }
    }

    #[test]
    fn ambiguous_paths_are_refused() {
        use AmbiguousPath::*;
        for (raw, why) in [
            ("v1", NotAbsolute),
            ("", NotAbsolute),
            ("*", NotAbsolute),
            ("/v1/payments%2Fcharge", EncodedSeparator),
            ("/v1/payments%2fcharge", EncodedSeparator),
            ("/v1/payments%5Ccharge", EncodedSeparator),
            ("/v1\\payments", Backslash),
            ("/v1/%2e/payments/charge", EncodedDotSegment),
            ("/v1/x/%2E%2E/payments", EncodedDotSegment),
            ("/v1/x/.%2e/payments", EncodedDotSegment),
            ("/v1;x/payments/charge", Parameters),
            ("/v1%3Bx/payments", Parameters),
            ("/v1/%00", Control),
            ("/v1/%1f", Control),
            ("/v1/%7F", Control),
            ("/v1/\u{1}", Control),
            ("/v1/%", BadEscape),
            ("/v1/%2", BadEscape),
            ("/v1/%zz", BadEscape),
            ("/..", AboveRoot),
            ("/a/../..", AboveRoot),
            ("/a/../../b", AboveRoot),
        ] {
            assert_eq!(normalize(raw), Err(why), "{raw}");
        }
    }

    #[test]
    fn decoding_and_prefixes() {
        assert_eq!(decoded("caf%C3%A9"), "café".as_bytes());
        assert_eq!(decoded("%2"), b"%2");
        assert_eq!(decoded("a%"), b"a%");
        assert!(under_prefix("/_idem", "/_idem"));
        assert!(under_prefix("/_idem/", "/_idem"));
        assert!(under_prefix("/_IDEM/x", "/_idem"));
        assert!(!under_prefix("/_idemx", "/_idem"));
        assert!(!under_prefix("/_ide", "/_idem"));
    }
}
