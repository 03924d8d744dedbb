//! The guards' own rules, without a database.

use super::*;

#[test]
fn identifiers_are_plain() {
    assert!(Ident::new("coupon_instance").is_ok());
    assert!(Ident::new("shop.coupon_instance").is_ok());
    for bad in ["", "a b", "x;drop", "1x", "a.b.c", "a\"b"] {
        assert!(Ident::new(bad).is_err(), "{bad}");
    }
}

#[test]
fn undeclared_edges_and_states_are_refused() {
    let sm = StateMachine::new("t", "id", "s")
        .unwrap()
        .states(["new", "paid"])
        .edge("new", "paid")
        .unwrap();
    assert!(sm.check(&"new".into(), &"paid".into()).is_ok());
    assert!(matches!(
        sm.check(&"paid".into(), &"new".into()),
        Err(GuardError::UndeclaredTransition { .. })
    ));
    assert!(sm.edge("new", "shipped").is_err());
}

#[test]
fn sql_is_built_from_checked_names() {
    let sm = StateMachine::new("t", "id", "s").unwrap();
    assert_eq!(sm.update_sql(), "UPDATE t SET s = ? WHERE id = ? AND s = ?");
    assert_eq!(
        numbered(&sm.update_sql()),
        "UPDATE t SET s = $1 WHERE id = $2 AND s = $3"
    );
    let c = Counter::new("stock", "sku", "avail").unwrap();
    assert_eq!(
        c.update_sql(-2, |v| v.to_owned()).unwrap(),
        "UPDATE stock SET avail = avail + ? WHERE sku = ? AND avail >= 2"
    );
    assert_eq!(
        c.clone()
            .ceiling(10)
            .update_sql(3, |v| v.to_owned())
            .unwrap(),
        "UPDATE stock SET avail = avail + ? WHERE sku = ? AND avail <= 7"
    );
    assert!(c.floor(i64::MAX).update_sql(-1, |v| v.to_owned()).is_none());
    let v = Versioned::new("orders", "id", "version").unwrap();
    let cols = Versioned::columns(&[("status", "paid".into())]).unwrap();
    assert_eq!(
        v.update_sql(&cols),
        "UPDATE orders SET status = ?, version = version + 1 WHERE id = ? AND version = ?"
    );
}

#[test]
fn outcomes_serialize_for_replay() {
    let t = serde_json::to_string(&Transition::Conflict(3.into())).unwrap();
    assert_eq!(t, r#"{"outcome":"conflict","state":3}"#);
    let back: Transition = serde_json::from_str(&t).unwrap();
    assert_eq!(back, Transition::Conflict(Scalar::Int(3)));
    let b = serde_json::to_string(&Bounded::Insufficient(1)).unwrap();
    assert_eq!(b, r#"{"outcome":"insufficient","value":1}"#);
}
