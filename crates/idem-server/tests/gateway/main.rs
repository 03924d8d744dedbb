//! `idem gateway` over real sockets: a counting upstream, the gateway in front of it, and a
//! real HTTP client, for every rule and every way the upstream can fail.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use axum::http::{Method, Request, StatusCode};
use idem_gateway::gateway::{FileConfig, Gateway, Upstream as UpstreamUrl};
use serde_json::Value;
use tokio::net::TcpListener;

#[path = "../gateway_support/mod.rs"]
mod gateway_support;
use gateway_support::*;

mod failures;
mod operator;
mod replays;
mod routing;
