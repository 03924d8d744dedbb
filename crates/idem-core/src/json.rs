//! JSON read exactly, for fingerprints: every number as written, every member once.
//!
//! `serde_json::Value` holds a number as an `f64` once it is not an integer of 64 bits, so
//! `18446744073709551616` and `…617`, or `0.1` and `0.10000000000000000001`, become one value,
//! and it keeps the last of two members of one name, so `{"amount":100,"amount":999}` reads
//! as `{"amount":999}`. A fingerprint over such a value would take two different requests for
//! one. Its `arbitrary_precision` feature keeps number text, but turns on for every crate in a
//! build and changes how numbers deserialize everywhere; no JSON crate canonicalises numbers
//! exactly. So this small reader is written here: it keeps each number as its exact decimal
//! value (canonical text, so `1`, `1.0`, `10e-1` and `1e0` are one value and nothing else is),
//! and refuses an object that names a member twice (RFC 7493, I-JSON). Strings are decoded
//! by `serde_json`.

use std::fmt;

/// The deepest nesting read, as `serde_json`'s own limit.
const MAX_DEPTH: usize = 128;

/// The longest exponent, in digits, of a number read, as written and in its canonical form
/// (which moves the exponent by the number's digits): enough for any number a program means.
const MAX_EXPONENT_DIGITS: usize = 15;

/// A JSON value read exactly: numbers as canonical text, object members sorted by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Json {
    /// `null`.
    Null,
    /// `true` or `false`.
    Bool(bool),
    /// A number, as its canonical text ([`parse`] says which).
    Number(String),
    /// A string, decoded.
    String(String),
    /// An array.
    Array(Vec<Json>),
    /// An object's members, sorted by name (bytes of UTF-8), each name once.
    Object(Vec<(String, Json)>),
}

/// Why a text is not read as JSON.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum JsonError {
    /// Not JSON (or nested deeper than 128, or a number whose exponent, as written or in
    /// canonical form, has more than 15 digits).
    #[error("not valid JSON at byte {at}")]
    Syntax {
        /// Where the reader stopped.
        at: usize,
    },
    /// An object names a member twice: servers keep one or the other, so it has no one
    /// meaning. The name is not shown.
    #[error("an object names one member twice (at byte {at})")]
    DuplicateMember {
        /// Where the object ends.
        at: usize,
    },
}

/// Reads `text` as one JSON value, exactly.
///
/// A number's canonical text is its decimal value with no sign for zero, no leading or
/// trailing zero digits: an integer of up to 21 digits as digits (`100`), a fraction whose
/// first significant digit is at most 6 places after the point in positional form (`0.001`,
/// `-12.5`), anything else in scientific form (`1e21`, `1.5e-7`).
pub fn parse(text: &[u8]) -> Result<Json, JsonError> {
    let mut r = Reader { text, at: 0 };
    let value = r.value(0)?;
    r.skip_space();
    if r.at != text.len() {
        return Err(r.syntax());
    }
    Ok(value)
}

impl Json {
    /// The value at an RFC 6901 JSON Pointer (`""` is the whole value), as
    /// `serde_json::Value::pointer` finds it.
    pub fn pointer(&self, pointer: &str) -> Option<&Json> {
        if pointer.is_empty() {
            return Some(self);
        }
        let rest = pointer.strip_prefix('/')?;
        rest.split('/').try_fold(self, |at, token| {
            let token = token.replace("~1", "/").replace("~0", "~");
            match at {
                Json::Object(members) => members
                    .binary_search_by(|(name, _)| name.as_bytes().cmp(token.as_bytes()))
                    .ok()
                    .map(|i| &members[i].1),
                Json::Array(items) => {
                    if token.is_empty() || (token.len() > 1 && token.starts_with('0')) {
                        return None;
                    }
                    items.get(token.parse::<usize>().ok()?)
                }
                _ => None,
            }
        })
    }

    /// Appends the canonical text: no whitespace, members in order of name, strings escaped
    /// as `serde_json` escapes them, numbers as [`parse`] writes them.
    pub fn write_canonical(&self, out: &mut Vec<u8>) {
        match self {
            Json::Null => out.extend_from_slice(b"null"),
            Json::Bool(true) => out.extend_from_slice(b"true"),
            Json::Bool(false) => out.extend_from_slice(b"false"),
            Json::Number(n) => out.extend_from_slice(n.as_bytes()),
            Json::String(s) => write_string(out, s),
            Json::Array(items) => {
                out.push(b'[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    item.write_canonical(out);
                }
                out.push(b']');
            }
            Json::Object(members) => {
                out.push(b'{');
                for (i, (name, value)) in members.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    write_string(out, name);
                    out.push(b':');
                    value.write_canonical(out);
                }
                out.push(b'}');
            }
        }
    }
}

impl fmt::Display for Json {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = Vec::new();
        self.write_canonical(&mut out);
        f.write_str(&String::from_utf8_lossy(&out))
    }
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    // Writing into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

struct Reader<'a> {
    text: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn syntax(&self) -> JsonError {
        JsonError::Syntax { at: self.at }
    }

    fn peek(&self) -> Option<u8> {
        self.text.get(self.at).copied()
    }

    fn skip_space(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    fn literal(&mut self, word: &[u8], value: Json) -> Result<Json, JsonError> {
        if self.text[self.at..].starts_with(word) {
            self.at += word.len();
            Ok(value)
        } else {
            Err(self.syntax())
        }
    }

    fn value(&mut self, depth: usize) -> Result<Json, JsonError> {
        self.skip_space();
        match self.peek() {
            Some(b'n') => self.literal(b"null", Json::Null),
            Some(b't') => self.literal(b"true", Json::Bool(true)),
            Some(b'f') => self.literal(b"false", Json::Bool(false)),
            Some(b'"') => self.string().map(Json::String),
            Some(b'-' | b'0'..=b'9') => self.number().map(Json::Number),
            Some(b'[') if depth < MAX_DEPTH => self.array(depth + 1),
            Some(b'{') if depth < MAX_DEPTH => self.object(depth + 1),
            _ => Err(self.syntax()),
        }
    }

    fn array(&mut self, depth: usize) -> Result<Json, JsonError> {
        self.at += 1;
        let mut items = Vec::new();
        self.skip_space();
        if self.peek() == Some(b']') {
            self.at += 1;
            return Ok(Json::Array(items));
        }
        loop {
            items.push(self.value(depth)?);
            self.skip_space();
            match self.peek() {
                Some(b',') => self.at += 1,
                Some(b']') => {
                    self.at += 1;
                    return Ok(Json::Array(items));
                }
                _ => return Err(self.syntax()),
            }
        }
    }

    fn object(&mut self, depth: usize) -> Result<Json, JsonError> {
        self.at += 1;
        let mut members = Vec::new();
        self.skip_space();
        if self.peek() == Some(b'}') {
            self.at += 1;
            return Ok(Json::Object(members));
        }
        loop {
            self.skip_space();
            if self.peek() != Some(b'"') {
                return Err(self.syntax());
            }
            let name = self.string()?;
            self.skip_space();
            if self.peek() != Some(b':') {
                return Err(self.syntax());
            }
            self.at += 1;
            members.push((name, self.value(depth)?));
            self.skip_space();
            match self.peek() {
                Some(b',') => self.at += 1,
                Some(b'}') => {
                    self.at += 1;
                    break;
                }
                _ => return Err(self.syntax()),
            }
        }
        members.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        if members.windows(2).any(|w| w[0].0 == w[1].0) {
            return Err(JsonError::DuplicateMember { at: self.at });
        }
        Ok(Json::Object(members))
    }

    /// A string token, decoded by `serde_json` (escapes, surrogate pairs, UTF-8).
    fn string(&mut self) -> Result<String, JsonError> {
        let start = self.at;
        self.at += 1;
        loop {
            match self.peek() {
                None => return Err(self.syntax()),
                Some(b'"') => break,
                Some(b'\\') => self.at += 2,
                Some(_) => self.at += 1,
            }
        }
        self.at += 1;
        let token = self.text.get(start..self.at).ok_or_else(|| self.syntax())?;
        serde_json::from_slice(token).map_err(|_| JsonError::Syntax { at: start })
    }

    /// A number token, as its canonical text.
    fn number(&mut self) -> Result<String, JsonError> {
        let digits_from = |r: &mut Self| {
            let from = r.at;
            while matches!(r.peek(), Some(b'0'..=b'9')) {
                r.at += 1;
            }
            &r.text[from..r.at]
        };
        let negative = self.peek() == Some(b'-');
        if negative {
            self.at += 1;
        }
        let int = digits_from(self);
        if int.is_empty() || (int.len() > 1 && int[0] == b'0') {
            return Err(self.syntax());
        }
        let mut frac: &[u8] = &[];
        if self.peek() == Some(b'.') {
            self.at += 1;
            frac = digits_from(self);
            if frac.is_empty() {
                return Err(self.syntax());
            }
        }
        let mut exponent: i64 = 0;
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.at += 1;
            let minus = match self.peek() {
                Some(b'-') => {
                    self.at += 1;
                    true
                }
                Some(b'+') => {
                    self.at += 1;
                    false
                }
                _ => false,
            };
            let exp = digits_from(self);
            let significant = exp.iter().skip_while(|&&d| d == b'0').count();
            if exp.is_empty() || significant > MAX_EXPONENT_DIGITS {
                return Err(self.syntax());
            }
            exponent = exp.iter().fold(0, |n, &d| n * 10 + i64::from(d - b'0'));
            if minus {
                exponent = -exponent;
            }
        }
        canonical_number(negative, int, frac, exponent).ok_or_else(|| self.syntax())
    }
}

/// The canonical text of `±int.frac × 10^exponent` (see [`parse`]); `None` if its exponent
/// would have more than [`MAX_EXPONENT_DIGITS`] digits, which the text read again would not
/// be taken with.
fn canonical_number(negative: bool, int: &[u8], frac: &[u8], exponent: i64) -> Option<String> {
    let all: Vec<u8> = int.iter().chain(frac).copied().collect();
    let first = all.iter().position(|&d| d != b'0');
    let Some(first) = first else {
        return Some("0".to_owned());
    };
    let last = all.iter().rposition(|&d| d != b'0').unwrap_or(first);
    let digits = &all[first..=last];
    // The value is digits × 10^e.
    let frac_len = i64::try_from(frac.len()).unwrap_or(i64::MAX);
    let trailing = i64::try_from(all.len() - 1 - last).unwrap_or(i64::MAX);
    let e = exponent - frac_len + trailing;
    let n = i64::try_from(digits.len()).unwrap_or(i64::MAX);
    let text = |d: &[u8]| String::from_utf8_lossy(d).into_owned();
    let mut out = String::from(if negative { "-" } else { "" });
    if e >= 0 && n + e <= 21 {
        out.push_str(&text(digits));
        out.extend(std::iter::repeat_n('0', usize::try_from(e).unwrap_or(0)));
    } else if e < 0 && n + e > 0 {
        let point = usize::try_from(n + e).unwrap_or(0);
        out.push_str(&text(&digits[..point]));
        out.push('.');
        out.push_str(&text(&digits[point..]));
    } else if e < 0 && -(n + e) < 6 {
        out.push_str("0.");
        out.extend(std::iter::repeat_n(
            '0',
            usize::try_from(-(n + e)).unwrap_or(0),
        ));
        out.push_str(&text(digits));
    } else {
        out.push_str(&text(&digits[..1]));
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&text(&digits[1..]));
        }
        let written = e.saturating_add(n - 1);
        if written.unsigned_abs().to_string().len() > MAX_EXPONENT_DIGITS {
            return None;
        }
        out.push('e');
        out.push_str(&written.to_string());
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A number whose canonical exponent would be longer than one read (the digits move it)
    /// is refused, rather than given a canonical text that does not read back.
    #[test]
    fn a_canonical_exponent_past_the_limit_is_refused() {
        assert!(parse(b"9999999e999999999999999").is_err());
        assert!(parse(b"0.000001e-999999999999999").is_err());
        assert_eq!(canon("9e999999999999999"), "9e999999999999999");
        let text = parse(b"99e99999999999998").unwrap().to_string();
        assert_eq!(canon(&text), text);
    }

    fn canon(text: &str) -> String {
        parse(text.as_bytes()).expect(text).to_string()
    }

    #[test]
    fn numbers_are_kept_exactly_and_spellings_of_one_value_are_one() {
        for (a, b) in [
            ("1", "1.0"),
            ("1", "1e0"),
            ("1", "10e-1"),
            ("100", "1e2"),
            ("100", "1.00E+2"),
            ("0", "-0"),
            ("0", "0.000e5"),
            ("-12.5", "-1.25e1"),
            ("0.001", "1e-3"),
        ] {
            assert_eq!(canon(a), canon(b), "{a} and {b}");
        }
        for (a, b) in [
            ("18446744073709551616", "18446744073709551617"),
            ("0.1", "0.10000000000000000001"),
            ("9007199254740993", "9007199254740992"),
            ("1e400", "1e401"),
            ("-1", "1"),
        ] {
            assert_ne!(canon(a), canon(b), "{a} and {b}");
        }
        assert_eq!(canon("18446744073709551616"), "18446744073709551616");
        assert_eq!(canon("1e20"), "100000000000000000000");
        assert_eq!(canon("1e21"), "1e21");
        assert_eq!(canon("-0.0000015"), "-0.0000015");
        assert_eq!(canon("1.5e-7"), "1.5e-7");
        assert_eq!(canon("123.456e-400"), "1.23456e-398");
    }

    #[test]
    fn a_member_named_twice_is_refused_and_bad_text_is_not_json() {
        for dup in [
            r#"{"amount":100,"amount":999}"#,
            r#"{"a":1,"b":{"x":1,"x":1}}"#,
            r#"[{"\u0061":1,"a":2}]"#,
        ] {
            assert!(
                matches!(
                    parse(dup.as_bytes()),
                    Err(JsonError::DuplicateMember { .. })
                ),
                "{dup}"
            );
        }
        for bad in [
            "",
            "{",
            "[1,]",
            "01",
            "1.",
            ".5",
            "-",
            "1e",
            "+1",
            "nul",
            "\"a",
            "{\"a\" 1}",
            "1 2",
            "\"\\x\"",
            "1e1234567890123456",
            "NaN",
        ] {
            assert!(
                matches!(parse(bad.as_bytes()), Err(JsonError::Syntax { .. })),
                "{bad:?}"
            );
        }
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        assert!(parse(deep.as_bytes()).is_err());
    }

    #[test]
    fn pointers_find_what_serde_json_finds() {
        let text = r#"{"a":{"b/c":[10,{"~d":2}]},"":0}"#;
        let v: serde_json::Value = serde_json::from_str(text).unwrap();
        let j = parse(text.as_bytes()).unwrap();
        for p in [
            "",
            "/a",
            "/a/b~1c",
            "/a/b~1c/0",
            "/a/b~1c/1/~0d",
            "/",
            "/a/b~1c/01",
            "/x",
            "a",
            "/a/b~1c/2",
        ] {
            assert_eq!(
                j.pointer(p).map(Json::to_string),
                v.pointer(p).map(crate::fingerprint::to_canonical_string),
                "{p}"
            );
        }
    }

    fn plain_json() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            any::<u64>().prop_map(serde_json::Value::from),
            ".{0,8}".prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::from),
                prop::collection::btree_map(".{0,6}", inner, 0..6)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Where `serde_json` loses nothing (integers of 64 bits, strings, no member twice),
        /// the exact reader's canonical text is the one fingerprints always had.
        #[test]
        fn canonical_text_is_unchanged_where_serde_json_is_exact(v in plain_json()) {
            let text = serde_json::to_string_pretty(&v).unwrap();
            prop_assert_eq!(
                parse(text.as_bytes()).unwrap().to_string(),
                crate::fingerprint::to_canonical_string(&v)
            );
        }

        /// Any number text reads back to itself: the canonical text is canonical.
        #[test]
        fn canonical_numbers_are_fixed_points(
            int in "-?(0|[1-9][0-9]{0,30})",
            frac in "(\\.[0-9]{1,30})?",
            exp in "([eE][+-]?[0-9]{1,4})?",
        ) {
            let once = canon(&format!("{int}{frac}{exp}"));
            prop_assert_eq!(canon(&once), once);
        }
    }
}
