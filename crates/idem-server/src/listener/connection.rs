//! One connection: what it is doing now (a head owed, a request in flight, idle), the
//! deadline that follows, and the byte stream that reports every read to it.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, ready};

use axum::Router;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use super::request::RequestService;
use super::{Bite, Limits, Log, OpenGuard};

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

/// What a connection is doing, for the header and idle timeouts.
pub(super) struct Activity {
    pub(super) state: Mutex<Phase>,
    pub(super) changed: Notify,
    /// Set to close the connection to make room for a newer one.
    pub(super) evicted: AtomicBool,
}

pub(super) struct Phase {
    pub(super) in_flight: usize,
    /// Whether a request head is on its way (bytes arrived, or the connection is new).
    pub(super) head: bool,
    pub(super) since: Instant,
}

impl Activity {
    pub(super) fn new() -> Self {
        Self {
            // A new connection owes its first request head.
            state: Mutex::new(Phase {
                in_flight: 0,
                head: true,
                since: Instant::now(),
            }),
            changed: Notify::new(),
            evicted: AtomicBool::new(false),
        }
    }

    /// Whether closing the connection drops no request.
    pub(super) fn evictable(&self) -> bool {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .in_flight
            == 0
    }

    pub(super) fn evict(&self) {
        self.evicted.store(true, Ordering::Relaxed);
        self.changed.notify_one();
    }

    pub(super) fn update(&self, f: impl FnOnce(&mut Phase) -> bool) {
        let changed = f(&mut self.state.lock().unwrap_or_else(PoisonError::into_inner));
        if changed {
            self.changed.notify_one();
        }
    }

    pub(super) fn received(&self) {
        self.update(|p| {
            let starts = p.in_flight == 0 && !p.head;
            if starts {
                p.head = true;
                p.since = Instant::now();
            }
            starts
        });
    }

    pub(super) fn request_started(&self) {
        self.update(|p| {
            p.in_flight += 1;
            p.head = false;
            true
        });
    }

    pub(super) fn request_finished(&self) {
        self.update(|p| {
            p.in_flight = p.in_flight.saturating_sub(1);
            if p.in_flight == 0 {
                p.since = Instant::now();
            }
            true
        });
    }

    /// When the connection is to be closed if nothing changes, and why.
    pub(super) fn deadline(&self, limits: &Limits) -> (Option<Instant>, Bite) {
        let p = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if p.in_flight > 0 {
            (None, Bite::Idle)
        } else if p.head {
            (Some(p.since + limits.header_timeout), Bite::Header)
        } else {
            (Some(p.since + limits.idle_timeout), Bite::Idle)
        }
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
