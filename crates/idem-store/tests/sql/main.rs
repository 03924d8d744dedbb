//! The PostgreSQL and MySQL/MariaDB stores against real servers: the conformance suite,
//! migrations, failures, and same-transaction mode. Each suite is skipped (with a note) when
//! its server does not answer, except under `CI=true`.

#![cfg(any(feature = "postgres", feature = "mysql"))]
#![allow(clippy::unwrap_used)]

#[macro_use]
mod store_tests;

#[cfg(feature = "postgres")]
mod postgres;

#[cfg(feature = "mysql")]
mod mysql;
