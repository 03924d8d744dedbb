//! Request fingerprints: SHA-256 over what makes two requests "the same".
//!
//! A key reused with a different fingerprint is a client bug (or an attack); the engine
//! answers `Mismatch` instead of replaying an answer to a different question. Three modes:
//!
//! - raw bytes: [`Fingerprint::of_bytes`];
//! - canonical JSON: [`Fingerprint::of_json`], in which object key order and insignificant
//!   whitespace do not matter, and a number is compared by value (`1`, `1.0` and `1e0` are one);
//!   from text, [`Fingerprint::of_json_str`] reads every number exactly and refuses a member
//!   named twice ([`crate::json`]);
//! - selected fields: [`Fingerprint::of_json_fields`], which looks only at the fields named by
//!   JSON Pointers (RFC 6901), so a request id or a timestamp inside the body can be left out.
//!
//! Composite fingerprints (method, path, query, body) are built with [`FingerprintBuilder`],
//! which length-prefixes every part so that no two different part lists hash alike.

use std::fmt;
use std::io::{self, Write};

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::json::{self, Json, JsonError};

/// A SHA-256 request fingerprint.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint([u8; 32]);

/// A fingerprint string that is not 64 hexadecimal digits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a fingerprint is 64 hexadecimal digits")]
pub struct ParseFingerprintError;

/// Domain tags keep the modes apart: the raw bytes `{"a":1}` and the JSON value `{"a":1}`
/// are different requests to the engine only if the caller chose different modes.
const TAG_BYTES: &[u8] = b"idem.bytes.v1";
const TAG_JSON: &[u8] = b"idem.json.v1";
const TAG_FIELDS: &[u8] = b"idem.fields.v1";
const TAG_PARTS: &[u8] = b"idem.parts.v1";

impl Fingerprint {
    /// Wraps a digest computed elsewhere.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The digest.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The fingerprint of raw bytes.
    pub fn of_bytes(bytes: &[u8]) -> Self {
        let mut h = Sha256::new();
        h.update(TAG_BYTES);
        h.update(bytes);
        Self(h.finalize().into())
    }

    /// The fingerprint of a JSON value in canonical form.
    pub fn of_json(value: &Value) -> Self {
        let mut h = HashWriter(Sha256::new());
        h.0.update(TAG_JSON);
        write_canonical(&mut h, value);
        Self(h.0.finalize().into())
    }

    /// Reads `text` as JSON exactly ([`crate::json`]: every number as written, a member named
    /// twice refused) and fingerprints its canonical form: the same fingerprint as
    /// [`Fingerprint::of_json`] of the value wherever `serde_json` reads it without loss.
    pub fn of_json_str(text: &str) -> Result<Self, JsonError> {
        json::parse(text.as_bytes()).map(|v| Self::of_exact_json(&v))
    }

    /// The fingerprint of a JSON value read exactly ([`json::parse`]), in canonical form.
    pub fn of_exact_json(value: &Json) -> Self {
        let mut h = Sha256::new();
        h.update(TAG_JSON);
        let mut canonical = Vec::new();
        value.write_canonical(&mut canonical);
        h.update(&canonical);
        Self(h.finalize().into())
    }

    /// [`Fingerprint::of_json_fields`] of a JSON value read exactly.
    pub fn of_exact_json_fields(value: &Json, pointers: &[&str]) -> Self {
        fields(pointers, |pointer| {
            value.pointer(pointer).map(|field| {
                let mut canonical = Vec::new();
                field.write_canonical(&mut canonical);
                canonical
            })
        })
    }

    /// The fingerprint of the serialised form of any `Serialize` value, canonicalised.
    pub fn of_serialize<T: serde::Serialize + ?Sized>(
        value: &T,
    ) -> Result<Self, serde_json::Error> {
        Ok(Self::of_json(&serde_json::to_value(value)?))
    }

    /// The fingerprint of only the fields of `value` named by JSON Pointers (RFC 6901, such as
    /// `/amount` or `/payee/iban`). The order of `pointers` does not matter; a field that is
    /// absent hashes differently from one that is `null`.
    pub fn of_json_fields(value: &Value, pointers: &[&str]) -> Self {
        fields(pointers, |pointer| {
            value.pointer(pointer).map(to_canonical_bytes)
        })
    }

    /// Starts a composite fingerprint.
    pub fn builder() -> FingerprintBuilder {
        FingerprintBuilder::tagged(TAG_PARTS)
    }

    /// Lower-case hexadecimal, 64 digits.
    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(64);
        self.write_hex(32, &mut s);
        s
    }

    /// Appends the first `bytes` bytes (at most 32) to `out` in lower-case hexadecimal: a
    /// prefix of [`Fingerprint::to_hex`], without a string of its own.
    pub fn write_hex(&self, bytes: usize, out: &mut String) {
        for &b in self.0.iter().take(bytes) {
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0xf)]));
        }
    }

    /// Parses 64 hexadecimal digits (either case).
    pub fn from_hex(text: &str) -> Result<Self, ParseFingerprintError> {
        let bytes = text.as_bytes();
        if bytes.len() != 64 {
            return Err(ParseFingerprintError);
        }
        let mut out = [0u8; 32];
        for (i, pair) in bytes.chunks_exact(2).enumerate() {
            out[i] = (nibble(pair[0])? << 4) | nibble(pair[1])?;
        }
        Ok(Self(out))
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

fn nibble(c: u8) -> Result<u8, ParseFingerprintError> {
    match c {
        b'0'..=b'9' => Ok(c - b'0'),
        b'a'..=b'f' => Ok(c - b'a' + 10),
        b'A'..=b'F' => Ok(c - b'A' + 10),
        _ => Err(ParseFingerprintError),
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", &self.to_hex()[..16])
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// The fingerprint of the fields at `pointers`, each found (as canonical JSON) by `find`.
fn fields(pointers: &[&str], find: impl Fn(&str) -> Option<Vec<u8>>) -> Fingerprint {
    let mut sorted: Vec<&str> = pointers.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut b = FingerprintBuilder::tagged(TAG_FIELDS);
    for pointer in sorted {
        b = b.part(pointer.as_bytes());
        b = match find(pointer) {
            Some(canonical) => b.part(b"present").part(&canonical),
            None => b.part(b"absent"),
        };
    }
    b.finish()
}

fn to_canonical_bytes(value: &Value) -> Vec<u8> {
    let mut canonical = Vec::new();
    write_canonical(&mut canonical, value);
    canonical
}

/// Builds a fingerprint from several parts; each part is length-prefixed.
#[derive(Clone)]
pub struct FingerprintBuilder(Sha256);

impl FingerprintBuilder {
    fn tagged(tag: &[u8]) -> Self {
        let mut h = Sha256::new();
        h.update(tag);
        Self(h)
    }

    /// Adds a part of raw bytes.
    #[must_use]
    pub fn part(mut self, bytes: &[u8]) -> Self {
        self.0.update((bytes.len() as u64).to_be_bytes());
        self.0.update(bytes);
        self
    }

    /// Adds a JSON value in canonical form.
    #[must_use]
    pub fn json(self, value: &Value) -> Self {
        self.part(&to_canonical_bytes(value))
    }

    /// Adds a JSON value read exactly ([`json::parse`]), in canonical form.
    #[must_use]
    pub fn exact_json(self, value: &Json) -> Self {
        let mut canonical = Vec::new();
        value.write_canonical(&mut canonical);
        self.part(&canonical)
    }

    /// Finishes the fingerprint.
    pub fn finish(self) -> Fingerprint {
        Fingerprint(self.0.finalize().into())
    }
}

/// Writes `value` in canonical JSON into `out`.
///
/// Canonical means: objects with their members sorted by key (byte order of UTF-8), no
/// whitespace, strings escaped as `serde_json` escapes them, and numbers by value: an integral
/// float within ±2^53 is written as an integer, so `1`, `1.0` and `1e0` are one value.
pub fn write_canonical<W: Write>(out: &mut W, value: &Value) {
    // Writing into a hasher or a Vec cannot fail.
    let _ = write_value(out, value);
}

/// The canonical JSON text of `value` (see [`write_canonical`]).
pub fn to_canonical_string(value: &Value) -> String {
    let mut out = Vec::new();
    write_canonical(&mut out, value);
    String::from_utf8(out).unwrap_or_default()
}

const MAX_EXACT_INT: f64 = 9_007_199_254_740_992.0; // 2^53

fn write_value<W: Write>(out: &mut W, value: &Value) -> io::Result<()> {
    match value {
        Value::Null => out.write_all(b"null"),
        Value::Bool(true) => out.write_all(b"true"),
        Value::Bool(false) => out.write_all(b"false"),
        Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() && f.fract() == 0.0 && f.abs() <= MAX_EXACT_INT => {
                // Exact: |f| <= 2^53 and integral, so the conversion loses nothing.
                #[allow(clippy::cast_possible_truncation)]
                let i = f as i64;
                write!(out, "{i}")
            }
            _ => write!(out, "{n}"),
        },
        Value::String(s) => serde_json::to_writer(&mut *out, s).map_err(io::Error::other),
        Value::Array(items) => {
            out.write_all(b"[")?;
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.write_all(b",")?;
                }
                write_value(out, item)?;
            }
            out.write_all(b"]")
        }
        Value::Object(map) => {
            let mut members: Vec<(&String, &Value)> = map.iter().collect();
            members.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.write_all(b"{")?;
            for (i, (k, v)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.write_all(b",")?;
                }
                serde_json::to_writer(&mut *out, k).map_err(io::Error::other)?;
                out.write_all(b":")?;
                write_value(out, v)?;
            }
            out.write_all(b"}")
        }
    }
}

struct HashWriter(Sha256);

impl Write for HashWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn canonical_json_ignores_order_and_whitespace() {
        let a = Fingerprint::of_json_str(r#"{"b": [1, {"y":2,"x":1}], "a": "s"}"#).unwrap();
        let b = Fingerprint::of_json_str("{\n \"a\":\"s\",\"b\":[1,{\"x\":1,\"y\":2}]}").unwrap();
        assert_eq!(a, b);
        assert_eq!(
            to_canonical_string(&json!({"b":1,"a":[true,null]})),
            r#"{"a":[true,null],"b":1}"#
        );
    }

    #[test]
    fn canonical_json_numbers_by_value() {
        let a = Fingerprint::of_json_str(r#"{"n":1}"#).unwrap();
        assert_eq!(a, Fingerprint::of_json_str(r#"{"n":1.0}"#).unwrap());
        assert_eq!(a, Fingerprint::of_json_str(r#"{"n":1e0}"#).unwrap());
        assert_ne!(a, Fingerprint::of_json_str(r#"{"n":1.5}"#).unwrap());
        assert_ne!(a, Fingerprint::of_json_str(r#"{"n":"1"}"#).unwrap());
    }

    #[test]
    fn canonical_json_keeps_array_order_and_values() {
        assert_ne!(
            Fingerprint::of_json(&json!([1, 2])),
            Fingerprint::of_json(&json!([2, 1]))
        );
        assert_ne!(
            Fingerprint::of_json(&json!({"a":1})),
            Fingerprint::of_json(&json!({"a":2}))
        );
    }

    #[test]
    fn modes_are_domain_separated() {
        assert_ne!(
            Fingerprint::of_bytes(br#"{"a":1}"#),
            Fingerprint::of_json(&json!({"a":1}))
        );
    }

    #[test]
    fn selected_fields_ignore_the_rest() {
        let a = json!({"amount": 10, "to": {"iban": "X"}, "request_time": 1});
        let b = json!({"request_time": 2, "to": {"iban": "X", "note": "hi"}, "amount": 10.0});
        let fields = ["/amount", "/to/iban"];
        assert_eq!(
            Fingerprint::of_json_fields(&a, &fields),
            Fingerprint::of_json_fields(&b, &["/to/iban", "/amount"])
        );
        let c = json!({"amount": 11, "to": {"iban": "X"}});
        assert_ne!(
            Fingerprint::of_json_fields(&a, &fields),
            Fingerprint::of_json_fields(&c, &fields)
        );
        // absent differs from null
        assert_ne!(
            Fingerprint::of_json_fields(&json!({}), &["/a"]),
            Fingerprint::of_json_fields(&json!({"a": null}), &["/a"])
        );
    }

    #[test]
    fn builder_parts_are_unambiguous() {
        let ab_c = Fingerprint::builder().part(b"ab").part(b"c").finish();
        let a_bc = Fingerprint::builder().part(b"a").part(b"bc").finish();
        assert_ne!(ab_c, a_bc);
    }

    /// Stored records hold these digests: a change of hash library must not change a byte.
    /// The expected values are `sha256sum` of the tag followed by the (canonical) input.
    #[test]
    fn digests_are_plain_sha256_of_tag_and_input() {
        assert_eq!(
            Fingerprint::of_bytes(b"hello").to_hex(),
            "415778691c746335e06cd88310679962d6762405efebdea67f365bfa683eab3d"
        );
        assert_eq!(
            Fingerprint::of_json(&json!({"b": 1, "a": [1.0, "x"]})).to_hex(),
            "527826dcd7f659c3f5b01b06e00bced0034e18fb9a81d9e8f59a9ef273aa5ead"
        );
    }

    #[test]
    fn hex_round_trip_and_rejects_garbage() {
        let fp = Fingerprint::of_bytes(b"x");
        assert_eq!(Fingerprint::from_hex(&fp.to_hex()), Ok(fp));
        assert_eq!(Fingerprint::from_hex(&fp.to_hex().to_uppercase()), Ok(fp));
        assert!(Fingerprint::from_hex("zz").is_err());
        assert!(Fingerprint::from_hex(&"g".repeat(64)).is_err());
    }

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|i| json!(i)),
            (-1e6f64..1e6).prop_map(|f| json!(f)),
            "\\PC{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                proptest::collection::btree_map("\\PC{0,6}", inner, 0..5)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn canonical_form_is_stable_under_reformatting(v in arb_json()) {
            let pretty = serde_json::to_string_pretty(&v).unwrap();
            let reparsed: Value = serde_json::from_str(&pretty).unwrap();
            prop_assert_eq!(Fingerprint::of_json(&v), Fingerprint::of_json(&reparsed));
            // the canonical text is itself valid JSON with the same canonical form
            let canon = to_canonical_string(&v);
            let again: Value = serde_json::from_str(&canon).unwrap();
            prop_assert_eq!(to_canonical_string(&again), canon);
        }
    }
}
