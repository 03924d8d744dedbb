//! Forwarding to the upstream, and what each way of failing means for the record.

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::body::Bytes;
use axum::extract::ConnectInfo;
use axum::http::uri::{Authority, PathAndQuery, Scheme};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Request, Response, Uri, header};
use http_body::Frame;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idem_core::BoxFuture;
use idem_http::policy::remove_hop_by_hop;
use idem_http::{
    BoxError, FENCE_HEADER, IDEMPOTENT_REPLAYED, LeaseFence, Problem, ProblemCode, Settle,
    ToProblem,
};
use tower_service::Service;

use super::resolve::BoundedResolver;

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
    /// Behind one `Arc`: the gateway's services are cloned for every request (a tower
    /// service is called by value), and the HTTP client alone holds several counted parts.
    inner: Arc<ProxyInner>,
}

/// The HTTP client the gateway and the relay send with (see [`client`]).
pub type UpstreamClient = Client<HttpConnector<BoundedResolver>, Body>;

#[derive(Clone)]
struct ProxyInner {
    client: UpstreamClient,
    upstream: Upstream,
    timeout: Duration,
    trusted: TrustedProxies,
}

/// The HTTP client the gateway and the relay send with, for requests that may take `timeout`:
/// its name lookup (a quarter, at most 5 s) and its connect (half, at most 5 s) are bounded by
/// less than that, so that a peer that cannot be reached, or whose name does not resolve, is
/// reported as such (nothing was sent: safe to retry) rather than as a timeout.
pub fn client(timeout: Duration) -> UpstreamClient {
    let lookup = (timeout / 4).min(Duration::from_secs(5));
    let mut connector = HttpConnector::new_with_resolver(BoundedResolver::new(lookup));
    connector.set_connect_timeout(Some((timeout / 2).min(Duration::from_secs(5))));
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new()).build(connector)
}

impl Proxy {
    /// A proxy to `upstream` that waits at most `timeout` for an answer.
    pub fn new(upstream: Upstream, timeout: Duration) -> Self {
        Self {
            inner: Arc::new(ProxyInner {
                client: client(timeout),
                upstream,
                timeout,
                trusted: TrustedProxies::default(),
            }),
        }
    }

    /// The same proxy, passing on the forwarding headers of requests from `trusted` peers.
    #[must_use]
    pub fn trusting(mut self, trusted: TrustedProxies) -> Self {
        Arc::make_mut(&mut self.inner).trusted = trusted;
        self
    }
}

/// The peers whose `X-Forwarded-*` and `Forwarded` headers are believed: the proxies in
/// front of the gateway. Empty by default: every client's are replaced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustedProxies(Vec<(IpAddr, u8)>);

impl TrustedProxies {
    /// Parses addresses (`10.0.0.7`, `::1`) and networks (`10.0.0.0/8`, `fd00::/8`);
    /// `0.0.0.0/0` and `::/0` trust everyone.
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<Self, String> {
        entries
            .iter()
            .map(|entry| {
                let entry = entry.as_ref();
                let bad = || {
                    format!(
                        "trusted_proxies: {entry:?} is not an address or a network \
                         (10.0.0.7, 10.0.0.0/8, fd00::/8)"
                    )
                };
                let (addr, len) = match entry.split_once('/') {
                    Some((addr, len)) => (addr, Some(len)),
                    None => (entry, None),
                };
                let addr: IpAddr = addr.trim().parse().map_err(|_| bad())?;
                let max = if addr.is_ipv4() { 32 } else { 128 };
                let len = match len {
                    Some(len) => len.trim().parse::<u8>().map_err(|_| bad())?,
                    None => max,
                };
                if len > max {
                    return Err(bad());
                }
                Ok((addr.to_canonical(), len))
            })
            .collect::<Result<_, String>>()
            .map(Self)
    }

    /// Whether `peer` is one of them (an IPv4 peer seen as `::ffff:a.b.c.d` counts as itself).
    pub fn contains(&self, peer: IpAddr) -> bool {
        let peer = peer.to_canonical();
        self.0.iter().any(|&(net, len)| match (net, peer) {
            (IpAddr::V4(n), IpAddr::V4(p)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
                u32::from(n) & mask == u32::from(p) & mask
            }
            (IpAddr::V6(n), IpAddr::V6(p)) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
                u128::from(n) & mask == u128::from(p) & mask
            }
            _ => false,
        })
    }

    /// Whether no peer is trusted.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Display for TrustedProxies {
    /// `10.0.0.0/8, ::1/128`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (addr, len)) in self.0.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{addr}/{len}")?;
        }
        Ok(())
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
        let proxy = self.inner.clone();
        Box::pin(async move { Ok(proxy.forward(req).await) })
    }
}

impl ProxyInner {
    async fn forward(&self, req: Request<Body>) -> Response<Body> {
        let fence = req.extensions().get::<LeaseFence>().map(|f| f.fence);
        let guarded = fence.is_some();
        let (mut parts, body) = req.into_parts();
        let Ok(uri) = self.upstream.uri_for(parts.uri.path_and_query()) else {
            return Problem::invalid_request("The request target cannot be forwarded.").into_http();
        };
        let peer = parts
            .extensions
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0.ip());
        let seen = Seen {
            peer,
            host: parts.uri.authority().map(|a| a.as_str().to_owned()),
            trusted: peer.is_some_and(|p| self.trusted.contains(p)),
        };
        forwarded_headers(&mut parts.headers, &seen);
        // A client's own is never passed on, in any spelling.
        remove_any_spelling(&mut parts.headers, &[FENCE_HEADER.as_str()]);
        if let Some(fence) = fence {
            parts.headers.insert(FENCE_HEADER, HeaderValue::from(fence));
        }
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
                // Only idem says an answer is a replay.
                remove_any_spelling(&mut head.headers, &[IDEMPOTENT_REPLAYED.as_str()]);
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
                    ProblemCode::UpstreamUnreachable,
                    "The upstream could not be reached; nothing was sent, so a retry is safe.",
                    Settle::Release,
                ),
            ),
            Ok(Err(_)) => (
                "failed",
                failure(
                    ProblemCode::UpstreamFailed,
                    "The connection to the upstream broke after the request was sent; \
                     whether it took effect is unknown.",
                    Settle::Unknown,
                ),
            ),
            Err(_) => (
                "timeout",
                failure(
                    ProblemCode::UpstreamTimeout,
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

fn failure(code: ProblemCode, detail: &'static str, settle: Settle) -> Response<Body> {
    let mut res: Response<Body> = code.problem(detail).into_http();
    res.extensions_mut().insert(settle);
    res
}

/// What the gateway saw of a request's connection.
struct Seen {
    /// The client's address.
    peer: Option<IpAddr>,
    /// The authority of an absolute-form request target (`POST http://host/path`).
    host: Option<String>,
    /// Whether the client is a trusted proxy.
    trusted: bool,
}

/// The fields through which proxies tell the upstream about the original request. A client
/// can write any of them, so they are believed only from a trusted proxy.
const FORWARDING_FIELDS: [&str; 7] = [
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
    "x-forwarded-port",
    "x-forwarded-prefix",
    "x-real-ip",
];

/// Removes the fields named `names` (lower case), and every field a server would read as one
/// of them: CGI and WSGI servers (wsgiref, gunicorn) and others that map `-` to `_` take
/// `Idem_Fence` for `Idem-Fence`, so a client could pass one on under a name the gateway never
/// looked at.
fn remove_any_spelling(headers: &mut HeaderMap, names: &[&str]) {
    let as_dashed = |name: &str, owned: &str| {
        name.len() == owned.len()
            && name
                .bytes()
                .zip(owned.bytes())
                .all(|(a, b)| a == b || (a == b'_' && b == b'-'))
    };
    let spelled: Vec<HeaderName> = headers
        .keys()
        .filter(|n| names.iter().any(|owned| as_dashed(n.as_str(), owned)))
        .cloned()
        .collect();
    for name in spelled {
        headers.remove(name);
    }
}

/// Prepares a request's header for the upstream: no hop-by-hop fields, `Host` set from the
/// upstream URL by the client, and this hop in `X-Forwarded-*`: the client's address appended
/// to `X-Forwarded-For`, the scheme (`http`: the gateway does not terminate TLS) in
/// `X-Forwarded-Proto` and the host the client asked for in `X-Forwarded-Host`.
///
/// From a trusted proxy, the forwarding fields it sent are kept (its `X-Forwarded-Proto:
/// https` stays, and the chain of `X-Forwarded-For` grows); from anyone else they are all
/// removed first, `Forwarded` and `X-Real-IP` included, so the upstream never believes a
/// client's claim about itself. `Forwarded` is passed on, never written.
fn forwarded_headers(headers: &mut HeaderMap, seen: &Seen) {
    remove_hop_by_hop(headers);
    let host = headers.remove(header::HOST).or_else(|| {
        seen.host
            .as_deref()
            .and_then(|h| HeaderValue::from_str(h).ok())
    });
    if !seen.trusted {
        remove_any_spelling(headers, &FORWARDING_FIELDS);
    }
    let forwarded_host = HeaderName::from_static("x-forwarded-host");
    if let (Some(host), false) = (host, headers.contains_key(&forwarded_host)) {
        headers.insert(forwarded_host, host);
    }
    headers
        .entry(HeaderName::from_static("x-forwarded-proto"))
        .or_insert(HeaderValue::from_static("http"));
    if let Some(ip) = seen.peer {
        let xff = HeaderName::from_static("x-forwarded-for");
        let mut chain: Vec<&str> = headers
            .get_all(&xff)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect();
        let ip = ip.to_canonical().to_string();
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
        let from_proxy = Seen {
            peer: Some([127, 0, 0, 1].into()),
            host: None,
            trusted: true,
        };
        forwarded_headers(&mut h, &from_proxy);
        assert!(h.get("x-private").is_none());
        assert!(h.get("keep-alive").is_none());
        assert!(h.get(header::CONNECTION).is_none());
        assert!(h.get(header::TRANSFER_ENCODING).is_none());
        assert!(h.get(header::HOST).is_none());
        assert_eq!(h["x-forwarded-host"], "api.example");
        assert_eq!(h["x-forwarded-for"], "10.0.0.1, 10.0.0.2, 127.0.0.1");
        assert_eq!(
            h["x-forwarded-proto"], "https",
            "a trusted proxy's value is kept"
        );
        assert_eq!(h[header::AUTHORIZATION], "Bearer t");
        let mut plain = HeaderMap::new();
        let unknown = Seen {
            peer: None,
            host: Some("api.example:8443".into()),
            trusted: false,
        };
        forwarded_headers(&mut plain, &unknown);
        assert_eq!(plain["x-forwarded-proto"], "http");
        assert_eq!(plain["x-forwarded-host"], "api.example:8443");
        assert!(plain.get("x-forwarded-for").is_none());
    }

    #[test]
    fn fields_idem_owns_are_removed_in_every_spelling() {
        let mut h = HeaderMap::new();
        for name in [
            "idem-fence",
            "idem_fence",
            "x_forwarded_for",
            "x-forwarded_for",
        ] {
            h.append(name, HeaderValue::from_static("1"));
        }
        h.insert("idem_fences", HeaderValue::from_static("kept"));
        h.insert("x_idem_fence", HeaderValue::from_static("kept"));
        remove_any_spelling(&mut h, &[FENCE_HEADER.as_str(), "x-forwarded-for"]);
        let mut left: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["idem_fences", "x_idem_fence"]);
        let client = Seen {
            peer: Some([192, 0, 2, 7].into()),
            host: None,
            trusted: false,
        };
        let mut h = HeaderMap::new();
        h.insert("x_real_ip", HeaderValue::from_static("10.9.9.9"));
        h.insert(
            "x_forwarded_host",
            HeaderValue::from_static("admin.internal"),
        );
        forwarded_headers(&mut h, &client);
        assert!(h.get("x_real_ip").is_none() && h.get("x_forwarded_host").is_none());
    }

    #[test]
    fn a_client_cannot_speak_for_itself() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("api.example"));
        for (name, value) in [
            ("x-forwarded-for", "10.9.9.9"),
            ("x-forwarded-for", "10.8.8.8"),
            ("x-forwarded-proto", "https"),
            ("x-forwarded-host", "admin.internal"),
            ("x-forwarded-port", "443"),
            ("x-forwarded-prefix", "/admin"),
            ("x-real-ip", "10.9.9.9"),
            ("forwarded", "for=10.9.9.9;proto=https"),
        ] {
            h.append(name, HeaderValue::from_static(value));
        }
        let client = Seen {
            peer: Some("::ffff:192.0.2.7".parse().unwrap()),
            host: None,
            trusted: false,
        };
        forwarded_headers(&mut h, &client);
        assert_eq!(h["x-forwarded-for"], "192.0.2.7");
        assert_eq!(h["x-forwarded-proto"], "http");
        assert_eq!(h["x-forwarded-host"], "api.example");
        for gone in [
            "x-forwarded-port",
            "x-forwarded-prefix",
            "x-real-ip",
            "forwarded",
        ] {
            assert!(h.get(gone).is_none(), "{gone}");
        }
        assert_eq!(h.get_all("x-forwarded-for").iter().count(), 1);
    }

    #[test]
    fn trusted_proxies() {
        let t = TrustedProxies::parse(&["10.0.0.0/8", "192.0.2.7", "fd00::/8", " ::1 "]).unwrap();
        for yes in ["10.1.2.3", "192.0.2.7", "::ffff:10.0.0.1", "fd12::1", "::1"] {
            assert!(t.contains(yes.parse().unwrap()), "{yes}");
        }
        for no in ["11.0.0.1", "192.0.2.8", "fe80::1", "::2", "127.0.0.1"] {
            assert!(!t.contains(no.parse().unwrap()), "{no}");
        }
        assert_eq!(t.to_string(), "10.0.0.0/8, 192.0.2.7/32, fd00::/8, ::1/128");
        let all = TrustedProxies::parse(&["0.0.0.0/0", "::/0"]).unwrap();
        assert!(all.contains("203.0.113.9".parse().unwrap()));
        assert!(all.contains("2001:db8::1".parse().unwrap()));
        assert!(TrustedProxies::parse::<&str>(&[]).unwrap().is_empty());
        for bad in [
            "10.0.0.0/33",
            "::/129",
            "localhost",
            "10.0.0.0/x",
            "10.0.0/8",
            "",
        ] {
            assert!(TrustedProxies::parse(&[bad]).is_err(), "{bad}");
        }
    }
}
