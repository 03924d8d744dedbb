//! The eight scenarios, one file each, numbered as the README's table lists them (and as the
//! clients pick them): each file holds its routes' handlers, its scheme, and the hand-written
//! code its guard falls back to when switched off.
//!
//! | # | file | scheme | routes |
//! | --- | --- | --- | --- |
//! | 1 | `transfer.rs` | server-issued ticket, accounts locked in id order, conditional debit | `POST /tickets`, `PUT /accounts/{id}/transfers/{ticket}` |
//! | 2 | `inventory.rs` | deduction keyed by order number, conditional decrement | `POST /inventory/deductions` |
//! | 3 | `coupon.rs` | state machine; the job that expires coupons | `POST /coupons/{id}/hold` |
//! | 4 | `order_form.rs` | one-time token in `Form-Token` | `POST /form-tokens`, `POST /orders` |
//! | 5 | `account.rs` | unique index on the user | `POST /users/{user}/account` |
//! | 6 | `payment.rs` | callbacks deduplicated by payment id, the order's state machine | `POST /payments/callback` |
//! | 7 | `order_status.rs` | optimistic lock on `version` | `GET`/`PATCH /orders/{id}` |
//! | 8 | `wire.rs` | steps with recovery points; the bank called with each step's own key | `POST /wires` |

// In the README's order, not the alphabet's.

pub(super) mod transfer;

pub(super) mod inventory;

pub(super) mod coupon;

pub(super) mod order_form;

pub(super) mod account;

pub(super) mod payment;

pub(super) mod order_status;

pub(super) mod wire;
