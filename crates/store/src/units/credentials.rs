//! Credentials: operators, service keys (secret stored as a hash) and the admin
//! secret; looking a principal up by the hash of its secret.
//!
//! Written once for every backend: generic over `crate::backend::Backend` (or the
//! `Dialect` of its connection), with no SQL text that differs per database.

use super::Units;
use super::decode::{invariant, parse_stored};
use super::idempotency::{claim_or_answer, commit_with_answer};
use crate::backend::{Backend, Dialect, Finish};
use crate::catalog::{CredentialKind, NewCredential, ServiceKey};
use crate::error::StoreError;
use crate::model::{IdempotencyClaim, Idempotent, Rejection, ResponseRenderer};
use crate::sql::statement;
use domain::limits::SERVICE_KEYS_ACTIVE_PER_SHOP_MAX;
use domain::{ErrorCode, OperatorId, Principal, ServiceKeyId, ShopCode, Timestamp};

/// Inserts a credential; `false` when its (kind, id) is taken.
/// The one admin credential, with this token hash.
fn admin_credential(secret_hash: &str) -> NewCredential {
    NewCredential {
        kind: CredentialKind::Admin,
        id: "admin".to_owned(),
        name: "admin".to_owned(),
        shop: None,
        secret_hash: secret_hash.to_owned(),
    }
}

pub(crate) async fn insert_credential<C: Dialect>(
    transaction: &mut C,
    credential: &NewCredential,
    now: Timestamp,
) -> Result<bool, StoreError> {
    let inserted = statement(
        "INSERT INTO credential (kind, id, name, shop, secret_hash, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (kind, id) DO NOTHING",
    )
    .bind(credential.kind.as_str())
    .bind(&credential.id)
    .bind(&credential.name)
    .bind(credential.shop.as_ref().map(ShopCode::as_str))
    .bind(&credential.secret_hash)
    .bind(now.unix_milliseconds())
    .execute(&mut *transaction)
    .await?;
    Ok(inserted == 1)
}

pub(crate) fn decode_service_key(
    (id, name, shop, created_at, revoked_at): (String, String, Option<String>, i64, Option<i64>),
) -> Result<ServiceKey, StoreError> {
    Ok(ServiceKey {
        id: parse_stored("service key id", &id, ServiceKeyId::parse)?,
        name,
        shop: parse_stored("shop", shop.as_deref().unwrap_or(""), ShopCode::parse)?,
        created_at: Timestamp::from_unix_milliseconds(created_at),
        revoked_at: revoked_at.map(Timestamp::from_unix_milliseconds),
    })
}

pub(crate) async fn load_service_key<C: Dialect>(
    connection: &mut C,
    key: &ServiceKeyId,
) -> Result<Option<ServiceKey>, StoreError> {
    let row = statement(
        "SELECT id, name, shop, created_at, revoked_at FROM credential WHERE kind = 'service' AND id = $1",
    )
    .bind(key.as_str())
    .fetch_optional_as::<(String, String, Option<String>, i64, Option<i64>)>(&mut *connection)
    .await?;
    row.map(decode_service_key).transpose()
}

/// Marks a credential revoked, once: a second revocation keeps the first time.
async fn mark_revoked<C: Dialect>(
    transaction: &mut C,
    kind: CredentialKind,
    id: &str,
    now: Timestamp,
) -> Result<(), StoreError> {
    statement(
        "UPDATE credential SET revoked_at = $3 WHERE kind = $1 AND id = $2 AND revoked_at IS NULL",
    )
    .bind(kind.as_str())
    .bind(id)
    .bind(now.unix_milliseconds())
    .execute(&mut *transaction)
    .await?;
    Ok(())
}

impl<B: Backend> Units<B> {
    pub async fn create_operator(
        &self,
        claim: &IdempotencyClaim,
        operator: &OperatorId,
        shop: &ShopCode,
        token_hash: &str,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        let credential = NewCredential {
            kind: CredentialKind::Operator,
            id: operator.as_str().to_owned(),
            name: operator.as_str().to_owned(),
            shop: Some(shop.clone()),
            secret_hash: token_hash.to_owned(),
        };
        let response = if insert_credential(&mut *transaction, &credential, now).await? {
            renderer.operator_created(operator, shop, None)
        } else {
            renderer.rejected(&Rejection::new(
                ErrorCode::AlreadyExists,
                format!("operator '{operator}' already exists"),
            ))
        };
        commit_with_answer(transaction, claim, response).await
    }

    /// A new service key of a shop; only the hash of its secret is stored.
    pub async fn create_service_key(
        &self,
        claim: &IdempotencyClaim,
        key: &ServiceKey,
        secret_hash: &str,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        // The shop's lock makes two creations count in turn: they cannot both take
        // the last place.
        transaction.lock_shop(&key.shop).await?;
        let active: i64 = statement(
            "SELECT COUNT(*) FROM credential WHERE kind = 'service' AND shop = $1 AND revoked_at IS NULL",
        )
        .bind(key.shop.as_str())
        .fetch_one_scalar(&mut *transaction)
        .await?;
        if active >= SERVICE_KEYS_ACTIVE_PER_SHOP_MAX {
            let response = renderer.rejected(&Rejection::new(
                ErrorCode::FailedPrecondition,
                format!(
                    "shop '{}' has {active} active service keys, the most it may have: revoke one it no longer uses first",
                    key.shop
                ),
            ));
            return commit_with_answer(transaction, claim, response).await;
        }
        let credential = NewCredential {
            kind: CredentialKind::Service,
            id: key.id.as_str().to_owned(),
            name: key.name.clone(),
            shop: Some(key.shop.clone()),
            secret_hash: secret_hash.to_owned(),
        };
        if !insert_credential(&mut *transaction, &credential, now).await? {
            return Err(invariant("a freshly minted service key id was taken"));
        }
        let response = renderer.service_key_created(key, None);
        commit_with_answer(transaction, claim, response).await
    }

    /// Revokes a service key: from now on its secret authenticates nobody.
    pub async fn revoke_service_key(
        &self,
        claim: &IdempotencyClaim,
        key: &ServiceKeyId,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        mark_revoked(
            &mut *transaction,
            CredentialKind::Service,
            key.as_str(),
            now,
        )
        .await?;
        let response = match load_service_key(&mut *transaction, key).await? {
            Some(revoked) => renderer.service_key_revoked(&revoked),
            None => renderer.rejected(&Rejection::new(
                ErrorCode::NotFound,
                format!("service key '{key}' does not exist"),
            )),
        };
        commit_with_answer(transaction, claim, response).await
    }

    /// Revokes an operator's token: from the commit on it authenticates nowhere (the
    /// credential caches forget it at once here, within their bound elsewhere). The
    /// operator's id stays taken: its entries in the shelf log keep naming it.
    pub async fn revoke_operator(
        &self,
        claim: &IdempotencyClaim,
        operator: &OperatorId,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        mark_revoked(
            &mut *transaction,
            CredentialKind::Operator,
            operator.as_str(),
            now,
        )
        .await?;
        let revoked: Option<(Option<String>, Option<i64>)> = statement(
            "SELECT shop, revoked_at FROM credential WHERE kind = 'operator' AND id = $1",
        )
        .bind(operator.as_str())
        .fetch_optional_as(&mut *transaction)
        .await?;
        let response = match revoked {
            Some((Some(shop), Some(revoked_at))) => renderer.operator_revoked(
                operator,
                &parse_stored("shop", &shop, ShopCode::parse)?,
                Timestamp::from_unix_milliseconds(revoked_at),
            ),
            Some(_) => {
                return Err(invariant(format!(
                    "operator '{operator}' has no shop or was not revoked"
                )));
            }
            None => renderer.rejected(&Rejection::new(
                ErrorCode::NotFound,
                format!("operator '{operator}' does not exist"),
            )),
        };
        commit_with_answer(transaction, claim, response).await
    }

    /// Service keys, the active ones first, each part newest first (of one shop when
    /// given): a listing cut at `limit` leaves out revoked keys before active ones.
    pub async fn service_keys(
        &self,
        shop: Option<&ShopCode>,
        limit: i64,
    ) -> Result<Vec<ServiceKey>, StoreError> {
        let rows = statement(
            "SELECT id, name, shop, created_at, revoked_at FROM credential \
             WHERE kind = 'service' AND ($1 IS NULL OR shop = $1) \
             ORDER BY CASE WHEN revoked_at IS NULL THEN 0 ELSE 1 END, created_at DESC, id LIMIT $2",
        )
        .bind(shop.map(ShopCode::as_str))
        .bind(limit)
        .fetch_all_as::<(String, String, Option<String>, i64, Option<i64>)>(
            &mut *self.writer_read_connection().await?,
        )
        .await?;
        rows.into_iter().map(decode_service_key).collect()
    }

    /// The principal whose secret hashes to `secret_hash`, unless revoked.
    pub async fn principal_by_secret_hash(
        &self,
        secret_hash: &str,
    ) -> Result<Option<Principal>, StoreError> {
        let row = statement(
            "SELECT kind, id, shop FROM credential WHERE secret_hash = $1 AND revoked_at IS NULL",
        )
        .bind(secret_hash)
        // Not the writer's own connection: on SQLite that one is every write's, and
        // anyone may send a token to look up.
        .fetch_optional_as::<(String, String, Option<String>)>(
            &mut *self.writer_read_connection().await?,
        )
        .await?;
        let Some((kind, id, shop)) = row else {
            return Ok(None);
        };
        let shop = shop
            .as_deref()
            .map(|shop| parse_stored("shop", shop, ShopCode::parse))
            .transpose()?;
        let principal = match (kind.as_str(), shop) {
            ("admin", None) => Principal::Admin,
            ("operator", Some(shop)) => Principal::Operator {
                id: parse_stored("operator id", &id, OperatorId::parse)?,
                shop,
            },
            ("service", Some(shop)) => Principal::Service {
                key: parse_stored("service key id", &id, ServiceKeyId::parse)?,
                shop,
            },
            _ => return Err(invariant(format!("credential {kind}/{id} is malformed"))),
        };
        Ok(Some(principal))
    }

    /// Whether an admin token was stored (a generated one, kept across restarts).
    pub async fn admin_credential_exists(&self) -> Result<bool, StoreError> {
        let found: Option<String> =
            statement("SELECT id FROM credential WHERE kind = 'admin' AND revoked_at IS NULL")
                .fetch_optional_scalar(&mut *self.write_connection().await?)
                .await?;
        Ok(found.is_some())
    }

    /// Stores the first admin token's hash unless one is stored: answers whether this
    /// call stored it. Instances started together on a new database each generate a
    /// token; only the one stored is printed, and none replaces another's.
    pub async fn store_first_admin_secret(
        &self,
        secret_hash: &str,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let mut transaction = self.begin_write().await?;
        let credential = admin_credential(secret_hash);
        let stored = insert_credential(&mut *transaction, &credential, now).await?;
        transaction.commit().await?;
        Ok(stored)
    }

    /// Deletes the stored admin token's hash (a configured one replaces it for good):
    /// answers whether one was stored.
    pub async fn retire_admin_secret(&self) -> Result<bool, StoreError> {
        let mut transaction = self.begin_write().await?;
        let deleted = statement("DELETE FROM credential WHERE kind = 'admin'")
            .execute(&mut *transaction)
            .await?;
        transaction.commit().await?;
        Ok(deleted > 0)
    }

    /// Stores the admin token's hash, replacing any earlier one (rotation).
    pub async fn replace_admin_secret(
        &self,
        secret_hash: &str,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        let mut transaction = self.begin_write().await?;
        statement("DELETE FROM credential WHERE kind = 'admin'")
            .execute(&mut *transaction)
            .await?;
        let credential = admin_credential(secret_hash);
        if !insert_credential(&mut *transaction, &credential, now).await? {
            return Err(invariant("the admin credential could not be stored"));
        }
        transaction.commit().await?;
        Ok(())
    }
}
