//! The admin page: one HTML file, a script and a style sheet, built into the binary (no build
//! step, nothing fetched from elsewhere). The page holds no data: it signs in with the admin
//! token and reads the record tools' JSON endpoints beside it.

use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use idem_http::{ProblemCode, ToProblem};

use super::RecordTools;

const INDEX: &str = include_str!("page/index.html");
const SCRIPT: &str = include_str!("page/app.js");
const STYLE: &str = include_str!("page/app.css");

/// Only this page's own files, no inline code, no framing, no form posts elsewhere.
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
                      connect-src 'self'; img-src 'self' data:; base-uri 'none'; \
                      form-action 'none'; frame-ancestors 'none'";

fn asset(body: &'static str, content_type: &'static str) -> Response {
    let mut res = body.into_response();
    let h = res.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(POLICY),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    res
}

/// The page, at the reserved prefix itself; off (403 `admin_disabled`) without an admin
/// token. Its assets are named under the configured prefix in normal form, never under the
/// path as asked: `//evil.example/..//_idem` reaches the page too, and a script named from it
/// would come from another host.
pub(super) async fn index(State(t): State<RecordTools>) -> Response {
    if t.token.is_none() {
        return ProblemCode::AdminDisabled
            .problem(
                "The admin page needs an admin token: start the server with --admin-token-file \
                 (admin_token_file in a gateway's config).",
            )
            .into_response();
    }
    // A prefix holds no quotes or angle brackets, but the page is markup: escape anyway.
    let base = format!("{}/", t.prefix.trim_end_matches('/'))
        .replace('&', "&amp;")
        .replace('"', "&quot;")
        .replace('<', "&lt;");
    let mut res = asset("", "text/html; charset=utf-8");
    *res.body_mut() = axum::body::Body::from(INDEX.replace("{{base}}", &base));
    res
}

pub(super) async fn script() -> Response {
    asset(SCRIPT, "text/javascript; charset=utf-8")
}

pub(super) async fn style() -> Response {
    asset(STYLE, "text/css; charset=utf-8")
}
