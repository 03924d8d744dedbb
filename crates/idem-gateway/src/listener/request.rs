//! One request on a connection: marked in flight until its answer is written, with a body
//! that must arrive within the body timeout.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::ConnectInfo;
use axum::http::{HeaderValue, Request, Response, header};
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use idem_http::{ProblemCode, ToProblem};
use tokio::time::Sleep;
use tower_service::Service;

use super::activity::Activity;
use super::{Bite, Limits, Log};

/// One connection's requests into the router.
#[derive(Clone)]
pub(super) struct RequestService {
    pub(super) app: Router,
    pub(super) peer: SocketAddr,
    pub(super) limits: Arc<Limits>,
    pub(super) log: Arc<Log>,
    pub(super) activity: Arc<Activity>,
    pub(super) capped: bool,
}

impl RequestService {
    pub(super) async fn handle(
        mut self,
        req: Request<Incoming>,
    ) -> Result<Response<Tracked>, Infallible> {
        self.activity.request_started();
        // Dropped with the response body, or with this future if the client goes away.
        let finished = Finished(self.activity.clone());
        if self.capped && req.uri().path() != self.limits.health_path {
            let res = ProblemCode::Overloaded
                .problem("The server is at its connection limit; try again shortly.")
                .retry_after(Duration::from_secs(1))
                .into_http::<Body>();
            return Ok(close(res).map(|b| Tracked::new(b, finished)));
        }
        let timed_out = Arc::new(AtomicBool::new(false));
        let (parts, body) = req.into_parts();
        let body = TimeoutBody {
            inner: body,
            deadline: tokio::time::Instant::now() + self.limits.body_timeout,
            sleep: None,
            timed_out: timed_out.clone(),
        };
        let mut req = Request::from_parts(parts, Body::new(body));
        req.extensions_mut().insert(ConnectInfo(self.peer));
        let Ok(mut res) = self.app.call(req).await;
        // Whatever the handler made of the failed read, the client hears why.
        if timed_out.load(Ordering::Relaxed) {
            self.log.bite(Bite::Body);
            res = close(
                ProblemCode::BodyTimeout
                    .problem(format!(
                        "The request body did not arrive within {}.",
                        humantime::format_duration(self.limits.body_timeout)
                    ))
                    .into_http::<Body>(),
            );
        }
        Ok(res.map(|b| Tracked::new(b, finished)))
    }
}

/// Marks the response to end its connection.
pub(super) fn close(mut res: Response<Body>) -> Response<Body> {
    res.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    res
}

/// Marks a request finished when its response has been written (or dropped).
pub(super) struct Finished(Arc<Activity>);

impl Drop for Finished {
    fn drop(&mut self) {
        self.0.request_finished();
    }
}

/// A response body that marks its request finished when dropped.
pub(super) struct Tracked {
    inner: Body,
    _finished: Finished,
}

impl Tracked {
    pub(super) fn new(inner: Body, finished: Finished) -> Self {
        Self {
            inner,
            _finished: finished,
        }
    }
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The error a request body gives when it is too slow.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within the body timeout")]
pub(super) struct BodyTimedOut;

/// A request body that fails once its deadline (counted from the head) passes. The timer is
/// armed only when a read has to wait, so a request whose body is already there (or empty, as
/// most are) registers none.
pub(super) struct TimeoutBody {
    pub(super) inner: Incoming,
    pub(super) deadline: tokio::time::Instant,
    pub(super) sleep: Option<Pin<Box<Sleep>>>,
    pub(super) timed_out: Arc<AtomicBool>,
}

impl http_body::Body for TimeoutBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        let deadline = self.deadline;
        let sleep = self
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        ready!(sleep.as_mut().poll(cx));
        self.timed_out.store(true, Ordering::Relaxed);
        Poll::Ready(Some(Err(BodyTimedOut.into())))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
