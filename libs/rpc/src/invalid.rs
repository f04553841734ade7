//! Refusing a request field by field: handlers walk a request with a
//! [`Checker`], which collects every field at fault with its reason, and
//! answer `INVALID_ARGUMENT` naming all of them at once
//! (`invalid request: template.replicas: ...; name: ...`), before anything
//! is read or written.

/// What is wrong with one field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The field's path, e.g. `listeners[1].port`.
    pub field: String,
    /// What is wrong with it.
    pub reason: String,
}

/// Why a request was refused before anything was read or written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Invalid {
    /// One or more fields are missing or malformed.
    #[error("{}", describe(.0))]
    Fields(Vec<Violation>),
}

impl Invalid {
    /// The fields named, in the order they were found.
    pub fn fields(&self) -> Vec<&str> {
        let Self::Fields(violations) = self;
        violations.iter().map(|v| v.field.as_str()).collect()
    }
}

fn describe(violations: &[Violation]) -> String {
    let parts: Vec<String> = violations.iter().map(|v| format!("{}: {}", v.field, v.reason)).collect();
    format!("invalid request: {}", parts.join("; "))
}

impl From<Invalid> for tonic::Status {
    fn from(error: Invalid) -> Self {
        tonic::Status::invalid_argument(error.to_string())
    }
}

/// Collects violations as a request is walked.
#[derive(Debug, Default)]
pub struct Checker {
    violations: Vec<Violation>,
}

impl Checker {
    /// Records that `field` is wrong, and why.
    pub fn bad(&mut self, field: impl Into<String>, reason: impl Into<String>) {
        self.violations.push(Violation { field: field.into(), reason: reason.into() });
    }

    /// Free text of at most `max` bytes and no control characters.
    pub fn text(&mut self, field: &str, value: &str, max: usize) {
        if value.len() > max {
            self.bad(field, format!("must be at most {max} bytes"));
        } else if value.chars().any(char::is_control) {
            self.bad(field, "must not contain control characters");
        }
    }

    /// A DNS label (a name of `what`); whether it is one.
    pub fn dns_label(&mut self, field: &str, value: &str, what: &str) -> bool {
        let ok = berth_core::is_dns_label(value);
        if !ok {
            self.bad(field, format!("'{}' is not {what}: use 1-63 lowercase letters, digits or '-'", shown(value)));
        }
        ok
    }

    /// A TCP port, 1 to 65535.
    pub fn port(&mut self, field: &str, port: u32) -> Option<u16> {
        match u16::try_from(port) {
            Ok(port) if port > 0 => Some(port),
            _ => {
                self.bad(field, format!("{port} is not a port: use 1 to 65535"));
                None
            }
        }
    }

    /// `Ok` when nothing was wrong, else every field that was.
    pub fn finish(self) -> Result<(), Invalid> {
        if self.violations.is_empty() { Ok(()) } else { Err(Invalid::Fields(self.violations)) }
    }
}

/// A caller's value as an error message may show it: at most 64
/// characters, control characters escaped.
pub fn shown(value: &str) -> String {
    value.chars().take(64).flat_map(char::escape_default).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_field_at_fault_is_named_in_one_invalid_argument() {
        let mut check = Checker::default();
        assert!(!check.dns_label("name", "Bad_Name", "a service name"));
        assert_eq!(check.port("ports[0]", 70_000), None);
        check.text("source.repo", "a\u{7}b", 10);
        let error = check.finish().unwrap_err();
        assert_eq!(error.fields(), ["name", "ports[0]", "source.repo"]);
        let status = tonic::Status::from(error);
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(status.message().starts_with("invalid request: name: 'Bad_Name' is not a service name"), "{status:?}");
        assert!(Checker::default().finish().is_ok());
        assert_eq!(shown("a\nb"), "a\\nb");
    }
}
