//! The bit layout of a Snowflake id.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How a Snowflake id's 63 bits (the sign bit is always 0) split into a millisecond timestamp
/// since a custom epoch, a worker id and a per-millisecond sequence.
///
/// ```
/// let layout = idem_id::Layout::default();
/// assert_eq!((layout.timestamp_bits(), layout.worker_bits(), layout.sequence_bits()), (41, 10, 12));
/// let id = layout.encode(1_000, 7, 3).unwrap();
/// assert_eq!(layout.decode(id), idem_id::Parts { millis: 1_000, worker: 7, sequence: 3 });
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    timestamp_bits: u8,
    worker_bits: u8,
    sequence_bits: u8,
    /// Milliseconds since the Unix epoch at which the timestamp field is zero.
    epoch_ms: u64,
}

/// The fields of an id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parts {
    /// Milliseconds since the layout's epoch.
    pub millis: u64,
    /// The worker id.
    pub worker: u64,
    /// The sequence within the millisecond.
    pub sequence: u64,
}

/// A layout, or a value for it, that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// The fields do not add up to 63 bits, or one is too small to be useful.
    #[error(
        "a layout needs timestamp + worker + sequence = 63 bits, with at least 31 timestamp, 1 worker \
         and 1 sequence bits (got {timestamp} + {worker} + {sequence})"
    )]
    Bits {
        /// Timestamp bits asked for.
        timestamp: u8,
        /// Worker bits asked for.
        worker: u8,
        /// Sequence bits asked for.
        sequence: u8,
    },
    /// The epoch is in the future, or before 1970.
    #[error("the epoch must lie between 1970 and now")]
    Epoch,
    /// A field's value does not fit its bits.
    #[error("{field} {value} does not fit in {bits} bits (at most {max})")]
    TooLarge {
        /// Which field.
        field: &'static str,
        /// The value given.
        value: u64,
        /// The field's width.
        bits: u8,
        /// The largest value that fits.
        max: u64,
    },
    /// The time is before the layout's epoch.
    #[error("the time is before the layout's epoch")]
    BeforeEpoch,
}

/// 2025-01-01T00:00:00Z, the default epoch: 41 bits of milliseconds from it last until 2094.
pub const DEFAULT_EPOCH_MS: u64 = 1_735_689_600_000;

impl Default for Layout {
    /// 41 timestamp bits from 2025-01-01, 10 worker bits (1,024 workers), 12 sequence bits
    /// (4,096 ids per millisecond per worker).
    fn default() -> Self {
        Self {
            timestamp_bits: 41,
            worker_bits: 10,
            sequence_bits: 12,
            epoch_ms: DEFAULT_EPOCH_MS,
        }
    }
}

impl Layout {
    /// A layout of `timestamp_bits + worker_bits + sequence_bits = 63`, timestamps counted
    /// from `epoch`.
    pub fn new(
        timestamp_bits: u8,
        worker_bits: u8,
        sequence_bits: u8,
        epoch: SystemTime,
    ) -> Result<Self, LayoutError> {
        let bits = LayoutError::Bits {
            timestamp: timestamp_bits,
            worker: worker_bits,
            sequence: sequence_bits,
        };
        let total = u16::from(timestamp_bits) + u16::from(worker_bits) + u16::from(sequence_bits);
        // 31 bits of milliseconds are 24 days: anything shorter runs out in testing.
        if total != 63 || timestamp_bits < 31 || worker_bits == 0 || sequence_bits == 0 {
            return Err(bits);
        }
        let epoch_ms = epoch
            .duration_since(UNIX_EPOCH)
            .ok()
            .filter(|_| epoch <= SystemTime::now())
            .and_then(|d| u64::try_from(d.as_millis()).ok())
            .ok_or(LayoutError::Epoch)?;
        Ok(Self {
            timestamp_bits,
            worker_bits,
            sequence_bits,
            epoch_ms,
        })
    }

    /// Bits of the timestamp.
    pub const fn timestamp_bits(&self) -> u8 {
        self.timestamp_bits
    }

    /// Bits of the worker id.
    pub const fn worker_bits(&self) -> u8 {
        self.worker_bits
    }

    /// Bits of the sequence.
    pub const fn sequence_bits(&self) -> u8 {
        self.sequence_bits
    }

    /// The epoch, in milliseconds since 1970.
    pub const fn epoch_ms(&self) -> u64 {
        self.epoch_ms
    }

    /// The largest worker id.
    pub const fn max_worker(&self) -> u64 {
        (1 << self.worker_bits) - 1
    }

    /// The largest sequence number.
    pub const fn max_sequence(&self) -> u64 {
        (1 << self.sequence_bits) - 1
    }

    /// The largest timestamp, in milliseconds since the epoch.
    pub const fn max_millis(&self) -> u64 {
        (1 << self.timestamp_bits) - 1
    }

    /// Ids per second one worker can issue at most.
    pub const fn ids_per_second(&self) -> u64 {
        (self.max_sequence() + 1) * 1000
    }

    /// The instant after which the timestamp no longer fits: the layout is exhausted.
    pub fn exhausted_at(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.epoch_ms.saturating_add(self.max_millis()))
    }

    /// Milliseconds since this layout's epoch at `t`.
    pub fn millis_at(&self, t: SystemTime) -> Result<u64, LayoutError> {
        let ms = t
            .duration_since(UNIX_EPOCH)
            .ok()
            .and_then(|d| u64::try_from(d.as_millis()).ok())
            .ok_or(LayoutError::BeforeEpoch)?;
        ms.checked_sub(self.epoch_ms)
            .ok_or(LayoutError::BeforeEpoch)
    }

    /// The id of these fields; each must fit its bits. The result is never negative as an
    /// `i64`.
    pub fn encode(&self, millis: u64, worker: u64, sequence: u64) -> Result<u64, LayoutError> {
        let check = |field, value: u64, bits: u8, max: u64| {
            if value > max {
                Err(LayoutError::TooLarge {
                    field,
                    value,
                    bits,
                    max,
                })
            } else {
                Ok(())
            }
        };
        check("timestamp", millis, self.timestamp_bits, self.max_millis())?;
        check("worker", worker, self.worker_bits, self.max_worker())?;
        check(
            "sequence",
            sequence,
            self.sequence_bits,
            self.max_sequence(),
        )?;
        Ok(self.pack(millis, worker, sequence))
    }

    /// Packs fields already known to fit.
    pub(crate) const fn pack(&self, millis: u64, worker: u64, sequence: u64) -> u64 {
        (millis << (self.worker_bits + self.sequence_bits))
            | (worker << self.sequence_bits)
            | sequence
    }

    /// The fields of `id`.
    pub const fn decode(&self, id: u64) -> Parts {
        Parts {
            millis: (id >> (self.worker_bits + self.sequence_bits)) & self.max_millis(),
            worker: (id >> self.sequence_bits) & self.max_worker(),
            sequence: id & self.max_sequence(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_default_layout_lasts_until_2094() {
        let layout = Layout::default();
        let years = layout
            .exhausted_at()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs()
            / (365 * 24 * 3600);
        assert_eq!(1970 + years, 2094);
        assert_eq!(layout.ids_per_second(), 4_096_000);
    }

    #[test]
    fn bad_layouts_and_values_are_refused() {
        let now = SystemTime::now();
        assert!(Layout::new(41, 10, 12, now).is_ok());
        for (t, w, s) in [
            (41, 10, 13),
            (30, 20, 13),
            (41, 0, 22),
            (41, 22, 0),
            (63, 0, 0),
        ] {
            assert!(
                matches!(Layout::new(t, w, s, now), Err(LayoutError::Bits { .. })),
                "{t}+{w}+{s}"
            );
        }
        let future = now + Duration::from_secs(3600);
        assert_eq!(Layout::new(41, 10, 12, future), Err(LayoutError::Epoch));
        let layout = Layout::default();
        assert!(matches!(
            layout.encode(0, 1024, 0),
            Err(LayoutError::TooLarge {
                field: "worker",
                ..
            })
        ));
        assert!(matches!(
            layout.encode(0, 0, 4096),
            Err(LayoutError::TooLarge {
                field: "sequence",
                ..
            })
        ));
        assert!(layout.encode(1 << 41, 0, 0).is_err());
        assert_eq!(layout.millis_at(UNIX_EPOCH), Err(LayoutError::BeforeEpoch));
    }

    fn layouts() -> impl Strategy<Value = Layout> {
        (31u8..=61, 1u8..=31).prop_filter_map("fields add up to 63", |(t, w)| {
            let s = 63u8.checked_sub(t + w).filter(|s| *s >= 1)?;
            Layout::new(
                t,
                w,
                s,
                UNIX_EPOCH + Duration::from_millis(DEFAULT_EPOCH_MS),
            )
            .ok()
        })
    }

    proptest! {
        #[test]
        fn encode_then_decode_gives_the_fields_back(
            layout in layouts(), m in any::<u64>(), w in any::<u64>(), s in any::<u64>()
        ) {
            let (m, w, s) = (m & layout.max_millis(), w & layout.max_worker(), s & layout.max_sequence());
            let id = layout.encode(m, w, s).unwrap();
            prop_assert!(i64::try_from(id).is_ok(), "negative id");
            prop_assert_eq!(layout.decode(id), Parts { millis: m, worker: w, sequence: s });
        }

        #[test]
        fn ids_order_by_time_then_worker_then_sequence(
            layout in layouts(),
            a in (any::<u64>(), any::<u64>(), any::<u64>()),
            b in (any::<u64>(), any::<u64>(), any::<u64>()),
        ) {
            let fit = |(m, w, s): (u64, u64, u64)| {
                (m & layout.max_millis(), w & layout.max_worker(), s & layout.max_sequence())
            };
            let (a, b) = (fit(a), fit(b));
            let ida = layout.encode(a.0, a.1, a.2).unwrap();
            let idb = layout.encode(b.0, b.1, b.2).unwrap();
            prop_assert_eq!(ida.cmp(&idb), a.cmp(&b));
        }
    }
}
