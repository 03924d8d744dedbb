//! Forwarding to the upstream, and what each way of failing means for the record.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::body::Bytes;
use axum::extract::ConnectInfo;
use axum::http::uri::{Authority, PathAndQuery, Scheme};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, Uri, header};
use http_body::Frame;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idem_core::BoxFuture;
use idem_http::policy::remove_hop_by_hop;
use idem_http::{BoxError, Guarded, Problem, Settle};
use tower_service::Service;

/// Where requests go: an `http://` origin and an optional base path.
#[derive(Debug, Clone)]
pub struct Upstream {
    authority: Authority,
    base_path: Arc<str>,
}

impl Upstream {
    /// Parses `http://host:port[/base]`.
    pub fn parse(url: &str) -> Result<Self, String> {
        let uri: Uri = url
            .parse()
            .map_err(|e| format!("upstream {url:?} is not a URL: {e}"))?;
        if uri.scheme() != Some(&Scheme::HTTP) {
            return Err(format!(
                "upstream {url:?} must be an http:// URL (put TLS termination in front of idem)"
            ));
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| format!("upstream {url:?} has no host"))?;
        if uri.query().is_some() {
            return Err(format!("upstream {url:?} must not have a query"));
        }
        Ok(Self {
            authority,
            base_path: uri.path().trim_end_matches('/').into(),
        })
    }

    fn uri_for(&self, path_and_query: Option<&PathAndQuery>) -> Result<Uri, axum::http::Error> {
        let pq = path_and_query.map_or("/", PathAndQuery::as_str);
        Uri::builder()
            .scheme(Scheme::HTTP)
            .authority(self.authority.clone())
            .path_and_query(format!("{}{pq}", self.base_path))
            .build()
    }
}

/// A reverse proxy to one upstream, as a tower service that never fails: every upstream
/// failure becomes a problem response carrying the [`Settle`] it implies.
///
/// - Refused or failed before the request was sent: 502 `upstream_unreachable`, and the key
///   is released (nothing reached the upstream, so a retry is safe).
/// - Timed out, or broken after the request was sent: 504 `upstream_timeout` or 502
///   `upstream_failed`, and the outcome is recorded as unknown.
///
/// The timeout covers the answer's head; for guarded requests it also covers the body, which
/// then fails at the deadline (the layer records a body that breaks off as an unknown
/// outcome). Other requests stream both ways without a deadline on the body. Nothing is
/// buffered here: the layer reads a guarded answer up to its `max_response`.
#[derive(Clone)]
pub struct Proxy {
    client: Client<HttpConnector, Body>,
    upstream: Upstream,
    timeout: Duration,
}

impl Proxy {
    /// A proxy to `upstream` that waits at most `timeout` for an answer.
    pub fn new(upstream: Upstream, timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        // Shorter than the whole timeout, so that an upstream that cannot be reached is
        // reported as such (and the key released) rather than as an unknown outcome.
        connector.set_connect_timeout(Some((timeout / 2).min(Duration::from_secs(5))));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new()).build(connector);
        Self {
            client,
            upstream,
            timeout,
        }
    }
}

impl Service<Request<Body>> for Proxy {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let proxy = self.clone();
        Box::pin(async move { Ok(proxy.forward(req).await) })
    }
}

impl Proxy {
    async fn forward(self, req: Request<Body>) -> Response<Body> {
        let guarded = req.extensions().get::<Guarded>().is_some();
        let (mut parts, body) = req.into_parts();
        let Ok(uri) = self.upstream.uri_for(parts.uri.path_and_query()) else {
            return Problem::invalid_request("The request target cannot be forwarded.").into_http();
        };
        let peer = parts
            .extensions
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0.ip());
        forwarded_headers(&mut parts.headers, peer);
        parts.uri = uri;
        parts.version = axum::http::Version::HTTP_11;
        parts.extensions = Default::default();
        let started = Instant::now();
        let deadline = tokio::time::Instant::from_std(started) + self.timeout;
        let sent = self.client.request(Request::from_parts(parts, body));
        let result = tokio::time::timeout_at(deadline, sent).await;
        metrics::histogram!("idem_gateway_upstream_seconds")
            .record(started.elapsed().as_secs_f64());
        let (outcome, res) = match result {
            Ok(Ok(res)) => {
                let (mut head, body) = res.into_parts();
                remove_hop_by_hop(&mut head.headers);
                head.version = axum::http::Version::default();
                let body = if guarded {
                    Body::new(Deadline::new(body, deadline))
                } else {
                    Body::new(body)
                };
                ("answered", Response::from_parts(head, body))
            }
            Ok(Err(e)) if e.is_connect() => (
                "unreachable",
                failure(
                    StatusCode::BAD_GATEWAY,
                    "upstream_unreachable",
                    "Upstream unreachable",
                    "The upstream could not be reached; nothing was sent, so a retry is safe.",
                    Settle::Release,
                ),
            ),
            Ok(Err(_)) => (
                "failed",
                failure(
                    StatusCode::BAD_GATEWAY,
                    "upstream_failed",
                    "Upstream failed",
                    "The connection to the upstream broke after the request was sent; \
                     whether it took effect is unknown.",
                    Settle::Unknown,
                ),
            ),
            Err(_) => (
                "timeout",
                failure(
                    StatusCode::GATEWAY_TIMEOUT,
                    "upstream_timeout",
                    "Upstream timed out",
                    "The upstream did not answer in time; whether the request took effect \
                     is unknown.",
                    Settle::Unknown,
                ),
            ),
        };
        metrics::counter!("idem_gateway_upstream_total", "outcome" => outcome).increment(1);
        res
    }
}

/// A response body that fails if it has not ended by a deadline.
struct Deadline {
    body: Incoming,
    sleep: Pin<Box<tokio::time::Sleep>>,
}

impl Deadline {
    fn new(body: Incoming, deadline: tokio::time::Instant) -> Self {
        Self {
            body,
            sleep: Box::pin(tokio::time::sleep_until(deadline)),
        }
    }
}

impl http_body::Body for Deadline {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.body).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        match self.sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err("the upstream's answer timed out".into()))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

fn failure(
    status: StatusCode,
    code: &'static str,
    title: &'static str,
    detail: &'static str,
    settle: Settle,
) -> Response<Body> {
    let mut res: Response<Body> = Problem::new(status, code, title, detail).into_http();
    res.extensions_mut().insert(settle);
    res
}

/// Prepares a request's header for the upstream: no hop-by-hop fields, `Host` set from the
/// upstream URL by the client, and the original host, scheme and client in `X-Forwarded-*`.
/// Values a proxy in front already set (a TLS terminator's `X-Forwarded-Proto: https`) are
/// kept; this hop's client address is appended to `X-Forwarded-For`.
fn forwarded_headers(headers: &mut HeaderMap, peer: Option<std::net::IpAddr>) {
    remove_hop_by_hop(headers);
    let host = headers.remove(header::HOST);
    let forwarded_host = HeaderName::from_static("x-forwarded-host");
    if let (Some(host), false) = (host, headers.contains_key(&forwarded_host)) {
        headers.insert(forwarded_host, host);
    }
    headers
        .entry(HeaderName::from_static("x-forwarded-proto"))
        .or_insert(HeaderValue::from_static("http"));
    if let Some(ip) = peer {
        let xff = HeaderName::from_static("x-forwarded-for");
        let mut chain: Vec<&str> = headers
            .get_all(&xff)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect();
        let ip = ip.to_string();
        chain.push(&ip);
        if let Ok(v) = HeaderValue::from_str(&chain.join(", ")) {
            headers.insert(xff, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_urls() {
        let u = Upstream::parse("http://127.0.0.1:8080/api/").unwrap();
        let pq = PathAndQuery::from_static("/orders?x=1");
        assert_eq!(
            u.uri_for(Some(&pq)).unwrap().to_string(),
            "http://127.0.0.1:8080/api/orders?x=1"
        );
        for bad in ["https://x", "127.0.0.1:80", "http://x/?q=1", "nonsense url"] {
            assert!(Upstream::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn hop_by_hop_fields_are_dropped() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("close, x-private"),
        );
        h.insert("x-private", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::HOST, HeaderValue::from_static("api.example"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer t"));
        h.append("x-forwarded-for", HeaderValue::from_static("10.0.0.1"));
        h.append("x-forwarded-for", HeaderValue::from_static("10.0.0.2"));
        h.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        forwarded_headers(&mut h, Some([127, 0, 0, 1].into()));
        assert!(h.get("x-private").is_none());
        assert!(h.get("keep-alive").is_none());
        assert!(h.get(header::CONNECTION).is_none());
        assert!(h.get(header::TRANSFER_ENCODING).is_none());
        assert!(h.get(header::HOST).is_none());
        assert_eq!(h["x-forwarded-host"], "api.example");
        assert_eq!(h["x-forwarded-for"], "10.0.0.1, 10.0.0.2, 127.0.0.1");
        assert_eq!(
            h["x-forwarded-proto"], "https",
            "a front proxy's value is kept"
        );
        let mut plain = HeaderMap::new();
        forwarded_headers(&mut plain, None);
        assert_eq!(plain["x-forwarded-proto"], "http");
        assert_eq!(h[header::AUTHORIZATION], "Bearer t");
    }
}
