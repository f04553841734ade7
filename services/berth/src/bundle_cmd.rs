//! `berth bundle push|inspect`: builds a bundle from a directory and pushes it to a
//! registry or an OCI layout directory, and shows what a reference holds.
//!
//! # References
//! `host/repo:tag`, `host/repo@sha256:<hex>`, or `oci:DIR:TAG` for an OCI image-layout
//! directory (what `berth dev` deploys from without a registry). Loopback registries and
//! those named by `--insecure-registry` are spoken to over plain HTTP.
//!
//! # What a failure looks like
//! One line, `berth: error: ...`, naming the field of `berth.toml` or the reference that
//! was wrong, and exit code 1.

use std::io::BufRead;
use std::path::PathBuf;

use berth_bundle::{
    BundleClient, BundleInfo, BundleReference, PackError, PackedBundle, ReferenceError, RegistryConfig,
    RegistryCredentials, RegistryError,
};
use berth_runtime::StartError;
use serde_json::{Value, json};

use crate::cli::OutputFormat;
use crate::cli::output::{self, Table};

/// Flags of `berth bundle`.
#[derive(Debug, clap::Args)]
pub(crate) struct BundleArgs {
    #[command(subcommand)]
    command: BundleCommand,
}

#[derive(Debug, clap::Subcommand)]
enum BundleCommand {
    /// Build a bundle from DIR (its `berth.toml` says how to run it) and push it to REF.
    Push {
        /// The bundle directory, holding `berth.toml`.
        #[arg(value_name = "DIR")]
        dir: PathBuf,
        /// Where to push: `host/repo:tag` or `oci:DIR:TAG`.
        #[arg(value_name = "REF", value_parser = parse_reference)]
        reference: BundleReference,
        #[command(flatten)]
        registry: RegistryArgs,
    },
    /// Show a bundle: digest, config, layers and sizes.
    Inspect {
        /// The bundle: `host/repo:tag`, `host/repo@sha256:<hex>` or `oci:DIR:TAG`.
        #[arg(value_name = "REF", value_parser = parse_reference)]
        reference: BundleReference,
        #[command(flatten)]
        registry: RegistryArgs,
    },
}

/// How to reach and authenticate to the registry.
#[derive(Debug, Clone, clap::Args)]
struct RegistryArgs {
    /// A registry to speak plain HTTP to, `host` or `host:port`; repeatable. Loopback
    /// registries always are.
    #[arg(long = "insecure-registry", env = "BERTH_INSECURE_REGISTRIES", value_name = "HOST", value_delimiter = ',')]
    insecure_registries: Vec<String>,
    /// The registry user; with --password or --password-stdin.
    #[arg(long, env = "BERTH_REGISTRY_USERNAME", value_name = "USER")]
    username: Option<String>,
    /// The registry password (prefer BERTH_REGISTRY_PASSWORD or --password-stdin: flags
    /// show in `ps`).
    #[arg(
        long,
        env = "BERTH_REGISTRY_PASSWORD",
        value_name = "PASSWORD",
        hide_env_values = true,
        conflicts_with = "password_stdin"
    )]
    password: Option<String>,
    /// Read the registry password from the first line of standard input.
    #[arg(long)]
    password_stdin: bool,
    /// A bearer token for the registry, instead of a user and password.
    #[arg(long, env = "BERTH_REGISTRY_TOKEN", value_name = "TOKEN", hide_env_values = true,
          conflicts_with_all = ["username", "password", "password_stdin"])]
    token: Option<String>,
    /// PEM file of the CA that signed a private registry's certificate.
    #[arg(long = "registry-ca", env = "BERTH_REGISTRY_CA", value_name = "FILE")]
    ca: Option<PathBuf>,
    /// Output format.
    #[arg(short = 'o', long, env = "BERTH_OUTPUT", value_enum, default_value_t = OutputFormat::Table,
          value_name = "FORMAT")]
    output: OutputFormat,
}

/// Why a bundle command failed. Each message is the whole line the user sees.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BundleCmdError {
    /// The directory could not be packed.
    #[error("cannot build a bundle from {dir}: {source}")]
    Pack {
        /// The directory.
        dir: String,
        /// Why.
        #[source]
        source: PackError,
    },
    /// The registry or layout refused or failed.
    #[error("{0}")]
    Registry(#[from] RegistryError),
    /// A flag's value cannot be used.
    #[error("{0}")]
    Usage(String),
    /// A file named by a flag could not be read.
    #[error("cannot read {what} {path}: {source}")]
    Read {
        /// What the file is for.
        what: &'static str,
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Standard output could not be written.
    #[error("cannot write output: {0}")]
    Output(#[source] std::io::Error),
}

impl From<BundleCmdError> for StartError {
    fn from(error: BundleCmdError) -> Self {
        StartError::Invalid(error.to_string().replace('\n', " "))
    }
}

fn parse_reference(value: &str) -> Result<BundleReference, String> {
    BundleReference::parse(value).map_err(|e: ReferenceError| e.to_string())
}

impl BundleArgs {
    pub(crate) async fn run(self) -> Result<(), BundleCmdError> {
        match self.command {
            BundleCommand::Push { dir, reference, registry } => {
                let (client, credentials) = registry.connect()?;
                let shown = dir.display().to_string();
                let bundle = tokio::task::spawn_blocking(move || PackedBundle::from_dir(&dir))
                    .await
                    .map_err(|e| BundleCmdError::Usage(format!("packing stopped: {e}")))?
                    .map_err(|source| BundleCmdError::Pack { dir: shown, source })?;
                let digest = client.push(&bundle, &reference, &credentials).await?;
                let pinned = reference.pinned(&digest);
                let layer_size = bundle.manifest().layers.iter().map(|l| l.size).sum::<u64>();
                match registry.output {
                    OutputFormat::Json => print_json(&json!({
                        "reference": reference.to_string(),
                        "digest": digest.to_string(),
                        "pinned": pinned.to_string(),
                        "modules": bundle.config().modules.len(),
                        "layer_size": layer_size,
                    })),
                    OutputFormat::Table => print(&output::fields(&[
                        ("Pushed", reference.to_string()),
                        ("Digest", digest.to_string()),
                        ("Pinned", pinned.to_string()),
                        ("Modules", bundle.config().modules.len().to_string()),
                        ("Layer", output::memory(layer_size)),
                    ])),
                }
            }
            BundleCommand::Inspect { reference, registry } => {
                let (client, credentials) = registry.connect()?;
                let info = client.inspect(&reference, &credentials).await?;
                match registry.output {
                    OutputFormat::Json => print_json(&info_json(&info)),
                    OutputFormat::Table => print(&info_table(&info)),
                }
            }
        }
    }
}

impl RegistryArgs {
    fn connect(&self) -> Result<(BundleClient, RegistryCredentials), BundleCmdError> {
        let ca_pem = match &self.ca {
            Some(path) => Some(std::fs::read_to_string(path).map_err(|source| BundleCmdError::Read {
                what: "registry CA",
                path: path.display().to_string(),
                source,
            })?),
            None => None,
        };
        let config = RegistryConfig {
            insecure_registries: self.insecure_registries.clone(),
            ca_pem,
            ..RegistryConfig::default()
        };
        let client = BundleClient::new(config)?;
        Ok((client, self.credentials()?))
    }

    fn credentials(&self) -> Result<RegistryCredentials, BundleCmdError> {
        if let Some(token) = &self.token {
            return Ok(RegistryCredentials::Bearer { token: token.clone() });
        }
        let password = if self.password_stdin {
            let mut line = String::new();
            std::io::stdin().lock().read_line(&mut line).map_err(|source| BundleCmdError::Read {
                what: "the password from",
                path: "standard input".to_owned(),
                source,
            })?;
            Some(line.trim_end_matches(['\r', '\n']).to_owned())
        } else {
            self.password.clone()
        };
        match (&self.username, password) {
            (Some(username), Some(password)) => Ok(RegistryCredentials::Basic { username: username.clone(), password }),
            (Some(_), None) => Err(BundleCmdError::Usage("--username needs --password or --password-stdin".to_owned())),
            (None, Some(_)) => Err(BundleCmdError::Usage("a password needs --username".to_owned())),
            (None, None) => Ok(RegistryCredentials::Anonymous),
        }
    }
}

fn info_json(info: &BundleInfo) -> Value {
    json!({
        "reference": info.reference.to_string(),
        "digest": info.digest.to_string(),
        "manifest_size": info.manifest_size,
        "manifest": serde_json::to_value(&info.manifest).unwrap_or(Value::Null),
        "config": serde_json::to_value(&info.config).unwrap_or(Value::Null),
    })
}

fn info_table(info: &BundleInfo) -> String {
    let config = &info.config;
    let env: Vec<String> = config.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let ports: Vec<String> = config.ports.iter().map(|p| format!("{}:{}", p.name, p.port)).collect();
    let mut out = output::fields(&[
        ("Reference", info.reference.to_string()),
        ("Digest", info.digest.to_string()),
        ("Artifact type", info.manifest.artifact_type.clone().unwrap_or_else(|| output::NONE.to_owned())),
        ("Manifest", output::memory(info.manifest_size)),
        ("Config", format!("{} ({})", info.manifest.config.digest, output::memory(info.manifest.config.size))),
        ("Entrypoint", config.entrypoint.clone()),
        ("Args", or_none(config.args.iter().map(|a| shell_word(a)).collect::<Vec<_>>().join(" "))),
        ("Env", or_none(env.join(" "))),
        ("Ports", or_none(ports.join(" "))),
    ]);
    let mut layers = Table::new(vec!["MEDIA TYPE", "DIGEST", "SIZE"]);
    for layer in &info.manifest.layers {
        layers.row(vec![layer.media_type.clone(), layer.digest.to_string(), output::memory(layer.size)]);
    }
    out.push_str(&layers.section("Layers", output::NONE));
    let mut modules = Table::new(vec!["PATH", "SIZE", "DIGEST"]);
    for module in &config.modules {
        modules.row(vec![module.path.clone(), output::memory(module.size), module.digest.to_string()]);
    }
    out.push_str(&modules.section("Modules", output::NONE));
    out
}

fn or_none(text: String) -> String {
    if text.is_empty() { output::NONE.to_owned() } else { text }
}

/// An argument as a shell would need it quoted.
fn shell_word(arg: &str) -> String {
    let plain = !arg.is_empty() && arg.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_=./:,@%+".contains(&b));
    if plain { arg.to_owned() } else { format!("'{}'", arg.replace('\'', r"'\''")) }
}

fn print(text: &str) -> Result<(), BundleCmdError> {
    output::write_stdout(text).map_err(BundleCmdError::Output)
}

fn print_json(value: &Value) -> Result<(), BundleCmdError> {
    print(&output::json_text(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_are_quoted_only_when_needed() {
        assert_eq!(shell_word("--port=8080"), "--port=8080");
        assert_eq!(shell_word("hello world"), "'hello world'");
        assert_eq!(shell_word("it's"), r"'it'\''s'");
        assert_eq!(shell_word(""), "''");
    }

    #[test]
    fn a_bundles_layers_read_as_a_table_under_their_heading_or_none() {
        let mut layers = Table::new(vec!["MEDIA TYPE", "DIGEST", "SIZE"]);
        assert_eq!(layers.section("Layers", output::NONE), "\nLayers:\n  <none>\n");
        layers.row(vec!["tar".into(), "sha256:ab".into(), output::memory(4300)]);
        assert_eq!(
            layers.section("Layers", output::NONE),
            "\nLayers:\n  MEDIA TYPE   DIGEST      SIZE\n  tar          sha256:ab   4.2Ki\n"
        );
    }
}
