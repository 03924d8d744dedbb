//! The relay a consumer connects through, so that a kill can cut its connections.

/// A TCP relay on a loopback port to a server: a consumer connects through its own, so that
/// killing the consumer can cut its connections the way a crashed process's sockets close.
/// (Dropping a consumer's task alone would leave its connections open: the broker would keep
/// its unacked events, and the database its open transaction and the locks it holds.)
pub(super) struct Relay {
    /// The server's URL as it goes through the relay.
    pub(super) url: String,
    relay: tokio::task::JoinHandle<()>,
}

impl Relay {
    /// A relay to the server of `url` (`scheme://[user@]host[:port]/…`; `default_port` when
    /// none is given) and the URL that goes through it. `None` for a URL it cannot relay:
    /// TLS (`amqps://`, which checks the server's name), or no host.
    pub(super) async fn open(url: &str, default_port: u16) -> Option<Relay> {
        let (scheme, rest) = url.split_once("://")?;
        if scheme == "amqps" {
            return None;
        }
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let (userinfo, host_port) = match authority.rsplit_once('@') {
            Some((u, h)) => (format!("{u}@"), h),
            None => (String::new(), authority),
        };
        if host_port.is_empty() {
            return None;
        }
        let has_port = match host_port.rsplit_once(':') {
            Some((h, p)) => !h.ends_with(':') && p.parse::<u16>().is_ok(),
            None => false,
        };
        let target = if has_port {
            host_port.to_owned()
        } else {
            format!("{host_port}:{default_port}")
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.ok()?;
        let addr = listener.local_addr().ok()?;
        let relay = tokio::spawn(async move {
            // Dropped with the relay task: every connection through it is cut at once.
            let mut links = tokio::task::JoinSet::new();
            while let Ok((mut inbound, _)) = listener.accept().await {
                let target = target.clone();
                links.spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                while links.try_join_next().is_some() {}
            }
        });
        Some(Relay {
            url: format!("{scheme}://{userinfo}{addr}{tail}"),
            relay,
        })
    }

    /// Cuts every connection through the relay, and takes no more.
    pub(super) fn cut(self) {
        self.relay.abort();
    }
}
