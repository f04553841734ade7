//! Hot-swappable TLS credentials: the certificate, key and trust bundle a
//! process presents and checks, read afresh on every handshake.
//!
//! # Who writes this
//! The owner of the credentials (the agent's heartbeater after a renewal, a
//! service's certificate reloader) calls [`TlsCredentials::reload`]; every
//! listener and connector holding a clone sees the new material on its next
//! handshake. Established connections keep the material they were made with
//! (the mesh's servers close one once its peer's certificate expired), and
//! no session is resumed: every handshake verifies the certificate its peer
//! presents against the bundle and the clock of that moment.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use berth_core::Identity;
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::MtlsError;
use crate::peer::identity_from_cert;
use crate::pem::{cert_not_after, certs_from_pem, key_from_pem};
use crate::verifier::MeshOrWorkload;

/// ALPN protocol for gRPC over HTTP/2; gRPC clients insist on it.
const ALPN_H2: &[u8] = b"h2";

/// PEM material for one identity: its chain, its key and the CA bundle it trusts.
#[derive(Clone)]
pub struct TlsMaterial {
    /// The leaf first, then any intermediates.
    pub cert_chain_pem: String,
    /// The leaf's private key.
    pub key_pem: String,
    /// Every CA this process trusts for its peers (prepared, active and
    /// retired authorities alike during a rotation).
    pub ca_bundle_pem: String,
}

impl std::fmt::Debug for TlsMaterial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsMaterial").finish_non_exhaustive()
    }
}

impl TlsMaterial {
    /// Reads the three PEM files.
    pub fn from_files(
        cert: impl AsRef<std::path::Path>,
        key: impl AsRef<std::path::Path>,
        ca: impl AsRef<std::path::Path>,
    ) -> Result<Self, MtlsError> {
        Ok(Self {
            cert_chain_pem: read(cert.as_ref())?,
            key_pem: read(key.as_ref())?,
            ca_bundle_pem: read(ca.as_ref())?,
        })
    }
}

fn read(path: &std::path::Path) -> Result<String, MtlsError> {
    std::fs::read_to_string(path).map_err(|source| MtlsError::Io { path: path.display().to_string(), source })
}

struct Loaded {
    server: Arc<ServerConfig>,
    /// The workload bundle client SVIDs are checked against; `None` admits no workload.
    workload_bundle_pem: Option<Arc<str>>,
    client: Arc<ClientConfig>,
    identity: Option<Identity>,
    not_after: i64,
    material: TlsMaterial,
}

/// The credentials a process serves and dials with; cheap to clone, and every
/// clone sees a [`reload`](Self::reload).
#[derive(Clone)]
pub struct TlsCredentials {
    current: Arc<RwLock<Arc<Loaded>>>,
    /// How many times new material was swapped in.
    generation: Arc<AtomicU64>,
}

impl std::fmt::Debug for TlsCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let loaded = self.loaded();
        f.debug_struct("TlsCredentials")
            .field("identity", &loaded.identity)
            .field("not_after", &loaded.not_after)
            .finish()
    }
}

impl TlsCredentials {
    /// Builds server and client configurations from `material`.
    pub fn new(material: TlsMaterial) -> Result<Self, MtlsError> {
        Ok(Self { current: Arc::new(RwLock::new(Arc::new(load(material, None)?))), generation: Arc::default() })
    }

    /// Swaps in new material; the next handshake uses it. On error the old
    /// material stays in force. The workload bundle trusted stays as it was.
    pub fn reload(&self, material: TlsMaterial) -> Result<(), MtlsError> {
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        *current = Arc::new(load(material, current.workload_bundle_pem.clone())?);
        self.generation.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    /// Admits client certificates carrying a SPIFFE ID (workload SVIDs) that
    /// chain to `bundle_pem`, the workload authority's bundle, from the next
    /// handshake; `None` admits none again. Our own certificate, and so the
    /// [`generation`](Self::generation), stays as it is. On error the bundle
    /// in force stays.
    pub fn trust_workloads(&self, bundle_pem: Option<String>) -> Result<(), MtlsError> {
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        if current.workload_bundle_pem.as_deref() == bundle_pem.as_deref() {
            return Ok(());
        }
        *current = Arc::new(load(current.material.clone(), bundle_pem.map(Arc::from))?);
        Ok(())
    }

    /// The workload bundle client SVIDs are checked against, if any; shared,
    /// so a caller that asks at every handshake copies nothing.
    pub fn workload_bundle(&self) -> Option<Arc<str>> {
        self.loaded().workload_bundle_pem.clone()
    }

    /// Counts the reloads: a client that made its connection at another
    /// generation presents material no longer current, and should make a
    /// fresh one (a server refuses a node certificate a renewal replaced).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// The configuration a listener accepts with: it presents our certificate
    /// and asks for, but does not require, a client certificate; the access
    /// layer refuses anonymous callers per RPC.
    pub fn server_config(&self) -> Arc<ServerConfig> {
        self.loaded().server.clone()
    }

    /// The configuration a client dials with: it presents our certificate
    /// and verifies the server against the trust bundle.
    pub fn client_config(&self) -> Arc<ClientConfig> {
        self.loaded().client.clone()
    }

    /// The berth identity our certificate names.
    pub fn identity(&self) -> Option<Identity> {
        self.loaded().identity.clone()
    }

    /// When our certificate expires, seconds since the Unix epoch.
    pub fn not_after(&self) -> i64 {
        self.loaded().not_after
    }

    /// The material currently in force.
    pub fn material(&self) -> TlsMaterial {
        self.loaded().material.clone()
    }

    fn loaded(&self) -> Arc<Loaded> {
        self.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots(ca_bundle_pem: &str) -> Result<Arc<RootCertStore>, MtlsError> {
    roots_named("CA bundle", ca_bundle_pem)
}

fn roots_named(what: &'static str, bundle_pem: &str) -> Result<Arc<RootCertStore>, MtlsError> {
    let mut roots = RootCertStore::empty();
    for cert in certs_from_pem(what, bundle_pem)? {
        roots.add(cert).map_err(MtlsError::Tls)?;
    }
    Ok(Arc::new(roots))
}

fn load(material: TlsMaterial, workload_bundle_pem: Option<Arc<str>>) -> Result<Loaded, MtlsError> {
    let chain: Vec<CertificateDer<'static>> = certs_from_pem("certificate", &material.cert_chain_pem)?;
    let key: PrivateKeyDer<'static> = key_from_pem(&material.key_pem)?;
    let roots = roots(&material.ca_bundle_pem)?;
    let provider = provider();

    let verifier = client_verifier(Some(roots.clone()), workload_bundle_pem.as_deref(), &provider)?;
    let mut server = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(MtlsError::Tls)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain.clone(), key.clone_key())
        .map_err(MtlsError::Tls)?;
    server.alpn_protocols = vec![ALPN_H2.to_vec()];
    // Mesh connections are long-lived; a full handshake on each is cheap
    // beside admitting a certificate that expired since.
    resume_no_session(&mut server);

    let server_verifier = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
        .build()
        .map_err(|e| MtlsError::Verifier(e.to_string()))?;
    let mut client = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(MtlsError::Tls)?
        .with_webpki_verifier(server_verifier)
        .with_client_auth_cert(chain.clone(), key)
        .map_err(MtlsError::Tls)?;
    client.alpn_protocols = vec![ALPN_H2.to_vec()];

    Ok(Loaded {
        server: Arc::new(server),
        workload_bundle_pem,
        client: Arc::new(client),
        identity: identity_from_cert(&chain[0]),
        not_after: cert_not_after(&chain[0])?,
        material,
    })
}

/// The client verifier of a listener: mesh certificates against `mesh`
/// roots, SVIDs against `workload_bundle_pem`, each kind refused without
/// its roots, a certificate optional (see [`MeshOrWorkload`]).
fn client_verifier(
    mesh: Option<Arc<RootCertStore>>,
    workload_bundle_pem: Option<&str>,
    provider: &Arc<CryptoProvider>,
) -> Result<Arc<MeshOrWorkload>, MtlsError> {
    let webpki = |roots| {
        WebPkiClientVerifier::builder_with_provider(roots, provider.clone())
            .allow_unauthenticated()
            .build()
            .map_err(|e| MtlsError::Verifier(e.to_string()))
    };
    let workloads = match workload_bundle_pem {
        Some(bundle) => Some(webpki(roots_named("workload bundle", bundle)?)?),
        None => None,
    };
    let mesh = match mesh {
        Some(roots) => Some(webpki(roots)?),
        None => None,
    };
    Ok(Arc::new(MeshOrWorkload::new(mesh, workloads, provider.signature_verification_algorithms)))
}

/// A server configuration for a public listener: it presents
/// `cert_chain_pem` (leaf first) with `key_pem` and offers `alpn` (e.g.
/// `h2`, `http/1.1`) in that order. With `workload_bundle_pem` it asks for,
/// but does not require, a client certificate, and admits only a workload's
/// SVID chaining to that bundle; without, it asks none.
pub fn public_server_config(
    cert_chain_pem: &str,
    key_pem: &str,
    alpn: &[&[u8]],
    workload_bundle_pem: Option<&str>,
) -> Result<Arc<ServerConfig>, MtlsError> {
    let chain = crate::pem::certs_from_pem("certificate", cert_chain_pem)?;
    let key = crate::pem::key_from_pem(key_pem)?;
    let provider = provider();
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(MtlsError::Tls)?;
    let builder = match workload_bundle_pem {
        Some(bundle) => builder.with_client_cert_verifier(client_verifier(None, Some(bundle), &provider)?),
        None => builder.with_no_client_auth(),
    };
    let mut server = builder.with_single_cert(chain, key).map_err(MtlsError::Tls)?;
    server.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    if workload_bundle_pem.is_some() {
        resume_no_session(&mut server);
    }
    Ok(Arc::new(server))
}

/// Makes `server` resume no TLS session: a resumed session skips the
/// client certificate's verification and carries the one first presented,
/// so it would admit a certificate that has expired (or whose authority
/// left the bundle) since.
fn resume_no_session(server: &mut ServerConfig) {
    server.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    server.send_tls13_tickets = 0;
}

/// A client configuration that verifies servers against `ca_bundle_pem` and
/// presents no certificate: what a host uses to `Join` before it has one.
pub fn anonymous_client_config(ca_bundle_pem: &str) -> Result<Arc<ClientConfig>, MtlsError> {
    let mut client = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(MtlsError::Tls)?
        .with_root_certificates(roots(ca_bundle_pem)?)
        .with_no_client_auth();
    client.alpn_protocols = vec![ALPN_H2.to_vec()];
    Ok(Arc::new(client))
}

/// Checks that the first certificate in `cert_pem` chains to a CA in
/// `ca_bundle_pem` and is valid now, exactly as a berth server would check
/// it as a client certificate.
pub fn verify_chain(cert_pem: &str, ca_bundle_pem: &str) -> Result<(), MtlsError> {
    let chain = certs_from_pem("certificate", cert_pem)?;
    let verifier = WebPkiClientVerifier::builder_with_provider(roots(ca_bundle_pem)?, provider())
        .build()
        .map_err(|e| MtlsError::Verifier(e.to_string()))?;
    verifier
        .verify_client_cert(&chain[0], &chain[1..], rustls_pki_types::UnixTime::now())
        .map(|_| ())
        .map_err(MtlsError::Tls)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::CertificateAuthority;

    fn material(ca: &CertificateAuthority, id: Identity) -> TlsMaterial {
        let (cert, key) = ca.issue(&id, &["localhost".into()], Duration::from_secs(600)).unwrap();
        TlsMaterial { cert_chain_pem: cert.cert_pem, key_pem: key, ca_bundle_pem: ca.cert_pem().to_string() }
    }

    #[test]
    fn reload_swaps_identity_and_keeps_old_on_error() {
        let ca = CertificateAuthority::generate("ca", Duration::from_secs(3600)).unwrap();
        let creds = TlsCredentials::new(material(&ca, Identity::service("leases").unwrap())).unwrap();
        let clone = creds.clone();
        creds.reload(material(&ca, Identity::service("egress").unwrap())).unwrap();
        assert_eq!(clone.identity(), Some(Identity::service("egress").unwrap()));

        let mut bad = material(&ca, Identity::service("x").unwrap());
        bad.key_pem = material(&ca, Identity::service("y").unwrap()).key_pem;
        assert!(creds.reload(bad).is_err(), "a key that does not match the certificate is refused");
        assert_eq!(clone.identity(), Some(Identity::service("egress").unwrap()));
    }

    #[test]
    fn empty_bundle_is_a_clear_error() {
        let ca = CertificateAuthority::generate("ca", Duration::from_secs(3600)).unwrap();
        let mut m = material(&ca, Identity::admin("a").unwrap());
        m.ca_bundle_pem = String::new();
        let err = TlsCredentials::new(m).unwrap_err().to_string();
        assert!(err.contains("CA bundle"), "{err}");
    }
}
