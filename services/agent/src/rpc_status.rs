//! How the agent reads a failed call to the control plane: whether it is
//! worth retrying, and the one line that says why it failed. A leaf every
//! caller of the control plane imports (the join, the heartbeat, the lease
//! runner, the egress follower).

/// Status codes that say "not now" rather than "no": the peer is down,
/// overloaded, rate-limiting, or the call was lost on the way.
pub(crate) fn is_transient_code(code: tonic::Code) -> bool {
    use tonic::Code;
    matches!(
        code,
        Code::Unavailable
            | Code::DeadlineExceeded
            | Code::ResourceExhausted
            | Code::Aborted
            | Code::Cancelled
            | Code::Unknown
            | Code::Internal
    )
}

/// A status as one line: its message (or code) and the transport errors
/// behind it, which say why a connection failed.
pub(crate) fn status_text(status: &tonic::Status) -> String {
    let text = if status.message().is_empty() { format!("{:?}", status.code()) } else { status.message().to_string() };
    berth_runtime::with_causes(text, std::error::Error::source(status))
}
