//! One tracing span per request, named by a request id that the caller may give in
//! `X-Request-Id` (a gateway also passes it to its upstream) and that every answer carries
//! back, so a log line, a store call (a child span, see [`crate::metered`]) and a client's
//! report can be matched. The span holds the method and the id, never the path (it may hold a
//! client's key) or a body.

use std::convert::Infallible;
use std::task::{Context, Poll};

use axum::extract::Request;
use axum::http::{HeaderName, HeaderValue};
use axum::response::Response;
use idem_core::BoxFuture;
use tower_layer::Layer;
use tower_service::Service;
use tracing::Instrument;

/// The request id header.
pub static REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The longest request id taken from a caller; a longer or odd one is replaced.
pub const MAX_REQUEST_ID: usize = 128;

/// The caller's request id if it is one word of visible ASCII of at most [`MAX_REQUEST_ID`]
/// bytes, or a new one.
fn request_id(given: Option<&HeaderValue>) -> HeaderValue {
    given
        .filter(|v| {
            let b = v.as_bytes();
            !b.is_empty() && b.len() <= MAX_REQUEST_ID && b.iter().all(u8::is_ascii_graphic)
        })
        .cloned()
        .unwrap_or_else(|| {
            // 32 hex digits always make a valid header value.
            HeaderValue::from_str(&idem_core::random_hex128())
                .unwrap_or_else(|_| HeaderValue::from_static("unknown"))
        })
}

/// The layer that runs each request in its span and returns the id (see the module's
/// notes). Written as a tower layer rather than `axum::middleware::from_fn`, which clones the
/// service below it and boxes a future for every request on top of the clone axum's route
/// makes anyway.
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestSpanLayer;

impl<S> Layer<S> for RequestSpanLayer {
    type Service = RequestSpan<S>;

    fn layer(&self, inner: S) -> RequestSpan<S> {
        RequestSpan { inner }
    }
}

/// The service of [`RequestSpanLayer`].
#[derive(Debug, Clone)]
pub struct RequestSpan<S> {
    inner: S,
}

impl<S> Service<Request> for RequestSpan<S>
where
    S: Service<Request, Response = Response, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request) -> Self::Future {
        let id = request_id(req.headers().get(&REQUEST_ID));
        req.headers_mut().insert(REQUEST_ID.clone(), id.clone());
        let span = tracing::info_span!(
            "request",
            id = %String::from_utf8_lossy(id.as_bytes()),
            method = %req.method(),
            status = tracing::field::Empty,
        );
        let answer = span.in_scope(|| self.inner.call(req));
        Box::pin(async move {
            let mut res = answer.instrument(span.clone()).await?;
            span.record("status", res.status().as_u16());
            res.headers_mut().insert(REQUEST_ID.clone(), id);
            Ok(res)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caller_s_id_is_kept_only_when_sound() {
        let ok = HeaderValue::from_static("req-42");
        assert_eq!(request_id(Some(&ok)), ok);
        for bad in ["", "two words", &"x".repeat(MAX_REQUEST_ID + 1)] {
            let given = HeaderValue::from_str(bad).unwrap();
            let made = request_id(Some(&given));
            assert_ne!(made, given);
            assert_eq!(made.len(), 32);
        }
        assert_eq!(request_id(None).len(), 32);
    }
}
