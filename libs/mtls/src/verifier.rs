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

use std::sync::Arc;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, SignatureScheme};

use crate::peer::names_spiffe_id;

/// Dispatches each client certificate to the verifier of its authority.
#[derive(Debug)]
pub(crate) struct MeshOrWorkload {
    mesh: Arc<dyn ClientCertVerifier>,
    workloads: Option<Arc<dyn ClientCertVerifier>>,
    hints: Vec<DistinguishedName>,
}

impl MeshOrWorkload {
    /// Mesh certificates through `mesh`, SVIDs through `workloads` (none
    /// admitted without it).
    pub(crate) fn new(mesh: Arc<dyn ClientCertVerifier>, workloads: Option<Arc<dyn ClientCertVerifier>>) -> Self {
        let mut hints = mesh.root_hint_subjects().to_vec();
        if let Some(workloads) = &workloads {
            hints.extend(workloads.root_hint_subjects().iter().cloned());
        }
        Self { mesh, workloads, hints }
    }
}

impl ClientCertVerifier for MeshOrWorkload {
    fn offer_client_auth(&self) -> bool {
        true
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
        if !names_spiffe_id(end_entity) {
            return self.mesh.verify_client_cert(end_entity, intermediates, now);
        }
        match &self.workloads {
            Some(workloads) => workloads.verify_client_cert(end_entity, intermediates, now),
            // No workload authority is trusted: its issuer is unknown here.
            None => Err(rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer)),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.mesh.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.mesh.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.mesh.supported_verify_schemes()
    }
}
