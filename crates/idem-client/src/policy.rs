//! How many times, and how far apart, a call is tried.

use std::time::{Duration, SystemTime};

use reqwest::header::{HeaderMap, RETRY_AFTER};

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

/// The `Retry-After` of an answer (RFC 9110 §10.2.3: seconds, or an HTTP date), from `now`.
/// A date in the past is no wait; a value that is neither is ignored.
pub(crate) fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use reqwest::header::HeaderValue;

    fn headers(retry_after: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(RETRY_AFTER, HeaderValue::from_str(retry_after).unwrap());
        h
    }

    #[test]
    fn retry_after_takes_seconds_and_dates_and_ignores_the_rest() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(
            retry_after(&headers("3"), now),
            Some(Duration::from_secs(3))
        );
        assert_eq!(retry_after(&headers(" 0 "), now), Some(Duration::ZERO));
        let later = httpdate::fmt_http_date(now + Duration::from_secs(7));
        assert_eq!(
            retry_after(&headers(&later), now),
            Some(Duration::from_secs(7))
        );
        let past = httpdate::fmt_http_date(now - Duration::from_secs(7));
        assert_eq!(retry_after(&headers(&past), now), Some(Duration::ZERO));
        assert_eq!(retry_after(&headers("-1"), now), None);
        assert_eq!(retry_after(&headers("soon"), now), None);
        assert_eq!(retry_after(&HeaderMap::new(), now), None);
    }

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
        let asked = retry_after(&headers("18446744073709551615"), SystemTime::now());
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
