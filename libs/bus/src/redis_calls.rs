//! What both Redis connections share: how long the bus waits for the server
//! ([`RedisTimings`]), and how one call is bounded in time and its failure
//! told apart (a server that is away, or one that refused the command).
//!
//! A leaf below [`crate::redis_bus`] (commands) and [`crate::redis_pubsub`]
//! (the subscription connection), which both import it.

use std::future::Future;
use std::time::Duration;

use redis::{ErrorKind, RedisError, RedisResult, ServerErrorKind};

use crate::BusError;
use crate::error::NoAnswer;

/// How long the Redis bus waits for the server, and how it paces reconnects.
///
/// The defaults suit production; tests shorten them to run in milliseconds.
#[derive(Clone, Debug)]
pub struct RedisTimings {
    /// How long one connection attempt may take before the bus counts as unavailable.
    pub connect_timeout: Duration,
    /// How long one command may take, reconnecting included.
    pub command_timeout: Duration,
    /// How often the idle pub/sub connection is probed, so a silently dead socket is noticed.
    pub keepalive_interval: Duration,
    /// The first pause before reconnecting a lost pub/sub connection; doubles per failure.
    pub reconnect_backoff_min: Duration,
    /// The longest pause between pub/sub reconnect attempts.
    pub reconnect_backoff_max: Duration,
}

impl Default for RedisTimings {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(3),
            command_timeout: Duration::from_secs(3),
            keepalive_interval: Duration::from_secs(5),
            reconnect_backoff_min: Duration::from_millis(100),
            reconnect_backoff_max: Duration::from_secs(5),
        }
    }
}

/// Awaits a Redis operation for at most `limit`, mapping what goes wrong to a [`BusError`].
pub(crate) async fn bounded<T>(
    address: &str,
    operation: &'static str,
    limit: Duration,
    operation_future: impl Future<Output = RedisResult<T>>,
) -> Result<T, BusError> {
    match tokio::time::timeout(limit, operation_future).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(err)) => Err(classify(address, operation, err)),
        Err(_elapsed) => Err(BusError::Unavailable { address: address.to_owned(), source: Box::new(NoAnswer(limit)) }),
    }
}

/// Tells a server that is away (retry later) from one that refused the command.
pub(crate) fn classify(address: &str, operation: &'static str, err: RedisError) -> BusError {
    let away = err.is_io_error()
        || err.is_timeout()
        || err.is_connection_dropped()
        || err.is_unrecoverable_error()
        || matches!(
            err.kind(),
            ErrorKind::AuthenticationFailed
                | ErrorKind::Server(
                    ServerErrorKind::BusyLoading
                        | ServerErrorKind::TryAgain
                        | ServerErrorKind::ClusterDown
                        | ServerErrorKind::MasterDown
                        | ServerErrorKind::ReadOnly
                )
        );
    if away {
        BusError::Unavailable { address: address.to_owned(), source: Box::new(err) }
    } else {
        BusError::internal(operation, err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_command_is_internal_but_a_dropped_connection_is_unavailable() {
        let refused = RedisError::from((ErrorKind::Server(ServerErrorKind::ResponseError), "boom"));
        let err = classify("127.0.0.1:6379", "deadline_due", refused);
        assert_eq!(err.to_string(), "bus operation deadline_due failed");

        let dropped = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        let err = classify("127.0.0.1:6379", "deadline_due", dropped);
        assert_eq!(err.to_string(), "bus at 127.0.0.1:6379 is unavailable");
        assert!(err.is_unavailable());
    }
}
