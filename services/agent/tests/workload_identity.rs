//! Every workload's own credential, through the real identity and leases
//! services and a contained runtime: minted before the workload starts,
//! readable by it alone, served to a standard SPIFFE client (the official
//! Python library) over the Workload API with JWT-SVIDs signed by identity,
//! renewed at half its life, never
//! renewed for a released lease, and a launch without one fails.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod common;

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_proto::identity::v1 as identity;
use berth_proto::leases::v1 as leases;
use berth_proto::leases::v1::LeasePhase;
use berth_testkit::eventually;

use common::*;

/// Where the SPIFFE Python library is installed (`scripts/test-deps.sh`),
/// apart from the system's packages, for the system's python3 under the
/// node's `/usr`.
const SPIFFE_PY: &str = "/usr/local/lib/berth-spiffe-py";

/// The identity directory of `lease_id` on the host.
fn identity_dir(data: &Path, lease_id: &str) -> PathBuf {
    data.join("svids").join(lease_id)
}

/// The SPIFFE ID the certificate in `dir` names, and the certificate.
fn svid_in(dir: &Path) -> (String, String) {
    let pem = std::fs::read_to_string(dir.join("svid.pem")).unwrap();
    let cert = berth_mtls::certs_from_pem("svid", &pem).unwrap().remove(0);
    (berth_mtls::cert_uris(&cert).unwrap().into_iter().next().unwrap(), pem)
}

fn expected_id(lease_id: &str) -> String {
    format!("spiffe://berth.internal/ns/default/svc/web/lease/{lease_id}")
}

/// What the workload printed on stdout, once it holds `needle`.
async fn stdout_until(data: &Path, lease_id: &str, needle: &str) -> String {
    let path = data.join("logs").join(lease_id).join("stdout.log");
    let stderr = data.join("logs").join(lease_id).join("stderr.log");
    eventually(&format!("the workload's output to hold {needle:?}"), SLOW, || async {
        let out = std::fs::read_to_string(&path).unwrap_or_default();
        if out.contains(needle) { Ok(out) } else { Err((out, std::fs::read_to_string(&stderr).unwrap_or_default())) }
    })
    .await
}

#[tokio::test]
async fn a_workload_reads_its_own_credential_which_no_other_user_can_and_loses_it_on_release() {
    let (plane, dir, agent) = plane_with_agent(Duration::from_secs(5)).await;
    // The workload checks what it was given, from inside its container.
    let script = r#"set -e
d="$BERTH_IDENTITY_DIR"
test "$SPIFFE_ENDPOINT_SOCKET" = "unix:/berth-workload-api.sock"
test -S "$d/agent.sock"
test -S /berth-workload-api.sock
grep -q "BEGIN CERTIFICATE" "$d/svid.pem"
grep -q "PRIVATE KEY" "$d/svid-key.pem"
grep -q "BEGIN CERTIFICATE" "$d/bundle.pem"
if touch "$d/svid.pem" 2>/dev/null || touch "$d/planted" 2>/dev/null; then echo "writable"; exit 9; fi
echo "checked $d"
exec sleep 1000"#;
    let lease = plane.request("svid", script).await;
    agent.started(&plane, &lease.lease_id).await;
    stdout_until(dir.path(), &lease.lease_id, "checked /berth/identity").await;

    let host = identity_dir(dir.path(), &lease.lease_id);
    let (spiffe_id, _) = svid_in(&host);
    assert_eq!(spiffe_id, expected_id(&lease.lease_id));
    let meta = std::fs::metadata(&host).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o700, "only its owner may enter it");
    assert_ne!(meta.uid(), 0, "it belongs to the workload's own user, not root");
    let key = std::fs::metadata(host.join("..data/svid-key.pem")).unwrap();
    assert_eq!((key.uid(), key.permissions().mode() & 0o777), (meta.uid(), 0o400));
    let bundle = identity::workloads_client::WorkloadsClient::new(plane.channel(&plane.identity_addr))
        .get_workload_bundle(identity::GetWorkloadBundleRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(std::fs::read_to_string(host.join("bundle.pem")).unwrap(), bundle.bundle_pem);
    assert!(
        berth_mtls::verify_chain(&std::fs::read_to_string(host.join("svid.pem")).unwrap(), &bundle.bundle_pem).is_ok(),
        "the certificate chains to the workload authority"
    );

    // A second tenant's workload on the same node (another user) can read
    // neither the files nor the socket of the first.
    let other = leases::Workload {
        command: "sh".into(),
        args: vec!["-c".into(), "exec sleep 1000".into()],
        service: "other".into(),
        ..Default::default()
    };
    let second = plane.request_workload("other", other).await;
    agent.started(&plane, &second.lease_id).await;
    let second_owner = std::fs::metadata(identity_dir(dir.path(), &second.lease_id)).unwrap().uid();
    assert_ne!(second_owner, meta.uid(), "each workload's directory is its own user's");

    plane.release(&lease.lease_id).await;
    eventually("the released workload's credential to be removed", SLOW, || async {
        if host.exists() { Err(std::fs::read_dir(&host).map(|d| d.count()).unwrap_or(0)) } else { Ok(()) }
    })
    .await;
    plane.release(&second.lease_id).await;
    agent.kill().await;
    plane.cleanup().await;
}

#[tokio::test]
async fn the_spiffe_python_library_fetches_the_workloads_svid_and_bundle_over_the_workload_api() {
    assert!(
        Path::new(SPIFFE_PY).join("spiffe").is_dir() || std::env::var("CI").as_deref() != Ok("true"),
        "the SPIFFE Python library is missing from {SPIFFE_PY}: run scripts/test-deps.sh"
    );
    if !Path::new(SPIFFE_PY).join("spiffe").is_dir() {
        eprintln!("skipped: the SPIFFE Python library is not installed at {SPIFFE_PY}");
        return;
    }
    let (plane, dir, agent) = plane_with_agent(Duration::from_secs(5)).await;
    let client = r#"
from spiffe import WorkloadApiClient
from spiffe.spiffe_id.spiffe_id import TrustDomain
with WorkloadApiClient() as client:
    svid = client.fetch_x509_svid()
    print("svid", svid.spiffe_id, len(svid.cert_chain))
    bundles = client.fetch_x509_bundles()
    bundle = bundles.get_bundle_for_trust_domain(TrustDomain("berth.internal"))
    print("bundle", len(bundle.x509_authorities))
    token = client.fetch_jwt_svid(audience={"db"})
    print("jwt", token.spiffe_id, sorted(token.audience))
    print("valid", client.validate_jwt_svid(token.token, "db").spiffe_id)
"#;
    let workload = leases::Workload {
        command: "/usr/bin/python3".into(),
        args: vec!["-S".into(), "-c".into(), client.into()],
        env: [("PYTHONPATH".to_string(), SPIFFE_PY.to_string())].into(),
        service: "web".into(),
        ..Default::default()
    };
    let lease = plane.request_workload("py-spiffe", workload).await;
    let ended = eventually("the client to end", SLOW, || async {
        let lease = plane.lease(&lease.lease_id).await;
        if lease.phase().is_open() { Err(lease) } else { Ok(lease) }
    })
    .await;
    let logs = dir.path().join("logs").join(&lease.lease_id);
    let out = std::fs::read_to_string(logs.join("stdout.log")).unwrap_or_default();
    let errors = std::fs::read_to_string(logs.join("stderr.log")).unwrap_or_default();
    assert_eq!((ended.phase(), ended.exit_code), (LeasePhase::Done, Some(0)), "{ended:?}\n{out}\n{errors}");
    assert!(out.contains(&format!("svid {} 1\n", expected_id(&lease.lease_id))), "{out}");
    assert!(out.contains("bundle 1\n"), "{out}");
    let id = expected_id(&lease.lease_id);
    assert!(out.contains(&format!("jwt {id} ['db']\nvalid {id}\n")), "{out}");
    agent.kill().await;
    plane.cleanup().await;
}

#[tokio::test]
async fn a_credential_is_renewed_at_half_its_life_and_never_for_a_released_lease() {
    let plane = ControlPlane::start_signing(Duration::from_secs(5), node_timing(), Duration::from_secs(4)).await;
    let dir = TestDir::new();
    let agent = RunningAgent::start(agent_config(&plane, dir.path())).await;
    let lease = plane.request("renewed", "exec sleep 1000").await;
    agent.started(&plane, &lease.lease_id).await;
    let host = identity_dir(dir.path(), &lease.lease_id);
    let (first_id, first_cert) = svid_in(&host);
    let renewed = eventually("the credential to be renewed", SLOW, || async {
        let (id, cert) = svid_in(&host);
        if cert != first_cert { Ok((id, cert)) } else { Err(cert) }
    })
    .await;
    assert_eq!(renewed.0, first_id, "a renewal names the same lease");

    // Stopped out from under the agent's workload, the lease's credential
    // is not renewed: identity refuses, and what the node holds stays as
    // it was (the workload is destroyed with the lease).
    plane.release(&lease.lease_id).await;
    let renew = identity::RenewWorkloadCertificateRequest {
        node_id: agent.handle.node_id(),
        lease_id: lease.lease_id.clone(),
        epoch: lease.epoch,
        csr_pem: berth_mtls::generate_csr("x").unwrap().0,
    };
    let node = berth_rpc::connect(&plane.identity_addr, agent.handle.credentials()).unwrap();
    let refused =
        identity::workloads_client::WorkloadsClient::new(node).renew_workload_certificate(renew).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused:?}");
    agent.kill().await;
    plane.cleanup().await;
}

#[tokio::test]
async fn a_launch_whose_credential_cannot_be_minted_fails_with_identity_unavailable() {
    let (plane, dir, agent) = plane_with_agent(Duration::from_secs(5)).await;
    plane.workload_ledger.refuse();
    let lease = plane.request("no-identity", "echo started; exec sleep 1000").await;
    let failed = plane.phase_until(&lease.lease_id, LeasePhase::Failed).await;
    assert_eq!(failed.reason, "IdentityUnavailable", "{failed:?}");
    assert!(failed.message.contains("identity"), "{failed:?}");
    let out = std::fs::read_to_string(dir.path().join("logs").join(&lease.lease_id).join("stdout.log"));
    assert!(!out.unwrap_or_default().contains("started"), "the workload never started");
    assert!(!identity_dir(dir.path(), &lease.lease_id).exists(), "nothing of it is left");
    agent.kill().await;
    plane.cleanup().await;
}
