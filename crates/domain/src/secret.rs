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

/// `url` with any password replaced by `<redacted>`, for logs and evidence:
/// `postgres://user:pw@host/db` becomes `postgres://user:<redacted>@host/db`. Text that
/// is not a URL with credentials comes back unchanged.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let Some((credentials, host)) = authority.rsplit_once('@') else {
        return url.to_owned();
    };
    let user = credentials.split(':').next().unwrap_or("");
    if credentials.contains(':') {
        format!("{scheme}://{user}:<redacted>@{host}{tail}")
    } else {
        format!("{scheme}://{user}@{host}{tail}")
    }
}

/// Replaces every URL's password in `text` (an error message that quotes a URL).
pub fn redact_urls_in(text: &str) -> String {
    text.split(' ')
        .map(|word| {
            if word.contains("://") && word.contains('@') {
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
}
