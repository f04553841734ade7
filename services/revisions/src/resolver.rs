//! Tag-to-digest resolution, done once per revision in the control plane so
//! every node pulls the identical digest. [`TagResolver`] is the seam; the
//! default, [`RegistryResolver`], asks the registry directly through
//! `berth_bundle::BundleClient`.
//!
//! # Plain HTTP
//! Registries are spoken to over HTTPS, except loopback ones and the hosts an
//! operator names with `--insecure-registry`; [`RegistryPolicy`] says which,
//! so a template asking for plain HTTP elsewhere is refused at apply.

use std::fmt;
use std::time::Duration;

use berth_bundle::{BundleClient, BundleReference, Digest, RegistryConfig, RegistryCredentials, RegistryError};
use berth_proto::types::v1::BundleRef;

use crate::secrets::{RegistrySecrets, host_of};

/// Why a bundle reference did not resolve; each kind is the reason of the
/// `BundleResolved=False` condition it causes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// The tag names nothing in the repository.
    #[error("{0}")]
    TagNotFound(String),
    /// The registry wants credentials, or refused the ones given.
    #[error("{0}")]
    Unauthorized(String),
    /// The registry could not be reached, failed or timed out; it is retried.
    #[error("{0}")]
    RegistryUnavailable(String),
    /// The reference cannot be resolved at all as written.
    #[error("{0}")]
    InvalidReference(String),
    /// The registry refused for another reason.
    #[error("{0}")]
    Refused(String),
}

impl ResolveError {
    /// The condition reason, one CamelCase word.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::TagNotFound(_) => "TagNotFound",
            Self::Unauthorized(_) => "Unauthorized",
            Self::RegistryUnavailable(_) => "RegistryUnavailable",
            Self::InvalidReference(_) => "InvalidReference",
            Self::Refused(_) => "RegistryRefused",
        }
    }
}

impl From<RegistryError> for ResolveError {
    fn from(error: RegistryError) -> Self {
        let message = error.to_string();
        match error {
            RegistryError::TagNotFound { .. } | RegistryError::ManifestNotFound { .. } => Self::TagNotFound(message),
            RegistryError::Unauthorized { .. } => Self::Unauthorized(message),
            RegistryError::RegistryUnavailable { .. } => Self::RegistryUnavailable(message),
            RegistryError::InvalidReference { .. } => Self::InvalidReference(message),
            _ => Self::Refused(message),
        }
    }
}

/// What `template`'s bundle or image names now, `sha256:<hex>`, asking the
/// registry for at most `limit`. The one place a tag is resolved: at apply,
/// when a revision is minted, and by the reconciler while a revision's
/// resolution keeps failing.
pub(crate) async fn resolve_template(
    resolver: &dyn TagResolver,
    template: &berth_proto::revisions::v1::ServiceTemplate,
    limit: std::time::Duration,
) -> Result<String, ResolveError> {
    let Some(artifact) = template.artifact() else {
        return Err(ResolveError::InvalidReference("the template names no bundle nor image".to_owned()));
    };
    match tokio::time::timeout(limit, resolver.resolve(artifact.reference)).await {
        Ok(result) => result.map(|digest| digest.to_string()),
        Err(_) => Err(ResolveError::RegistryUnavailable(format!("the registry did not answer within {limit:?}"))),
    }
}

/// Turns a template's bundle reference into the digest it names now.
#[tonic::async_trait]
pub trait TagResolver: fmt::Debug + Send + Sync + 'static {
    /// The manifest digest `bundle` names now: its own when pinned, else what its tag points to.
    async fn resolve(&self, bundle: &BundleRef) -> Result<Digest, ResolveError>;
}

/// How the control plane talks to registries: which it speaks plain HTTP
/// to, and which private CA it trusts for the others.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RegistryPolicy {
    /// `host` (any port) or `host:port` entries; loopback is always allowed.
    pub insecure_registries: Vec<String>,
    /// PEM certificates of a private registry CA, trusted beside the system
    /// roots when resolving tags (nodes take the same with `--registry-ca`).
    pub ca_pem: Option<String>,
    /// Whether templates may name `oci:DIR:TAG` layout directories. A layout
    /// exists on one machine only, so this is for meshes whose control plane
    /// and nodes share that machine (`berth dev`).
    pub allow_layouts: bool,
    /// Mirrors asked, in order, before the registries they mirror.
    pub mirrors: Vec<berth_bundle::RegistryMirror>,
}

impl RegistryPolicy {
    /// Whether `registry` (`host[:port]`) is spoken to over plain HTTP.
    pub fn plain_http(&self, registry: &str) -> bool {
        let host = host_of(registry);
        is_loopback(host) || self.insecure_registries.iter().any(|r| r == registry || r == host)
    }
}

/// How the resolver's registry client is set up under `policy`.
fn client_config(policy: &RegistryPolicy, timeout: Duration) -> RegistryConfig {
    RegistryConfig {
        insecure_registries: policy.insecure_registries.clone(),
        ca_pem: policy.ca_pem.clone(),
        connect_timeout: timeout,
        read_timeout: timeout,
        mirrors: policy.mirrors.clone(),
        ..RegistryConfig::default()
    }
}

fn is_loopback(host: &str) -> bool {
    host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Resolves against the registry itself.
#[derive(Debug, Clone)]
pub struct RegistryResolver {
    client: BundleClient,
    /// Registry credentials by the secret name a bundle reference gives.
    secrets: RegistrySecrets,
}

impl RegistryResolver {
    /// A resolver speaking plain HTTP where `policy` says, HTTPS elsewhere,
    /// giving up on a registry that does not answer within `timeout`.
    pub fn new(policy: &RegistryPolicy, timeout: Duration) -> Result<Self, RegistryError> {
        Self::with_config(client_config(policy, timeout))
    }

    fn with_config(config: RegistryConfig) -> Result<Self, RegistryError> {
        Ok(Self { client: BundleClient::new(config)?, secrets: RegistrySecrets::none() })
    }

    /// The same resolver, using `credentials` for bundles whose secret is
    /// `name`, in whichever registry they name.
    pub fn with_credentials(mut self, name: impl Into<String>, credentials: RegistryCredentials) -> Self {
        self.secrets = self.secrets.with(name, None, credentials);
        self
    }

    /// The same resolver, using `secrets` for bundles that name one.
    pub fn with_secrets(mut self, secrets: RegistrySecrets) -> Self {
        self.secrets = secrets;
        self
    }
}

#[tonic::async_trait]
impl TagResolver for RegistryResolver {
    async fn resolve(&self, bundle: &BundleRef) -> Result<Digest, ResolveError> {
        let reference =
            BundleReference::parse(&bundle.reference).map_err(|e| ResolveError::InvalidReference(e.to_string()))?;
        let credentials = match &reference {
            BundleReference::Registry(registry) if !bundle.secret.is_empty() => self
                .secrets
                .for_registry(&bundle.secret, registry.registry())
                .map_err(|e| ResolveError::Unauthorized(e.to_string()))?
                .clone(),
            _ => RegistryCredentials::Anonymous,
        };
        Ok(self.client.resolve(&reference, &credentials).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_and_listed_registries_are_plain_http() {
        let policy = RegistryPolicy {
            insecure_registries: vec!["registry.lan".into(), "cache.lan:5000".into()],
            ..RegistryPolicy::default()
        };
        assert!(policy.plain_http("127.0.0.1:5000"));
        assert!(policy.plain_http("localhost"));
        assert!(policy.plain_http("[::1]:80"));
        assert!(policy.plain_http("registry.lan:443"));
        assert!(policy.plain_http("cache.lan:5000"));
        assert!(!policy.plain_http("cache.lan:5001"));
        assert!(!policy.plain_http("registry.example.com"));
    }

    #[test]
    fn registry_failures_keep_their_kind_as_the_reason() {
        let not_found = ResolveError::from(RegistryError::TagNotFound { reference: "r/a:v1".into() });
        assert_eq!(not_found.reason(), "TagNotFound");
        let down = RegistryError::RegistryUnavailable { registry: "r".into(), detail: "refused".into() };
        assert_eq!(ResolveError::from(down).reason(), "RegistryUnavailable");
        let denied = RegistryError::Unauthorized { registry: "r".into(), detail: "401".into() };
        assert_eq!(ResolveError::from(denied).reason(), "Unauthorized");
    }

    #[tokio::test]
    async fn a_registry_signed_by_a_private_ca_resolves_with_that_ca_and_not_without() {
        let registry = berth_bundle::testing::TestRegistry::start_with_tls().await.unwrap();
        let ca = registry.ca_pem().unwrap().to_owned();
        // The test registry listens on loopback, which the control plane
        // otherwise speaks plain HTTP to; here it is spoken to as any
        // registry with a certificate would be.
        let https = |ca_pem: Option<String>| {
            let policy = RegistryPolicy { ca_pem, ..RegistryPolicy::default() };
            RegistryConfig { plain_http_loopback: false, ..client_config(&policy, Duration::from_secs(10)) }
        };
        let pusher = BundleClient::new(https(Some(ca.clone()))).unwrap();
        let source = tempfile::tempdir().unwrap();
        std::fs::write(source.path().join("berth.toml"), "entrypoint = \"run.sh\"\n").unwrap();
        std::fs::write(source.path().join("run.sh"), "#!/bin/sh\n").unwrap();
        let packed = berth_bundle::PackedBundle::from_dir(source.path()).unwrap();
        let reference = BundleReference::parse(&registry.reference("team/app:v1")).unwrap();
        let digest = pusher.push(&packed, &reference, &RegistryCredentials::Anonymous).await.unwrap();

        let bundle = BundleRef { reference: registry.reference("team/app:v1"), ..BundleRef::default() };
        let trusting = RegistryResolver::with_config(https(Some(ca))).unwrap();
        assert_eq!(trusting.resolve(&bundle).await.unwrap(), digest);
        let untrusting = RegistryResolver::with_config(https(None)).unwrap();
        let refused = untrusting.resolve(&bundle).await.unwrap_err();
        assert_eq!(refused.reason(), "RegistryUnavailable", "{refused}");
    }
}
