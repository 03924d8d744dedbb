//! The operations the clients run, one for each scenario, in the README's order, and what
//! each takes from an answer into the journal.

use std::sync::{Mutex, PoisonError};

use hyper::Method;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde_json::{Value, json};

use super::journal::Ack;
use super::wire::{Call, Wire};
use crate::schema::Opening;

/// Orders created so far, for the payment and status clients to pick from.
#[derive(Debug, Default)]
pub(super) struct Orders(Mutex<Vec<(i64, i64)>>);

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

/// One operation of a client: the `n`th of the run.
pub(super) struct Op<'a> {
    pub(super) wire: &'a Wire,
    pub(super) orders: &'a Orders,
    pub(super) opening: &'a Opening,
    pub(super) n: u64,
}

impl Op<'_> {
    /// Picks a scenario (as often as the README's traffic has it) and runs it.
    pub(super) async fn run(&self, rng: &mut StdRng) {
        match rng.random_range(0..100) {
            0..15 => self.transfer(rng).await,
            15..20 => self.wire(rng).await,
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

    /// Wires money to an account at the other bank, under one key; a double click is a second
    /// wire.
    async fn wire(&self, rng: &mut StdRng) {
        let from = rng.random_range(1..=self.opening.customers);
        let amount = rng.random_range(1..=300);
        let to = format!("ext-{}", rng.random_range(1..=40));
        let call = Call::new(
            Method::POST,
            "/wires".into(),
            json!({ "from": from, "to": to, "amount": amount }),
        );
        for answer in self.wire.click(rng, &call).await {
            let body = answer.json();
            let outcome = match (answer.status, answer.code().as_str()) {
                (200, _) => body["outcome"].as_str().unwrap_or_default().to_owned(),
                (409, "insufficient_funds") => "insufficient_funds".to_owned(),
                _ => continue,
            };
            if let Some(wire) = body["wire"].as_str() {
                self.ack(Ack::Wire {
                    wire: wire.to_owned(),
                    outcome,
                    amount,
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
