//! Secrets (tokens, keys, passwords) that must never reach a log, a report or an
//! answer by accident.

use std::fmt;

/// A secret value. `Debug` and `Display` print a placeholder; the value is read only
/// through [`Secret::expose`], at the one place that needs it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("Secret(<redacted>)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("<redacted>")
    }
}

/// Compares two secrets (or their digests) without an early exit, so the time taken
/// does not reveal how much of a guess was right. Empty never matches: an unset
/// secret is no secret.
pub fn constant_time_equal(left: &[u8], right: &[u8]) -> bool {
    if left.len() != right.len() || right.is_empty() {
        return false;
    }
    left.iter()
        .zip(right)
        .fold(0_u8, |difference, (a, b)| difference | (a ^ b))
        == 0
}

/// Whether a URL's host names this machine: `localhost` or a loopback address (IPv6
/// with or without its brackets). Where stockd insists on reaching only itself (a
/// gateway reached without TLS, a load test's database).
pub fn is_loopback_host(host: &str) -> bool {
    host == "localhost"
        || host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|address| address.is_loopback())
}

/// `url` with any password replaced by `<redacted>`, for logs, metrics labels and
/// evidence: `postgres://user:pw@host/db` becomes `postgres://user:<redacted>@host/db`,
/// and a query parameter that carries a secret (`?password=…`, which libpq and sqlx
/// accept too, `sslpassword`, a token) keeps its name and loses its value. A NATS list
/// of servers separated by commas is redacted server by server (one without a scheme
/// as NATS reads it, with the first one's), and NATS's token (`nats://token@host`, a
/// user with no password) is a secret too. Any other URL is one URL, commas and all (a
/// password may hold one; PostgreSQL names several hosts so). Text that is not a URL
/// comes back unchanged.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    if is_nats(scheme) && url.contains(',') {
        let prefix = format!(
            "{}://",
            scheme.trim_start_matches(|c: char| !c.is_ascii_alphanumeric())
        );
        return url
            .split(',')
            .enumerate()
            .map(|(index, server)| {
                if index == 0 || server.contains("://") {
                    return redact_one(server);
                }
                let trimmed = server.trim_start();
                let lead = &server[..server.len() - trimmed.len()];
                let redacted = redact_one(&format!("{prefix}{trimmed}"));
                format!(
                    "{lead}{}",
                    redacted.strip_prefix(&prefix).unwrap_or(&redacted)
                )
            })
            .collect::<Vec<_>>()
            .join(",");
    }
    redact_parts(scheme, rest)
}

/// Whether a scheme is NATS's (quotes or spaces before it allowed).
fn is_nats(scheme: &str) -> bool {
    let scheme = scheme
        .trim_start_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_ascii_lowercase();
    NATS_SCHEMES.contains(&scheme.as_str())
}

/// [`redact_url`] of one URL.
fn redact_one(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => redact_parts(scheme, rest),
        None => url.to_owned(),
    }
}

fn redact_parts(scheme: &str, rest: &str) -> String {
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let authority = match authority.rsplit_once('@') {
        Some((credentials, host)) => {
            let user = credentials.split(':').next().unwrap_or("");
            let token = is_nats(scheme);
            if credentials.contains(':') {
                format!("{user}:<redacted>@{host}")
            } else if token {
                format!("<redacted>@{host}")
            } else {
                format!("{user}@{host}")
            }
        }
        None => authority.to_owned(),
    };
    format!("{scheme}://{authority}{}", redact_query(tail))
}

/// Schemes whose lone user part is a token, not a name.
const NATS_SCHEMES: &[&str] = &["nats", "tls", "ws", "wss"];

/// The path, query and fragment of a URL with secret-bearing parameters' values
/// replaced.
fn redact_query(tail: &str) -> String {
    let Some((path, query)) = tail.split_once('?') else {
        return tail.to_owned();
    };
    let (query, fragment) = match query.split_once('#') {
        Some((query, fragment)) => (query, Some(fragment)),
        None => (query, None),
    };
    let parameters: Vec<String> = query
        .split('&')
        .map(|parameter| match parameter.split_once('=') {
            Some((name, _)) if names_a_secret(name) => format!("{name}=<redacted>"),
            _ => parameter.to_owned(),
        })
        .collect();
    let mut redacted = format!("{path}?{}", parameters.join("&"));
    if let Some(fragment) = fragment {
        redacted.push('#');
        redacted.push_str(fragment);
    }
    redacted
}

/// Whether a query parameter's name says it carries a secret.
fn names_a_secret(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    ["pass", "pwd", "secret", "token"]
        .iter()
        .any(|marker| name.contains(marker))
}

/// Replaces every URL's secrets in `text` (an error message that quotes a URL).
pub fn redact_urls_in(text: &str) -> String {
    text.split(' ')
        .map(|word| {
            if word.contains("://") {
                redact_url(word)
            } else {
                word.to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_compare_equal_only_when_exactly_equal_and_not_empty() {
        assert!(constant_time_equal(b"secret", b"secret"));
        assert!(!constant_time_equal(b"secreT", b"secret"));
        assert!(!constant_time_equal(b"secret-longer", b"secret"));
        assert!(!constant_time_equal(b"", b""));
    }

    #[test]
    fn a_secret_never_prints_its_value() {
        let secret = Secret::new("hunter2");
        assert_eq!(format!("{secret:?}"), "Secret(<redacted>)");
        assert_eq!(format!("{secret}"), "<redacted>");
        assert_eq!(secret.expose(), "hunter2");
    }

    #[test]
    fn passwords_in_urls_are_redacted_and_the_rest_kept() {
        assert_eq!(
            redact_url("postgres://stockd:s3cr%40t@db.example.com:5432/shop?sslmode=require"),
            "postgres://stockd:<redacted>@db.example.com:5432/shop?sslmode=require"
        );
        assert_eq!(
            redact_url("mysql://root@127.0.0.1:3306/test"),
            "mysql://root@127.0.0.1:3306/test"
        );
        assert_eq!(
            redact_url("sqlite://stockd-data/stockd.db"),
            "sqlite://stockd-data/stockd.db"
        );
        assert_eq!(
            redact_urls_in("cannot reach postgres://a:b@h/d: refused"),
            "cannot reach postgres://a:<redacted>@h/d: refused"
        );
    }

    #[test]
    fn every_server_of_a_nats_list_and_a_nats_token_are_redacted() {
        assert_eq!(
            redact_url("nats://u:first@n1:4222,nats://u:SECRET@n2:4222"),
            "nats://u:<redacted>@n1:4222,nats://u:<redacted>@n2:4222"
        );
        assert_eq!(
            redact_url("nats://TOKEN@n1:4222, tls://OTHER@n2:4222"),
            "nats://<redacted>@n1:4222, tls://<redacted>@n2:4222"
        );
        assert_eq!(
            redact_url("postgres://stockd@db/shop"),
            "postgres://stockd@db/shop",
            "a database's user name is no secret"
        );
        assert_eq!(
            redact_url("nats://a:first@n1:4222, b:second@n2:4222"),
            "nats://a:<redacted>@n1:4222, b:<redacted>@n2:4222",
            "a server without a scheme is read as NATS reads it"
        );
        assert_eq!(
            redact_url("'nats://TOKEN@n1:4222'"),
            "'nats://<redacted>@n1:4222'"
        );
    }

    #[test]
    fn a_database_url_with_commas_is_one_url() {
        assert_eq!(
            redact_url("postgres://u:pa,ss@db/shop"),
            "postgres://u:<redacted>@db/shop",
            "a password with a comma"
        );
        assert_eq!(
            redact_url("postgres://h1,h2/db?password=s3cret"),
            "postgres://h1,h2/db?password=<redacted>",
            "several hosts"
        );
    }

    #[test]
    fn a_password_in_the_query_string_is_redacted_whatever_else_the_url_holds() {
        assert_eq!(
            redact_url("postgres://stockd@db2/shop?password=s3cret"),
            "postgres://stockd@db2/shop?password=<redacted>"
        );
        assert_eq!(
            redact_url(
                "postgres://db2:5433/shop?user=stockd&PassWord=s3cret&sslmode=require&sslpassword=k3y#x"
            ),
            "postgres://db2:5433/shop?user=stockd&PassWord=<redacted>&sslmode=require&sslpassword=<redacted>#x"
        );
        assert_eq!(
            redact_urls_in("replica postgres://h/d?password=s3cret failed"),
            "replica postgres://h/d?password=<redacted> failed"
        );
        assert_eq!(
            redact_url("postgres://u:p@h/d?password=q"),
            "postgres://u:<redacted>@h/d?password=<redacted>"
        );
    }
}

#[cfg(test)]
mod loopback_tests {
    use super::is_loopback_host;

    #[test]
    fn only_this_machine_is_a_loopback_host() {
        for host in ["localhost", "127.0.0.1", "127.9.9.9", "::1", "[::1]"] {
            assert!(is_loopback_host(host), "{host}");
        }
        for host in ["", "db.example.com", "10.0.0.7", "[2001:db8::1]", "0.0.0.0"] {
            assert!(!is_loopback_host(host), "{host}");
        }
    }
}
