//! One client's wire: an operation's request sent under one key until it is answered, with
//! the trouble rolled for each attempt (a timeout, a lost answer, a duplicate sent at once),
//! and sent again under a fresh key when the user double-clicks.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde_json::Value;

use super::Rates;
use super::journal::{Journal, bump};

/// One HTTP answer.
#[derive(Debug, Clone)]
pub struct Answer {
    /// Its status.
    pub status: u16,
    /// Its body.
    pub body: Bytes,
}

impl Answer {
    pub(super) fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    pub(super) fn code(&self) -> String {
        self.json()["code"].as_str().unwrap_or_default().to_owned()
    }
}

/// One operation's request.
#[derive(Debug, Clone)]
pub(super) struct Call {
    method: Method,
    path: String,
    body: Value,
    /// Whether it carries an `Idempotency-Key` (reads and the provider's callbacks do not).
    pub(super) keyed: bool,
    /// The order form's one-time token.
    pub(super) form_token: Option<String>,
}

impl Call {
    pub(super) fn new(method: Method, path: String, body: Value) -> Self {
        Self {
            method,
            path,
            body,
            keyed: true,
            form_token: None,
        }
    }
}

/// How many attempts one key gets before the operation is given up.
const MAX_ATTEMPTS: u32 = 60;

/// A client: an HTTP connection pool, a random source, and the shared journal.
#[derive(Clone)]
pub(super) struct Wire {
    http: Client<HttpConnector, Full<Bytes>>,
    base: String,
    rates: Rates,
    pub(super) journal: Arc<Journal>,
}

impl Wire {
    /// A client of the service at `base`, troubled at `rates`, writing to `journal`.
    pub(super) fn new(base: String, rates: Rates, journal: Arc<Journal>) -> Self {
        Self {
            http: Client::builder(TokioExecutor::new()).build_http(),
            base,
            rates,
            journal,
        }
    }

    async fn once(&self, call: &Call, key: &str, timeout: Duration) -> Option<Answer> {
        let mut req = Request::builder()
            .method(call.method.clone())
            .uri(format!("{}{}", self.base, call.path))
            .header("content-type", "application/json");
        if call.keyed {
            req = req.header("idempotency-key", format!("\"{key}\""));
        }
        if let Some(token) = &call.form_token {
            req = req.header("form-token", token);
        }
        let req = req
            .body(Full::new(Bytes::from(call.body.to_string())))
            .ok()?;
        bump(&self.journal.counters.requests);
        let sent = async {
            let res = self.http.request(req).await.ok()?;
            let status = res.status().as_u16();
            let body = res.into_body().collect().await.ok()?.to_bytes();
            Some(Answer { status, body })
        };
        match tokio::time::timeout(timeout, sent).await {
            Ok(answer) => answer,
            Err(_) => {
                bump(&self.journal.counters.timeouts);
                None
            }
        }
    }

    /// Sends `call` under one key until it has an answer that is not "try again" (a 5xx, a
    /// 408/425/429, the key in use, an unknown outcome), with the chaos rolled per attempt.
    ///
    /// Every final answer comes back, the lost ones too (the service gave them, whether or not
    /// the client heard them), the one the client kept last; none if it gave up.
    pub(super) async fn send(&self, rng: &mut StdRng, call: &Call) -> Vec<Answer> {
        let key = format!("{:032x}", rng.random::<u128>());
        let c = &self.journal.counters;
        let mut nap = Duration::from_millis(2);
        let mut heard = Vec::new();
        for attempt in 0..MAX_ATTEMPTS {
            if attempt > 0 {
                bump(&c.retries);
                tokio::time::sleep(nap).await;
                nap = (nap * 2).min(Duration::from_millis(200));
            }
            let timeout = if rng.random_bool(self.rates.timeout) {
                Duration::from_millis(rng.random_range(1..=25))
            } else {
                Duration::from_secs(30)
            };
            let answers = if rng.random_bool(self.rates.duplicate) {
                bump(&c.duplicates);
                let (a, b) = tokio::join!(
                    self.once(call, &key, timeout),
                    self.once(call, &key, Duration::from_secs(30))
                );
                vec![a, b]
            } else {
                vec![self.once(call, &key, timeout).await]
            };
            let mut accepted = None;
            for answer in answers.into_iter().flatten() {
                match (answer.status, answer.code().as_str()) {
                    (409, "request_in_progress") => bump(&c.in_progress),
                    (409, "outcome_unknown") | (408 | 425 | 429, _) => {}
                    (500..=599, code) => {
                        if code == "simulated_crash" {
                            bump(&c.crashes);
                        }
                    }
                    _ => {
                        if call.keyed {
                            self.journal.final_answer(&key, &answer);
                        }
                        accepted.get_or_insert(answer);
                    }
                }
            }
            if let Some(answer) = accepted {
                let lost = rng.random_bool(self.rates.drop);
                heard.push(answer);
                if lost {
                    bump(&c.dropped);
                    continue;
                }
                return heard;
            }
        }
        bump(&c.gave_up);
        heard.clear();
        heard
    }

    /// Sends `call`, and with the double-click rate sends it again at once under a fresh key;
    /// every answer comes back.
    pub(super) async fn click(&self, rng: &mut StdRng, call: &Call) -> Vec<Answer> {
        if rng.random_bool(self.rates.double_click) {
            bump(&self.journal.counters.double_clicks);
            let mut other = StdRng::seed_from_u64(rng.random());
            let (a, b) = tokio::join!(self.send(rng, call), self.send(&mut other, call));
            a.into_iter().chain(b).collect()
        } else {
            self.send(rng, call).await
        }
    }
}
