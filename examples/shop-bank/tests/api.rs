//! The shop's routes one request at a time: the seeds' answers, and bad input refused with a
//! problem+json code.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use shop_bank::{Db, Guards, Opening, ServerChaos, Shop, Tables};

struct Shopfront {
    base: String,
    http: Client<HttpConnector, Full<Bytes>>,
    shop: Arc<Shop>,
    _dir: tempfile::TempDir,
}

impl Shopfront {
    async fn open() -> Self {
        Self::open_with(ServerChaos::off()).await
    }

    async fn open_with(chaos: ServerChaos) -> Self {
        let dir = tempfile::tempdir().unwrap();
        Self::open_in(dir, chaos, true).await
    }

    /// Another instance of the service over this one's books and records, as a second process
    /// started after the first stopped would be.
    async fn restarted(self, chaos: ServerChaos) -> Self {
        Self::open_in(self._dir, chaos, false).await
    }

    async fn open_in(dir: tempfile::TempDir, chaos: ServerChaos, create: bool) -> Self {
        let url = format!("sqlite://{}", dir.path().join("shop.db").display());
        let db = Db::connect(&url, 4).await.unwrap();
        let tables = Tables::new("shop_").unwrap();
        if create {
            tables
                .create(&db, &Guards::all(), &Opening::default())
                .await
                .unwrap();
        }
        let store: idem_core::SharedStore =
            Arc::new(idem::SqliteStore::open(dir.path().join("idem.db")).unwrap());
        let shop = Arc::new(Shop::new(db, tables, store.clone(), Guards::all(), chaos).unwrap());
        let app = shop_bank::shop::app(shop.clone(), store);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        Self {
            base,
            http: Client::builder(TokioExecutor::new()).build_http(),
            shop,
            _dir: dir,
        }
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        key: Option<&str>,
        body: &str,
    ) -> (u16, Value) {
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("content-type", "application/json");
        if let Some(key) = key {
            req = req.header("idempotency-key", format!("\"{key}\""));
        }
        let res = self
            .http
            .request(req.body(Full::new(Bytes::from(body.to_owned()))).unwrap())
            .await
            .unwrap();
        let status = res.status().as_u16();
        let body = res.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
    }

    async fn post(&self, path: &str, key: &str, body: Value) -> (u16, Value) {
        self.send(Method::POST, path, Some(key), &body.to_string())
            .await
    }
}

#[tokio::test]
async fn a_hold_on_an_expired_coupon_is_refused_not_taken_for_already_held() {
    let s = Shopfront::open().await;
    s.shop.expire_coupon(3).await.unwrap();
    let (status, body) = s
        .post("/coupons/3/hold", "k1", json!({ "order_no": "o-1" }))
        .await;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("coupon_expired"))
    );
    // The same order again is answered as before; another order is told the coupon is held.
    let (status, _) = s
        .post("/coupons/4/hold", "k2", json!({ "order_no": "o-1" }))
        .await;
    assert_eq!(status, 200);
    let (status, _) = s
        .post("/coupons/4/hold", "k3", json!({ "order_no": "o-1" }))
        .await;
    assert_eq!(status, 200);
    let (status, body) = s
        .post("/coupons/4/hold", "k4", json!({ "order_no": "o-2" }))
        .await;
    assert_eq!((status, body["code"].as_str()), (409, Some("coupon_held")));
}

#[tokio::test]
async fn insufficient_stock_is_a_permanent_answer_for_the_order() {
    let s = Shopfront::open().await;
    let big = json!({ "order_no": "o-9", "sku": "sku-1", "qty": 1000 });
    let (status, body) = s.post("/inventory/deductions", "k1", big.clone()).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("insufficient_stock"))
    );
    // A double click under a fresh key gets the same answer from the order's row.
    let (status, body) = s.post("/inventory/deductions", "k2", big).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("insufficient_stock"))
    );
    // The order number cannot be spent again on other items.
    let other = json!({ "order_no": "o-9", "sku": "sku-1", "qty": 1 });
    let (status, body) = s.post("/inventory/deductions", "k3", other).await;
    assert_eq!((status, body["code"].as_str()), (409, Some("order_reused")));
}

#[tokio::test]
async fn a_ticket_moves_money_once() {
    let s = Shopfront::open().await;
    let (status, body) = s.post("/tickets", "t", json!({ "account": 1 })).await;
    assert_eq!(status, 201);
    let ticket = body["ticket"].as_str().unwrap().to_owned();
    let path = format!("/accounts/1/transfers/{ticket}");
    let transfer = json!({ "to": 2, "amount": 100 }).to_string();
    for key in ["a", "b", "c"] {
        let (status, body) = s.send(Method::PUT, &path, Some(key), &transfer).await;
        assert_eq!((status, body["outcome"].as_str()), (200, Some("done")));
    }
    let rows = s
        .shop
        .db()
        .rows(
            "SELECT id, balance FROM shop_accounts WHERE id IN (1, 2) ORDER BY id",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows[0][1], 900.into());
    assert_eq!(rows[1][1], 1100.into());
    // Another account's ticket, or a made-up one, is refused.
    let other = format!("/accounts/2/transfers/{ticket}");
    let to_three = json!({ "to": 3, "amount": 100 }).to_string();
    let (status, body) = s.send(Method::PUT, &other, Some("d"), &to_three).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (404, Some("unknown_ticket"))
    );
}

/// Method, path, key, body, and the status and code expected.
type Case = (
    Method,
    &'static str,
    Option<&'static str>,
    &'static str,
    u16,
    &'static str,
);

#[tokio::test]
async fn bad_input_gets_a_problem_with_a_stable_code() {
    let s = Shopfront::open().await;
    let cases: Vec<Case> = vec![
        (
            Method::POST,
            "/tickets",
            Some("k1"),
            "{not json",
            400,
            "invalid_body",
        ),
        (
            Method::POST,
            "/tickets",
            None,
            r#"{"account":1}"#,
            400,
            "idempotency_key_missing",
        ),
        (
            Method::POST,
            "/tickets",
            Some("k2"),
            r#"{"account":999}"#,
            404,
            "unknown_account",
        ),
        (
            Method::POST,
            "/wires",
            Some("w1"),
            r#"{"from":999,"to":"ext-1","amount":5}"#,
            404,
            "unknown_account",
        ),
        (
            Method::POST,
            "/wires",
            Some("w2"),
            r#"{"from":1,"to":"ext 1","amount":5}"#,
            400,
            "invalid_name",
        ),
        (
            Method::POST,
            "/wires",
            Some("w3"),
            r#"{"from":1,"to":"ext-1","amount":-5}"#,
            400,
            "invalid_amount",
        ),
        (
            Method::POST,
            "/wires",
            None,
            r#"{"from":1,"to":"ext-1","amount":5}"#,
            400,
            "idempotency_key_missing",
        ),
        (
            Method::PUT,
            "/accounts/1/transfers/5",
            Some("k3"),
            r#"{"to":2,"amount":0}"#,
            400,
            "invalid_amount",
        ),
        (
            Method::PUT,
            "/accounts/1/transfers/5",
            Some("k4"),
            r#"{"to":1,"amount":5}"#,
            400,
            "invalid_transfer",
        ),
        (
            Method::POST,
            "/inventory/deductions",
            Some("k5"),
            r#"{"order_no":"bad no","sku":"sku-1","qty":1}"#,
            400,
            "invalid_name",
        ),
        (
            Method::POST,
            "/inventory/deductions",
            Some("k6"),
            r#"{"order_no":"o1","sku":"sku-404","qty":1}"#,
            404,
            "unknown_sku",
        ),
        (
            Method::POST,
            "/coupons/999/hold",
            Some("k7"),
            r#"{"order_no":"o1"}"#,
            404,
            "unknown_coupon",
        ),
        (
            Method::POST,
            "/orders",
            Some("k8"),
            r#"{"user":1,"form":"f1","amount":5}"#,
            400,
            "token_missing",
        ),
        (
            Method::PATCH,
            "/orders/1",
            Some("k9"),
            r#"{"expected_version":1,"status":"lost"}"#,
            400,
            "invalid_status",
        ),
        (
            Method::POST,
            "/payments/callback",
            None,
            r#"{"payment":"p1","order":"1","amount":5,"channel":"side"}"#,
            400,
            "invalid_channel",
        ),
        (Method::GET, "/orders/12345", None, "", 404, "unknown_order"),
        (Method::GET, "/orders/abc", None, "", 400, "invalid_path"),
        (
            Method::POST,
            "/users/abc/account",
            Some("k10"),
            "",
            400,
            "invalid_path",
        ),
        (
            Method::POST,
            "/users/0/account",
            Some("k11"),
            "",
            400,
            "invalid_user",
        ),
        (
            Method::PUT,
            "/accounts/1/transfers/5",
            Some("k12"),
            r#"{"to":2,"amount":2000000000}"#,
            400,
            "invalid_amount",
        ),
        (Method::GET, "/nowhere", None, "", 404, "not_found"),
        (
            Method::DELETE,
            "/tickets",
            None,
            "",
            405,
            "method_not_allowed",
        ),
    ];
    for (method, path, key, body, status, code) in cases {
        let (got, answer) = s.send(method.clone(), path, key, body).await;
        assert_eq!(
            (got, answer["code"].as_str()),
            (status, Some(code)),
            "{method} {path} {body}"
        );
    }
}

#[tokio::test]
async fn a_payment_reported_on_both_channels_is_credited_once() {
    let s = Shopfront::open().await;
    let (_, token) = s.post("/form-tokens", "t", json!({})).await;
    let token = token["token"].as_str().unwrap().to_owned();
    let req = Request::builder()
        .method(Method::POST)
        .uri(format!("{}/orders", s.base))
        .header("content-type", "application/json")
        .header("idempotency-key", "\"o\"")
        .header("form-token", token)
        .body(Full::new(Bytes::from(
            json!({ "user": 1, "form": "f-1", "amount": 70 }).to_string(),
        )))
        .unwrap();
    let res = s.http.request(req).await.unwrap();
    assert_eq!(res.status(), 201);
    let body: Value =
        serde_json::from_slice(&res.into_body().collect().await.unwrap().to_bytes()).unwrap();
    let order = body["order"].as_str().unwrap().to_owned();
    for channel in ["front", "back", "back"] {
        let cb = json!({ "payment": "pay-1", "order": order, "amount": 70, "channel": channel });
        let (status, body) = s
            .send(Method::POST, "/payments/callback", None, &cb.to_string())
            .await;
        assert_eq!((status, body["status"].as_str()), (200, Some("paid")));
    }
    let rows = s
        .shop
        .db()
        .rows("SELECT balance FROM shop_accounts WHERE id = 0", &[])
        .await
        .unwrap();
    assert_eq!(rows[0][0], 70.into());
}

/// A service that stops after every commit, before answering: each retry (same key; the 503
/// was not stored) must be answered from what the first attempt committed.
#[tokio::test]
async fn retries_after_the_service_stopped_are_answered_from_the_books() {
    let s = Shopfront::open_with(ServerChaos::new(1.0, 0, 1)).await;
    let (_, token) = s.post("/form-tokens", "t", json!({})).await;
    let token = token["token"].as_str().unwrap().to_owned();
    let order = json!({ "user": 1, "form": "f-9", "amount": 40 }).to_string();
    let send_order = || async {
        let req = Request::builder()
            .method(Method::POST)
            .uri(format!("{}/orders", s.base))
            .header("content-type", "application/json")
            .header("idempotency-key", "\"o\"")
            .header("form-token", token.as_str())
            .body(Full::new(Bytes::from(order.clone())))
            .unwrap();
        let res = s.http.request(req).await.unwrap();
        let status = res.status().as_u16();
        let body = res.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice::<Value>(&body).unwrap())
    };
    let (status, body) = send_order().await;
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("simulated_crash"))
    );
    // The token is spent; the order made from the form is the answer.
    let (status, body) = send_order().await;
    assert_eq!((status, body["status"].as_str()), (201, Some("created")));
    let id = body["order"].as_str().unwrap().to_owned();

    let path = format!("/orders/{id}");
    let cancel = json!({ "expected_version": 1, "status": "cancelled" }).to_string();
    let (status, body) = s.send(Method::PATCH, &path, Some("p"), &cancel).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("simulated_crash"))
    );
    // The order is at version 2 now; the change recorded after version 1 is this one.
    let (status, body) = s.send(Method::PATCH, &path, Some("p"), &cancel).await;
    let got = (status, body["status"].as_str(), body["version"].as_i64());
    assert_eq!(got, (200, Some("cancelled"), Some(2)));
    // Another change from version 1 is a conflict.
    let ship = json!({ "expected_version": 1, "status": "shipped" }).to_string();
    let (status, body) = s.send(Method::PATCH, &path, Some("q"), &ship).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (409, Some("version_conflict"))
    );
}

/// A wire whose service dies after the debit (before the bank call) is taken over by the next
/// process once its lease has run out: the debit is not made again, the bank is called once,
/// and a retry after that gets the same answer.
#[tokio::test]
async fn a_wire_stopped_between_steps_resumes_in_the_next_process() {
    // Dies at every chance: after the debit, the attempt dies holding the wire's key.
    let first = Shopfront::open_with(ServerChaos::new(1.0, 0, 1)).await;
    let wire = json!({ "from": 1, "to": "ext-7", "amount": 250 });
    let (status, body) = first.post("/wires", "w-1", wire.clone()).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("simulated_crash"))
    );
    let count = |s: &Shopfront, sql: &'static str| {
        let db = s.shop.db().clone();
        async move { db.rows(sql, &[]).await.unwrap()[0][0].clone() }
    };
    let balance = "SELECT balance FROM shop_accounts WHERE id = 1";
    let at_bank = "SELECT COUNT(*) FROM shop_bank_wires";
    assert_eq!(count(&first, balance).await, 750.into());
    assert_eq!(count(&first, at_bank).await, 0.into());

    let next = first.restarted(ServerChaos::off()).await;
    // Until the dead attempt's lease runs out, the wire is in progress.
    let (status, mut body) = next.post("/wires", "w-1", wire.clone()).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (503, Some("wire_in_progress"))
    );
    for _ in 0..50 {
        if body["code"] != "wire_in_progress" {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        body = next.post("/wires", "w-1", wire.clone()).await.1;
    }
    let (status, body) = next.post("/wires", "w-1", wire.clone()).await;
    assert_eq!(
        (status, body["outcome"].as_str()),
        (200, Some("sent")),
        "{body}"
    );
    assert_eq!(body["wire"], "w-1");
    let receipt = body["receipt"].as_str().unwrap().to_owned();
    assert_eq!(count(&next, balance).await, 750.into(), "debited once");
    assert_eq!(count(&next, at_bank).await, 1.into());
    let (status, again) = next.post("/wires", "w-1", wire).await;
    assert_eq!(
        (status, again["receipt"].as_str()),
        (200, Some(receipt.as_str()))
    );
    assert_eq!(count(&next, at_bank).await, 1.into());

    // More than the account holds: refused, and the refusal is the key's answer.
    let big = json!({ "from": 2, "to": "ext-7", "amount": 5000 });
    for _ in 0..2 {
        let (status, body) = next.post("/wires", "w-2", big.clone()).await;
        assert_eq!(
            (status, body["code"].as_str()),
            (409, Some("insufficient_funds"))
        );
    }
}
