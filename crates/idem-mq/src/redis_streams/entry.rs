//! Reading the server's answers: stream entries, and the pending list.
//!
//! By hand rather than through redis-rs's `StreamReadReply`, which copies every field name
//! into a `String` key of a `HashMap`: here an entry keeps its fields in order, binary, and the
//! body is moved out of the answer without a copy.

use bytes::Bytes;
use redis::Value;

use super::bytes;
use crate::MqError;

/// One entry of a stream: its id and its fields, in order.
#[derive(Debug)]
pub(super) struct Entry {
    pub(super) id: String,
    pub(super) fields: Vec<(Bytes, Bytes)>,
}

/// One line of the extended `XPENDING` answer: an entry's id and how many times it was
/// delivered.
#[derive(Debug)]
pub(super) struct Pending {
    pub(super) id: String,
    pub(super) deliveries: u64,
}

fn malformed(what: &str) -> MqError {
    MqError::Broker {
        message: format!("the server's answer to {what} is not what Redis sends"),
        source: None,
    }
}

fn text(value: Value) -> Option<String> {
    match value {
        Value::BulkString(b) => String::from_utf8(b).ok(),
        Value::SimpleString(s) => Some(s),
        _ => None,
    }
}

fn array(value: Value) -> Option<Vec<Value>> {
    match value {
        Value::Array(items) | Value::Set(items) => Some(items),
        _ => None,
    }
}

/// The entries of an `XREADGROUP` answer for one stream (RESP2: `[[stream, entries]]`;
/// RESP3: `{stream: entries}`); none when the read timed out (`nil`).
pub(super) fn read_reply(value: Value) -> Result<Vec<Entry>, MqError> {
    let what = "XREADGROUP";
    let per_stream = match value {
        Value::Nil => return Ok(Vec::new()),
        Value::Map(pairs) => pairs.into_iter().map(|(_, v)| v).collect::<Vec<_>>(),
        Value::Array(streams) => streams
            .into_iter()
            .map(|s| {
                let mut pair = array(s).ok_or_else(|| malformed(what))?;
                if pair.len() != 2 {
                    return Err(malformed(what));
                }
                Ok(pair.swap_remove(1))
            })
            .collect::<Result<Vec<_>, _>>()?,
        _ => return Err(malformed(what)),
    };
    let mut out = Vec::new();
    for entries in per_stream {
        out.extend(entries_of(entries, what)?);
    }
    Ok(out)
}

/// A list of entries (`[[id, [field, value, …]], …]`). An entry whose fields are `nil` (it was
/// deleted while pending) comes back with no fields.
pub(super) fn entries_of(value: Value, what: &str) -> Result<Vec<Entry>, MqError> {
    let items = array(value).ok_or_else(|| malformed(what))?;
    items
        .into_iter()
        // An entry deleted from the stream while pending: `XCLAIM` answers `nil` for it on
        // servers before 7.0 (later ones leave it out).
        .filter(|item| *item != Value::Nil)
        .map(|item| entry(item, what))
        .collect()
}

fn entry(value: Value, what: &str) -> Result<Entry, MqError> {
    let mut parts = array(value).ok_or_else(|| malformed(what))?.into_iter();
    let id = parts.next().and_then(text).ok_or_else(|| malformed(what))?;
    let fields = match parts.next() {
        None | Some(Value::Nil) => Vec::new(),
        Some(Value::Map(pairs)) => pairs
            .into_iter()
            .map(|(k, v)| Some((bytes(k)?, bytes(v)?)))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| malformed(what))?,
        Some(flat) => {
            let flat = array(flat).ok_or_else(|| malformed(what))?;
            if flat.len() % 2 != 0 {
                return Err(malformed(what));
            }
            let mut fields = Vec::with_capacity(flat.len() / 2);
            let mut flat = flat.into_iter();
            while let (Some(k), Some(v)) = (flat.next(), flat.next()) {
                fields.push((
                    bytes(k).ok_or_else(|| malformed(what))?,
                    bytes(v).ok_or_else(|| malformed(what))?,
                ));
            }
            fields
        }
    };
    Ok(Entry { id, fields })
}

/// The extended `XPENDING` answer: `[[id, consumer, idle ms, deliveries], …]`.
pub(super) fn pending_reply(value: Value) -> Result<Vec<Pending>, MqError> {
    let what = "XPENDING";
    let items = array(value).ok_or_else(|| malformed(what))?;
    items
        .into_iter()
        .map(|item| {
            let mut parts = array(item).ok_or_else(|| malformed(what))?.into_iter();
            let id = parts.next().and_then(text).ok_or_else(|| malformed(what))?;
            let deliveries = match parts.nth(2) {
                Some(Value::Int(n)) => u64::try_from(n).unwrap_or(0),
                _ => return Err(malformed(what)),
            };
            Ok(Pending { id, deliveries })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn entries_are_read_in_order_from_either_protocol() {
        let resp2 = Value::Array(vec![Value::Array(vec![
            bulk("orders"),
            Value::Array(vec![
                Value::Array(vec![
                    bulk("1-0"),
                    Value::Array(vec![
                        bulk("message_id"),
                        bulk("a"),
                        bulk("payload"),
                        bulk("x"),
                    ]),
                ]),
                Value::Array(vec![bulk("2-0"), Value::Nil]),
            ]),
        ])]);
        let entries = read_reply(resp2).expect("read");
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].id, "1-0");
        assert_eq!(
            entries[0].fields,
            vec![
                (Bytes::from("message_id"), Bytes::from("a")),
                (Bytes::from("payload"), Bytes::from("x"))
            ]
        );
        assert!(
            entries[1].fields.is_empty(),
            "a deleted entry has no fields"
        );

        let resp3 = Value::Map(vec![(
            bulk("orders"),
            Value::Array(vec![Value::Array(vec![
                bulk("3-0"),
                Value::Map(vec![(bulk("payload"), bulk("y"))]),
            ])]),
        )]);
        let entries = read_reply(resp3).expect("read");
        assert_eq!(entries[0].id, "3-0");
        assert_eq!(entries[0].fields[0].1, Bytes::from("y"));

        assert!(read_reply(Value::Nil).expect("a timed-out read").is_empty());
    }

    #[test]
    fn a_malformed_answer_is_an_error_not_a_panic() {
        assert!(read_reply(Value::Int(3)).is_err());
        let odd = Value::Array(vec![Value::Array(vec![
            bulk("s"),
            Value::Array(vec![Value::Array(vec![
                bulk("1-0"),
                Value::Array(vec![bulk("lonely")]),
            ])]),
        ])]);
        assert!(read_reply(odd).is_err());
        assert!(pending_reply(Value::Array(vec![Value::Array(vec![bulk("1-0")])])).is_err());
    }

    #[test]
    fn pending_lines_give_the_delivery_count() {
        let answer = Value::Array(vec![Value::Array(vec![
            bulk("5-1"),
            bulk("c1"),
            Value::Int(61_000),
            Value::Int(3),
        ])]);
        let pending = pending_reply(answer).expect("read");
        assert_eq!(pending[0].id, "5-1");
        assert_eq!(pending[0].deliveries, 3);
    }
}
