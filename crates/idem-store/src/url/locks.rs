//! Lock backend URLs: where `idem serve --locks` keeps locks when not in the records' store.

use idem_core::SharedLockStore;

use super::{OpenError, StoreUrl, StoreUrlError, err};

/// Opens the lock backend `url` names:
///
/// - `zk://host:port[,host:port…][/root][?session_timeout_ms=N]` (feature `zookeeper`):
///   ZooKeeper, locks under `root` (default `/idem`), with the session timeout asked for
///   (default 10000, at least 200);
/// - `etcd://host:port[,host:port…][/prefix][?session_ttl_s=N]` (feature `etcd`): etcd,
///   keys under `prefix` (default `/idem`), with a session of N seconds (default 10, 1 to
///   3600);
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
    if let Some(rest) = url.strip_prefix("etcd://") {
        return etcd(rest).await;
    }
    let parsed: StoreUrl = url.parse()?;
    parsed.open_with_locks().await?.1.ok_or_else(|| {
        OpenError::Url(err(format!(
            "{} keeps no locks; name one that does, such as zk://host:2181, etcd://host:2379 or redis://host",
            super::redact(url)
        )))
    })
}

/// A coordination service's URL after its scheme, `host:port[,…][/root][?option=N]`: the
/// hosts, the root (default `/idem`) and the one numeric option's value (`default` when
/// absent), which must lie in `range`.
fn parse_service(
    scheme: &str,
    rest: &str,
    example: &str,
    option: &str,
    default: u64,
    range: std::ops::RangeInclusive<u64>,
) -> Result<(String, String, u64), StoreUrlError> {
    let (location, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (hosts, root) = match location.find('/') {
        Some(i) => (&location[..i], &location[i..]),
        None => (location, ""),
    };
    if hosts.is_empty() {
        return Err(err(format!(
            "{scheme}:// needs at least one host:port, as in {scheme}://{example}/idem"
        )));
    }
    for host in hosts.split(',') {
        let ok = host
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
        if !ok {
            return Err(err(format!(
                "{scheme}:// host {host:?} is not host:port (as in {example})"
            )));
        }
    }
    let root = match root.trim_end_matches('/') {
        "" => "/idem",
        root => root,
    };
    let mut value = default;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some((name, v)) if name == option => {
                value = v
                    .parse::<u64>()
                    .ok()
                    .filter(|n| range.contains(n))
                    .ok_or_else(|| {
                        err(format!(
                            "{scheme}:// {option} must be a number from {} to {}",
                            range.start(),
                            range.end()
                        ))
                    })?;
            }
            _ => {
                return Err(err(format!(
                    "{scheme}:// does not take the option {pair:?}"
                )));
            }
        }
    }
    Ok((hosts.to_owned(), root.to_owned(), value))
}

/// `host:port[,…][/root][?session_timeout_ms=N]`: the hosts, root and session timeout.
fn parse_zookeeper(rest: &str) -> Result<(String, String, u64), StoreUrlError> {
    parse_service(
        "zk",
        rest,
        "127.0.0.1:2181",
        "session_timeout_ms",
        10_000,
        200..=3_600_000,
    )
}

/// `host:port[,…][/prefix][?session_ttl_s=N]`: the endpoints, prefix and session length.
fn parse_etcd(rest: &str) -> Result<(String, String, u64), StoreUrlError> {
    parse_service(
        "etcd",
        rest,
        "127.0.0.1:2379",
        "session_ttl_s",
        10,
        1..=3_600,
    )
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

#[cfg(feature = "etcd")]
async fn etcd(rest: &str) -> Result<SharedLockStore, OpenError> {
    let (endpoints, prefix, ttl) = parse_etcd(rest)?;
    let options = crate::EtcdOptions::default()
        .prefix(prefix)
        .session_ttl(std::time::Duration::from_secs(ttl));
    Ok(std::sync::Arc::new(
        crate::EtcdLocks::connect(&endpoints, options).await?,
    ))
}

#[cfg(not(feature = "etcd"))]
async fn etcd(rest: &str) -> Result<SharedLockStore, OpenError> {
    parse_etcd(rest)?;
    Err(OpenError::Url(err(
        "etcd:// needs idem built with the `etcd` feature",
    )))
}

#[cfg(test)]
mod tests {
    use super::{parse_etcd, parse_zookeeper};

    #[test]
    fn etcd_urls_are_read_and_checked() {
        assert_eq!(
            parse_etcd("127.0.0.1:2379").unwrap(),
            ("127.0.0.1:2379".into(), "/idem".into(), 10)
        );
        assert_eq!(
            parse_etcd("a:1,b:2/apps/locks/?session_ttl_s=3").unwrap(),
            ("a:1,b:2".into(), "/apps/locks".into(), 3)
        );
        for bad in [
            "",
            "/idem",
            "host",
            "a:1?session_ttl_s=0",
            "a:1?session_ttl_s=3601",
            "a:1?session_timeout_ms=500",
        ] {
            assert!(parse_etcd(bad).is_err(), "{bad:?} was taken");
        }
    }

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
