#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use berth_mtls::CertificateAuthority;
use berth_proto::identity::v1::{
    RenewWorkloadCertificateRequest, SignWorkloadCertificateRequest, SignWorkloadCertificateResponse,
    SignWorkloadJwtRequest, SignWorkloadJwtResponse,
};
use berth_proto::leases::v1::RegisterLaunchRequest;

use super::*;

const SPIFFE_ID: &str = "spiffe://berth.internal/ns/shop/svc/web/lease/l-1";

/// What the fake node trusts as the mesh CA.
const MESH_CA: &str = "-----BEGIN CERTIFICATE-----\nmesh\n-----END CERTIFICATE-----\n";

/// Identity and leases as the node sees them, signing with a CA of its
/// own: certificates live `ttl`; renewals are refused once `refuse_renewals`.
#[derive(Debug)]
struct FakeWorkloads {
    ca: CertificateAuthority,
    ttl: Duration,
    registrations: AtomicU32,
    renewals: AtomicU32,
    refuse_renewals: std::sync::atomic::AtomicBool,
}

impl FakeWorkloads {
    fn new(ttl: Duration) -> Arc<Self> {
        Arc::new(Self {
            ca: CertificateAuthority::generate("workloads", Duration::from_secs(3600)).unwrap(),
            ttl,
            registrations: AtomicU32::new(0),
            renewals: AtomicU32::new(0),
            refuse_renewals: std::sync::atomic::AtomicBool::new(false),
        })
    }

    fn signed(&self, csr_pem: &str) -> SignWorkloadCertificateResponse {
        let cert =
            self.ca.sign_svid_csr(csr_pem, &berth_core::WorkloadId::parse(SPIFFE_ID).unwrap(), self.ttl).unwrap();
        SignWorkloadCertificateResponse {
            spiffe_id: SPIFFE_ID.into(),
            certificate_pem: cert.cert_pem,
            bundle_pem: self.ca.cert_pem().to_string(),
            not_before: Some(prost_types::Timestamp { seconds: cert.not_before, nanos: 0 }),
            not_after: Some(prost_types::Timestamp { seconds: cert.not_after, nanos: 0 }),
            lease_id: "l-1".into(),
            epoch: 1,
            jwks_json: berth_mtls::jwks(self.ca.cert_pem()).unwrap(),
        }
    }
}

#[async_trait::async_trait]
impl WorkloadsApi for FakeWorkloads {
    async fn register_launch(&self, request: RegisterLaunchRequest) -> Result<String, tonic::Status> {
        assert_eq!((request.lease_id.as_str(), request.epoch, request.node_id.as_str()), ("l-1", 1, "n-1"));
        let n = self.registrations.fetch_add(1, Ordering::SeqCst);
        Ok(format!("registration-{n}"))
    }

    async fn sign(
        &self,
        request: SignWorkloadCertificateRequest,
    ) -> Result<SignWorkloadCertificateResponse, tonic::Status> {
        assert!(request.registration.starts_with("registration-"));
        Ok(self.signed(&request.csr_pem))
    }

    async fn sign_jwt(&self, request: SignWorkloadJwtRequest) -> Result<SignWorkloadJwtResponse, tonic::Status> {
        assert_eq!((request.lease_id.as_str(), request.epoch, request.node_id.as_str()), ("l-1", 1, "n-1"));
        let (token, claims) = self.ca.sign_jwt_svid(SPIFFE_ID, &request.audience, Duration::from_secs(300)).unwrap();
        Ok(SignWorkloadJwtResponse {
            spiffe_id: SPIFFE_ID.into(),
            token,
            expires_at: Some(prost_types::Timestamp { seconds: claims.exp, nanos: 0 }),
            jwks_json: berth_mtls::jwks(self.ca.cert_pem()).unwrap(),
        })
    }

    async fn renew(
        &self,
        request: RenewWorkloadCertificateRequest,
    ) -> Result<SignWorkloadCertificateResponse, tonic::Status> {
        if self.refuse_renewals.load(Ordering::SeqCst) {
            return Err(tonic::Status::failed_precondition("lease l-1 is LEASE_PHASE_RELEASED"));
        }
        self.renewals.fetch_add(1, Ordering::SeqCst);
        Ok(self.signed(&request.csr_pem))
    }

    fn reconnect(&self) {}

    fn mesh_bundle(&self) -> String {
        MESH_CA.into()
    }
}

fn lease() -> (LeaseWatch, watch::Sender<u64>, watch::Sender<Option<String>>) {
    let (epoch_tx, epoch) = watch::channel(1);
    let (node_tx, node) = watch::channel(Some("n-1".to_string()));
    (LeaseWatch { lease_id: "l-1".into(), epoch, node }, epoch_tx, node_tx)
}

fn svids(dir: &Path, api: Arc<FakeWorkloads>) -> Svids {
    Svids::new(dir, api, (Duration::from_millis(20), Duration::from_millis(100)), CancellationToken::new())
}

#[tokio::test]
async fn a_minted_credential_is_files_behind_one_link_and_reads_back_the_same() {
    let tmp = tempfile::tempdir().unwrap();
    let api = FakeWorkloads::new(Duration::from_secs(600));
    let svids = svids(tmp.path(), api.clone());
    let (lease, _epoch, _node) = lease();
    let dir = svids.mint(lease).await.unwrap();
    assert_eq!(dir, tmp.path().join(SVIDS_DIR).join("l-1"));
    for file in SHOWN_FILES {
        let link = std::fs::read_link(dir.join(file)).unwrap();
        assert_eq!(link, Path::new(CURRENT).join(file), "{file} follows the current generation");
    }
    let loaded = Svid::load(&dir).unwrap();
    assert_eq!(loaded.spiffe_id, SPIFFE_ID);
    assert_eq!(loaded.bundle_pem, api.ca.cert_pem());
    assert_eq!(loaded.mesh_bundle_pem, MESH_CA, "berth's own CA, to call its APIs with");
    assert!(berth_mtls::verify_chain(&loaded.cert_pem, &loaded.bundle_pem).is_ok());
    assert_eq!(loaded.trust_domain(), "spiffe://berth.internal");
    use std::os::unix::fs::PermissionsExt as _;
    let mode = |path: &Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&dir.join(KEY_FILE)), 0o400);
    assert!(dir.join(SOCKET_FILE).exists(), "the Workload API listens");
    assert_eq!(api.registrations.load(Ordering::SeqCst), 1, "one registration per launch");

    svids.forget("l-1").await;
    assert!(!dir.exists(), "forgotten, nothing is left");
}

#[tokio::test]
async fn renewal_at_half_life_replaces_the_files_whole_and_stops_once_refused() {
    let tmp = tempfile::tempdir().unwrap();
    // Certificates are backdated; half the life left at receipt is 1 s.
    let api = FakeWorkloads::new(Duration::from_secs(2));
    let svids = svids(tmp.path(), api.clone());
    let (lease, _epoch, _node) = lease();
    let dir = svids.mint(lease).await.unwrap();
    let first = std::fs::read_to_string(dir.join(SVID_FILE)).unwrap();
    berth_testkit::eventually("a renewal", berth_testkit::PATIENCE, || async {
        let now = std::fs::read_to_string(dir.join(SVID_FILE)).unwrap();
        if now != first { Ok(()) } else { Err(api.renewals.load(Ordering::SeqCst)) }
    })
    .await;
    let renewed = Svid::load(&dir).unwrap();
    assert_eq!(renewed.spiffe_id, SPIFFE_ID);
    assert_eq!(
        berth_mtls::private_key_der(&renewed.key_pem).unwrap(),
        berth_mtls::private_key_der(&std::fs::read_to_string(dir.join(KEY_FILE)).unwrap()).unwrap(),
        "the key stays; only the certificate is new"
    );
    // The old generation goes once the new one is in place (just after the
    // swap a reader may still find it).
    berth_testkit::eventually("old generations removed", berth_testkit::PATIENCE, || async {
        let generations: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.unwrap().file_name().into_string().ok())
            .filter(|name| name.starts_with(GENERATION_PREFIX))
            .collect();
        if generations.len() == 1 { Ok(()) } else { Err(generations) }
    })
    .await;

    api.refuse_renewals.store(true, Ordering::SeqCst);
    let refused_at = api.renewals.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(api.renewals.load(Ordering::SeqCst), refused_at, "no renewal after a refusal");
    svids.forget("l-1").await;
}

#[tokio::test]
async fn an_adopted_workload_resumes_from_its_files_and_retain_removes_the_unheld() {
    let tmp = tempfile::tempdir().unwrap();
    let api = FakeWorkloads::new(Duration::from_secs(600));
    let first = svids(tmp.path(), api.clone());
    let (lease_watch, _epoch, _node) = lease();
    let dir = first.mint(lease_watch).await.unwrap();
    drop(first);

    let second = svids(tmp.path(), api.clone());
    let (lease_watch, _epoch, _node) = lease();
    second.adopt(lease_watch).await;
    assert!(dir.join(SOCKET_FILE).exists());
    std::fs::create_dir_all(tmp.path().join(SVIDS_DIR).join("l-gone")).unwrap();
    second.retain(&BTreeSet::from(["l-1".to_string()])).await;
    assert!(dir.exists(), "a held lease's credential stays");
    assert!(!tmp.path().join(SVIDS_DIR).join("l-gone").exists(), "an unheld one goes");
}

#[tokio::test]
async fn a_standard_spiffe_client_reads_the_credential_over_the_workload_api() {
    const SPIFFE_PY: &str = "/usr/local/lib/berth-spiffe-py";
    if !Path::new(SPIFFE_PY).join("spiffe").is_dir() {
        assert_ne!(std::env::var("CI").as_deref(), Ok("true"), "py-spiffe is missing: run scripts/test-deps.sh");
        eprintln!("skipped: the SPIFFE Python library is not installed at {SPIFFE_PY}");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let api = FakeWorkloads::new(Duration::from_secs(600));
    let svids = svids(tmp.path(), api.clone());
    let (lease, _epoch, _node) = lease();
    let dir = svids.mint(lease).await.unwrap();
    let client = r#"
from spiffe import WorkloadApiClient
from spiffe.spiffe_id.spiffe_id import TrustDomain
with WorkloadApiClient() as client:
    svid = client.fetch_x509_svid()
    print("svid", svid.spiffe_id, len(svid.cert_chain))
    bundle = client.fetch_x509_bundles().get_bundle_for_trust_domain(TrustDomain("berth.internal"))
    print("bundle", len(bundle.x509_authorities))
    token = client.fetch_jwt_svid(audience={"db"})
    print("jwt", token.spiffe_id, sorted(token.audience))
    print("valid", client.validate_jwt_svid(token.token, "db").spiffe_id)
    jwt_bundle = client.fetch_jwt_bundles().get_bundle_for_trust_domain(TrustDomain("berth.internal"))
    print("jwt keys", len(jwt_bundle.jwt_authorities))
    try:
        client.validate_jwt_svid(token.token, "web")
        print("accepted for another audience")
    except Exception:
        print("refused for another audience")
"#;
    let output = tokio::process::Command::new("/usr/bin/python3")
        .args(["-S", "-c", client])
        .env("PYTHONPATH", SPIFFE_PY)
        // A path of one component, as the container runtimes give one (see
        // the container provider's `link_workload_api`).
        .current_dir(&dir)
        .env("SPIFFE_ENDPOINT_SOCKET", format!("unix:{SOCKET_FILE}"))
        .output()
        .await
        .unwrap();
    let (out, errors) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "{out}\n{errors}");
    assert_eq!(
        out,
        format!(
            "svid {SPIFFE_ID} 1\nbundle 1\njwt {SPIFFE_ID} ['db']\nvalid {SPIFFE_ID}\njwt keys 1\n\
             refused for another audience\n"
        )
    );
    svids.forget("l-1").await;
}
