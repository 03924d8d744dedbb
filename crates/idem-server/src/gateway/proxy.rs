//! Forwarding to the upstream, and what each way of failing means for the record.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::uri::{Authority, PathAndQuery, Scheme};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, Uri, header};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idem_http::{Guarded, Problem, Settle};
use tower_service::Service;

/// Where requests go: an `http://` origin and an optional base path.
#[derive(Debug, Clone)]
pub struct Upstream {
    authority: Authority,
    base_path: String,
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
            base_path: uri.path().trim_end_matches('/').to_owned(),
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
/// For guarded requests the whole answer is read within the timeout, so that a body that
/// stalls half way counts as a timeout; other requests stream both ways.
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

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl Service<Request<Body>> for Proxy {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Response<Body>, Infallible>>;

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
        let exchange = async {
            let res = self
                .client
                .request(Request::from_parts(parts, body))
                .await?;
            let (mut head, body) = res.into_parts();
            strip_hop_by_hop(&mut head.headers);
            head.version = axum::http::Version::default();
            let body = if guarded {
                Body::from(body.collect().await?.to_bytes())
            } else {
                Body::new(body)
            };
            Ok::<_, Failure>(Response::from_parts(head, body))
        };
        let result = tokio::time::timeout(self.timeout, exchange).await;
        metrics::histogram!("idem_gateway_upstream_seconds")
            .record(started.elapsed().as_secs_f64());
        let (outcome, res) = match result {
            Ok(Ok(res)) => ("answered", res),
            Ok(Err(Failure::Client(e))) if e.is_connect() => (
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

/// How an exchange with the upstream failed.
enum Failure {
    Client(hyper_util::client::legacy::Error),
    Body,
}

impl From<hyper_util::client::legacy::Error> for Failure {
    fn from(e: hyper_util::client::legacy::Error) -> Self {
        Self::Client(e)
    }
}

impl From<hyper::Error> for Failure {
    fn from(_: hyper::Error) -> Self {
        Self::Body
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

/// RFC 9110 §7.6.1: drops the fields that describe one connection, including those the
/// `Connection` field names.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let nominated: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in nominated {
        headers.remove(name);
    }
    let hop: Vec<HeaderName> = headers
        .keys()
        .filter(|n| idem_http::policy::is_hop_by_hop(n))
        .cloned()
        .collect();
    for name in hop {
        headers.remove(name);
    }
}

/// Prepares a request's header for the upstream: no hop-by-hop fields, `Host` set from the
/// upstream URL by the client, and the original host and client in `X-Forwarded-*`.
fn forwarded_headers(headers: &mut HeaderMap, peer: Option<std::net::IpAddr>) {
    strip_hop_by_hop(headers);
    if let Some(host) = headers.remove(header::HOST) {
        headers.insert(HeaderName::from_static("x-forwarded-host"), host);
    }
    headers.insert(
        HeaderName::from_static("x-forwarded-proto"),
        HeaderValue::from_static("http"),
    );
    if let Some(ip) = peer {
        let xff = HeaderName::from_static("x-forwarded-for");
        let value = match headers.get(&xff).and_then(|v| v.to_str().ok()) {
            Some(prior) => format!("{prior}, {ip}"),
            None => ip.to_string(),
        };
        if let Ok(v) = HeaderValue::from_str(&value) {
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
        h.insert("x-forwarded-for", HeaderValue::from_static("10.0.0.1"));
        forwarded_headers(&mut h, Some([127, 0, 0, 1].into()));
        assert!(h.get("x-private").is_none());
        assert!(h.get("keep-alive").is_none());
        assert!(h.get(header::CONNECTION).is_none());
        assert!(h.get(header::TRANSFER_ENCODING).is_none());
        assert!(h.get(header::HOST).is_none());
        assert_eq!(h["x-forwarded-host"], "api.example");
        assert_eq!(h["x-forwarded-for"], "10.0.0.1, 127.0.0.1");
        assert_eq!(h[header::AUTHORIZATION], "Bearer t");
    }
}
