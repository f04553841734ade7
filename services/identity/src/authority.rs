//! The CA custodian: the mesh's certificate authorities, kept in the identity
//! schema with their private keys sealed, and every signature identity makes.
//!
//! # What is stored
//! One row per authority in `authorities`: its certificate, its key sealed
//! with ChaCha20-Poly1305 under a key derived by HKDF-SHA256 from
//! `--auth-secret` (with a domain-separation label, and the certificate's
//! fingerprint as associated data so a sealed key cannot be swapped onto
//! another certificate), its state, and the latest expiry of anything it
//! signed.
//!
//! # Invariants
//! - Exactly one authority is active (a unique `active_slot`); two replicas
//!   creating the first CA at once both insert-if-absent and both end up
//!   using the one that won.
//! - Rotation is SPIRE-style: `prepared` (in the bundle, signs nothing) →
//!   `active` → `retired` (in the bundle until the last certificate it signed
//!   has expired, then dropped). Activation is refused until the prepared CA
//!   has been in the bundle for [`AuthorityTiming::min_prepared`], so every
//!   heartbeating agent has it before it signs.
//! - The plain CA key never leaves this module except as the in-memory
//!   signer; it is never logged or returned.
//! - Every authority serves one [`Purpose`]: the mesh's, or workloads'
//!   (X.509-SVIDs). Each purpose has its own active authority and bundle, so
//!   a workload's certificate never chains to a root a mesh endpoint trusts:
//!   one signed under the mesh's root would pass every mesh server's TLS
//!   verification and lean on admission alone to be refused.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use berth_core::Identity;
use berth_mtls::{CertificateAuthority, IssuedCertificate, MtlsError, TlsMaterial, cert_not_after, certs_from_pem};
use berth_proto::identity::v1;
use berth_proto::timestamp_from_ms as timestamp;
use berth_store::{Store, StoreError};
use ring::aead::{self, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::hkdf;
use ring::rand::{SecureRandom, SystemRandom};
use sqlx::Row;
use tonic::{Request, Response, Status};

/// The shortest `--auth-secret` accepted.
pub const AUTH_SECRET_MIN_LEN: usize = 32;

/// HKDF salt and info: the derived key seals CA keys of berth identity v1 and
/// nothing else.
const SEAL_SALT: &[u8] = b"berth.identity.v1";
const SEAL_INFO: &[u8] = b"berth/identity/ca-key-seal/v1";

/// How long a replica trusts its cached view of the authorities; another
/// replica's rotation reaches it within this.
const CACHE_TTL: Duration = Duration::from_secs(2);

/// Issuance marks are written rounded up by this much, so a steady stream of
/// same-lifetime certificates writes the row once per step, not per signature.
const MARK_STEP_MS: i64 = 10 * 60 * 1000;

/// CA lifetimes and rotation timing.
#[derive(Debug, Clone)]
pub struct AuthorityTiming {
    /// How long a new CA is valid.
    pub ca_validity: Duration,
    /// How long a prepared CA must have been in the bundle before it may be
    /// activated (a few heartbeat intervals).
    pub min_prepared: Duration,
    /// Default lifetime of admin certificates from `IssueCertificate`.
    pub admin_cert_ttl: Duration,
    /// Default lifetime of service certificates from `IssueCertificate`.
    pub service_cert_ttl: Duration,
    /// The longest lifetime `IssueCertificate` grants.
    pub max_cert_ttl: Duration,
}

impl Default for AuthorityTiming {
    fn default() -> Self {
        Self {
            ca_validity: Duration::from_secs(10 * 365 * 24 * 3600),
            min_prepared: Duration::from_secs(30),
            admin_cert_ttl: Duration::from_secs(24 * 3600),
            service_cert_ttl: Duration::from_secs(7 * 24 * 3600),
            max_cert_ttl: Duration::from_secs(90 * 24 * 3600),
        }
    }
}

/// Why an authority operation failed.
#[derive(Debug, thiserror::Error)]
pub enum AuthorityError {
    /// The CSR could not be parsed or its signature does not verify.
    #[error("invalid csr_pem: {0}")]
    Csr(String),
    /// The CSR's key is weak or of an unsupported kind.
    #[error("{0}")]
    WeakKey(String),
    /// A request field is wrong; the message names it.
    #[error("{0}")]
    InvalidArgument(String),
    /// The secret is too short to seal a CA key with.
    #[error("--auth-secret must be at least {AUTH_SECRET_MIN_LEN} characters")]
    SecretTooShort,
    /// A sealed key did not open: the secret differs from the one it was sealed with.
    #[error("cannot unseal the CA key: --auth-secret differs from the one the CA was created with")]
    Unseal,
    /// A rotation step is not possible now; the message says why.
    #[error("{0}")]
    Rotation(String),
    /// A stored CA key opens under neither secret of a reseal.
    #[error(
        "cannot re-seal CA {fingerprint}: its key opens under neither the old nor the new secret; nothing was changed"
    )]
    ResealRefused {
        /// The CA whose key did not open.
        fingerprint: String,
    },
    /// The secret file could not be read.
    #[error("cannot read the auth secret file {path}: {detail}")]
    SecretFile {
        /// The file.
        path: String,
        /// Why.
        detail: String,
    },
    /// Certificate generation failed.
    #[error("certificate operation failed: {0}")]
    Mtls(#[source] MtlsError),
    /// The stored authorities are inconsistent (no active CA after creation).
    #[error("no active CA in the identity schema")]
    NoActive,
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

berth_store::store_errors!(AuthorityError);

impl From<MtlsError> for AuthorityError {
    fn from(error: MtlsError) -> Self {
        match error {
            MtlsError::Csr(detail) | MtlsError::Pem { detail, .. } => AuthorityError::Csr(detail),
            e @ MtlsError::WeakKey(_) => AuthorityError::WeakKey(format!("csr_pem: {e}")),
            other => AuthorityError::Mtls(other),
        }
    }
}

impl From<AuthorityError> for Status {
    fn from(error: AuthorityError) -> Self {
        match error {
            AuthorityError::Csr(_) | AuthorityError::WeakKey(_) | AuthorityError::InvalidArgument(_) => {
                Status::invalid_argument(error.to_string())
            }
            AuthorityError::Rotation(_) => Status::failed_precondition(error.to_string()),
            AuthorityError::Store(e) => e.into(),
            other => {
                tracing::error!(error = %other, "authority failure");
                Status::internal("the certificate authority failed; see the identity service's log")
            }
        }
    }
}

/// Where an authority is in its rotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Prepared,
    Active,
    Retired,
}

impl State {
    fn as_str(self) -> &'static str {
        match self {
            State::Prepared => "prepared",
            State::Active => "active",
            State::Retired => "retired",
        }
    }

    fn parse(s: &str) -> Result<Self, AuthorityError> {
        match s {
            "prepared" => Ok(State::Prepared),
            "active" => Ok(State::Active),
            "retired" => Ok(State::Retired),
            other => Err(AuthorityError::Store(StoreError::internal(format!("unknown authority state '{other}'")))),
        }
    }

    fn to_proto(self) -> v1::AuthorityState {
        match self {
            State::Prepared => v1::AuthorityState::Prepared,
            State::Active => v1::AuthorityState::Active,
            State::Retired => v1::AuthorityState::Retired,
        }
    }
}

/// What an authority signs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// The mesh's certificates: nodes, services, operators, routers.
    Mesh,
    /// Workloads' X.509-SVIDs, under a root the mesh does not trust.
    Workload,
}

impl Purpose {
    fn as_str(self) -> &'static str {
        match self {
            Purpose::Mesh => "mesh",
            Purpose::Workload => "workload",
        }
    }

    fn ca_name(self) -> &'static str {
        match self {
            Purpose::Mesh => "berth CA",
            Purpose::Workload => "berth workload CA",
        }
    }
}

/// One stored authority.
#[derive(Debug, Clone)]
struct Row0 {
    fingerprint: String,
    cert_pem: String,
    sealed_key: Vec<u8>,
    state: State,
    created_at_ms: i64,
    not_after_ms: i64,
    last_signed_not_after_ms: i64,
}

/// What a replica knows of the authorities, refreshed every [`CACHE_TTL`].
struct View {
    loaded: Instant,
    rows: Vec<Row0>,
    active: Arc<CertificateAuthority>,
    /// The issuance mark already written for the active authority.
    active_mark_ms: i64,
    bundle_pem: String,
}

struct Inner {
    store: Store,
    purpose: Purpose,
    /// The key CA keys are sealed under, from the auth secret.
    seal: std::sync::RwLock<Arc<LessSafeKey>>,
    /// Where the secret is read from, when it is a file: read again when
    /// the stored keys no longer open under the one in memory (a reseal).
    secret_file: Option<std::path::PathBuf>,
    timing: AuthorityTiming,
    view: RwLock<Option<Arc<View>>>,
    /// One refresh at a time; others wait for it rather than stampede.
    refresh: tokio::sync::Mutex<()>,
    /// The bundle digest each node last acknowledged, as this replica knows
    /// it; `None` until loaded from `node_ca_acks`.
    acks: std::sync::Mutex<Option<std::collections::HashMap<String, String>>>,
}

/// The SHA-256 (lowercase hex) of a CA bundle's PEM, as nodes report what
/// they trust.
pub fn bundle_digest(bundle_pem: &str) -> String {
    hex::encode(ring::digest::digest(&ring::digest::SHA256, bundle_pem.as_bytes()))
}

/// Holds the CA in the identity schema and signs with it; cheap to clone.
#[derive(Clone)]
pub struct Authority {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authority").field("timing", &self.inner.timing).finish_non_exhaustive()
    }
}

fn sealing_key(secret: &str) -> Result<LessSafeKey, AuthorityError> {
    if secret.len() < AUTH_SECRET_MIN_LEN {
        return Err(AuthorityError::SecretTooShort);
    }
    let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, SEAL_SALT).extract(secret.as_bytes());
    let okm = prk.expand(&[SEAL_INFO], &aead::CHACHA20_POLY1305).map_err(|_| AuthorityError::Unseal)?;
    Ok(LessSafeKey::new(UnboundKey::from(okm)))
}

fn seal(key: &LessSafeKey, fingerprint: &str, plain: &[u8]) -> Result<Vec<u8>, AuthorityError> {
    let mut nonce = [0u8; NONCE_LEN];
    SystemRandom::new()
        .fill(&mut nonce)
        .map_err(|_| AuthorityError::Mtls(MtlsError::Verifier("no system randomness".into())))?;
    let mut sealed = plain.to_vec();
    key.seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::from(fingerprint.as_bytes()), &mut sealed)
        .map_err(|_| AuthorityError::Unseal)?;
    let mut out = nonce.to_vec();
    out.extend_from_slice(&sealed);
    Ok(out)
}

fn unseal(key: &LessSafeKey, fingerprint: &str, sealed: &[u8]) -> Result<String, AuthorityError> {
    if sealed.len() < NONCE_LEN {
        return Err(AuthorityError::Unseal);
    }
    let (nonce, body) = sealed.split_at(NONCE_LEN);
    let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| AuthorityError::Unseal)?;
    let mut body = body.to_vec();
    let plain =
        key.open_in_place(nonce, Aad::from(fingerprint.as_bytes()), &mut body).map_err(|_| AuthorityError::Unseal)?;
    String::from_utf8(plain.to_vec()).map_err(|_| AuthorityError::Unseal)
}

/// The secret in `path`, without its trailing newline.
pub(crate) fn read_secret_file(path: &std::path::Path) -> Result<String, AuthorityError> {
    std::fs::read_to_string(path)
        .map(|text| text.trim_end_matches(['\n', '\r']).to_string())
        .map_err(|e| AuthorityError::SecretFile { path: path.display().to_string(), detail: e.to_string() })
}

/// What [`Authority::reseal`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Resealed {
    /// Keys sealed under the old secret, now under the new one.
    pub resealed: usize,
    /// Keys already under the new secret (a reseal run again).
    pub already: usize,
}

impl Authority {
    /// Loads the authorities, creating the first CA if there is none, and
    /// checks that `auth_secret` opens the active one.
    pub async fn open(store: Store, auth_secret: &str, timing: AuthorityTiming) -> Result<Self, AuthorityError> {
        Self::open_sealed(store, sealing_key(auth_secret)?, None, timing).await
    }

    /// [`Authority::open`] with the secret read from `path`, and read again
    /// whenever a stored key no longer opens under it: a replica given its
    /// secret as a file follows a reseal without a restart.
    pub async fn open_with_secret_file(
        store: Store,
        path: &std::path::Path,
        timing: AuthorityTiming,
    ) -> Result<Self, AuthorityError> {
        let key = sealing_key(&read_secret_file(path)?)?;
        Self::open_sealed(store, key, Some(path.to_path_buf()), timing).await
    }

    async fn open_sealed(
        store: Store,
        seal: LessSafeKey,
        secret_file: Option<std::path::PathBuf>,
        timing: AuthorityTiming,
    ) -> Result<Self, AuthorityError> {
        Self::open_for(Purpose::Mesh, store, Arc::new(seal), secret_file, timing).await
    }

    async fn open_for(
        purpose: Purpose,
        store: Store,
        seal: Arc<LessSafeKey>,
        secret_file: Option<std::path::PathBuf>,
        timing: AuthorityTiming,
    ) -> Result<Self, AuthorityError> {
        let authority = Authority {
            inner: Arc::new(Inner {
                store,
                purpose,
                seal: std::sync::RwLock::new(seal),
                secret_file,
                timing,
                view: RwLock::new(None),
                refresh: tokio::sync::Mutex::new(()),
                acks: std::sync::Mutex::new(None),
            }),
        };
        if !authority.load_rows().await?.iter().any(|r| r.state == State::Active) {
            authority.create_first().await?;
        }
        authority.refresh().await?;
        Ok(authority)
    }

    /// The workloads' authority beside this (mesh) one: the same store,
    /// secret and timing, its own root, created on first use.
    pub async fn workloads(&self) -> Result<Authority, AuthorityError> {
        let inner = &self.inner;
        Self::open_for(
            Purpose::Workload,
            inner.store.clone(),
            self.sealing(),
            inner.secret_file.clone(),
            inner.timing.clone(),
        )
        .await
    }

    /// What it signs.
    pub fn purpose(&self) -> Purpose {
        self.inner.purpose
    }

    /// Re-seals every stored CA key from `old_secret` to `new_secret` in
    /// one transaction: all of them or none. A key already under the new
    /// secret is left as it is, so a reseal run again (after a crash, or
    /// racing a rotation that added a key) converges; a key that opens
    /// under neither refuses the whole reseal. Afterwards the old secret
    /// opens nothing: a replica started with it refuses to start, and a
    /// running one refuses to seal a new CA with it.
    pub async fn reseal(store: &Store, old_secret: &str, new_secret: &str) -> Result<Resealed, AuthorityError> {
        let (old, new) = (sealing_key(old_secret)?, sealing_key(new_secret)?);
        let (old, new) = (&old, &new);
        let done = store
            .tx("authority.reseal", |conn| {
                Box::pin(async move {
                    let rows = sqlx::query("SELECT fingerprint, sealed_key FROM authorities ORDER BY created_at_ms")
                        .fetch_all(&mut *conn)
                        .await?;
                    let mut done = Resealed::default();
                    for row in rows {
                        let fingerprint: String = row.try_get("fingerprint")?;
                        let sealed: Vec<u8> = row.try_get("sealed_key")?;
                        if unseal(new, &fingerprint, &sealed).is_ok() {
                            done.already += 1;
                            continue;
                        }
                        let key = unseal(old, &fingerprint, &sealed)
                            .map_err(|_| AuthorityError::ResealRefused { fingerprint: fingerprint.clone() })?;
                        let resealed = seal(new, &fingerprint, key.as_bytes())?;
                        sqlx::query("UPDATE authorities SET sealed_key = $1 WHERE fingerprint = $2")
                            .bind(resealed)
                            .bind(&fingerprint)
                            .execute(&mut *conn)
                            .await?;
                        done.resealed += 1;
                    }
                    Ok::<_, AuthorityError>(done)
                })
            })
            .await?;
        tracing::info!(resealed = done.resealed, already = done.already, "re-sealed the CA keys under the new secret");
        Ok(done)
    }

    /// The sealing key in use now.
    fn sealing(&self) -> Arc<LessSafeKey> {
        self.inner.seal.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Opens a stored key; when it does not open and the secret is a file,
    /// reads the file again (a reseal may have changed it) and tries once more.
    fn unseal_row(&self, fingerprint: &str, sealed: &[u8]) -> Result<String, AuthorityError> {
        match unseal(&self.sealing(), fingerprint, sealed) {
            Ok(key) => Ok(key),
            Err(error) => {
                let Some(path) = &self.inner.secret_file else { return Err(error) };
                let fresh = Arc::new(sealing_key(&read_secret_file(path)?)?);
                let key = unseal(&fresh, fingerprint, sealed)?;
                *self.inner.seal.write().unwrap_or_else(std::sync::PoisonError::into_inner) = fresh;
                tracing::info!(path = %path.display(), "took up the auth secret from its file again");
                Ok(key)
            }
        }
    }

    async fn create_first(&self) -> Result<(), AuthorityError> {
        let purpose = self.inner.purpose;
        let (fingerprint, cert_pem, sealed, not_after_ms) = self.generate(purpose.ca_name())?;
        let now = berth_runtime::wall_clock_ms();
        // Insert-if-absent on the purpose's active slot: of two replicas
        // racing here, one row wins and the other insert does nothing.
        sqlx::query(
            "INSERT INTO authorities (fingerprint, purpose, cert_pem, sealed_key, state, active_slot, created_at_ms, \
             activated_at_ms, not_after_ms) VALUES ($1, $6, $2, $3, 'active', 1, $4, $4, $5) ON CONFLICT DO NOTHING",
        )
        .bind(&fingerprint)
        .bind(&cert_pem)
        .bind(sealed)
        .bind(now)
        .bind(not_after_ms)
        .bind(purpose.as_str())
        .execute(self.inner.store.pool())
        .await?;
        tracing::info!(%fingerprint, purpose = purpose.as_str(), "certificate authority ready");
        Ok(())
    }

    /// A new CA, its fingerprint, PEM, sealed key and expiry.
    fn generate(&self, name: &str) -> Result<(String, String, Vec<u8>, i64), AuthorityError> {
        let ca = CertificateAuthority::generate(name, self.inner.timing.ca_validity).map_err(AuthorityError::Mtls)?;
        let fingerprint = ca.fingerprint();
        let sealed = seal(&self.sealing(), &fingerprint, ca.key_pem().as_bytes())?;
        let der = certs_from_pem("CA certificate", ca.cert_pem()).map_err(AuthorityError::Mtls)?;
        let not_after_ms = cert_not_after(&der[0]).map_err(AuthorityError::Mtls)? * 1000;
        Ok((fingerprint, ca.cert_pem().to_string(), sealed, not_after_ms))
    }

    async fn load_rows(&self) -> Result<Vec<Row0>, AuthorityError> {
        let rows = sqlx::query(
            "SELECT fingerprint, cert_pem, sealed_key, state, created_at_ms, not_after_ms, last_signed_not_after_ms \
             FROM authorities WHERE purpose = $1 ORDER BY created_at_ms",
        )
        .bind(self.inner.purpose.as_str())
        .fetch_all(self.inner.store.pool())
        .await?;
        rows.iter()
            .map(|r| {
                Ok(Row0 {
                    fingerprint: r.try_get("fingerprint")?,
                    cert_pem: r.try_get("cert_pem")?,
                    sealed_key: r.try_get("sealed_key")?,
                    state: State::parse(&r.try_get::<String, _>("state")?)?,
                    created_at_ms: r.try_get("created_at_ms")?,
                    not_after_ms: r.try_get("not_after_ms")?,
                    last_signed_not_after_ms: r.try_get("last_signed_not_after_ms")?,
                })
            })
            .collect()
    }

    /// Re-reads the authorities and rebuilds the view.
    async fn refresh(&self) -> Result<Arc<View>, AuthorityError> {
        let requested = Instant::now();
        let _one = self.inner.refresh.lock().await;
        // Another caller's refresh that started after this request began
        // already saw everything this one would.
        if let Some(view) = self.cached()
            && view.loaded > requested
        {
            return Ok(view);
        }
        let now = berth_runtime::wall_clock_ms();
        let rows: Vec<Row0> = self
            .load_rows()
            .await?
            .into_iter()
            .filter(|r| r.not_after_ms > now && (r.state != State::Retired || r.last_signed_not_after_ms > now))
            .collect();
        let active_row = rows.iter().find(|r| r.state == State::Active).ok_or(AuthorityError::NoActive)?;
        let previous = self.cached();
        let active = match previous.as_ref().filter(|v| v.active.fingerprint() == active_row.fingerprint) {
            Some(v) => v.active.clone(),
            None => {
                let key_pem = self.unseal_row(&active_row.fingerprint, &active_row.sealed_key)?;
                Arc::new(CertificateAuthority::from_pem(&active_row.cert_pem, &key_pem).map_err(AuthorityError::Mtls)?)
            }
        };
        let mut ordered: Vec<&Row0> = rows.iter().collect();
        ordered.sort_by_key(|r| match r.state {
            State::Active => 0,
            State::Prepared => 1,
            State::Retired => 2,
        });
        let bundle_pem = ordered.iter().map(|r| r.cert_pem.trim_end().to_string() + "\n").collect::<String>();
        let view = Arc::new(View {
            loaded: Instant::now(),
            active_mark_ms: active_row.last_signed_not_after_ms,
            active,
            bundle_pem,
            rows,
        });
        *self.inner.view.write().unwrap_or_else(|e| e.into_inner()) = Some(view.clone());
        Ok(view)
    }

    fn cached(&self) -> Option<Arc<View>> {
        self.inner.view.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    async fn view(&self) -> Result<Arc<View>, AuthorityError> {
        match self.cached() {
            Some(view) if view.loaded.elapsed() < CACHE_TTL => Ok(view),
            // Boxed: reloading reads the database, and every heartbeat in
            // flight awaits this; the cached answer needs no room for it.
            _ => Box::pin(self.refresh()).await,
        }
    }

    /// Every CA certificate to trust now (active, prepared, and retired ones
    /// whose signatures are still live), PEM, active first. Cached; cheap.
    pub async fn bundle_pem(&self) -> Result<String, AuthorityError> {
        Ok(self.view().await?.bundle_pem.clone())
    }

    /// Signs a node certificate for `node_id` from the node's CSR. The CSR's
    /// signature and key strength are checked; its requested names are not
    /// used.
    pub async fn sign_node(
        &self,
        csr_pem: &str,
        node_id: &str,
        extra_sans: &[String],
        ttl: Duration,
    ) -> Result<IssuedCertificate, AuthorityError> {
        let identity = Identity::node(node_id).map_err(|e| AuthorityError::InvalidArgument(e.to_string()))?;
        self.sign(csr_pem, &identity, extra_sans, ttl).await
    }

    /// Signs `csr_pem` as the X.509-SVID `spiffe_id`, valid for `ttl`, with
    /// the bundle that verifies it. Only a workloads' authority signs SVIDs,
    /// and it signs nothing else.
    pub async fn sign_svid(
        &self,
        csr_pem: &str,
        spiffe_id: &berth_core::WorkloadId,
        ttl: Duration,
    ) -> Result<(IssuedCertificate, String), AuthorityError> {
        self.serves(Purpose::Workload)?;
        let view = self.view().await?;
        let cert = view.active.sign_svid_csr(csr_pem, spiffe_id, ttl)?;
        self.mark(&view, cert.not_after * 1000).await?;
        Ok((cert, view.bundle_pem.clone()))
    }

    /// A JWT-SVID for `spiffe_id` and `audience`, living `ttl`, signed by
    /// the active workload authority; the token, its claims and the JWK set
    /// of the bundle (what verifies it).
    pub async fn sign_jwt_svid(
        &self,
        spiffe_id: &str,
        audience: &[String],
        ttl: Duration,
    ) -> Result<(String, berth_mtls::JwtSvidClaims, String), AuthorityError> {
        self.serves(Purpose::Workload)?;
        let view = self.view().await?;
        let (token, claims) = view.active.sign_jwt_svid(spiffe_id, audience, ttl)?;
        self.mark(&view, claims.exp * 1000).await?;
        Ok((token, claims, berth_mtls::jwks(&view.bundle_pem)?))
    }

    /// Refuses to sign what another purpose's authority signs.
    fn serves(&self, purpose: Purpose) -> Result<(), AuthorityError> {
        if self.inner.purpose == purpose {
            Ok(())
        } else {
            Err(AuthorityError::InvalidArgument(format!(
                "the {} authority does not sign {} certificates",
                self.inner.purpose.as_str(),
                purpose.as_str()
            )))
        }
    }

    /// Signs `csr_pem` for any identity.
    pub async fn sign(
        &self,
        csr_pem: &str,
        identity: &Identity,
        extra_sans: &[String],
        ttl: Duration,
    ) -> Result<IssuedCertificate, AuthorityError> {
        self.serves(Purpose::Mesh)?;
        let view = self.view().await?;
        let cert = view.active.sign_csr(csr_pem, identity, extra_sans, ttl)?;
        self.mark(&view, cert.not_after * 1000).await?;
        Ok(cert)
    }

    /// Issues a key and certificate for `identity` in-process (for the
    /// processes that share identity's address space: `berth dev`, and
    /// identity's own serving certificate).
    pub async fn issue_material(
        &self,
        identity: &Identity,
        extra_sans: &[String],
        ttl: Duration,
    ) -> Result<TlsMaterial, AuthorityError> {
        self.serves(Purpose::Mesh)?;
        let view = self.view().await?;
        let (cert, key_pem) = view.active.issue(identity, extra_sans, ttl).map_err(AuthorityError::Mtls)?;
        self.mark(&view, cert.not_after * 1000).await?;
        Ok(TlsMaterial { cert_chain_pem: cert.cert_pem, key_pem, ca_bundle_pem: view.bundle_pem.clone() })
    }

    /// Records that the active authority signed something valid until
    /// `not_after_ms`, so it is kept in the bundle at least that long after
    /// it retires.
    async fn mark(&self, view: &View, not_after_ms: i64) -> Result<(), AuthorityError> {
        if not_after_ms <= view.active_mark_ms {
            return Ok(());
        }
        let mark = (not_after_ms / MARK_STEP_MS + 1) * MARK_STEP_MS;
        sqlx::query(
            "UPDATE authorities SET last_signed_not_after_ms = $2 WHERE fingerprint = $1 AND last_signed_not_after_ms < $2",
        )
        .bind(view.active.fingerprint())
        .bind(mark)
        .execute(self.inner.store.pool())
        .await?;
        self.refresh().await?;
        Ok(())
    }

    /// Prepares a new CA, replacing any prepared one: it joins the bundle but
    /// signs nothing until activated. Refused when the stored active key no
    /// longer opens under this replica's secret (it was re-sealed), so no
    /// CA is ever sealed under a retired secret.
    pub async fn prepare(&self) -> Result<(), AuthorityError> {
        let rows = self.load_rows().await?;
        if let Some(active) = rows.iter().find(|r| r.state == State::Active)
            && self.unseal_row(&active.fingerprint, &active.sealed_key).is_err()
        {
            return Err(AuthorityError::Rotation(
                "the CA key was re-sealed under a new auth secret: restart this replica with it (or give it \
                 --auth-secret-file) before rotating"
                    .into(),
            ));
        }
        let purpose = self.inner.purpose.as_str();
        let (fingerprint, cert_pem, sealed, not_after_ms) = self.generate(self.inner.purpose.ca_name())?;
        let now = berth_runtime::wall_clock_ms();
        self.inner
            .store
            .tx("authority.prepare", |conn| {
                let (fingerprint, cert_pem, sealed) = (fingerprint.clone(), cert_pem.clone(), sealed.clone());
                Box::pin(async move {
                    sqlx::query("DELETE FROM authorities WHERE state = 'prepared' AND purpose = $1")
                        .bind(purpose)
                        .execute(&mut *conn)
                        .await?;
                    sqlx::query(
                        "INSERT INTO authorities (fingerprint, purpose, cert_pem, sealed_key, state, created_at_ms, \
                         not_after_ms) VALUES ($1, $6, $2, $3, 'prepared', $4, $5)",
                    )
                    .bind(fingerprint)
                    .bind(cert_pem)
                    .bind(sealed)
                    .bind(now)
                    .bind(not_after_ms)
                    .bind(purpose)
                    .execute(&mut *conn)
                    .await?;
                    Ok::<_, AuthorityError>(())
                })
            })
            .await?;
        tracing::info!(%fingerprint, "prepared a new certificate authority");
        self.refresh().await?;
        Ok(())
    }

    /// Records that `node_id` trusts the bundle whose PEM hashes to
    /// `bundle_sha256`: a write only when this replica does not already know
    /// it, so steady heartbeats cost a map lookup.
    pub async fn acknowledge(&self, node_id: &str, bundle_sha256: &str) -> Result<(), AuthorityError> {
        if self.acknowledged(node_id, bundle_sha256).is_none() {
            self.load_acks().await?;
        }
        if self.acknowledged(node_id, bundle_sha256) == Some(true) {
            return Ok(());
        }
        let (node, digest, now) = (node_id.to_owned(), bundle_sha256.to_owned(), berth_runtime::wall_clock_ms());
        self.inner
            .store
            .tx("authority.acknowledge", |conn| {
                let (node, digest) = (node.clone(), digest.clone());
                Box::pin(async move {
                    sqlx::query(
                        "INSERT INTO node_ca_acks (node_id, bundle_sha256, acked_at_ms) VALUES ($1, $2, $3) \
                         ON CONFLICT (node_id) DO UPDATE SET bundle_sha256 = $2, acked_at_ms = $3",
                    )
                    .bind(&node)
                    .bind(&digest)
                    .bind(now)
                    .execute(&mut *conn)
                    .await?;
                    Ok::<_, AuthorityError>(())
                })
            })
            .await?;
        if let Some(acks) = self.inner.acks.lock().unwrap_or_else(std::sync::PoisonError::into_inner).as_mut() {
            acks.insert(node_id.to_owned(), bundle_sha256.to_owned());
        }
        Ok(())
    }

    /// Whether this replica knows `node_id` trusts `bundle_sha256`; `None`
    /// until the map is loaded.
    fn acknowledged(&self, node_id: &str, bundle_sha256: &str) -> Option<bool> {
        let acks = self.inner.acks.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        acks.as_ref().map(|acks| acks.get(node_id).is_some_and(|known| known == bundle_sha256))
    }

    /// Loads every node's acknowledged bundle into this replica's map.
    async fn load_acks(&self) -> Result<(), AuthorityError> {
        let rows = self
            .inner
            .store
            .read("authority.load_acks", |conn| {
                Box::pin(async move {
                    let rows =
                        sqlx::query("SELECT node_id, bundle_sha256 FROM node_ca_acks").fetch_all(&mut *conn).await?;
                    rows.iter()
                        .map(|row| {
                            Ok((row.try_get::<String, _>("node_id")?, row.try_get::<String, _>("bundle_sha256")?))
                        })
                        .collect::<Result<Vec<_>, AuthorityError>>()
                })
            })
            .await?;
        let mut acks = self.inner.acks.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if acks.is_none() {
            *acks = Some(rows.into_iter().collect());
        }
        Ok(())
    }

    /// Activates the prepared CA; the active one retires. Refused while an
    /// UP node has not acknowledged the bundle holding it, unless `force`.
    pub async fn activate(&self, force: bool) -> Result<(), AuthorityError> {
        self.activate_after(force, self.inner.timing.min_prepared).await
    }

    /// [`Authority::activate`], refused until the prepared CA has been in
    /// the bundle for `min_prepared`.
    pub async fn activate_after(&self, force: bool, min_prepared: Duration) -> Result<(), AuthorityError> {
        let now = berth_runtime::wall_clock_ms();
        let min_prepared_ms = min_prepared.as_millis() as i64;
        let who = match self.inner.purpose {
            Purpose::Mesh => "every node has it",
            Purpose::Workload => "every workload has renewed with it",
        };
        // The bundle every node must have before the prepared CA signs: the
        // one distributed now, which holds it.
        let view = self.refresh().await?;
        let expected = bundle_digest(&view.bundle_pem);
        let expected = expected.as_str();
        let purpose = self.inner.purpose.as_str();
        // Nodes acknowledge the mesh's bundle; the workloads' is handed out
        // with every SVID.
        let check_acks = !force && self.inner.purpose == Purpose::Mesh;
        let fingerprint = self
            .inner
            .store
            .tx("authority.activate", |conn| {
                Box::pin(async move {
                    let prepared = sqlx::query(
                        "SELECT fingerprint, created_at_ms FROM authorities WHERE state = 'prepared' AND purpose = $1",
                    )
                    .bind(purpose)
                    .fetch_optional(&mut *conn)
                    .await?;
                    let Some(prepared) = prepared else {
                        return Err(AuthorityError::Rotation(
                            "no prepared CA to activate; call RotateCA with activate=false first".into(),
                        ));
                    };
                    let fingerprint: String = prepared.try_get("fingerprint")?;
                    let created: i64 = prepared.try_get("created_at_ms")?;
                    let ready_at = created + min_prepared_ms;
                    if now < ready_at {
                        return Err(AuthorityError::Rotation(format!(
                            "the prepared CA has been in the bundle for {}s; wait {}s more so {who}",
                            (now - created) / 1000,
                            (ready_at - now + 999) / 1000
                        )));
                    }
                    if check_acks {
                        let lagging = sqlx::query(
                            "SELECT n.node_id FROM nodes n LEFT JOIN node_ca_acks a ON a.node_id = n.node_id \
                             WHERE n.state = 'up' AND (a.bundle_sha256 IS NULL OR a.bundle_sha256 <> $1) \
                             ORDER BY n.node_id LIMIT 11",
                        )
                        .bind(expected)
                        .fetch_all(&mut *conn)
                        .await?;
                        if !lagging.is_empty() {
                            let mut names: Vec<String> =
                                lagging.iter().map(|row| row.try_get("node_id")).collect::<Result<_, _>>()?;
                            if names.len() > 10 {
                                names.truncate(10);
                                names.push("…".to_owned());
                            }
                            return Err(AuthorityError::Rotation(format!(
                                "UP nodes have not yet acknowledged the bundle holding the prepared CA: {}; \
                                 wait for their heartbeats, or activate with force (they could not verify \
                                 what the new CA signs)",
                                names.join(", ")
                            )));
                        }
                    }
                    sqlx::query(
                        "UPDATE authorities SET state = 'retired', active_slot = NULL \
                         WHERE state = 'active' AND purpose = $1",
                    )
                    .bind(purpose)
                    .execute(&mut *conn)
                    .await?;
                    let done = sqlx::query(
                        "UPDATE authorities SET state = 'active', active_slot = 1, activated_at_ms = $2 \
                         WHERE fingerprint = $1 AND state = 'prepared'",
                    )
                    .bind(&fingerprint)
                    .bind(now)
                    .execute(&mut *conn)
                    .await?;
                    berth_store::expect_one(done.rows_affected(), "prepared authority")?;
                    Ok(fingerprint)
                })
            })
            .await?;
        tracing::info!(%fingerprint, purpose = purpose, "activated the prepared certificate authority");
        self.refresh().await?;
        Ok(())
    }

    async fn describe(&self) -> Result<(String, Vec<v1::CertificateAuthority>), AuthorityError> {
        let view = self.refresh().await?;
        let mut authorities: Vec<v1::CertificateAuthority> = view
            .rows
            .iter()
            .map(|r| v1::CertificateAuthority {
                fingerprint: r.fingerprint.clone(),
                state: r.state.to_proto() as i32,
                not_before: Some(timestamp(r.created_at_ms)),
                not_after: Some(timestamp(r.not_after_ms)),
                certificate_pem: r.cert_pem.clone(),
            })
            .collect();
        authorities.sort_by_key(|a| match v1::AuthorityState::try_from(a.state) {
            Ok(v1::AuthorityState::Active) => 0,
            Ok(v1::AuthorityState::Prepared) => 1,
            _ => 2,
        });
        Ok((view.bundle_pem.clone(), authorities))
    }

    /// The state name of the authority with `fingerprint`, if it is in the bundle.
    pub async fn state_of(&self, fingerprint: &str) -> Result<Option<&'static str>, AuthorityError> {
        Ok(self.view().await?.rows.iter().find(|r| r.fingerprint == fingerprint).map(|r| r.state.as_str()))
    }

    /// The fingerprint of the active authority.
    pub async fn active_fingerprint(&self) -> Result<String, AuthorityError> {
        Ok(self.view().await?.active.fingerprint())
    }
}

/// `berth.identity.v1.Authority`: the mesh's authority, and the
/// workloads' where a request names [`v1::CaPurpose::Workload`].
///
/// # Rotating the workloads' authority
/// Workloads learn a new root with their SVIDs (every signing and renewal
/// answers the whole bundle, prepared roots included), and berth's servers
/// that admit workloads follow the bundle on their own. So the prepared
/// workload CA may sign only once it has been in the bundle for a whole
/// workload certificate lifetime: every SVID alive then was renewed, at
/// half its life, with a bundle holding it. `force` skips that wait.
#[derive(Debug, Clone)]
pub struct AuthorityApi {
    mesh: Authority,
    workloads: Authority,
    workload_cert_ttl: Duration,
}

impl AuthorityApi {
    /// The API over `mesh` and `workloads`, whose SVIDs live `workload_cert_ttl`.
    pub fn new(mesh: Authority, workloads: Authority, workload_cert_ttl: Duration) -> Self {
        Self { mesh, workloads, workload_cert_ttl }
    }

    fn authority(&self, purpose: i32) -> Result<&Authority, Status> {
        match v1::CaPurpose::try_from(purpose) {
            Ok(v1::CaPurpose::Unspecified | v1::CaPurpose::Mesh) => Ok(&self.mesh),
            Ok(v1::CaPurpose::Workload) => Ok(&self.workloads),
            Err(_) => Err(Status::invalid_argument(format!(
                "purpose: {purpose} is none of CA_PURPOSE_MESH, CA_PURPOSE_WORKLOAD"
            ))),
        }
    }
}

#[tonic::async_trait]
impl v1::authority_server::Authority for AuthorityApi {
    async fn get_ca_bundle(
        &self,
        request: Request<v1::GetCaBundleRequest>,
    ) -> Result<Response<v1::GetCaBundleResponse>, Status> {
        let (ca_bundle_pem, authorities) = self.authority(request.get_ref().purpose)?.describe().await?;
        Ok(Response::new(v1::GetCaBundleResponse { ca_bundle_pem, authorities }))
    }

    async fn rotate_ca(&self, request: Request<v1::RotateCaRequest>) -> Result<Response<v1::RotateCaResponse>, Status> {
        let request = request.get_ref();
        let authority = self.authority(request.purpose)?;
        match (request.activate, authority.purpose()) {
            (false, _) => authority.prepare().await?,
            (true, Purpose::Mesh) => authority.activate(request.force).await?,
            (true, Purpose::Workload) => {
                let min_prepared = authority.inner.timing.min_prepared;
                let wait = if request.force { min_prepared } else { min_prepared.max(self.workload_cert_ttl) };
                authority.activate_after(request.force, wait).await?;
            }
        }
        let (ca_bundle_pem, authorities) = authority.describe().await?;
        Ok(Response::new(v1::RotateCaResponse { ca_bundle_pem, authorities }))
    }

    async fn issue_certificate(
        &self,
        request: Request<v1::IssueCertificateRequest>,
    ) -> Result<Response<v1::IssueCertificateResponse>, Status> {
        self.mesh.issue_certificate(request).await
    }
}

impl Authority {
    /// `Authority/IssueCertificate`, with the mesh's authority.
    async fn issue_certificate(
        &self,
        request: Request<v1::IssueCertificateRequest>,
    ) -> Result<Response<v1::IssueCertificateResponse>, Status> {
        let caller = berth_rpc::caller(&request)?.clone();
        let req = request.into_inner();
        let timing = &self.inner.timing;
        let (identity, default_ttl) = match v1::CertificateKind::try_from(req.kind) {
            Ok(v1::CertificateKind::Admin) => (Identity::admin(&req.name), timing.admin_cert_ttl),
            Ok(v1::CertificateKind::Service) => (Identity::service(&req.name), timing.service_cert_ttl),
            Ok(v1::CertificateKind::Router) => (Identity::router(&req.name), timing.service_cert_ttl),
            _ => {
                return Err(Status::invalid_argument(
                    "kind must be CERTIFICATE_KIND_ADMIN, CERTIFICATE_KIND_SERVICE or CERTIFICATE_KIND_ROUTER \
                     (node certificates come from Join)",
                ));
            }
        };
        let identity = identity.map_err(|e| Status::invalid_argument(format!("name: {e}")))?;
        if caller.kind() != berth_core::CallerKind::Admin && identity != caller {
            return Err(Status::permission_denied(format!(
                "{caller} may renew only its own certificate, not issue one for {identity}"
            )));
        }
        let ttl = match req.ttl_seconds {
            0 => default_ttl,
            s => Duration::from_secs(u64::from(s)),
        };
        if ttl > timing.max_cert_ttl {
            return Err(Status::invalid_argument(format!(
                "ttl_seconds: at most {} seconds",
                timing.max_cert_ttl.as_secs()
            )));
        }
        if identity.kind() == berth_core::CallerKind::Admin && !req.dns_names.is_empty() {
            return Err(Status::invalid_argument("dns_names: only service and router certificates carry host names"));
        }
        if let Some(bad) =
            req.dns_names.iter().find(|n| n.is_empty() || n.len() > 253 || n.ends_with(".berth.internal"))
        {
            return Err(Status::invalid_argument(format!(
                "dns_names: '{bad}' is not a host name a service can be dialled by"
            )));
        }
        let cert = self.sign(&req.csr_pem, &identity, &req.dns_names, ttl).await?;
        tracing::info!(issued_to = %identity, by = %caller, not_after = cert.not_after, "issued certificate");
        Ok(Response::new(v1::IssueCertificateResponse {
            certificate_pem: cert.cert_pem,
            ca_bundle_pem: self.bundle_pem().await?,
            expires_at: Some(timestamp(cert.not_after * 1000)),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_key_opens_only_with_its_secret_and_fingerprint() {
        let key = sealing_key(&"s".repeat(32)).unwrap();
        let sealed = seal(&key, "fp-a", b"private").unwrap();
        assert_eq!(unseal(&key, "fp-a", &sealed).unwrap(), "private");
        assert!(matches!(unseal(&key, "fp-b", &sealed), Err(AuthorityError::Unseal)));
        let other = sealing_key(&"t".repeat(32)).unwrap();
        assert!(matches!(unseal(&other, "fp-a", &sealed), Err(AuthorityError::Unseal)));
        assert!(matches!(unseal(&key, "fp-a", &sealed[..5]), Err(AuthorityError::Unseal)));
    }

    #[test]
    fn short_secret_is_refused() {
        assert!(matches!(sealing_key("short"), Err(AuthorityError::SecretTooShort)));
    }
}
