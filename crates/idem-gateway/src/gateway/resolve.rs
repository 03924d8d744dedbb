//! Name lookups for the upstream client, with a deadline.
//!
//! hyper-util's `HttpConnector` resolves the host before it starts its connect timer, so its
//! connect timeout does not bound the lookup. A resolver that stalls (glibc's default is 5 s a
//! try, two tries a name server) would then run into the whole request's deadline, and a
//! request that never left would be reported as a timeout: an unknown outcome, held until an
//! operator or the TTL clears it. Bounded here, a stalled lookup fails as a connect error
//! (nothing was sent: the key is released, a retry is safe). No crate offers this bound on
//! hyper-util's resolver; it is a timeout around its future.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::client::legacy::connect::dns::{GaiResolver, Name};
use tower_service::Service;

/// A resolver whose lookups fail with [`io::ErrorKind::TimedOut`] after `timeout`.
#[derive(Clone, Debug)]
pub struct BoundedResolver<R = GaiResolver> {
    inner: R,
    timeout: Duration,
}

impl BoundedResolver {
    /// The system's resolver (`getaddrinfo`, on a blocking thread), bounded by `timeout`.
    pub fn new(timeout: Duration) -> Self {
        Self::over(GaiResolver::new(), timeout)
    }
}

impl<R> BoundedResolver<R> {
    /// `inner`, bounded by `timeout`.
    pub fn over(inner: R, timeout: Duration) -> Self {
        Self { inner, timeout }
    }
}

impl<R> Service<Name> for BoundedResolver<R>
where
    R: Service<Name, Error = io::Error>,
    R::Future: Send + 'static,
{
    type Response = R::Response;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<R::Response>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, name: Name) -> Self::Future {
        let lookup = self.inner.call(name);
        let timeout = self.timeout;
        Box::pin(async move {
            // A `getaddrinfo` cannot be cancelled: its blocking thread finishes on its own.
            tokio::time::timeout(timeout, lookup)
                .await
                .unwrap_or_else(|_| {
                    Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("the name did not resolve within {timeout:?}"),
                    ))
                })
        })
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use axum::body::Body;
    use hyper_util::client::legacy::Client;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::TokioExecutor;

    use super::*;

    /// A resolver that never answers.
    #[derive(Clone)]
    struct Stalled;

    impl Service<Name> for Stalled {
        type Response = std::vec::IntoIter<SocketAddr>;
        type Error = io::Error;
        type Future = std::future::Pending<io::Result<Self::Response>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _: Name) -> Self::Future {
            std::future::pending()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_lookup_is_a_connect_error_by_its_deadline() {
        let resolver = BoundedResolver::over(Stalled, Duration::from_secs(2));
        let client: Client<_, Body> =
            Client::builder(TokioExecutor::new()).build(HttpConnector::new_with_resolver(resolver));
        let started = tokio::time::Instant::now();
        let sent = client.request(
            axum::http::Request::post("http://upstream.invalid/pay")
                .body(Body::empty())
                .expect("request"),
        );
        let err = tokio::time::timeout(Duration::from_secs(60), sent)
            .await
            .expect("answered before the request's own deadline")
            .expect_err("nothing resolved");
        assert!(
            err.is_connect(),
            "a connect error, so nothing was sent: {err:?}"
        );
        assert_eq!(started.elapsed(), Duration::from_secs(2));
    }
}
