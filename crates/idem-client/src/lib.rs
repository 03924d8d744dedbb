//! The client side of `Idempotency-Key`, for [`reqwest`]: one key per logical operation, kept
//! across every retry, and retries only where they are safe.
//!
//! A server that honours `Idempotency-Key` (`idem gateway`, `idem_http::IdempotencyLayer`,
//! Stripe…) runs a request once per key and answers every retry with the first answer. That
//! only helps a client that sends the *same* key on each retry of one operation, retries what
//! can be retried, and stops where retrying cannot help. [`Retries`] does that:
//!
//! - a POST or PATCH gets an `Idempotency-Key` (a UUIDv7) unless it carries one, and keeps it on
//!   every retry; a POST or PATCH without a key (with [`Retries::attach_keys`] off) is never
//!   retried; GET, HEAD, OPTIONS, TRACE, PUT and DELETE are retried with or without one;
//! - retried: connection failures and timeouts, 5xx (but 501 and 505), 408, 425, 429, 409
//!   "a request with this key is in progress", and any 409 with a `Retry-After`; with
//!   exponential backoff and full jitter, bounded in attempts and in total time, and never
//!   sooner than a `Retry-After` (the rules are `idem_wire::read`'s, which `idem relay` reads
//!   answers by too);
//! - never retried: a key used with a different request (422, or 400 under Stripe's rules:
//!   [`Error::KeyMismatch`]) and an outcome the server does not know (409 `outcome_unknown`
//!   without `Retry-After`: [`Error::OutcomeUnknown`]), nor any other answer;
//! - every call says how it went ([`Report`]): its key, its attempts, and whether the answer
//!   was a replay (`Idempotent-Replayed: true`).
//!
//! As a helper around a plain `reqwest::Client`:
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let http = reqwest::Client::new();
//! let retries = idem_client::Retries::default();
//! let answer = retries
//!     .send(&http, http.post("http://127.0.0.1:7080/v1/charges").body(r#"{"amount":1000}"#))
//!     .await?;
//! println!("{} (replayed: {})", answer.response.status(), answer.report.replayed);
//! # Ok(()) }
//! ```
//!
//! Or as a `reqwest-middleware` middleware, whose answers carry their [`Report`] and whose
//! failures are an [`Error`] inside `reqwest_middleware::Error::Middleware`:
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let http = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
//!     .with(idem_client::Retries::default())
//!     .build();
//! let response = http.post("http://127.0.0.1:7080/v1/charges").send().await?;
//! let replayed = idem_client::report(&response).is_some_and(|r| r.replayed);
//! # Ok(()) }
//! ```
//!
//! A key lives only as long as the call here. An operation that must survive a restart of the
//! caller (a job retried by a queue) makes its key once with [`new_key`], stores it with the
//! job, and sets the header itself on every run: the key is the caller's, and is kept.
//!
//! Requests the server got may run on the server more than once only where the server does
//! not deduplicate them: retries of a keyed request are safe against a server that honours
//! the key, and retries of GET, PUT and DELETE are safe by HTTP's own rules (RFC 9110 §9.2.2).

mod classify;
mod outcome;
mod policy;

use std::time::Instant;

use reqwest::header::{HeaderName, HeaderValue};
use reqwest::{Method, Request, Response};
use reqwest_middleware::{Middleware, Next};

use crate::classify::{Verdict, classify};
pub use crate::outcome::{Answer, Error, Last, Report, report};
pub use crate::policy::RetryPolicy;

/// The header a key travels in.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// A fresh key for one logical operation: a UUIDv7 (time-ordered, 122 bits of which 62 are
/// random), as text.
pub fn new_key() -> String {
    idem_id::uuid7().to_string()
}

/// How a key is written in the header.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KeyFormat {
    /// As a structured-field string, `Idempotency-Key: "01890a5d-…"`, as the IETF httpapi
    /// draft writes it. Servers that take the bare form (Stripe) keep the quotes as part of
    /// the key, which still works: the same key on every retry.
    #[default]
    Quoted,
    /// Bare, `Idempotency-Key: 01890a5d-…`, as Stripe's clients send it.
    Bare,
}

/// Retries that keep one key per call: the policy, and how keys are attached. Use it as a
/// helper ([`Retries::send`], [`Retries::execute`]) or as a `reqwest-middleware` middleware.
#[derive(Clone, Debug)]
pub struct Retries {
    policy: RetryPolicy,
    attach_keys: bool,
    format: KeyFormat,
    header: HeaderName,
}

impl Default for Retries {
    fn default() -> Self {
        Self::new(RetryPolicy::default())
    }
}

type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// What sends one attempt: a plain client, or the rest of a middleware chain.
trait Attempt {
    fn send(&mut self, request: Request) -> BoxFuture<'_, reqwest_middleware::Result<Response>>;
}

struct Plain<'a>(&'a reqwest::Client);

impl Attempt for Plain<'_> {
    fn send(&mut self, request: Request) -> BoxFuture<'_, reqwest_middleware::Result<Response>> {
        let client = self.0;
        Box::pin(async move { Ok(client.execute(request).await?) })
    }
}

struct Chain<'a, 'b> {
    next: Next<'a>,
    extensions: &'b mut http::Extensions,
}

impl Attempt for Chain<'_, '_> {
    fn send(&mut self, request: Request) -> BoxFuture<'_, reqwest_middleware::Result<Response>> {
        self.next.clone().run(request, self.extensions)
    }
}

impl Retries {
    /// Retries under `policy`, attaching quoted keys to POST and PATCH.
    pub fn new(policy: RetryPolicy) -> Self {
        Self {
            policy,
            attach_keys: true,
            format: KeyFormat::Quoted,
            header: HeaderName::from_static(IDEMPOTENCY_KEY),
        }
    }

    /// Whether a POST or PATCH without a key gets one (default: yes). Without, such requests
    /// are sent once.
    #[must_use]
    pub fn attach_keys(mut self, attach: bool) -> Self {
        self.attach_keys = attach;
        self
    }

    /// How attached keys are written (default [`KeyFormat::Quoted`]).
    #[must_use]
    pub fn key_format(mut self, format: KeyFormat) -> Self {
        self.format = format;
        self
    }

    /// The header keys travel in, for servers that use another name (default
    /// `Idempotency-Key`).
    #[must_use]
    pub fn key_header(mut self, header: HeaderName) -> Self {
        self.header = header;
        self
    }

    /// The policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// Builds `request` and sends it with `client`, retrying as this says.
    pub async fn send(
        &self,
        client: &reqwest::Client,
        request: reqwest::RequestBuilder,
    ) -> Result<Answer, Error> {
        let request = request
            .build()
            .map_err(|e| Error::Request(reqwest_middleware::Error::Reqwest(e)))?;
        self.execute(client, request).await
    }

    /// Sends `request` with `client`, retrying as this says.
    pub async fn execute(
        &self,
        client: &reqwest::Client,
        request: Request,
    ) -> Result<Answer, Error> {
        self.run(request, Plain(client)).await
    }

    /// The key the request carries, attaching one if it should have one.
    fn key(&self, request: &mut Request) -> Option<String> {
        if let Some(value) = request.headers().get(&self.header) {
            let text = String::from_utf8_lossy(value.as_bytes());
            let trimmed = text.trim();
            let bare = trimmed
                .strip_prefix('"')
                .and_then(|t| t.strip_suffix('"'))
                .unwrap_or(trimmed);
            return Some(bare.to_owned());
        }
        if !self.attach_keys || !matches!(*request.method(), Method::POST | Method::PATCH) {
            return None;
        }
        let key = new_key();
        let written = match self.format {
            KeyFormat::Quoted => format!("\"{key}\""),
            KeyFormat::Bare => key.clone(),
        };
        // A UUID's text is visible ASCII, always a valid header value.
        let value = HeaderValue::try_from(written).ok()?;
        request.headers_mut().insert(self.header.clone(), value);
        Some(key)
    }

    async fn run(&self, mut request: Request, mut attempt: impl Attempt) -> Result<Answer, Error> {
        let key = self.key(&mut request);
        let retryable = key.is_some() || idempotent(request.method());
        let start = Instant::now();
        let mut attempts = 0;
        loop {
            attempts += 1;
            // A body that cannot be copied (a stream) is sent once.
            let again = (retryable && attempts < self.policy.attempts)
                .then(|| request.try_clone())
                .flatten();
            let sent = attempt.send(request).await;
            let report = |replayed| Report {
                key: key.clone(),
                attempts,
                elapsed: start.elapsed(),
                replayed,
            };
            let verdict = match sent {
                Ok(response) => classify(response).await,
                // Retried if there are attempts left; after a retry, the last one gives up.
                Err(e) if transient(&e) && (again.is_some() || attempts > 1) => Verdict::Retry {
                    last: Last::Transport(e),
                    after: None,
                },
                Err(e) => return Err(Error::Request(e)),
            };
            let (last, after) = match verdict {
                Verdict::Keep(response) => {
                    let replayed = response
                        .headers()
                        .get("idempotent-replayed")
                        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
                    return Ok(Answer {
                        response,
                        report: report(replayed),
                    });
                }
                Verdict::Unknown { detail } => {
                    return Err(Error::OutcomeUnknown {
                        detail,
                        report: report(false),
                    });
                }
                Verdict::Mismatch { status, detail } => {
                    return Err(Error::KeyMismatch {
                        status,
                        detail,
                        report: report(false),
                    });
                }
                Verdict::Retry { last, after } => (last, after),
            };
            let Some(again) = again else {
                return match last {
                    // Not retried at all (no key, or a stream): the answer is the caller's.
                    Last::Response(response) if !retryable || attempts == 1 => Ok(Answer {
                        response: *response,
                        report: report(false),
                    }),
                    last => Err(Error::GaveUp {
                        last,
                        report: report(false),
                    }),
                };
            };
            let pause = self
                .policy
                .pause(attempts, after)
                .filter(|p| start.elapsed().saturating_add(*p) <= self.policy.total_time);
            let Some(pause) = pause else {
                return Err(Error::GaveUp {
                    last,
                    report: report(false),
                });
            };
            // Let go of the answer (and its connection) before sleeping.
            drop(last);
            tokio::time::sleep(pause).await;
            request = again;
        }
    }
}

/// Methods whose repetition has the effect of one request (RFC 9110 §9.2.2).
fn idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// Failures of the way rather than of the request: the connection was refused, broke, or
/// timed out. Failures of building the request, of a redirect policy, or of another
/// middleware are not.
fn transient(e: &reqwest_middleware::Error) -> bool {
    match e {
        reqwest_middleware::Error::Reqwest(e) => {
            !(e.is_builder() || e.is_redirect() || e.is_decode() || e.is_status())
                && (e.is_connect() || e.is_timeout() || e.is_request() || e.is_body())
        }
        reqwest_middleware::Error::Middleware(_) => false,
    }
}

#[async_trait::async_trait]
impl Middleware for Retries {
    async fn handle(
        &self,
        request: Request,
        extensions: &mut http::Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        match self.run(request, Chain { next, extensions }).await {
            Ok(Answer {
                mut response,
                report,
            }) => {
                response.extensions_mut().insert(report);
                Ok(response)
            }
            Err(Error::Request(e)) => Err(e),
            Err(e) => Err(reqwest_middleware::Error::middleware(e)),
        }
    }
}
