//! The chaos clients: many at once, each operation sent over HTTP with an `Idempotency-Key`
//! and retried until it has an answer, while the network and the users misbehave: attempts
//! time out (the client hangs up), answers are lost on the way back, the same request is sent
//! twice at once, and users double-click (the same operation again under a new key).
//!
//! Every answer a client accepts is written to the [`Journal`], which the audit holds against
//! the books.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde_json::{Value, json};

use crate::schema::Opening;

/// How often each kind of trouble happens, per attempt (probabilities from 0 to 1).
#[derive(Debug, Clone, PartialEq)]
pub struct Rates {
    /// The client gives up on an attempt after 1 to 25 ms and tries again.
    pub timeout: f64,
    /// An answer is lost on its way back; the client tries again.
    pub drop: f64,
    /// The same request (same key) is sent twice at once.
    pub duplicate: f64,
    /// The user clicks twice: the operation is sent again at once under a fresh key.
    pub double_click: f64,
    /// The service stops after committing, before answering.
    pub crash: f64,
    /// The service takes up to this long inside an operation.
    pub pause_ms: u64,
}

impl Default for Rates {
    fn default() -> Self {
        Self {
            timeout: 0.15,
            drop: 0.1,
            duplicate: 0.1,
            double_click: 0.15,
            crash: 0.05,
            pause_ms: 8,
        }
    }
}

impl Rates {
    /// No trouble at all.
    pub fn calm() -> Self {
        Self {
            timeout: 0.0,
            drop: 0.0,
            duplicate: 0.0,
            double_click: 0.0,
            crash: 0.0,
            pause_ms: 0,
        }
    }
}

/// An answer a client accepted as the outcome of an operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ack {
    /// A transfer by `ticket` answered `outcome` (`done` or `insufficient_funds`).
    Transfer {
        /// The ticket.
        ticket: i64,
        /// What the answer said.
        outcome: String,
    },
    /// A deduction for `order_no` answered `outcome` (`deducted` or `insufficient_stock`).
    Deduction {
        /// The order number.
        order_no: String,
        /// What the answer said.
        outcome: String,
    },
    /// Coupon `coupon` was said to be held by `order_no`.
    CouponHeld {
        /// The coupon.
        coupon: i64,
        /// The order told it holds it.
        order_no: String,
    },
    /// Coupon `coupon` was said to have expired.
    CouponExpired {
        /// The coupon.
        coupon: i64,
    },
    /// `user` was told its account is `account`.
    Account {
        /// The user.
        user: i64,
        /// The account.
        account: i64,
    },
    /// Order `order` was created from form `form`.
    Order {
        /// The order.
        order: i64,
        /// The form it came from.
        form: String,
    },
    /// Order `order` was said to be paid by `payment`.
    Paid {
        /// The order.
        order: i64,
        /// The payment.
        payment: String,
    },
    /// Order `order` was said to be at `version` with `status`.
    Version {
        /// The order.
        order: i64,
        /// Its version.
        version: i64,
        /// Its status's name.
        status: String,
    },
}

/// What happened on the wire.
#[derive(Debug, Default)]
pub struct Counters {
    /// Operations finished.
    pub operations: AtomicU64,
    /// Requests sent.
    pub requests: AtomicU64,
    /// Attempts after the first for one key.
    pub retries: AtomicU64,
    /// Attempts the client gave up on.
    pub timeouts: AtomicU64,
    /// Answers thrown away as lost.
    pub dropped: AtomicU64,
    /// Requests sent twice at once under one key.
    pub duplicates: AtomicU64,
    /// Operations sent again under a fresh key.
    pub double_clicks: AtomicU64,
    /// Answers saying the service stopped after committing.
    pub crashes: AtomicU64,
    /// Answers saying the key was in use by another attempt.
    pub in_progress: AtomicU64,
    /// Replays: answers for a key that had been answered before.
    pub replays: AtomicU64,
    /// Operations given up after too many attempts.
    pub gave_up: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Every answer accepted, and every key whose answers differed.
#[derive(Debug, Default)]
pub struct Journal {
    acks: Mutex<Vec<Ack>>,
    finals: Mutex<HashMap<String, (u16, Bytes)>>,
    differing: Mutex<Vec<String>>,
    /// The wire's counters.
    pub counters: Counters,
}

impl Journal {
    fn ack(&self, ack: Ack) {
        self.acks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(ack);
    }

    /// The answers accepted.
    pub fn acks(&self) -> Vec<Ack> {
        self.acks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Keys that got two different final answers.
    pub fn differing(&self) -> Vec<String> {
        self.differing
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Holds a final answer against the earlier ones for its key.
    fn final_answer(&self, key: &str, answer: &Answer) {
        let mut finals = self.finals.lock().unwrap_or_else(PoisonError::into_inner);
        match finals.get(key) {
            None => {
                finals.insert(key.to_owned(), (answer.status, answer.body.clone()));
            }
            Some((status, body)) => {
                bump(&self.counters.replays);
                if (*status, body) != (answer.status, &answer.body) {
                    self.differing
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(format!(
                            "key {key}: answered {status} {} and then {} {}",
                            String::from_utf8_lossy(body),
                            answer.status,
                            String::from_utf8_lossy(&answer.body)
                        ));
                }
            }
        }
    }
}

/// One HTTP answer.
#[derive(Debug, Clone)]
pub struct Answer {
    /// Its status.
    pub status: u16,
    /// Its body.
    pub body: Bytes,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    fn code(&self) -> String {
        self.json()["code"].as_str().unwrap_or_default().to_owned()
    }
}

/// One operation's request.
#[derive(Debug, Clone)]
struct Call {
    method: Method,
    path: String,
    body: Value,
    keyed: bool,
    form_token: Option<String>,
}

impl Call {
    fn new(method: Method, path: String, body: Value) -> Self {
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
struct Wire {
    http: Client<HttpConnector, Full<Bytes>>,
    base: String,
    rates: Rates,
    journal: Arc<Journal>,
}

impl Wire {
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
    async fn send(&self, rng: &mut StdRng, call: &Call) -> Vec<Answer> {
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
    async fn click(&self, rng: &mut StdRng, call: &Call) -> Vec<Answer> {
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

/// Orders created so far, for the payment and status clients to pick from.
#[derive(Debug, Default)]
struct Orders(Mutex<Vec<(i64, i64)>>);

impl Orders {
    fn push(&self, id: i64, amount: i64) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((id, amount));
    }

    fn pick(&self, rng: &mut StdRng) -> Option<(i64, i64)> {
        let orders = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if orders.is_empty() {
            None
        } else {
            Some(orders[rng.random_range(0..orders.len())])
        }
    }
}

/// What the clients are to do.
#[derive(Debug, Clone)]
pub struct Workload {
    /// How many clients run at once.
    pub clients: usize,
    /// How many operations they run between them.
    pub operations: u64,
    /// The seed of every random choice the clients make.
    pub seed: u64,
    /// The trouble.
    pub rates: Rates,
    /// The books the shop opened with.
    pub opening: Opening,
}

/// Runs the workload against the service at `base` (`http://host:port`), writing to
/// `journal`.
pub async fn run(base: String, workload: &Workload, journal: Arc<Journal>) {
    let wire = Wire {
        http: Client::builder(TokioExecutor::new()).build_http(),
        base,
        rates: workload.rates.clone(),
        journal,
    };
    let orders = Arc::new(Orders::default());
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for client in 0..workload.clients {
        let (wire, orders, next) = (wire.clone(), orders.clone(), next.clone());
        let workload = workload.clone();
        tasks.spawn(async move {
            let mut rng = StdRng::seed_from_u64(
                workload.seed ^ (client as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            );
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= workload.operations {
                    break;
                }
                let op = Op {
                    wire: &wire,
                    orders: &orders,
                    opening: &workload.opening,
                    n,
                };
                op.run(&mut rng).await;
                bump(&wire.journal.counters.operations);
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        if let Err(e) = done
            && e.is_panic()
        {
            std::panic::resume_unwind(e.into_panic());
        }
    }
}

struct Op<'a> {
    wire: &'a Wire,
    orders: &'a Orders,
    opening: &'a Opening,
    n: u64,
}

impl Op<'_> {
    async fn run(&self, rng: &mut StdRng) {
        match rng.random_range(0..100) {
            0..20 => self.transfer(rng).await,
            20..35 => self.deduct(rng).await,
            35..50 => self.hold_coupon(rng).await,
            50..65 => self.order(rng).await,
            65..75 => self.open_account(rng).await,
            75..90 => self.pay(rng).await,
            _ => self.change_status(rng).await,
        }
    }

    fn ack(&self, ack: Ack) {
        self.wire.journal.ack(ack);
    }

    async fn transfer(&self, rng: &mut StdRng) {
        let customers = self.opening.customers;
        let from = rng.random_range(1..=customers);
        let to = (from + rng.random_range(1..customers) - 1) % customers + 1;
        let amount = rng.random_range(1..=300);
        let call = Call::new(Method::POST, "/tickets".into(), json!({ "account": from }));
        let Some(answer) = self.wire.send(rng, &call).await.pop() else {
            return;
        };
        let Some(ticket) = answer.json()["ticket"]
            .as_str()
            .and_then(|t| t.parse::<i64>().ok())
        else {
            return;
        };
        let call = Call::new(
            Method::PUT,
            format!("/accounts/{from}/transfers/{ticket}"),
            json!({ "to": to, "amount": amount }),
        );
        for answer in self.wire.click(rng, &call).await {
            let outcome = match (answer.status, answer.code().as_str()) {
                (200, _) => answer.json()["outcome"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                (409, "insufficient_funds") => "insufficient_funds".to_owned(),
                _ => continue,
            };
            self.ack(Ack::Transfer { ticket, outcome });
        }
    }

    async fn deduct(&self, rng: &mut StdRng) {
        let order_no = format!("o-{}", self.n);
        let sku = Opening::sku(rng.random_range(1..=self.opening.skus));
        let qty = rng.random_range(1..=5);
        let call = Call::new(
            Method::POST,
            "/inventory/deductions".into(),
            json!({ "order_no": order_no, "sku": sku, "qty": qty }),
        );
        for answer in self.wire.click(rng, &call).await {
            let outcome = match (answer.status, answer.code().as_str()) {
                (201, _) => "deducted",
                (409, "insufficient_stock") => "insufficient_stock",
                _ => continue,
            };
            self.ack(Ack::Deduction {
                order_no: order_no.clone(),
                outcome: outcome.to_owned(),
            });
        }
    }

    async fn hold_coupon(&self, rng: &mut StdRng) {
        let coupon = rng.random_range(1..=self.opening.coupons);
        let order_no = format!("c-{}", self.n);
        let call = Call::new(
            Method::POST,
            format!("/coupons/{coupon}/hold"),
            json!({ "order_no": order_no }),
        );
        for answer in self.wire.click(rng, &call).await {
            match (answer.status, answer.code().as_str()) {
                (200, _) => self.ack(Ack::CouponHeld {
                    coupon,
                    order_no: order_no.clone(),
                }),
                (409, "coupon_expired") => self.ack(Ack::CouponExpired { coupon }),
                _ => {}
            }
        }
    }

    async fn order(&self, rng: &mut StdRng) {
        let user = rng.random_range(1..=self.opening.customers);
        let call = Call::new(Method::POST, "/form-tokens".into(), json!({}));
        let Some(answer) = self.wire.send(rng, &call).await.pop() else {
            return;
        };
        let Some(token) = answer.json()["token"].as_str().map(str::to_owned) else {
            return;
        };
        let form = format!("f-{}", self.n);
        let amount = rng.random_range(10..=200);
        let mut call = Call::new(
            Method::POST,
            "/orders".into(),
            json!({ "user": user, "form": form, "amount": amount }),
        );
        call.form_token = Some(token);
        for answer in self.wire.click(rng, &call).await {
            if answer.status != 201 {
                continue;
            }
            let Some(order) = answer.json()["order"].as_str().and_then(|o| o.parse().ok()) else {
                continue;
            };
            self.orders.push(order, amount);
            self.ack(Ack::Order {
                order,
                form: form.clone(),
            });
        }
    }

    async fn open_account(&self, rng: &mut StdRng) {
        let user = 1_000 + rng.random_range(0..24);
        let call = Call::new(Method::POST, format!("/users/{user}/account"), json!({}));
        for answer in self.wire.click(rng, &call).await {
            if !matches!(answer.status, 200 | 201) {
                continue;
            }
            if let Some(account) = answer.json()["account"]
                .as_str()
                .and_then(|a| a.parse().ok())
            {
                self.ack(Ack::Account { user, account });
            }
        }
    }

    /// The provider's callbacks for one payment, on the front and the back channel, at once or
    /// one after the other; each is sent until it is answered (no key: the provider has none).
    async fn pay(&self, rng: &mut StdRng) {
        let Some((order, amount)) = self.orders.pick(rng) else {
            return;
        };
        let payment = format!("pay-{order}");
        let callback = |channel: &str| {
            let mut call = Call::new(
                Method::POST,
                "/payments/callback".into(),
                json!({ "payment": payment, "order": order.to_string(), "amount": amount, "channel": channel }),
            );
            call.keyed = false;
            call
        };
        let (front, back) = (callback("front"), callback("back"));
        let answers = if rng.random_bool(0.5) {
            let mut other = StdRng::seed_from_u64(rng.random());
            let (a, b) = tokio::join!(
                self.wire.send(rng, &front),
                self.wire.send(&mut other, &back)
            );
            [a, b].concat()
        } else {
            let a = self.wire.send(rng, &front).await;
            [a, self.wire.send(rng, &back).await].concat()
        };
        for answer in answers {
            if answer.status == 200 {
                self.ack(Ack::Paid {
                    order,
                    payment: payment.clone(),
                });
            }
        }
    }

    /// Reads an order and moves it on: a created order is cancelled now and then, a paid one
    /// shipped, each under the version just read.
    async fn change_status(&self, rng: &mut StdRng) {
        let Some((order, _)) = self.orders.pick(rng) else {
            return;
        };
        let mut read = Call::new(Method::GET, format!("/orders/{order}"), Value::Null);
        // A read is not replayed: two reads may well differ.
        read.keyed = false;
        let Some(answer) = self.wire.send(rng, &read).await.pop() else {
            return;
        };
        let seen = answer.json();
        let Some(version) = seen["version"].as_i64() else {
            return;
        };
        let to = match seen["status"].as_str() {
            Some("created") if rng.random_bool(0.4) => "cancelled",
            Some("paid") => "shipped",
            _ => return,
        };
        let call = Call::new(
            Method::PATCH,
            format!("/orders/{order}"),
            json!({ "expected_version": version, "status": to }),
        );
        for answer in self.wire.click(rng, &call).await {
            if answer.status != 200 {
                continue;
            }
            let body = answer.json();
            if let (Some(version), Some(status)) =
                (body["version"].as_i64(), body["status"].as_str())
            {
                self.ack(Ack::Version {
                    order,
                    version,
                    status: status.to_owned(),
                });
            }
        }
    }
}
