//! Service certificates that renew themselves through identity: past half
//! its life a service's certificate is replaced by one of the same identity,
//! host names and lifetime, served at once and written over its files; a
//! service certificate can renew only itself.

#![allow(clippy::unwrap_used, reason = "a failed unwrap is a failed test, with its line")]

mod support;

use berth_testkit::on_both_backends;

use std::time::Duration;

use berth_core::Identity;
use berth_mtls::{TlsMaterial, cert_host_names, certs_from_pem, generate_csr, verify_chain};
use berth_proto::identity::v1;
use berth_runtime::{TlsArgs, renew_if_due};
use support::{Backend, Cluster, fast_timing};
use tonic::Code;

on_both_backends!(a_service_certificate_renews_itself_past_half_its_life_and_only_itself);

fn write(args: &TlsArgs, material: &TlsMaterial) {
    std::fs::write(&args.tls_cert, &material.cert_chain_pem).unwrap();
    std::fs::write(&args.tls_key, &material.key_pem).unwrap();
    std::fs::write(&args.ca_file, &material.ca_bundle_pem).unwrap();
}

async fn a_service_certificate_renews_itself_past_half_its_life_and_only_itself(backend: Backend) {
    let cluster = Cluster::start(backend, fast_timing()).await;
    let authority = cluster.replicas[0].service.authority().clone();
    let leases = Identity::service("leases").unwrap();
    let hosts = vec!["leases".to_owned(), "127.0.0.1".to_owned()];
    let dir = tempfile::tempdir().unwrap();
    let args = TlsArgs {
        tls_cert: dir.path().join("leases.pem"),
        tls_key: dir.path().join("leases-key.pem"),
        ca_file: dir.path().join("ca.pem"),
    };
    let addr = cluster.addr(0);

    // Young: nothing to do.
    write(&args, &authority.issue_material(&leases, &hosts, Duration::from_secs(3600)).await.unwrap());
    let credentials = args.load().unwrap();
    assert!(!renew_if_due(&args, &credentials, &addr).await.unwrap(), "not yet half its life");

    // Past half its life: renewed through identity, in force and on disk.
    let short = authority.issue_material(&leases, &hosts, Duration::from_secs(2)).await.unwrap();
    write(&args, &short);
    let credentials = args.load().unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = credentials.not_after();
    assert!(renew_if_due(&args, &credentials, &addr).await.unwrap(), "renewed once past half its life");
    assert!(credentials.not_after() > before, "served from now on");
    let on_disk = TlsMaterial::from_files(&args.tls_cert, &args.tls_key, &args.ca_file).unwrap();
    assert_eq!(on_disk.cert_chain_pem, credentials.material().cert_chain_pem, "written over its files");
    assert_ne!(on_disk.key_pem, short.key_pem, "under a new key");
    verify_chain(&on_disk.cert_chain_pem, &on_disk.ca_bundle_pem).unwrap();
    assert_eq!(credentials.identity(), Some(leases.clone()), "the same identity");
    let leaf = &certs_from_pem("certificate", &on_disk.cert_chain_pem).unwrap()[0];
    let kept = cert_host_names(leaf).unwrap();
    assert!(kept.contains(&"leases".to_owned()) && kept.contains(&"127.0.0.1".to_owned()), "{kept:?}");
    let key_mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&args.tls_key).unwrap().permissions());
    assert_eq!(key_mode & 0o077, 0, "the key stays private");

    // A service certificate asks for another service's: refused.
    let channel = berth_rpc::connect(&addr, credentials.clone()).unwrap();
    let (csr_pem, _) = generate_csr("revisions").unwrap();
    let request = v1::IssueCertificateRequest {
        kind: v1::CertificateKind::Service as i32,
        name: "revisions".into(),
        csr_pem,
        ..Default::default()
    };
    let refused = v1::authority_client::AuthorityClient::new(channel).issue_certificate(request).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains("only its own"), "{}", refused.message());
    cluster.cleanup().await;
}
