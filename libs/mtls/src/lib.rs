//! Certificates and TLS for the berth mesh: the certificate authority that
//! signs every identity, the credential holders that servers and clients
//! read on every handshake, and the peer identity read back from a
//! presented certificate.
//!
//! # Invariants
//! - A leaf certificate carries exactly one berth identity SAN (see
//!   [`berth_core::Identity`]); the SANs a CSR asks for are ignored and the
//!   authority writes the SANs itself.
//! - Credentials are swapped atomically: a handshake sees either the old
//!   certificate, key and trust bundle, or the new ones, never a mix. A swap
//!   reaches the next handshake without restarting any listener.
//! - Only ECDSA P-256/P-384 and Ed25519 keys are accepted in a CSR; RSA and
//!   anything else is refused as weak or unsupported.

mod authority;
mod credentials;
mod jwt;
mod peer;
mod pem;
mod verifier;

pub use authority::{BACKDATE, CertificateAuthority, IssuedCertificate, csr_for_key, generate_csr};
pub use credentials::{TlsCredentials, TlsMaterial, anonymous_client_config, public_server_config, verify_chain};
pub use jwt::{JwtSvidClaims, jwks, verify_jwt_svid};
pub use peer::identity_from_cert;
pub use pem::{
    cert_host_names, cert_not_after, cert_uris, cert_validity, certs_from_pem, fingerprint, private_key_der,
};

/// Why a certificate operation failed.
#[derive(Debug, thiserror::Error)]
pub enum MtlsError {
    /// PEM input held nothing usable or could not be decoded.
    #[error("invalid {what}: {detail}")]
    Pem {
        /// Which input was bad (certificate, private key, CA bundle, CSR).
        what: &'static str,
        /// What was wrong with it.
        detail: String,
    },
    /// A CSR's signature did not verify or it could not be parsed.
    #[error("invalid certificate signing request: {0}")]
    Csr(String),
    /// The CSR's key is of a kind berth does not sign.
    #[error("weak or unsupported key in certificate signing request: {0}; use ECDSA P-256, P-384 or Ed25519")]
    WeakKey(String),
    /// Certificate generation or signing failed.
    #[error("certificate generation failed")]
    Generate(#[source] rcgen::Error),
    /// rustls refused the material (key does not match the certificate, empty bundle, ...).
    #[error("tls configuration refused: {0}")]
    Tls(#[source] rustls::Error),
    /// The trust bundle could not build a client verifier.
    #[error("trust bundle refused: {0}")]
    Verifier(String),
    /// A JWT-SVID could not be signed, or does not verify.
    #[error("{0}")]
    Jwt(String),
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}
