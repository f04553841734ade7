//! The registry flags every binary that talks to registries takes
//! (`berth-agent` for pulls, `berth-revisions` for tag resolution), written
//! once so both read them alike.

use std::path::PathBuf;

use crate::client::RegistryMirror;

/// `--insecure-registry`, `--registry-mirror` and `--registry-ca`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct RegistryArgs {
    /// A registry spoken to over plain HTTP, `host` or `host:port` (repeat,
    /// or comma separated). Loopback registries always are.
    #[arg(long = "insecure-registry", env = "BERTH_INSECURE_REGISTRIES", value_name = "HOST", value_delimiter = ',')]
    pub insecure_registries: Vec<String>,
    /// A mirror asked before the registry it mirrors, `ORIGIN=MIRROR`
    /// (e.g. `docker.io=mirror.internal:5000`; repeat for more, tried in
    /// order, or separate with spaces): tags and content come from it first,
    /// verified by digest, and from the origin when it fails. It gets the
    /// origin's credentials only when written `ORIGIN=MIRROR,credentials`.
    /// Give revisions and the nodes the same mirrors.
    #[arg(long = "registry-mirror", env = "BERTH_REGISTRY_MIRRORS", value_name = "ORIGIN=MIRROR",
        value_delimiter = ' ', value_parser = str::parse::<RegistryMirror>)]
    pub registry_mirrors: Vec<RegistryMirror>,
    /// PEM file of the CA that signed a private registry's certificate,
    /// trusted beside the system roots (give revisions and the nodes the
    /// same file).
    #[arg(long = "registry-ca", env = "BERTH_REGISTRY_CA", value_name = "FILE")]
    pub registry_ca: Option<PathBuf>,
}

impl RegistryArgs {
    /// The plain-HTTP registries, trimmed, empty entries left out.
    pub fn insecure_registries(&self) -> Vec<String> {
        self.insecure_registries.iter().map(|r| r.trim().to_owned()).filter(|r| !r.is_empty()).collect()
    }

    /// The private CA's PEM, read from `--registry-ca` when it is given.
    pub fn ca_pem(&self) -> std::io::Result<Option<String>> {
        self.registry_ca.as_deref().map(std::fs::read_to_string).transpose()
    }

    /// A registry client as the flags say; the error names the flag.
    pub fn client(&self) -> Result<crate::BundleClient, String> {
        let ca_pem = self.ca_pem().map_err(|e| {
            let path = self.registry_ca.as_ref().map(|p| p.display().to_string()).unwrap_or_default();
            format!("--registry-ca: cannot read {path}: {e}")
        })?;
        let config = crate::RegistryConfig {
            insecure_registries: self.insecure_registries(),
            ca_pem,
            mirrors: self.registry_mirrors.clone(),
            ..crate::RegistryConfig::default()
        };
        crate::BundleClient::new(config).map_err(|e| format!("--registry-ca: {e}"))
    }
}
