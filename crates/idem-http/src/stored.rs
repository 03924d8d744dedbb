//! How an HTTP answer is kept in a record.
//!
//! A small length-prefixed binary layout, written by hand: it stores bodies as they are (JSON
//! would need base64 and grow them by a third) and it is a few dozen lines. Every stored
//! value starts with a version tag so a later layout can read old records.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use idem_core::Timestamp;

const TAG: &[u8; 4] = b"IDH1";
const RESPONSE: u8 = 0;
const UNKNOWN: u8 = 1;
const TOO_LARGE: u8 = 2;
/// An answer with trailers (a gRPC answer's status, or an HTTP answer's trailer fields): as
/// [`RESPONSE`], with the trailer fields after the header fields. An answer without trailers
/// keeps [`RESPONSE`]'s layout.
const RESPONSE_WITH_TRAILERS: u8 = 3;

/// What a completed HTTP record holds.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(
    clippy::large_enum_variant,
    reason = "one value per request, read once: boxing the answer would only add an allocation"
)]
pub(crate) enum Stored {
    /// The answer to replay.
    Response {
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
        /// Empty when the answer had none.
        trailers: HeaderMap,
    },
    /// The request may or may not have taken effect. `until`: when a retry may run it again
    /// (`None`: never by itself).
    Unknown { until: Option<Timestamp> },
    /// The answer was delivered but was too large to keep.
    TooLarge { status: StatusCode },
}

/// A stored value that is not in this layout.
#[derive(Debug, thiserror::Error)]
#[error("the stored HTTP response is corrupt")]
pub(crate) struct Corrupt;

impl Stored {
    /// The stored form. An answer's body is its last bytes, so the body can be handed on as a
    /// slice of it rather than kept beside it.
    pub(crate) fn encode(&self) -> Bytes {
        let body_len = match self {
            Self::Response { body, .. } => body.len(),
            _ => 0,
        };
        // Room for the body and a typical head at once: no copy as it grows.
        let mut out = BytesMut::with_capacity(body_len + 512);
        out.put_slice(TAG);
        match self {
            Self::Response {
                status,
                headers,
                body,
                trailers,
            } => {
                out.put_u8(if trailers.is_empty() {
                    RESPONSE
                } else {
                    RESPONSE_WITH_TRAILERS
                });
                out.put_u16(status.as_u16());
                put_fields(&mut out, headers);
                if !trailers.is_empty() {
                    put_fields(&mut out, trailers);
                }
                out.put_slice(body);
            }
            Self::Unknown { until } => {
                out.put_u8(UNKNOWN);
                out.put_u64(until.map_or(0, Timestamp::as_millis));
            }
            Self::TooLarge { status } => {
                out.put_u8(TOO_LARGE);
                out.put_u16(status.as_u16());
            }
        }
        out.freeze()
    }

    pub(crate) fn decode(mut b: Bytes) -> Result<Self, Corrupt> {
        if b.len() < 5 || &b[..4] != TAG {
            return Err(Corrupt);
        }
        b.advance(4);
        match b.get_u8() {
            tag @ (RESPONSE | RESPONSE_WITH_TRAILERS) => {
                let status = status(get_u16(&mut b)?)?;
                let headers = get_fields(&mut b)?;
                let trailers = if tag == RESPONSE_WITH_TRAILERS {
                    get_fields(&mut b)?
                } else {
                    HeaderMap::new()
                };
                Ok(Self::Response {
                    status,
                    headers,
                    body: b,
                    trailers,
                })
            }
            UNKNOWN if b.len() == 8 => {
                let until = b.get_u64();
                Ok(Self::Unknown {
                    until: (until != 0).then(|| Timestamp::from_millis(until)),
                })
            }
            TOO_LARGE if b.len() == 2 => Ok(Self::TooLarge {
                status: status(b.get_u16())?,
            }),
            _ => Err(Corrupt),
        }
    }
}

/// What a stored value is, told from its first bytes alone (a listing's response head): the
/// kind of answer and its status, without the headers and body.
pub(crate) fn kind_of_head(head: &[u8]) -> Option<Stored> {
    let rest = head.strip_prefix(TAG.as_slice())?;
    let (&tag, rest) = rest.split_first()?;
    let u16_at = |b: &[u8]| Some(u16::from_be_bytes([*b.first()?, *b.get(1)?]));
    match tag {
        RESPONSE | RESPONSE_WITH_TRAILERS => Some(Stored::Response {
            status: status(u16_at(rest)?).ok()?,
            headers: HeaderMap::new(),
            body: Bytes::new(),
            trailers: HeaderMap::new(),
        }),
        UNKNOWN => {
            let until = u64::from_be_bytes(rest.get(..8)?.try_into().ok()?);
            Some(Stored::Unknown {
                until: (until != 0).then(|| Timestamp::from_millis(until)),
            })
        }
        TOO_LARGE => Some(Stored::TooLarge {
            status: status(u16_at(rest)?).ok()?,
        }),
        _ => None,
    }
}

/// The first bytes of every stored unknown outcome.
pub(crate) const UNKNOWN_PREFIX: [u8; 5] = [TAG[0], TAG[1], TAG[2], TAG[3], UNKNOWN];

fn put_fields(out: &mut BytesMut, fields: &HeaderMap) {
    // `HeaderMap` holds at most 32768 entries, so the count fits.
    out.put_u16(u16::try_from(fields.len()).unwrap_or(u16::MAX));
    for (name, value) in fields.iter().take(usize::from(u16::MAX)) {
        put_field(out, name.as_str().as_bytes());
        put_field(out, value.as_bytes());
    }
}

fn get_fields(b: &mut Bytes) -> Result<HeaderMap, Corrupt> {
    let count = get_u16(b)?;
    // `try_`: a corrupt count or too many fields is an error, never a panic.
    let mut fields = HeaderMap::try_with_capacity(usize::from(count)).map_err(|_| Corrupt)?;
    for _ in 0..count {
        let name = HeaderName::from_bytes(&get_field(b)?).map_err(|_| Corrupt)?;
        let value = HeaderValue::from_maybe_shared(get_field(b)?).map_err(|_| Corrupt)?;
        fields.try_append(name, value).map_err(|_| Corrupt)?;
    }
    Ok(fields)
}

fn put_field(out: &mut BytesMut, v: &[u8]) {
    // Header names and values are far below 4 GiB: hyper limits a whole head to far less.
    out.put_u32(u32::try_from(v.len()).unwrap_or(u32::MAX));
    out.put_slice(v);
}

fn get_u16(b: &mut Bytes) -> Result<u16, Corrupt> {
    if b.len() < 2 {
        return Err(Corrupt);
    }
    Ok(b.get_u16())
}

fn get_field(b: &mut Bytes) -> Result<Bytes, Corrupt> {
    if b.len() < 4 {
        return Err(Corrupt);
    }
    let len = usize::try_from(b.get_u32()).map_err(|_| Corrupt)?;
    if b.len() < len {
        return Err(Corrupt);
    }
    Ok(b.split_to(len))
}

fn status(code: u16) -> Result<StatusCode, Corrupt> {
    StatusCode::from_u16(code).map_err(|_| Corrupt)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.append("x-multi", HeaderValue::from_static("a"));
        headers.append("x-multi", HeaderValue::from_static("b"));
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        trailers.append("x-t", HeaderValue::from_static("1"));
        for s in [
            Stored::Response {
                status: StatusCode::CREATED,
                headers: headers.clone(),
                body: Bytes::from_static(b"{\"id\":1}\0\xff"),
                trailers: HeaderMap::new(),
            },
            Stored::Response {
                status: StatusCode::NO_CONTENT,
                headers: HeaderMap::new(),
                body: Bytes::new(),
                trailers: HeaderMap::new(),
            },
            Stored::Response {
                status: StatusCode::OK,
                headers,
                body: Bytes::from_static(b"\0\0\0\0\x02hi"),
                trailers: trailers.clone(),
            },
            Stored::Response {
                status: StatusCode::OK,
                headers: HeaderMap::new(),
                body: Bytes::new(),
                trailers,
            },
            Stored::Unknown { until: None },
            Stored::Unknown {
                until: Some(Timestamp::from_millis(42)),
            },
            Stored::TooLarge {
                status: StatusCode::OK,
            },
        ] {
            assert_eq!(Stored::decode(s.encode()).unwrap(), s);
        }
    }

    #[test]
    fn a_head_tells_the_kind_of_answer() {
        let until = Some(Timestamp::from_millis(1_234));
        for stored in [
            Stored::Response {
                status: StatusCode::CREATED,
                headers: HeaderMap::new(),
                body: Bytes::from(vec![7; 100]),
                trailers: HeaderMap::new(),
            },
            Stored::Unknown { until },
            Stored::Unknown { until: None },
            Stored::TooLarge {
                status: StatusCode::OK,
            },
        ] {
            let bytes = stored.encode();
            let head = &bytes[..bytes.len().min(32)];
            let kind = kind_of_head(head).unwrap();
            match (&stored, kind) {
                (Stored::Response { status, .. }, Stored::Response { status: s, .. }) => {
                    assert_eq!(*status, s);
                }
                (a, b) if matches!(a, Stored::Response { .. }) => panic!("{a:?} read as {b:?}"),
                (a, b) => assert_eq!(*a, b),
            }
        }
        assert!(
            Stored::Unknown { until }
                .encode()
                .starts_with(&UNKNOWN_PREFIX)
        );
        for bad in [
            &b""[..],
            b"IDH1",
            b"IDH1\x00\x00",
            b"XXXX\x00\x00\xc8",
            b"IDH1\x09",
        ] {
            assert_eq!(kind_of_head(bad), None);
        }
    }

    #[test]
    fn corrupt_values_are_refused() {
        let good = Stored::TooLarge {
            status: StatusCode::OK,
        }
        .encode();
        for bad in [
            &b""[..],
            b"IDH1",
            b"IDH2\x02\x00\xc8",
            b"IDH1\x09",
            b"IDH1\x02\x00",
            b"IDH1\x00\x00\xc8\x00\x01\x00\x00\x00\x09ab",
            b"IDH1\x00\x03\xe8\x00\x00",
            b"IDH1\x00\x00\xc8\xff\xff",
            b"IDH1\x03\x00\xc8\x00\x00",
            b"IDH1\x03\x00\xc8\x00\x00\x00\x02",
        ] {
            assert!(
                Stored::decode(Bytes::copy_from_slice(bad)).is_err(),
                "{bad:?}"
            );
        }
        let mut truncated = good.to_vec();
        truncated.pop();
        assert!(Stored::decode(Bytes::from(truncated)).is_err());
    }
}
