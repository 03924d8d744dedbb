//! The API's OpenAPI 3.1 document, served at `GET /openapi.json`.
//!
//! Request bodies and query parameters are the handlers' own types, and so are the record
//! API's answers ([`crate::answers`]); the problem body and the answers `idem-ops` writes are
//! described in `answers`; the operations are in `ops`. Each operation's errors come from one table (`ERRORS`, in
//! `errors`): for every status an operation may answer with a
//! problem, the document lists the `code`s it may carry, so a client (or a test) can tell an
//! undocumented error from a documented one. `crates/idem-server/openapi.json` is this
//! document as committed; `tests/openapi.rs` keeps the two equal.

use serde_json::Value;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::{Modify, OpenApi};

mod answers;
mod errors;
mod ops;

use answers::Problem;
use errors::Errors;

/// The document, as `GET /openapi.json` serves it.
pub fn document() -> Value {
    let mut doc = serde_json::to_value(ApiDoc::openapi()).unwrap_or_default();
    spell_unsigned_formats(&mut doc);
    doc
}

/// The document as pretty-printed JSON with a final newline, as committed.
pub fn pretty() -> String {
    let mut text = serde_json::to_string_pretty(&document()).unwrap_or_default();
    text.push('\n');
    text
}

/// `GET /openapi.json`.
pub(crate) async fn serve() -> axum::Json<Value> {
    axum::Json(document())
}

/// Unsigned integers are described as `uint8` … `uint64` (OpenAPI's `int64` would cap them at
/// 2^63 - 1); utoipa 5 spells these formats `u-int64`.
fn spell_unsigned_formats(v: &mut Value) {
    match v {
        Value::Object(map) => {
            for (name, member) in map.iter_mut() {
                if let (true, Value::String(format)) = (name == "format", &mut *member) {
                    if let Some(bits) = format.strip_prefix("u-int") {
                        *format = format!("uint{bits}");
                    }
                } else {
                    spell_unsigned_formats(member);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(spell_unsigned_formats),
        _ => {}
    }
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "idem",
        description = "The idem server's JSON API: idempotency records, one-time tokens, locks \
                       and ids for services in any language, and the operator's endpoints under \
                       `/_idem`: health and metrics on both listeners, the admin page and the \
                       record tools (tag `admin`) on the admin listener only (--admin-listen). \
                       Every error is an RFC 9457 problem+json with a stable `code`."
    ),
    paths(
        ops::healthz,
        ops::begin,
        ops::step,
        ops::renew,
        ops::complete,
        ops::release,
        ops::get_record,
        ops::issue_token,
        ops::consume_token,
        ops::acquire_lock,
        ops::renew_lock,
        ops::release_lock,
        ops::uuid7,
        ops::snowflake,
        ops::segment,
        ops::openapi_json,
        ops::admin_health,
        ops::admin_metrics,
        ops::admin_page,
        ops::admin_page_slash,
        ops::admin_script,
        ops::admin_style,
        ops::records_list,
        ops::records_counts,
        ops::records_show,
        ops::records_history,
        ops::records_repair,
        ops::segments,
        ops::locks_held,
    ),
    components(schemas(Problem)),
    modifiers(&Security, &Errors),
    tags(
        (name = "records", description = "Idempotency records: claim a key, store the answer, replay it."),
        (name = "tokens", description = "One-time tokens, each caller's its own."),
        (name = "locks", description = "Locks with fencing tokens."),
        (name = "ids", description = "UUIDv7, Snowflake and segment ids."),
        (name = "health", description = "Health and metrics."),
        (name = "admin", description = "The admin page and the operator's record tools, behind the admin token, on the admin listener (--admin-listen) only."),
    )
)]
struct ApiDoc;

/// The name of the API key scheme.
const API_KEY: &str = "api_key";
/// The name of the admin token scheme.
const ADMIN_TOKEN: &str = "admin_token";

struct Security;

impl Modify for Security {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        let bearer = |description: &str| {
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(description))
                    .build(),
            )
        };
        components.add_security_scheme(
            API_KEY,
            bearer(
                "An API key from the server's --api-keys file, as `Authorization: Bearer <key>`. \
                 A server without one serves every caller anonymously, under one scope.",
            ),
        );
        components.add_security_scheme(
            ADMIN_TOKEN,
            bearer(
                "The admin token (--admin-token-file), as `Authorization: Bearer <token>`. \
                 Without one the record tools answer 403 `admin_disabled`.",
            ),
        );
        for (path, item) in doc.paths.paths.iter_mut() {
            let requirement = if path.starts_with("/v1/") {
                // Anonymous callers too, on a server without API keys.
                vec![
                    SecurityRequirement::default(),
                    SecurityRequirement::new(API_KEY, Vec::<String>::new()),
                ]
            } else if path.starts_with("/_idem/records")
                || path == "/_idem/segments"
                || path == "/_idem/locks"
            {
                vec![SecurityRequirement::new(ADMIN_TOKEN, Vec::<String>::new())]
            } else {
                continue;
            };
            for op in [&mut item.get, &mut item.post].into_iter().flatten() {
                op.security = Some(requirement.clone());
            }
        }
    }
}
