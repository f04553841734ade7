//! Bundles for test services, pushed to an OCI layout directory (revisions
//! runs with `--allow-oci-layouts`, and every agent shares the host's
//! filesystem), so a mesh deploys with no registry at all.

use std::path::Path;

use anyhow::Context as _;
use berth_bundle::{BundleClient, BundleReference, PackedBundle, RegistryConfig, RegistryCredentials};
use berth_proto::revisions::v1 as revisions_v1;
use berth_proto::types::v1::{BundleRef, Capacity};

use crate::{Mesh, RUN_MARKER_ENV, ServiceKind};

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

/// Declares service `name` running `bundle` (a sleeper), `replicas` of it
/// over the mesh's tier, each replica marked as the run's.
pub async fn deploy(mesh: &Mesh, name: &str, bundle: &str, replicas: u32) -> anyhow::Result<()> {
    let mut services = revisions_v1::services_client::ServicesClient::new(mesh.channel(ServiceKind::Revisions)?);
    services
        .apply_service(revisions_v1::ApplyServiceRequest {
            name: name.into(),
            template: Some(revisions_v1::ServiceTemplate {
                bundle: Some(BundleRef { reference: bundle.into(), ..Default::default() }),
                env: [(RUN_MARKER_ENV.to_string(), mesh.run_id().to_string())].into(),
                resources: Some(Capacity { cpu_millis: 100, memory_bytes: 32 << 20 }),
                replicas: Some(replicas),
                tier: mesh.options().tier.clone(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .with_context(|| format!("ApplyService {name}"))?;
    Ok(())
}
