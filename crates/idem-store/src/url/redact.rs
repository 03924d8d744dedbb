//! Hiding the credentials a URL can carry, for messages and logs. Every place that shows a
//! store, broker or target URL calls [`redact`]: one rule, so no copy of it lags behind.

/// Schemes whose user information, when it has no `:`, is a user name and not a secret. For
/// any other scheme (`nats://TOKEN@host`, `http://TOKEN@host`) a lone user part is hidden.
const USER_NAME_SCHEMES: &[&str] = &[
    "postgres",
    "postgresql",
    "mysql",
    "mariadb",
    "redis",
    "rediss",
    "redis+cluster",
    "amqp",
    "amqps",
];

/// Parts of a query parameter's name (lower case, without `-` and `_`) that make its value a
/// credential: `password`, `sslpassword`, `passwd`, `pwd`, `auth_token`, `secret`, `api-key`….
const CREDENTIAL_NAMES: &[&str] = &[
    "pass",
    "pwd",
    "secret",
    "token",
    "auth",
    "credential",
    "apikey",
    "accesskey",
    "privatekey",
];

/// `url` with every credential it can carry replaced by `***`: the password in the user
/// information (`user:***@`; a lone user part too, for schemes where it is a token), and the
/// value of every query parameter whose name says it is a credential (`is_credential`, below).
///
/// Built for URLs as people write them, not only as RFC 3986 allows: a password with `/`, `?`,
/// `#`, `:` or `@` in it, unencoded, is hidden whole, because the user information is taken to
/// end at the *last* `@`. Where that guesses wrong (an `@` in a query), more is hidden, never
/// less.
///
/// ```
/// use idem_store::redact;
/// assert_eq!(redact("postgres://app:s3cret@db/app"), "postgres://app:***@db/app");
/// assert_eq!(redact("postgres://u:S3c/ret?P@W@db:5432/app"), "postgres://u:***@db:5432/app");
/// assert_eq!(redact("redis://:pw@cache:6379"), "redis://:***@cache:6379");
/// assert_eq!(redact("nats://t0ken@127.0.0.1:4222"), "nats://***@127.0.0.1:4222");
/// assert_eq!(
///     redact("postgres://db/app?user=app&sslpassword=s3cret&sslmode=require"),
///     "postgres://db/app?user=app&sslpassword=***&sslmode=require"
/// );
/// assert_eq!(redact("sqlite://idem.db"), "sqlite://idem.db");
/// ```
pub fn redact(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (Some(scheme), rest),
        None => (None, url),
    };
    let (userinfo, after) = match rest.rsplit_once('@') {
        Some((userinfo, after)) => (Some(userinfo), after),
        None => (None, rest),
    };
    let mut out = String::with_capacity(url.len());
    if let Some(scheme) = scheme {
        out.push_str(scheme);
        out.push_str("://");
    }
    if let Some(userinfo) = userinfo {
        match userinfo.split_once(':') {
            Some((user, _)) => {
                out.push_str(user);
                out.push_str(":***");
            }
            None if scheme
                .is_some_and(|s| USER_NAME_SCHEMES.contains(&s.to_ascii_lowercase().as_str())) =>
            {
                out.push_str(userinfo);
            }
            None => out.push_str("***"),
        }
        out.push('@');
    }
    let Some((location, query)) = after.split_once('?') else {
        out.push_str(after);
        return out;
    };
    out.push_str(location);
    out.push('?');
    for (i, pair) in query.split('&').enumerate() {
        if i > 0 {
            out.push('&');
        }
        match pair.split_once('=') {
            Some((name, _)) if is_credential(name) => {
                out.push_str(name);
                out.push_str("=***");
            }
            _ => out.push_str(pair),
        }
    }
    out
}

/// Whether a URL query parameter of this name carries a credential: its name, decoded, in
/// lower case and without `-` and `_`, contains `pass`, `pwd`, `secret`, `token`, `auth`,
/// `credential`, `apikey`, `accesskey` or `privatekey`.
pub(crate) fn is_credential(name: &str) -> bool {
    let name: String = percent_decoded(name)
        .chars()
        .filter(|c| !matches!(c, '-' | '_'))
        .flat_map(char::to_lowercase)
        .collect();
    CREDENTIAL_NAMES.iter().any(|part| name.contains(part))
}

/// `text` with `%XX` escapes (and `+`, as a query's space) decoded, as a driver reads a
/// query's names; invalid escapes stay as they are, bytes that are not UTF-8 become U+FFFD.
pub(crate) fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    let hex = |b: Option<&u8>| b.and_then(|&b| char::from(b).to_digit(16));
    while let Some(&b) = bytes.get(i) {
        i += 1;
        match b {
            b'%' => match (hex(bytes.get(i)), hex(bytes.get(i + 1))) {
                (Some(high), Some(low)) => {
                    // Two hex digits: at most 255.
                    out.push(u8::try_from(high * 16 + low).unwrap_or(b'%'));
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            b'+' => out.push(b' '),
            b => out.push(b),
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
