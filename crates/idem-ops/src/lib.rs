//! What every idem HTTP service (`idem serve`, `idem gateway`) shares for its operators.
//!
//! - [`admin`]: the admin token, the record tools (list, count, show, repair with a preview)
//!   as an HTTP API and as functions the CLI calls, and the admin page.
//! - [`health`]: health by component, logged when it changes.
//! - [`metrics`]: a Prometheus text recorder; [`metered`]: a store that times its calls.
//! - [`trace`]: one span per request, named by its request id.
//! - [`json`]: bounded JSON bodies and path parameters whose every rejection is problem+json.

pub mod admin;
pub mod health;
pub mod json;
pub mod metered;
pub mod metrics;
pub mod trace;
