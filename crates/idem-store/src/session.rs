//! A coordination service's session as its holders see it (ZooKeeper, etcd): which session the
//! store has, and until when the service keeps it at least. Holdings belong to the session, so
//! a holder counts itself in no longer than that ([`idem_core::LockStore::session_end`]).

use std::time::{Duration, Instant};

use idem_core::BoxFuture;
use tokio::sync::watch;

/// A session, and until when the service keeps it at least: the moment the request that last
/// reached the service (a grant, a keep-alive, a sync) was *sent*, plus how long the service
/// keeps a session it hears nothing from. The service counts from when it took the request,
/// which is later.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Vouched {
    pub(crate) id: i64,
    pub(crate) until: Instant,
}

impl Vouched {
    pub(crate) fn new(id: i64, sent: Instant, keeps: Duration) -> Self {
        Self {
            id,
            until: sent.checked_add(keeps).unwrap_or(sent),
        }
    }
}

/// Moves session `id`'s end later, to what a request sent at `sent` vouches for; a no-op if
/// the store has moved on to another session, or the end is later already.
pub(crate) fn extend(session: &watch::Sender<Vouched>, id: i64, sent: Instant, keeps: Duration) {
    session.send_if_modified(|v| {
        let now = Vouched::new(id, sent, keeps);
        let later = v.id == id && now.until > v.until;
        if later {
            *v = now;
        }
        later
    });
}

/// Ends session `id` now: the service said it is gone.
pub(crate) fn end(session: &watch::Sender<Vouched>, id: i64) {
    session.send_if_modified(|v| {
        let now = Instant::now();
        let ends = v.id == id && v.until > now;
        if ends {
            v.until = now;
        }
        ends
    });
}

/// Resolves once the session the store has now is over for its holders: replaced by another,
/// unvouched for past its end, or the store dropped.
pub(crate) fn ended(session: &watch::Sender<Vouched>) -> BoxFuture<'static, ()> {
    let mut session = session.subscribe();
    let id = session.borrow_and_update().id;
    Box::pin(async move {
        loop {
            let now = *session.borrow_and_update();
            if now.id != id || Instant::now() >= now.until {
                return;
            }
            tokio::select! {
                changed = session.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
                () = tokio::time::sleep_until(now.until.into()) => {}
            }
        }
    })
}
