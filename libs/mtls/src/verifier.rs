//! The client-certificate verifier of every berth listener: mesh
//! certificates against the mesh CA bundle, workload SVIDs against the
//! workload bundle, never one against the other's.
//!
//! # Invariants
//! - A client certificate carrying a SPIFFE URI SAN is checked only against
//!   the workload bundle (and refused when the listener trusts no workload);
//!   any other only against the mesh bundle. A workload authority that
//!   signed a DNS name, or a mesh CA that signed a SPIFFE ID, gets nothing:
//!   [`crate::identity_from_cert`] reads an SVID as a workload only.
//! - A client certificate stays optional: the access layer refuses anonymous
//!   callers per RPC.
//! - A public listener (the router's) has no mesh side: there, only a
//!   workload's SVID is a client certificate worth presenting.

use std::sync::Arc;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::{WebPkiSupportedAlgorithms, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, SignatureScheme};

use crate::peer::names_spiffe_id;

/// Dispatches each client certificate to the verifier of its authority.
#[derive(Debug)]
pub(crate) struct MeshOrWorkload {
    mesh: Option<Arc<dyn ClientCertVerifier>>,
    workloads: Option<Arc<dyn ClientCertVerifier>>,
    hints: Vec<DistinguishedName>,
    algorithms: WebPkiSupportedAlgorithms,
}

impl MeshOrWorkload {
    /// Mesh certificates through `mesh`, SVIDs through `workloads`; a kind
    /// without its verifier is refused. Handshake signatures are checked with
    /// `algorithms`.
    pub(crate) fn new(
        mesh: Option<Arc<dyn ClientCertVerifier>>,
        workloads: Option<Arc<dyn ClientCertVerifier>>,
        algorithms: WebPkiSupportedAlgorithms,
    ) -> Self {
        let hints = mesh.iter().chain(&workloads).flat_map(|v| v.root_hint_subjects().iter().cloned()).collect();
        Self { mesh, workloads, hints, algorithms }
    }
}

impl ClientCertVerifier for MeshOrWorkload {
    fn offer_client_auth(&self) -> bool {
        self.mesh.is_some() || self.workloads.is_some()
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &self.hints
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verifier = if names_spiffe_id(end_entity) { &self.workloads } else { &self.mesh };
        match verifier {
            Some(verifier) => verifier.verify_client_cert(end_entity, intermediates, now),
            // No authority of its kind is trusted here: its issuer is unknown.
            None => Err(rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer)),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}
