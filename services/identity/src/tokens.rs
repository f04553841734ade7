//! Join tokens: what an operator hands a new host so that it may join, and
//! the `JoinTokens` admin API over them.
//!
//! # What is stored
//! `join_tokens`: one row per token with its tier, labels, limits and use
//! count, and only the SHA-256 of its secret. A token reads
//! `berth-join.<token_id>.<secret>`: the id (`jt-` and 12 hex digits) finds
//! the row, the secret (32 random bytes, hex) proves possession.
//!
//! # Who writes this
//! `CreateJoinToken` inserts, `RevokeJoinToken` sets `revoked_at_ms` (the row
//! stays), `Join` takes one use with a single conditional `UPDATE` inside its
//! transaction ([`consume`]), and the elected monitor deletes tokens long
//! expired ([`forget_expired`]).
//!
//! # Invariants
//! - A presented secret is compared with the stored hash in constant time,
//!   and an unknown id is compared against a dummy hash, so neither the
//!   answer nor its timing tells whether a token id exists.
//! - Why a token is refused (expired, used up, revoked) is said only once
//!   its secret has matched; before that every refusal is "invalid join token".
//! - Uses are counted in SQL (`uses < max_uses` in the `UPDATE`), so
//!   concurrent joins never take more uses than the token allows.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use berth_proto::identity::v1;
use berth_store::StoreError;
use sqlx::any::AnyRow;
use sqlx::{AnyConnection, Row as _};
use subtle::ConstantTimeEq as _;

use crate::IdentityService;
use crate::config::{DEFAULT_TOKEN_TTL, MAX_TOKEN_TTL, MAX_TOKEN_USES, millis};
use crate::registry::{labels_json, timestamp};

/// What every join token starts with.
const TOKEN_PREFIX: &str = "berth-join";

/// Random bytes in a token's secret.
const SECRET_BYTES: usize = 32;

/// Random bytes in a token id.
const TOKEN_ID_BYTES: usize = 6;

/// The longest description kept.
const MAX_DESCRIPTION_LEN: usize = 1024;

/// The most labels a token (or a node) may carry.
const MAX_LABELS: usize = 64;

/// The longest label key.
const MAX_LABEL_KEY_LEN: usize = 128;

/// The longest label value.
const MAX_LABEL_VALUE_LEN: usize = 256;

/// How many fresh ids are tried when one collides.
const ID_ATTEMPTS: usize = 3;

/// Every column of `join_tokens` but the secret's hash.
macro_rules! token_columns {
    () => {
        "token_id, tier, labels_json, description, created_by, created_at_ms, expires_at_ms, max_uses, uses, \
         revoked_at_ms"
    };
}

/// Why a join token operation failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TokenError {
    /// A request field is missing or out of bounds.
    #[error("invalid {field}: {reason}")]
    InvalidArgument {
        /// The request field.
        field: &'static str,
        /// What it must be instead.
        reason: String,
    },
    /// No token has this id.
    #[error("join token {0} not found")]
    NotFound(String),
    /// The presented token is malformed, unknown, or its secret does not match.
    #[error("invalid join token")]
    Invalid,
    /// The token's time ran out.
    #[error("join token expired")]
    Expired,
    /// Every join the token allows has been made.
    #[error("join token used up")]
    UsedUp,
    /// An operator revoked the token.
    #[error("join token revoked")]
    Revoked,
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

berth_store::store_errors!(TokenError, |error| match error {
    TokenError::InvalidArgument { .. } => tonic::Status::invalid_argument(error.to_string()),
    TokenError::NotFound(_) => tonic::Status::not_found(error.to_string()),
    TokenError::Invalid | TokenError::Expired | TokenError::UsedUp | TokenError::Revoked => {
        tonic::Status::unauthenticated(error.to_string())
    }
    TokenError::Store(error) => error.into(),
});

/// A token as a joining host presents it.
#[derive(Clone)]
pub(crate) struct PresentedToken {
    pub(crate) token_id: String,
    secret: String,
}

impl std::fmt::Debug for PresentedToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PresentedToken").field("token_id", &self.token_id).finish_non_exhaustive()
    }
}

impl PresentedToken {
    /// Splits `berth-join.<token_id>.<secret>`; `None` when it is not one.
    pub(crate) fn parse(token: &str) -> Option<Self> {
        let mut parts = token.trim().split('.');
        let (prefix, token_id, secret) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || prefix != TOKEN_PREFIX || !is_token_id(token_id) || secret.is_empty() {
            return None;
        }
        Some(Self { token_id: token_id.to_owned(), secret: secret.to_owned() })
    }
}

fn is_token_id(id: &str) -> bool {
    id.strip_prefix("jt-").is_some_and(|hex| {
        hex.len() == TOKEN_ID_BYTES * 2 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// What a valid token grants the node that joins with it.
#[derive(Debug, Clone)]
pub(crate) struct TokenGrant {
    pub(crate) token_id: String,
    pub(crate) tier: String,
    pub(crate) labels: BTreeMap<String, String>,
}

fn secret_hash(secret: &str) -> String {
    hex::encode(ring::digest::digest(&ring::digest::SHA256, secret.as_bytes()))
}

/// Checks a presented token without using it: its secret, then whether it
/// is still usable. The use itself is taken by [`consume`].
pub(crate) async fn verify(store: &berth_store::Store, token: &PresentedToken) -> Result<TokenGrant, TokenError> {
    let sql = format!(
        "SELECT {}, secret_sha256, {} AS now_ms FROM join_tokens WHERE token_id = $1",
        token_columns!(),
        store.now_ms_sql()
    );
    let row = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(&token.token_id).fetch_optional(store.pool()).await?;
    let presented = secret_hash(&token.secret);
    // An unknown id costs the same comparison as a known one.
    let stored = match &row {
        Some(row) => row.try_get::<String, _>("secret_sha256")?,
        None => secret_hash(""),
    };
    let matches: bool = presented.as_bytes().ct_eq(stored.as_bytes()).into();
    let Some(row) = row.filter(|_| matches) else {
        return Err(TokenError::Invalid);
    };
    refusal(&row)?;
    let token = decode(&row)?;
    Ok(TokenGrant { token_id: token.token_id, tier: token.tier, labels: token.labels.into_iter().collect() })
}

/// Takes one use of `token_id` inside the caller's transaction, or says why
/// it cannot (the secret has already been checked by [`verify`]).
pub(crate) async fn consume(conn: &mut AnyConnection, now_sql: &str, token_id: &str) -> Result<(), TokenError> {
    let sql = format!(
        "UPDATE join_tokens SET uses = uses + 1 WHERE token_id = $1 AND uses < max_uses \
         AND revoked_at_ms IS NULL AND expires_at_ms > {now_sql}"
    );
    let done = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(token_id).execute(&mut *conn).await?;
    if done.rows_affected() == 1 {
        return Ok(());
    }
    let sql = format!("SELECT {}, {now_sql} AS now_ms FROM join_tokens WHERE token_id = $1", token_columns!());
    let row = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(token_id).fetch_optional(&mut *conn).await?;
    let Some(row) = row else {
        return Err(TokenError::Invalid);
    };
    refusal(&row)?;
    // Usable by every measure yet not updated: the clocks disagreed by a hair.
    Err(TokenError::Expired)
}

/// Why the token in `row` (selected with its `now_ms`) cannot be used, if it cannot.
fn refusal(row: &AnyRow) -> Result<(), TokenError> {
    let now_ms: i64 = row.try_get("now_ms")?;
    let revoked_at_ms: Option<i64> = row.try_get("revoked_at_ms")?;
    let expires_at_ms: i64 = row.try_get("expires_at_ms")?;
    let (uses, max_uses): (i64, i64) = (row.try_get("uses")?, row.try_get("max_uses")?);
    if revoked_at_ms.is_some() {
        Err(TokenError::Revoked)
    } else if expires_at_ms <= now_ms {
        Err(TokenError::Expired)
    } else if uses >= max_uses {
        Err(TokenError::UsedUp)
    } else {
        Ok(())
    }
}

/// Deletes tokens that expired more than `retention` ago; how many.
pub(crate) async fn forget_expired(store: &berth_store::Store, retention: Duration) -> Result<u64, StoreError> {
    let sql = format!("DELETE FROM join_tokens WHERE expires_at_ms < {} - $1", store.now_ms_sql());
    let done = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(millis(retention)).execute(store.pool()).await?;
    Ok(done.rows_affected())
}

fn decode(row: &AnyRow) -> Result<v1::JoinToken, StoreError> {
    let labels_json: String = row.try_get("labels_json")?;
    let labels: HashMap<String, String> = serde_json::from_str(&labels_json).map_err(|e| StoreError::Internal {
        context: "decoding join token labels".into(),
        source: Some(Box::new(e)),
    })?;
    let count = |column: &str| -> Result<u32, StoreError> {
        Ok(u32::try_from(row.try_get::<i64, _>(column)?).unwrap_or(u32::MAX))
    };
    Ok(v1::JoinToken {
        token_id: row.try_get("token_id")?,
        tier: row.try_get("tier")?,
        labels,
        created_at: Some(timestamp(row.try_get("created_at_ms")?)),
        expires_at: Some(timestamp(row.try_get("expires_at_ms")?)),
        max_uses: count("max_uses")?,
        uses: count("uses")?,
        revoked: row.try_get::<Option<i64>, _>("revoked_at_ms")?.is_some(),
        description: row.try_get("description")?,
        created_by: row.try_get("created_by")?,
    })
}

/// Checks a tier name: empty (none) or a DNS label.
pub(crate) fn check_tier(tier: &str) -> Result<(), String> {
    if tier.is_empty() || berth_core::is_dns_label(tier) {
        Ok(())
    } else {
        Err(format!("'{tier}' is not a tier name: use 1-63 lowercase letters, digits or '-'"))
    }
}

/// Checks labels: bounded count and sizes, keys of letters, digits, `.`, `_`, `-` and `/`.
pub(crate) fn check_labels<'a>(labels: impl IntoIterator<Item = (&'a String, &'a String)>) -> Result<(), String> {
    for (n, (key, value)) in labels.into_iter().enumerate() {
        if n >= MAX_LABELS {
            return Err(format!("at most {MAX_LABELS} labels are allowed"));
        }
        let key_ok = !key.is_empty()
            && key.len() <= MAX_LABEL_KEY_LEN
            && key.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'/'));
        if !key_ok {
            return Err(format!(
                "label key '{key}' must be 1-{MAX_LABEL_KEY_LEN} ASCII letters, digits, '.', '_', '-' or '/'"
            ));
        }
        if value.len() > MAX_LABEL_VALUE_LEN || value.chars().any(char::is_control) {
            return Err(format!(
                "label '{key}' has a value longer than {MAX_LABEL_VALUE_LEN} bytes or with control characters"
            ));
        }
    }
    Ok(())
}

/// A validated `CreateJoinTokenRequest`.
struct NewToken {
    tier: String,
    labels: BTreeMap<String, String>,
    ttl: Duration,
    max_uses: u32,
    description: String,
}

impl NewToken {
    fn from_request(request: v1::CreateJoinTokenRequest) -> Result<Self, TokenError> {
        let invalid = |field, reason: String| TokenError::InvalidArgument { field, reason };
        check_tier(&request.tier).map_err(|reason| invalid("tier", reason))?;
        check_labels(&request.labels).map_err(|reason| invalid("labels", reason))?;
        let ttl = match request.ttl_seconds {
            0 => DEFAULT_TOKEN_TTL,
            seconds => Duration::from_secs(u64::from(seconds)),
        };
        if ttl > MAX_TOKEN_TTL {
            return Err(invalid(
                "ttl_seconds",
                format!("{} exceeds the longest token life, {} seconds", ttl.as_secs(), MAX_TOKEN_TTL.as_secs()),
            ));
        }
        let max_uses = match request.max_uses {
            0 => 1,
            uses if uses > MAX_TOKEN_USES => {
                return Err(invalid("max_uses", format!("{uses} exceeds the limit of {MAX_TOKEN_USES}")));
            }
            uses => uses,
        };
        if request.description.len() > MAX_DESCRIPTION_LEN {
            return Err(invalid("description", format!("longer than {MAX_DESCRIPTION_LEN} bytes")));
        }
        Ok(Self {
            tier: request.tier,
            labels: request.labels.into_iter().collect(),
            ttl,
            max_uses,
            description: request.description,
        })
    }
}

/// Random bytes, hex.
pub(crate) fn random_hex<const N: usize>() -> String {
    hex::encode(rand::random::<[u8; N]>())
}

impl IdentityService {
    async fn create_token(&self, created_by: &str, new: NewToken) -> Result<v1::CreateJoinTokenResponse, TokenError> {
        let labels = labels_json(&new.labels)?;
        let now = self.store.now_ms_sql();
        let sql = format!(
            "INSERT INTO join_tokens (token_id, secret_sha256, tier, labels_json, description, created_by, \
             created_at_ms, expires_at_ms, max_uses, uses) \
             VALUES ($1, $2, $3, $4, $5, $6, {now}, {now} + $7, $8, 0) RETURNING expires_at_ms"
        );
        for attempt in 1..=ID_ATTEMPTS {
            let token_id = format!("jt-{}", random_hex::<TOKEN_ID_BYTES>());
            let secret = random_hex::<SECRET_BYTES>();
            let (sql, hash, labels, token_id_bound) =
                (sql.clone(), secret_hash(&secret), labels.clone(), token_id.clone());
            let (tier, description) = (new.tier.clone(), new.description.clone());
            let (ttl_ms, max_uses) = (millis(new.ttl), i64::from(new.max_uses));
            let owner = created_by.to_owned();
            let inserted = self
                .store
                .tx("join_tokens.create", move |conn| {
                    let (sql, hash, labels, token_id) =
                        (sql.clone(), hash.clone(), labels.clone(), token_id_bound.clone());
                    let (tier, description, created_by) = (tier.clone(), description.clone(), owner.clone());
                    Box::pin(async move {
                        let expires_at_ms: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                            .bind(token_id)
                            .bind(hash)
                            .bind(tier)
                            .bind(labels)
                            .bind(description)
                            .bind(created_by)
                            .bind(ttl_ms)
                            .bind(max_uses)
                            .fetch_one(&mut *conn)
                            .await?;
                        Ok::<_, StoreError>(expires_at_ms)
                    })
                })
                .await;
            match inserted {
                Ok(expires_at_ms) => {
                    tracing::info!(%token_id, %created_by, tier = %new.tier, max_uses = new.max_uses, "join token created");
                    return Ok(v1::CreateJoinTokenResponse {
                        token: format!("{TOKEN_PREFIX}.{token_id}.{secret}"),
                        token_id,
                        expires_at: Some(timestamp(expires_at_ms)),
                    });
                }
                Err(StoreError::AlreadyExists { .. }) if attempt < ID_ATTEMPTS => continue,
                Err(error) => return Err(error.into()),
            }
        }
        Err(StoreError::internal("no free join token id").into())
    }

    async fn list_tokens(&self, usable_only: bool) -> Result<Vec<v1::JoinToken>, TokenError> {
        let sql = format!(
            "SELECT {} FROM join_tokens WHERE $1 = 0 OR (revoked_at_ms IS NULL AND expires_at_ms > {} \
             AND uses < max_uses) ORDER BY created_at_ms DESC, token_id",
            token_columns!(),
            self.store.now_ms_sql()
        );
        let rows =
            sqlx::query(sqlx::AssertSqlSafe(sql)).bind(i64::from(usable_only)).fetch_all(self.store.pool()).await?;
        Ok(rows.iter().map(decode).collect::<Result<_, _>>()?)
    }

    async fn revoke_token(&self, revoked_by: &str, token_id: &str) -> Result<v1::JoinToken, TokenError> {
        let now = self.store.now_ms_sql();
        let update =
            format!("UPDATE join_tokens SET revoked_at_ms = {now} WHERE token_id = $1 AND revoked_at_ms IS NULL");
        let select = format!("SELECT {} FROM join_tokens WHERE token_id = $1", token_columns!());
        let id = token_id.to_owned();
        let token = self
            .store
            .tx("join_tokens.revoke", move |conn| {
                let (update, select, id) = (update.clone(), select.clone(), id.clone());
                Box::pin(async move {
                    sqlx::query(sqlx::AssertSqlSafe(update)).bind(&id).execute(&mut *conn).await?;
                    let row = sqlx::query(sqlx::AssertSqlSafe(select)).bind(&id).fetch_optional(&mut *conn).await?;
                    match row {
                        Some(row) => Ok(decode(&row)?),
                        None => Err(TokenError::NotFound(id)),
                    }
                })
            })
            .await?;
        tracing::info!(%token_id, %revoked_by, "join token revoked");
        Ok(token)
    }
}

#[tonic::async_trait]
impl v1::join_tokens_server::JoinTokens for IdentityService {
    async fn create_join_token(
        &self,
        request: tonic::Request<v1::CreateJoinTokenRequest>,
    ) -> Result<tonic::Response<v1::CreateJoinTokenResponse>, tonic::Status> {
        let admin = berth_rpc::caller(&request)?.name().to_owned();
        let new = NewToken::from_request(request.into_inner())?;
        Ok(tonic::Response::new(self.create_token(&admin, new).await?))
    }

    async fn list_join_tokens(
        &self,
        request: tonic::Request<v1::ListJoinTokensRequest>,
    ) -> Result<tonic::Response<v1::ListJoinTokensResponse>, tonic::Status> {
        let join_tokens = self.list_tokens(request.get_ref().usable_only).await?;
        Ok(tonic::Response::new(v1::ListJoinTokensResponse { join_tokens }))
    }

    async fn revoke_join_token(
        &self,
        request: tonic::Request<v1::RevokeJoinTokenRequest>,
    ) -> Result<tonic::Response<v1::RevokeJoinTokenResponse>, tonic::Status> {
        let admin = berth_rpc::caller(&request)?.name().to_owned();
        let token_id = &request.get_ref().token_id;
        if !is_token_id(token_id) {
            return Err(TokenError::InvalidArgument {
                field: "token_id",
                reason: format!("'{token_id}' is not a join token id (jt- and 12 hex digits)"),
            }
            .into());
        }
        let join_token = self.revoke_token(&admin, token_id).await?;
        Ok(tonic::Response::new(v1::RevokeJoinTokenResponse { join_token: Some(join_token) }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_well_formed_token_splits_into_id_and_secret() {
        let token = PresentedToken::parse("berth-join.jt-0123456789ab.deadbeef").unwrap();
        assert_eq!(token.token_id, "jt-0123456789ab");
        assert_eq!(token.secret, "deadbeef");
    }

    #[test]
    fn malformed_tokens_are_refused() {
        for bad in [
            "",
            "berth-join",
            "berth-join.jt-0123456789ab",
            "berth-join.jt-0123456789ab.",
            "other.jt-0123456789ab.secret",
            "berth-join.jt-0123.secret",
            "berth-join.jt-0123456789AB.secret",
            "berth-join.jt-0123456789ab.secret.extra",
        ] {
            assert!(PresentedToken::parse(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn a_presented_token_never_prints_its_secret() {
        let token = PresentedToken::parse("berth-join.jt-0123456789ab.topsecret").unwrap();
        assert!(!format!("{token:?}").contains("topsecret"));
    }

    #[test]
    fn bounds_on_new_tokens_name_the_field() {
        let too_long = v1::CreateJoinTokenRequest { ttl_seconds: u32::MAX, ..Default::default() };
        let error = NewToken::from_request(too_long).err().unwrap();
        assert!(matches!(error, TokenError::InvalidArgument { field: "ttl_seconds", .. }), "{error}");
        let too_many = v1::CreateJoinTokenRequest { max_uses: MAX_TOKEN_USES + 1, ..Default::default() };
        let error = NewToken::from_request(too_many).err().unwrap();
        assert!(matches!(error, TokenError::InvalidArgument { field: "max_uses", .. }), "{error}");
        let bad_tier = v1::CreateJoinTokenRequest { tier: "GPU".into(), ..Default::default() };
        let error = NewToken::from_request(bad_tier).err().unwrap();
        assert!(matches!(error, TokenError::InvalidArgument { field: "tier", .. }), "{error}");
    }

    #[test]
    fn zero_means_the_defaults() {
        let new = NewToken::from_request(v1::CreateJoinTokenRequest::default()).unwrap();
        assert_eq!((new.ttl, new.max_uses), (DEFAULT_TOKEN_TTL, 1));
    }

    #[test]
    fn label_keys_and_values_are_bounded() {
        let ok: BTreeMap<String, String> = [("zone".to_owned(), "eu-1".to_owned())].into();
        assert!(check_labels(&ok).is_ok());
        let bad_key: BTreeMap<String, String> = [("a b".to_owned(), "x".to_owned())].into();
        assert!(check_labels(&bad_key).is_err());
        let long_value: BTreeMap<String, String> = [("k".to_owned(), "v".repeat(MAX_LABEL_VALUE_LEN + 1))].into();
        assert!(check_labels(&long_value).is_err());
    }
}
