//! `berth.toml`, the file in a bundle directory that says how to run it, and the rules
//! every run definition obeys, whether read from that file or from a pulled bundle's config.
//!
//! # The file
//! ```toml
//! entrypoint = "bin/server"      # a file in the bundle, or an absolute path on the node
//! args = ["--port", "8080"]
//!
//! [env]
//! LOG_LEVEL = "info"
//!
//! [[ports]]
//! name = "http"                  # a DNS label, unique in the bundle
//! port = 8080                    # 1 to 65535, unique in the bundle
//! ```
//!
//! # Invariants
//! A definition that passed [`validate`] has a non-empty entrypoint that is either absolute
//! or a relative path of plain components (no `.`, `..` or empty parts), no NUL byte
//! anywhere, environment names without `=`, and ports with unique names and numbers.

use std::collections::BTreeMap;
use std::path::{Component, Path};

use serde::{Deserialize, Serialize};

/// The file in a bundle directory that `berth bundle push` reads.
pub const SPEC_FILE: &str = "berth.toml";

/// Why a run definition is refused. Each message names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// The file could not be read.
    #[error("cannot read {path}: {reason}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// The file is not TOML of the expected shape (a missing or unknown field, a wrong type).
    #[error("{path} is not a valid bundle spec: {reason}")]
    Parse {
        /// The file.
        path: String,
        /// What the TOML parser said, with the line.
        reason: String,
    },
    /// A field has a value outside what berth can run.
    #[error("{field}: {reason}")]
    Invalid {
        /// The field, e.g. `ports[1].port` or `env.PATH`.
        field: String,
        /// What it must be instead.
        reason: String,
    },
}

impl SpecError {
    fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Invalid { field: field.into(), reason: reason.into() }
    }
}

/// A port the bundle's program listens on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BundlePort {
    /// The port's name, a DNS label unique in the bundle, e.g. `http`.
    pub name: String,
    /// The TCP port number, 1 to 65535.
    pub port: u16,
}

/// How to run a bundle: what `berth.toml` says, and what the bundle's config carries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BundleSpec {
    /// The program: a path inside the bundle, or an absolute path on the node.
    pub entrypoint: String,
    /// Arguments passed to the program.
    pub args: Vec<String>,
    /// Environment variables for the program.
    pub env: BTreeMap<String, String>,
    /// The ports the program listens on.
    pub ports: Vec<BundlePort>,
}

/// `berth.toml` as written; numbers stay wide so that a bad port is reported by field.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SpecFile {
    entrypoint: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    ports: Vec<PortEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PortEntry {
    name: String,
    port: i64,
}

impl BundleSpec {
    /// Reads and validates `berth.toml` in `dir`.
    pub fn read(dir: &Path) -> Result<Self, SpecError> {
        let path = dir.join(SPEC_FILE);
        let text = std::fs::read_to_string(&path)
            .map_err(|e| SpecError::Read { path: path.display().to_string(), reason: e.to_string() })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses and validates the text of a `berth.toml`; `path` names it in errors.
    pub fn parse(text: &str, path: &str) -> Result<Self, SpecError> {
        let file: SpecFile = toml::from_str(text).map_err(|e| {
            let line =
                e.span().map(|span| text.as_bytes().iter().take(span.start).filter(|b| **b == b'\n').count() + 1);
            let message = one_line(e.message());
            let reason = match line {
                Some(line) => format!("line {line}: {message}"),
                None => message,
            };
            SpecError::Parse { path: path.to_owned(), reason }
        })?;
        let mut ports = Vec::with_capacity(file.ports.len());
        for (i, entry) in file.ports.into_iter().enumerate() {
            let port = u16::try_from(entry.port).ok().filter(|p| *p != 0).ok_or_else(|| {
                SpecError::invalid(format!("ports[{i}].port"), format!("{} is not a port (1-65535)", entry.port))
            })?;
            ports.push(BundlePort { name: entry.name, port });
        }
        let spec = Self { entrypoint: file.entrypoint, args: file.args, env: file.env, ports };
        validate(&spec)?;
        Ok(spec)
    }
}

/// Checks the rules in the module docs.
pub fn validate(spec: &BundleSpec) -> Result<(), SpecError> {
    validate_entrypoint(&spec.entrypoint)?;
    for (i, arg) in spec.args.iter().enumerate() {
        if arg.contains('\0') {
            return Err(SpecError::invalid(format!("args[{i}]"), "contains a NUL byte"));
        }
    }
    for (name, value) in &spec.env {
        if name.is_empty() {
            return Err(SpecError::invalid("env", "a variable has an empty name"));
        }
        if name.contains('=') || name.contains('\0') {
            return Err(SpecError::invalid(format!("env.{name}"), "a variable name may not contain `=` or NUL"));
        }
        if value.contains('\0') {
            return Err(SpecError::invalid(format!("env.{name}"), "the value contains a NUL byte"));
        }
    }
    for (i, port) in spec.ports.iter().enumerate() {
        if !berth_core::is_dns_label(&port.name) {
            return Err(SpecError::invalid(
                format!("ports[{i}].name"),
                format!("`{}` is not a DNS label (1-63 of a-z 0-9 -, not starting or ending with -)", port.name),
            ));
        }
        if port.port == 0 {
            return Err(SpecError::invalid(format!("ports[{i}].port"), "0 is not a port (1-65535)"));
        }
        if let Some(j) = spec.ports[..i].iter().position(|p| p.name == port.name) {
            return Err(SpecError::invalid(format!("ports[{i}].name"), format!("`{}` is also ports[{j}]", port.name)));
        }
        if let Some(j) = spec.ports[..i].iter().position(|p| p.port == port.port) {
            return Err(SpecError::invalid(format!("ports[{i}].port"), format!("{} is also ports[{j}]", port.port)));
        }
    }
    Ok(())
}

fn validate_entrypoint(entrypoint: &str) -> Result<(), SpecError> {
    if entrypoint.is_empty() {
        return Err(SpecError::invalid("entrypoint", "is empty; name the program to run"));
    }
    if entrypoint.contains('\0') {
        return Err(SpecError::invalid("entrypoint", "contains a NUL byte"));
    }
    if !Path::new(entrypoint).is_absolute() && !is_bundle_path(entrypoint) {
        return Err(SpecError::invalid(
            "entrypoint",
            format!("`{entrypoint}` must be a path inside the bundle without `.` or `..` parts, or an absolute path"),
        ));
    }
    Ok(())
}

/// Whether `path` is relative and made only of plain, non-empty components joined by `/`,
/// so that joining it to a bundle root stays inside it.
pub(crate) fn is_bundle_path(path: &str) -> bool {
    !path.is_empty()
        && !path.contains('\0')
        && path.split('/').all(|part| !part.is_empty() && part != "." && part != "..")
        && Path::new(path).components().all(|c| matches!(c, Component::Normal(_)))
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(text: &str) -> String {
        match BundleSpec::parse(text, "berth.toml") {
            Err(SpecError::Invalid { field, .. }) => field,
            other => panic!("expected an invalid field, got {other:?}"),
        }
    }

    #[test]
    fn a_full_spec_parses() {
        let spec = BundleSpec::parse(
            r#"
            entrypoint = "bin/server"
            args = ["--port", "8080"]
            [env]
            LOG = "info"
            [[ports]]
            name = "http"
            port = 8080
            "#,
            "berth.toml",
        )
        .unwrap();
        assert_eq!(spec.entrypoint, "bin/server");
        assert_eq!(spec.args, ["--port", "8080"]);
        assert_eq!(spec.env["LOG"], "info");
        assert_eq!(spec.ports, [BundlePort { name: "http".into(), port: 8080 }]);
    }

    #[test]
    fn errors_name_the_field() {
        assert_eq!(field_of(r#"entrypoint = """#), "entrypoint");
        assert_eq!(field_of(r#"entrypoint = "../escape""#), "entrypoint");
        assert_eq!(field_of("entrypoint = \"a\"\n[[ports]]\nname = \"http\"\nport = 70000"), "ports[0].port");
        assert_eq!(field_of("entrypoint = \"a\"\n[[ports]]\nname = \"http\"\nport = 0"), "ports[0].port");
        assert_eq!(field_of("entrypoint = \"a\"\n[[ports]]\nname = \"HTTP\"\nport = 80"), "ports[0].name");
        assert_eq!(
            field_of("entrypoint = \"a\"\n[[ports]]\nname = \"a\"\nport = 80\n[[ports]]\nname = \"a\"\nport = 81"),
            "ports[1].name"
        );
        assert_eq!(
            field_of("entrypoint = \"a\"\n[[ports]]\nname = \"a\"\nport = 80\n[[ports]]\nname = \"b\"\nport = 80"),
            "ports[1].port"
        );
        assert_eq!(field_of("entrypoint = \"a\"\n[env]\n\"A=B\" = \"x\""), "env.A=B");
    }

    #[test]
    fn unknown_and_missing_fields_are_named_by_the_parser() {
        let Err(SpecError::Parse { reason, .. }) = BundleSpec::parse(r#"entrypont = "a""#, "berth.toml") else {
            panic!("expected a parse error");
        };
        assert!(reason.contains("entrypont"), "{reason}");
        let Err(SpecError::Parse { reason, .. }) = BundleSpec::parse("args = []", "berth.toml") else {
            panic!("expected a parse error");
        };
        assert!(reason.contains("entrypoint"), "{reason}");
    }

    #[test]
    fn bundle_paths_are_plain_relative_components() {
        assert!(is_bundle_path("bin/server"));
        for bad in ["", "/bin/sh", "../x", "a/../b", "./a", "a//b", "a/"] {
            assert!(!is_bundle_path(bad), "{bad} should be refused");
        }
    }
}
