//! Registry credentials as the operator gives them to revisions, by the name
//! a template's `bundle.secret` uses. Revisions resolves tags with them, and
//! hands them to a node for one pull of a lease's bundle (see
//! [`crate::pull`]); nothing else sees them.
//!
//! # The file
//! `--registry-credentials FILE` (or `BERTH_REGISTRY_CREDENTIALS`) names a
//! JSON object with one entry per name:
//!
//! ```json
//! {
//!   "team-registry": {"registry": "registry.example.com", "username": "ci", "password": "s3cret"},
//!   "ghcr": {"registry": "ghcr.io", "token": "ghp_…"}
//! }
//! ```
//!
//! Each entry holds either `username` and `password`, or `token` (sent as a
//! bearer token). `registry` binds the credentials to one registry (`host`
//! for any port, or `host:port`): a template naming them for a bundle in
//! another registry is refused, so an apply cannot send them elsewhere.
//! Without `registry` they go to whichever registry the template names.
//!
//! # Invariants
//! - No password or token is written to the store, the bus, a lease or a
//!   log; [`RegistrySecrets`] prints only names and registries.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use berth_bundle::RegistryCredentials;
use serde_json::Value;

/// Why the credentials file was refused.
pub type SecretsError = berth_core::JsonFileError;

/// Why named credentials cannot be used for a registry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum SecretLookupError {
    /// No credentials have this name.
    #[error("no registry credentials named '{name}' are known to the control plane")]
    Unknown {
        /// The name asked for.
        name: String,
    },
    /// The credentials are bound to another registry.
    #[error("the registry credentials '{name}' are for registry {bound}, not {registry}")]
    OtherRegistry {
        /// The name asked for.
        name: String,
        /// The registry they are bound to.
        bound: String,
        /// The registry they were asked for.
        registry: String,
    },
}

/// One named entry: the credentials and the registry they are bound to.
#[derive(Clone, PartialEq, Eq)]
struct RegistrySecret {
    registry: Option<String>,
    credentials: RegistryCredentials,
}

/// Named registry credentials; cheap to clone, clones share the entries.
#[derive(Clone, Default)]
pub struct RegistrySecrets {
    entries: Arc<BTreeMap<String, RegistrySecret>>,
}

impl fmt::Debug for RegistrySecrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown: BTreeMap<&str, &str> = self
            .entries
            .iter()
            .map(|(name, secret)| (name.as_str(), secret.registry.as_deref().unwrap_or("any registry")))
            .collect();
        f.debug_struct("RegistrySecrets").field("entries", &shown).finish()
    }
}

/// The fields an entry may have.
const ENTRY_FIELDS: [&str; 4] = ["registry", "username", "password", "token"];

impl RegistrySecrets {
    /// No credentials: every bundle is pulled anonymously.
    pub fn none() -> Self {
        Self::default()
    }

    /// These credentials and `credentials` named `name`, bound to `registry`
    /// (`host` or `host:port`) when given.
    pub fn with(mut self, name: impl Into<String>, registry: Option<&str>, credentials: RegistryCredentials) -> Self {
        let secret = RegistrySecret { registry: registry.map(str::to_owned), credentials };
        Arc::make_mut(&mut self.entries).insert(name.into(), secret);
        self
    }

    /// The names held, in order.
    pub fn names(&self) -> Vec<&str> {
        self.entries.keys().map(String::as_str).collect()
    }

    /// Whether no credentials are held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The credentials file at `path` (see the module docs).
    pub fn from_file(path: &Path) -> Result<Self, SecretsError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| SecretsError::Read { file: file.clone(), source })?;
        Self::parse(&file, &text)
    }

    /// The credentials file `file` holding `text`.
    pub fn parse(file: &str, text: &str) -> Result<Self, SecretsError> {
        let value = SecretsError::parse(file, text)?;
        let refuse = |path: &str, problem: &str| SecretsError::Field {
            file: file.to_owned(),
            path: if path.is_empty() { "the file".to_owned() } else { path.to_owned() },
            problem: problem.to_owned(),
        };
        let Value::Object(entries) = value else {
            return Err(refuse("", "must be an object of named credentials"));
        };
        let mut secrets = Self::none();
        for (name, entry) in entries {
            if name.is_empty() {
                return Err(refuse("\"\"", "a name must not be empty"));
            }
            let Value::Object(fields) = entry else {
                return Err(refuse(&name, "must be an object with username and password, or token"));
            };
            let mut text = BTreeMap::new();
            for (field, value) in fields {
                let at = format!("{name}.{field}");
                if !ENTRY_FIELDS.contains(&field.as_str()) {
                    return Err(refuse(
                        &at,
                        &format!("unknown field; the fields here are {}", ENTRY_FIELDS.join(", ")),
                    ));
                }
                match value {
                    Value::String(value) if !value.is_empty() => {
                        text.insert(field, value);
                    }
                    Value::String(_) => return Err(refuse(&at, "must not be empty")),
                    _ => return Err(refuse(&at, "must be a string")),
                }
            }
            let credentials = match (text.remove("username"), text.remove("password"), text.remove("token")) {
                (Some(username), Some(password), None) => RegistryCredentials::Basic { username, password },
                (None, None, Some(token)) => RegistryCredentials::Bearer { token },
                (_, _, Some(_)) => return Err(refuse(&name, "holds a token and a username or password; give one")),
                (Some(_), None, None) => return Err(refuse(&format!("{name}.password"), "missing")),
                (None, Some(_), None) => return Err(refuse(&format!("{name}.username"), "missing")),
                (None, None, None) => return Err(refuse(&name, "needs username and password, or token")),
            };
            secrets = secrets.with(name, text.remove("registry").as_deref(), credentials);
        }
        Ok(secrets)
    }

    /// The credentials named `name`, when they may be sent to `registry`
    /// (`host[:port]`).
    pub(crate) fn for_registry(&self, name: &str, registry: &str) -> Result<&RegistryCredentials, SecretLookupError> {
        let secret = self.entries.get(name).ok_or_else(|| SecretLookupError::Unknown { name: name.to_owned() })?;
        match &secret.registry {
            Some(bound) if !same_registry(bound, registry) => Err(SecretLookupError::OtherRegistry {
                name: name.to_owned(),
                bound: bound.clone(),
                registry: registry.to_owned(),
            }),
            _ => Ok(&secret.credentials),
        }
    }
}

/// Whether `registry` is the one `bound` names: the same `host:port`, or the
/// same host when `bound` gives no port.
fn same_registry(bound: &str, registry: &str) -> bool {
    let (bound, registry) = (bound.to_ascii_lowercase(), registry.to_ascii_lowercase());
    bound == registry || (host_of(&bound) == bound && host_of(&registry) == bound)
}

/// The host part of `host[:port]` or `[v6][:port]`.
pub(crate) fn host_of(registry: &str) -> &str {
    if let Some(rest) = registry.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match registry.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => registry,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_file_reads() {
        let text = r#"{
            "team-registry": {"registry": "registry.example.com", "username": "ci", "password": "s3cret"},
            "ghcr": {"registry": "ghcr.io", "token": "tok"},
            "anywhere": {"username": "u", "password": "p"}
        }"#;
        let secrets = RegistrySecrets::parse("creds.json", text).unwrap();
        assert_eq!(secrets.names(), ["anywhere", "ghcr", "team-registry"]);
        assert_eq!(
            secrets.for_registry("team-registry", "registry.example.com:443").unwrap(),
            &RegistryCredentials::Basic { username: "ci".into(), password: "s3cret".into() }
        );
        assert_eq!(
            secrets.for_registry("ghcr", "ghcr.io").unwrap(),
            &RegistryCredentials::Bearer { token: "tok".into() }
        );
        assert!(secrets.for_registry("anywhere", "127.0.0.1:5000").is_ok());
    }

    #[test]
    fn bound_credentials_go_to_their_registry_only() {
        let basic = RegistryCredentials::Basic { username: "u".into(), password: "p".into() };
        let secrets = RegistrySecrets::none().with("host", Some("registry.lan"), basic.clone()).with(
            "port",
            Some("registry.lan:5000"),
            basic,
        );
        assert!(secrets.for_registry("host", "registry.lan").is_ok());
        assert!(secrets.for_registry("host", "REGISTRY.lan:5001").is_ok());
        assert!(secrets.for_registry("port", "registry.lan:5000").is_ok());
        let refused = secrets.for_registry("port", "registry.lan:5001").unwrap_err();
        assert_eq!(
            refused.to_string(),
            "the registry credentials 'port' are for registry registry.lan:5000, not registry.lan:5001"
        );
        assert!(secrets.for_registry("host", "evil.example.com").is_err());
        let unknown = secrets.for_registry("nope", "registry.lan").unwrap_err();
        assert_eq!(unknown, SecretLookupError::Unknown { name: "nope".into() });
    }

    #[test]
    fn each_refusal_names_the_field() {
        let cases = [
            ("[]", "the file"),
            (r#"{"a": "x"}"#, "a"),
            (r#"{"a": {"username": "u"}}"#, "a.password"),
            (r#"{"a": {"password": "p"}}"#, "a.username"),
            (r#"{"a": {"token": "t", "username": "u"}}"#, "a"),
            (r#"{"a": {}}"#, "a"),
            (r#"{"a": {"token": ""}}"#, "a.token"),
            (r#"{"a": {"token": 1}}"#, "a.token"),
            (r#"{"a": {"token": "t", "pasword": "p"}}"#, "a.pasword"),
        ];
        for (text, path) in cases {
            match RegistrySecrets::parse("f.json", text).unwrap_err() {
                SecretsError::Field { path: at, .. } => assert_eq!(at, path, "{text}"),
                other => panic!("{text}: {other}"),
            }
        }
        assert!(matches!(RegistrySecrets::parse("f.json", "{").unwrap_err(), SecretsError::Syntax { .. }));
    }

    #[test]
    fn debug_output_never_holds_a_password_or_token() {
        let secrets = RegistrySecrets::parse(
            "f.json",
            r#"{"a": {"username": "ci", "password": "hunter2"}, "b": {"registry": "r.lan", "token": "tok3n"}}"#,
        )
        .unwrap();
        let shown = format!("{secrets:?}");
        assert!(!shown.contains("hunter2") && !shown.contains("tok3n"), "{shown}");
        assert!(shown.contains("r.lan"), "{shown}");
    }
}
