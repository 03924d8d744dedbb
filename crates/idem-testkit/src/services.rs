//! The real servers backend suites run against, and what to do when one is missing.
//!
//! Each service has a loopback default and an environment variable to point elsewhere
//! (`IDEM_TEST_POSTGRES_URL`, `IDEM_TEST_MYSQL_URL`, `IDEM_TEST_REDIS_URL`). When the server
//! cannot be reached, a suite is skipped with a note on standard error saying why, unless
//! `CI=true`: there a missing service fails the test.

use std::collections::HashSet;
use std::io::Write;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::Duration;

/// A server the tests use.
#[derive(Debug, Clone, Copy)]
pub struct Service {
    /// Its name in messages.
    pub name: &'static str,
    /// The variable that overrides its URL.
    pub env: &'static str,
    /// Its URL on the project's machines.
    pub default_url: &'static str,
}

/// PostgreSQL, database `test`.
pub const POSTGRES: Service = Service {
    name: "PostgreSQL",
    env: "IDEM_TEST_POSTGRES_URL",
    default_url: "postgres://postgres@127.0.0.1:5432/test",
};

/// MariaDB or MySQL, database `test`.
pub const MYSQL: Service = Service {
    name: "MySQL/MariaDB",
    env: "IDEM_TEST_MYSQL_URL",
    default_url: "mysql://root@127.0.0.1:3306/test",
};

/// Redis.
pub const REDIS: Service = Service {
    name: "Redis",
    env: "IDEM_TEST_REDIS_URL",
    default_url: "redis://127.0.0.1:6379",
};

impl Service {
    /// The URL to test against, or `None` (with a note on standard error, once per process)
    /// if nothing answers there. Panics under `CI=true` if nothing answers.
    pub fn url(&self) -> Option<String> {
        let url = std::env::var(self.env).unwrap_or_else(|_| self.default_url.to_owned());
        let addr = authority(&url);
        let reachable = addr.to_socket_addrs().ok().and_then(|mut addrs| {
            addrs.find(|a| TcpStream::connect_timeout(a, Duration::from_secs(2)).is_ok())
        });
        if reachable.is_some() {
            return Some(url);
        }
        let why = format!(
            "{} tests skipped: nothing answers at {addr} (start the server, or set {} to its URL)",
            self.name, self.env
        );
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("{why}; under CI=true a missing service is a failure");
        }
        note_once(&why);
        None
    }
}

/// `host:port` of a URL such as `postgres://user:pw@host:5432/db?x=y`.
fn authority(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let rest = rest.split(['/', '?']).next().unwrap_or_default();
    let host_port = rest.rsplit_once('@').map_or(rest, |(_, hp)| hp);
    if host_port
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
    {
        return host_port.to_owned();
    }
    let port = match scheme {
        "postgres" | "postgresql" => 5432,
        "mysql" | "mariadb" => 3306,
        _ => 6379,
    };
    format!("{host_port}:{port}")
}

/// Writes `note` to standard error once per process, past the test harness's capture (which
/// only takes `print!`/`eprint!`), so a skipped suite is visible in a normal `cargo test`.
fn note_once(note: &str) {
    static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let mut seen = SEEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if seen
        .get_or_insert_with(HashSet::new)
        .insert(note.to_owned())
    {
        let _ = writeln!(std::io::stderr(), "note: {note}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authorities() {
        assert_eq!(authority("postgres://u:p@db:6000/x?y=1"), "db:6000");
        assert_eq!(
            authority("postgres://postgres@127.0.0.1/test"),
            "127.0.0.1:5432"
        );
        assert_eq!(authority("mysql://root@localhost/test"), "localhost:3306");
        assert_eq!(authority("redis://127.0.0.1"), "127.0.0.1:6379");
    }
}
