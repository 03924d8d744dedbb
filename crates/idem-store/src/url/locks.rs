//! Lock backend URLs: where `idem serve --locks` keeps locks when not in the records' store.

use idem_core::SharedLockStore;

use super::{OpenError, StoreUrl, StoreUrlError, err};

/// Opens the lock backend `url` names:
///
/// - `zk://host:port[,host:port…][/root][?session_timeout_ms=N]` (feature `zookeeper`):
///   ZooKeeper, locks under `root` (default `/idem`), with the session timeout asked for
///   (default 10000, at least 200);
/// - any store URL whose store keeps locks (every store but MySQL/MariaDB).
///
/// ```
/// # async fn demo() {
/// let locks = idem_store::open_locks("memory://").await.unwrap();
/// assert_eq!(locks.kind(), "memory");
/// assert!(idem_store::open_locks("zk://").await.is_err());
/// # }
/// ```
pub async fn open_locks(url: &str) -> Result<SharedLockStore, OpenError> {
    if let Some(rest) = url.strip_prefix("zk://") {
        return zookeeper(rest).await;
    }
    let parsed: StoreUrl = url.parse()?;
    parsed.open_with_locks().await?.1.ok_or_else(|| {
        OpenError::Url(err(format!(
            "{} keeps no locks; name one that does, such as zk://host:2181 or redis://host",
            super::redact(url)
        )))
    })
}

/// `host:port[,…][/root][?session_timeout_ms=N]`: the hosts, root and session timeout.
fn parse_zookeeper(rest: &str) -> Result<(String, String, u64), StoreUrlError> {
    let (location, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (hosts, root) = match location.find('/') {
        Some(i) => (&location[..i], &location[i..]),
        None => (location, ""),
    };
    if hosts.is_empty() {
        return Err(err(
            "zk:// needs at least one host:port, as in zk://127.0.0.1:2181/idem",
        ));
    }
    for host in hosts.split(',') {
        let ok = host
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
        if !ok {
            return Err(err(format!(
                "zk:// host {host:?} is not host:port (as in 127.0.0.1:2181)"
            )));
        }
    }
    let root = match root.trim_end_matches('/') {
        "" => "/idem",
        root => root,
    };
    let mut session_ms = 10_000;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("session_timeout_ms", v)) => {
                session_ms = v
                    .parse::<u64>()
                    .ok()
                    .filter(|ms| (200..=3_600_000).contains(ms))
                    .ok_or_else(|| {
                        err("zk:// session_timeout_ms must be a number from 200 to 3600000")
                    })?;
            }
            _ => return Err(err(format!("zk:// does not take the option {pair:?}"))),
        }
    }
    Ok((hosts.to_owned(), root.to_owned(), session_ms))
}

#[cfg(feature = "zookeeper")]
async fn zookeeper(rest: &str) -> Result<SharedLockStore, OpenError> {
    let (hosts, root, session_ms) = parse_zookeeper(rest)?;
    let options = crate::ZooKeeperOptions::default()
        .root(root)
        .session_timeout(std::time::Duration::from_millis(session_ms));
    Ok(std::sync::Arc::new(
        crate::ZooKeeperLocks::connect(&hosts, options).await?,
    ))
}

#[cfg(not(feature = "zookeeper"))]
async fn zookeeper(rest: &str) -> Result<SharedLockStore, OpenError> {
    parse_zookeeper(rest)?;
    Err(OpenError::Url(err(
        "zk:// needs idem built with the `zookeeper` feature",
    )))
}

#[cfg(test)]
mod tests {
    use super::parse_zookeeper;

    #[test]
    fn zookeeper_urls_are_read_and_checked() {
        assert_eq!(
            parse_zookeeper("127.0.0.1:2181").unwrap(),
            ("127.0.0.1:2181".into(), "/idem".into(), 10_000)
        );
        assert_eq!(
            parse_zookeeper("a:1,b:2/apps/locks/?session_timeout_ms=500").unwrap(),
            ("a:1,b:2".into(), "/apps/locks".into(), 500)
        );
        for bad in [
            "",
            "/idem",
            "host",
            "host:0",
            "host:port",
            ":2181",
            "a:1,/x",
            "a:1?session_timeout_ms=10",
            "a:1?session_timeout_ms=x",
            "a:1?colour=blue",
        ] {
            assert!(parse_zookeeper(bad).is_err(), "{bad:?} was taken");
        }
    }
}
