//! What can go wrong on the bus, in terms a caller can act on.
//!
//! # Invariants
//! A raw Redis error never becomes a whole message: each variant carries its
//! own message and keeps the driver's error only as the `source`, so logs
//! printing the chain still see it.

use std::error::Error as StdError;
use std::time::Duration;

/// The error of every bus operation.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    /// The bus URL or key prefix cannot be used; fix the configuration.
    #[error("invalid bus {setting} `{value}`: {reason}")]
    Config {
        /// Which setting was wrong: `url` or `prefix`.
        setting: &'static str,
        /// The value given, with any password removed.
        value: String,
        /// Why it was refused.
        reason: String,
    },
    /// The bus server cannot be reached or stopped answering; retry once it is back.
    #[error("bus at {address} is unavailable")]
    Unavailable {
        /// The `host:port` that was dialled.
        address: String,
        /// What the connection attempt or command ran into.
        #[source]
        source: Box<dyn StdError + Send + Sync>,
    },
    /// An argument is outside what the bus stores faithfully.
    #[error("invalid {field}: {reason}")]
    InvalidInput {
        /// The argument that was wrong.
        field: &'static str,
        /// What it must be instead.
        reason: &'static str,
    },
    /// The bus answered in a way the caller cannot fix (a script error, an unexpected reply).
    #[error("bus operation {operation} failed")]
    Internal {
        /// The operation that failed, e.g. `deadline_due`.
        operation: &'static str,
        /// The underlying failure.
        #[source]
        source: Box<dyn StdError + Send + Sync>,
    },
}

impl BusError {
    /// Whether the failure is the server being away, so that retrying later may succeed.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Self::Unavailable { .. })
    }

    pub(crate) fn config(setting: &'static str, value: &str, reason: impl Into<String>) -> Self {
        Self::Config { setting, value: redact_url(value), reason: reason.into() }
    }

    pub(crate) fn internal(operation: &'static str, source: impl Into<Box<dyn StdError + Send + Sync>>) -> Self {
        Self::Internal { operation, source: source.into() }
    }
}

/// The server did not answer in time; the source of an `Unavailable`.
#[derive(Debug, thiserror::Error)]
#[error("no answer within {0:?}")]
pub(crate) struct NoAnswer(pub(crate) Duration);

/// The task that owns the pub/sub connection has stopped; the source of an `Internal`.
#[derive(Debug, thiserror::Error)]
#[error("the pub/sub task has stopped")]
pub(crate) struct PubSubStopped;

/// The pub/sub connection is down and being re-established; the source of an `Unavailable`.
#[derive(Debug, thiserror::Error)]
#[error("the pub/sub connection is being re-established")]
pub(crate) struct Reconnecting;

/// Removes the userinfo (`user:password@`) of a URL so it can appear in messages and logs.
pub(crate) fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{scheme}://***@{}", &rest[at + 1..]),
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redact_url_hides_the_password_but_keeps_the_address() {
        assert_eq!(redact_url("redis://:hunter2@cache.internal:6380/0"), "redis://***@cache.internal:6380/0");
        assert_eq!(redact_url("rediss://berth:hunter2@10.0.0.1"), "rediss://***@10.0.0.1");
        assert_eq!(redact_url("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(redact_url("not a url"), "not a url");
    }

    #[test]
    fn an_at_sign_after_the_authority_is_not_taken_for_credentials() {
        assert_eq!(redact_url("redis://127.0.0.1/0?user=a@b"), "redis://127.0.0.1/0?user=a@b");
    }

    #[test]
    fn config_error_never_shows_the_password() {
        let err = BusError::config("url", "redis://:hunter2@[::1", "unparsable");
        let message = err.to_string();
        assert!(!message.contains("hunter2"), "{message}");
        assert!(message.starts_with("invalid bus url"), "{message}");
    }
}
