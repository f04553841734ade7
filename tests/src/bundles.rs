//! Bundles for test services, pushed to an OCI layout directory (revisions
//! runs with `--allow-oci-layouts`, and every agent shares the host's
//! filesystem), so a mesh deploys with no registry at all.

use std::path::Path;

use anyhow::Context as _;
use berth_bundle::{BundleClient, BundleReference, PackedBundle, RegistryConfig, RegistryCredentials};

/// Packs a bundle whose program sleeps for a day and pushes it to the
/// layout at `layout` under `tag`; returns its reference, `oci:LAYOUT:TAG`.
pub async fn push_sleeper(layout: &Path, tag: &str) -> anyhow::Result<String> {
    let source = tempfile::Builder::new().prefix("berth-e2e-bundle-").tempdir()?;
    std::fs::write(
        source.path().join(berth_bundle::SPEC_FILE),
        "# A replica that only runs: what the control plane sees of it is all a test needs.\n\
         entrypoint = \"/bin/sleep\"\nargs = [\"86400\"]\n",
    )?;
    std::fs::write(source.path().join("README"), "a test bundle\n")?;
    let dir = source.path().to_path_buf();
    let bundle = tokio::task::spawn_blocking(move || PackedBundle::from_dir(&dir)).await??;
    let reference = format!("oci:{}:{tag}", layout.display());
    let parsed = BundleReference::parse(&reference).with_context(|| format!("bundle reference {reference}"))?;
    BundleClient::new(RegistryConfig::default())?
        .push(&bundle, &parsed, &RegistryCredentials::default())
        .await
        .with_context(|| format!("cannot push the bundle to {reference}"))?;
    Ok(reference)
}
