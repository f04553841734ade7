//! Caller deadlines: a call whose `grpc-timeout` header has run out before
//! its handler answered ends with `DEADLINE_EXCEEDED`, and its handler is
//! dropped, so a server stops working for a caller that has given up.
//!
//! As in every gRPC server, the deadline bounds the handler's answer (the
//! response headers of a stream), not the life of a stream it returns. A
//! malformed header is refused with `INVALID_ARGUMENT` naming it rather than
//! ignored, so a caller never believes it set a deadline that is not kept.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tonic::Status;

/// The header a gRPC caller sends its remaining time in.
const GRPC_TIMEOUT: &str = "grpc-timeout";

/// Tower layer applying [`Deadline`].
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct DeadlineLayer;

impl<S> tower_layer::Layer<S> for DeadlineLayer {
    type Service = Deadline<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Deadline { inner }
    }
}

/// The service [`DeadlineLayer`] produces.
#[derive(Debug, Clone)]
pub(crate) struct Deadline<S> {
    inner: S,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B, ResBody> tower_service::Service<http::Request<B>> for Deadline<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<ResBody>, Error = Infallible>,
    S::Future: Send + 'static,
    ResBody: Default + Send + 'static,
{
    type Response = S::Response;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let limit = match req.headers().get(GRPC_TIMEOUT).map(|v| parse_grpc_timeout(v.as_bytes())) {
            None => return Box::pin(self.inner.call(req)),
            Some(Ok(limit)) => limit,
            Some(Err(reason)) => {
                let status = Status::invalid_argument(format!("header {GRPC_TIMEOUT}: {reason}"));
                return Box::pin(std::future::ready(Ok(status.into_http())));
            }
        };
        let answer = self.inner.call(req);
        Box::pin(async move {
            match tokio::time::timeout(limit, answer).await {
                Ok(answered) => answered,
                Err(_) => Ok(Status::deadline_exceeded(format!(
                    "the caller's deadline of {limit:?} passed before the call was answered"
                ))
                .into_http()),
            }
        })
    }
}

/// Reads a `grpc-timeout` value: 1 to 8 digits and a unit, `H`, `M`, `S`,
/// `m` (milliseconds), `u` (microseconds) or `n` (nanoseconds).
fn parse_grpc_timeout(value: &[u8]) -> Result<Duration, &'static str> {
    let Some((&unit, digits)) = value.split_last() else {
        return Err("empty; expected up to 8 digits and a unit (H, M, S, m, u, n)");
    };
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return Err("expected 1 to 8 digits before the unit");
    }
    let amount = digits.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
    Ok(match unit {
        b'H' => Duration::from_secs(amount * 3600),
        b'M' => Duration::from_secs(amount * 60),
        b'S' => Duration::from_secs(amount),
        b'm' => Duration::from_millis(amount),
        b'u' => Duration::from_micros(amount),
        b'n' => Duration::from_nanos(amount),
        _ => return Err("unknown unit; expected H, M, S, m, u or n"),
    })
}

#[cfg(test)]
mod tests {
    use tower::ServiceExt as _;
    use tower_layer::Layer as _;

    use super::*;

    /// A handler that answers OK after `delay`.
    fn slow(
        delay: Duration,
    ) -> impl tower_service::Service<
        http::Request<()>,
        Response = http::Response<tonic::body::Body>,
        Error = Infallible,
        Future = impl Send + 'static,
    > + Clone {
        tower::service_fn(move |_req: http::Request<()>| async move {
            tokio::time::sleep(delay).await;
            Ok::<_, Infallible>(http::Response::new(tonic::body::Body::default()))
        })
    }

    async fn answer(delay: Duration, timeout: Option<&str>) -> Option<tonic::Code> {
        let mut req = http::Request::new(());
        if let Some(timeout) = timeout {
            req.headers_mut().insert(GRPC_TIMEOUT, http::HeaderValue::from_str(timeout).unwrap());
        }
        let Ok(response) = DeadlineLayer.layer(slow(delay)).oneshot(req).await;
        Status::from_header_map(response.headers()).map(|status| status.code())
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_past_its_callers_deadline_ends_deadline_exceeded() {
        assert_eq!(answer(Duration::from_secs(5), Some("100m")).await, Some(tonic::Code::DeadlineExceeded));
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_within_its_deadline_or_without_one_is_answered_by_its_handler() {
        assert_eq!(answer(Duration::from_millis(50), Some("1S")).await, None, "the handler's own answer");
        assert_eq!(answer(Duration::from_secs(3600), None).await, None, "no deadline, no limit");
    }

    #[tokio::test(start_paused = true)]
    async fn a_malformed_deadline_is_refused_naming_the_header() {
        let mut req = http::Request::new(());
        req.headers_mut().insert(GRPC_TIMEOUT, http::HeaderValue::from_static("soon"));
        let Ok(response) = DeadlineLayer.layer(slow(Duration::ZERO)).oneshot(req).await;
        let status = Status::from_header_map(response.headers()).unwrap();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(status.message().contains("grpc-timeout"), "{}", status.message());
    }

    #[test]
    fn every_unit_reads_as_its_duration() {
        assert_eq!(parse_grpc_timeout(b"2H"), Ok(Duration::from_secs(7200)));
        assert_eq!(parse_grpc_timeout(b"3M"), Ok(Duration::from_secs(180)));
        assert_eq!(parse_grpc_timeout(b"10S"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_grpc_timeout(b"1500m"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_grpc_timeout(b"99999999u"), Ok(Duration::from_micros(99_999_999)));
        assert_eq!(parse_grpc_timeout(b"7n"), Ok(Duration::from_nanos(7)));
    }

    #[test]
    fn malformed_values_are_refused_with_the_reason() {
        for bad in [&b""[..], b"S", b"123456789S", b"12x", b"-1S", b"1.5S", b" 1S"] {
            assert!(parse_grpc_timeout(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        assert!(parse_grpc_timeout(b"5d").unwrap_err().contains("unit"));
    }
}
