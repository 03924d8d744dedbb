//! One connection: what it is doing now (a head owed, a request in flight, idle), the
//! deadline that follows, and the byte stream that reports every read to it.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, ready};

use axum::Router;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;

use super::activity::Activity;
use super::request::RequestService;
use super::{Limits, Log, OpenGuard};

pub(super) struct Connection {
    pub(super) limits: Arc<Limits>,
    pub(super) log: Arc<Log>,
    pub(super) app: Router,
    pub(super) peer: SocketAddr,
    pub(super) capped: bool,
    pub(super) activity: Arc<Activity>,
    pub(super) open: OpenGuard,
}

impl Connection {
    pub(super) async fn run(self, stream: TcpStream, mut stop: watch::Receiver<bool>) {
        let activity = self.activity;
        let io = TokioIo::new(Watched {
            inner: stream,
            activity: activity.clone(),
        });
        let service = RequestService {
            app: self.app,
            peer: self.peer,
            limits: self.limits.clone(),
            log: self.log.clone(),
            activity: activity.clone(),
            capped: self.capped,
        };
        let conn = hyper::server::conn::http1::Builder::new()
            .keep_alive(!self.capped)
            .header_read_timeout(None)
            .serve_connection(
                io,
                hyper::service::service_fn(move |req| service.clone().handle(req)),
            );
        let mut conn = std::pin::pin!(conn);
        let mut closing = false;
        loop {
            if activity.evicted.load(Ordering::Relaxed) {
                break;
            }
            let (deadline, bite) = activity.deadline(&self.limits);
            let expired = async {
                match deadline {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = conn.as_mut() => break,
                () = expired => {
                    // The connection may have moved on in this same wakeup.
                    if activity.deadline(&self.limits).0.is_some_and(|at| at <= Instant::now()) {
                        // Nothing in flight: closing drops no answer.
                        self.log.bite(bite);
                        break;
                    }
                }
                () = activity.changed.notified() => {}
                _ = stop.wait_for(|s| *s), if !closing => {
                    closing = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
        drop(self.open);
    }
}

/// The client's socket, noting when bytes arrive.
pub(super) struct Watched {
    pub(super) inner: TcpStream,
    pub(super) activity: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        ready!(Pin::new(&mut self.inner).poll_read(cx, buf))?;
        if buf.filled().len() > before {
            self.activity.received();
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
