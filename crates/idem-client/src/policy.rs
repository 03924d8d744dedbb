//! How many times, and how far apart, a call is tried.

use std::time::Duration;

/// How many attempts a call gets and how long the pauses between them are.
///
/// Pauses follow exponential backoff with full jitter: before retry `n` the client sleeps a
/// random time between zero and `min(max_delay, base_delay × 2ⁿ⁻¹)`, so that many clients
/// failing at once do not come back at once. An answer with `Retry-After` is waited for
/// instead: never less than the server asked, plus up to `base_delay` of jitter; a server that
/// asks for longer than [`RetryPolicy::max_retry_after`] ends the retries. No pause starts that
/// would end after the call's [`total_time`](RetryPolicy::total_time).
///
/// The default: 5 attempts, backoff from 200 ms up to 10 s, 60 s in all, `Retry-After` up to
/// 60 s.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    pub(crate) attempts: u32,
    pub(crate) base_delay: Duration,
    pub(crate) max_delay: Duration,
    pub(crate) total_time: Duration,
    pub(crate) max_retry_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            attempts: 5,
            base_delay: Duration::from_millis(200),
            max_delay: Duration::from_secs(10),
            total_time: Duration::from_secs(60),
            max_retry_after: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// One attempt, no retries (keys are still attached and answers still classified).
    #[must_use]
    pub fn never() -> Self {
        Self::default().attempts(1)
    }

    /// Attempts in all, the first included (at least 1).
    #[must_use]
    pub fn attempts(mut self, attempts: u32) -> Self {
        self.attempts = attempts.max(1);
        self
    }

    /// The backoff's first ceiling and its largest.
    #[must_use]
    pub fn backoff(mut self, base_delay: Duration, max_delay: Duration) -> Self {
        self.base_delay = base_delay;
        self.max_delay = max_delay.max(base_delay);
        self
    }

    /// The longest a call may take from its first attempt, pauses included: no pause is
    /// started that would end after it. An attempt under way is not cut short (give the
    /// `reqwest::Client` a timeout for that).
    #[must_use]
    pub fn total_time(mut self, total_time: Duration) -> Self {
        self.total_time = total_time;
        self
    }

    /// The longest `Retry-After` the client waits for; a server asking for more ends the
    /// retries.
    #[must_use]
    pub fn max_retry_after(mut self, max_retry_after: Duration) -> Self {
        self.max_retry_after = max_retry_after;
        self
    }

    /// The pause before retry number `retry` (1 for the first), given the server's
    /// `Retry-After`; `None` when the server asks for longer than this policy waits.
    pub(crate) fn pause(&self, retry: u32, retry_after: Option<Duration>) -> Option<Duration> {
        match retry_after {
            Some(asked) if asked > self.max_retry_after => None,
            Some(asked) => Some(asked.saturating_add(jitter(self.base_delay))),
            None => {
                let factor = 2u32.saturating_pow(retry.saturating_sub(1));
                Some(jitter(
                    self.base_delay.saturating_mul(factor).min(self.max_delay),
                ))
            }
        }
    }
}

/// A random duration from zero to `ceiling`, both included.
fn jitter(ceiling: Duration) -> Duration {
    let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
    Duration::from_nanos(rand::random_range(0..=nanos))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn backoff_grows_to_its_cap_with_full_jitter() {
        let p = RetryPolicy::default().backoff(Duration::from_millis(100), Duration::from_secs(1));
        for retry in 1..=40 {
            let ceiling =
                Duration::from_millis(100 * (1 << (retry - 1).min(10))).min(Duration::from_secs(1));
            let mut most = Duration::ZERO;
            for _ in 0..200 {
                let d = p.pause(retry, None).unwrap();
                assert!(d <= ceiling, "retry {retry}: {d:?} over {ceiling:?}");
                most = most.max(d);
            }
            // Full jitter spreads over the whole range, not a band near the ceiling.
            assert!(
                most > ceiling / 2,
                "retry {retry}: never above half of {ceiling:?}"
            );
        }
    }

    #[test]
    fn retry_after_is_a_floor_and_too_long_a_wait_ends_the_retries() {
        let p = RetryPolicy::default()
            .backoff(Duration::from_millis(50), Duration::from_secs(1))
            .max_retry_after(Duration::from_secs(5));
        for _ in 0..200 {
            let d = p.pause(1, Some(Duration::from_secs(2))).unwrap();
            assert!(d >= Duration::from_secs(2) && d <= Duration::from_millis(2050));
        }
        assert_eq!(p.pause(1, Some(Duration::from_secs(6))), None);
        assert!(p.pause(1, Some(Duration::from_secs(5))).is_some());
    }

    #[test]
    fn the_longest_retry_after_does_not_overflow() {
        // A caller that honours any wait, and a server that asks for the most a header holds.
        let p = RetryPolicy::default()
            .backoff(Duration::from_secs(5), Duration::from_secs(60))
            .max_retry_after(Duration::MAX);
        let mut headers = http::HeaderMap::new();
        headers.insert(http::header::RETRY_AFTER, u64::MAX.into());
        let asked = idem_wire::retry_after(&headers, std::time::SystemTime::now());
        assert_eq!(asked, Some(Duration::from_secs(u64::MAX)));
        for _ in 0..50 {
            assert!(p.pause(1, asked).is_some());
        }
    }

    #[test]
    fn at_least_one_attempt() {
        assert_eq!(RetryPolicy::default().attempts(0).attempts, 1);
        assert_eq!(RetryPolicy::never().attempts, 1);
    }
}
