//! A guarded request's fingerprint: what makes two requests with one key "the same request".

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use idem_core::Fingerprint;
use idem_core::json::{self, JsonError};
use idem_wire::ProblemCode;

use crate::problem::{Problem, ToProblem as _};

use crate::policy::Policy;

/// Method, path, query, the selected headers, and the body: canonical JSON when it is JSON
/// (so key order and spacing do not matter, and every number counts as written), only the
/// selected fields if the policy names some, the raw bytes otherwise. A JSON body that names
/// a member twice has no one meaning (servers keep one or the other), so it is refused.
pub(crate) fn fingerprint(
    policy: &Policy,
    parts: &http::request::Parts,
    body: &Bytes,
) -> Result<Fingerprint, Problem> {
    let mut fp = Fingerprint::builder()
        .part(b"idem-http/2")
        .part(parts.method.as_str().as_bytes())
        .part(parts.uri.path().as_bytes())
        .part(parts.uri.query().unwrap_or("").as_bytes());
    fp = with_headers(fp, policy, parts);
    let json = if parts
        .headers
        .get(CONTENT_TYPE)
        .is_some_and(|ct| is_json(ct.as_bytes()))
    {
        match json::parse(body) {
            Ok(v) => Some(v),
            Err(JsonError::DuplicateMember { .. }) => {
                return Err(ProblemCode::MalformedJson.problem(
                    "An object in the JSON body names one member twice, which servers read \
                     differently; send each member once.",
                ));
            }
            // Not JSON after all: fingerprinted by its bytes.
            Err(_) => None,
        }
    } else {
        None
    };
    fp = match (json, &policy.fingerprint_json_fields) {
        (Some(v), Some(fields)) => {
            let pointers: Vec<&str> = fields.iter().map(String::as_str).collect();
            fp.part(b"json-fields").part(
                Fingerprint::of_exact_json_fields(&v, &pointers)
                    .to_hex()
                    .as_bytes(),
            )
        }
        (Some(v), None) => fp.part(b"json").exact_json(&v),
        (None, _) => fp.part(b"bytes").part(body),
    };
    Ok(fp.finish())
}

/// A gRPC call's fingerprint: its method path, the selected metadata, and the request
/// message's bytes (with its frame head).
#[cfg(feature = "grpc")]
pub(crate) fn grpc_fingerprint(
    policy: &Policy,
    parts: &http::request::Parts,
    body: &Bytes,
) -> Fingerprint {
    let fp = Fingerprint::builder()
        .part(b"idem-grpc/1")
        .part(parts.uri.path().as_bytes());
    with_headers(fp, policy, parts).part(body).finish()
}

/// The policy's fingerprinted headers (or metadata), each with all its values.
fn with_headers(
    mut fp: idem_core::FingerprintBuilder,
    policy: &Policy,
    parts: &http::request::Parts,
) -> idem_core::FingerprintBuilder {
    for name in &policy.fingerprint_headers {
        let values = parts.headers.get_all(name);
        // The count frames the values, so no split of values between headers collides.
        let count = values.iter().count() as u64;
        fp = fp.part(name.as_str().as_bytes()).part(&count.to_be_bytes());
        for value in values {
            fp = fp.part(value.as_bytes());
        }
    }
    fp
}

/// `application/json`, or any `+json` type, with or without parameters.
fn is_json(content_type: &[u8]) -> bool {
    let essence = content_type
        .split(|&b| b == b';')
        .next()
        .unwrap_or_default()
        .trim_ascii();
    essence.eq_ignore_ascii_case(b"application/json")
        || essence.len() >= 5 && essence[essence.len() - 5..].eq_ignore_ascii_case(b"+json")
}
