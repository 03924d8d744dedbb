//! The gRPC layer in front of a tonic server: every status it answers, and a client retrying
//! through a proxy that loses requests and answers.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod bank;
mod chaos;
mod statuses;
