//! Idempotency keys: claiming a key at the start of a unit of work, answering a
//! repeat with the first answer, storing the answer with the effect, and purging old
//! records.
//!
//! Written once for every backend: generic over `crate::backend::Backend` (or the
//! `Dialect` of its connection), with no SQL text that differs per database.

use super::Units;
use super::decode::{corrupt, expect_one_row, invariant, stored_response};
use crate::backend::{Backend, Dialect, Finish};
use crate::error::StoreError;
use crate::model::{IdempotencyClaim, Idempotent, ScopedKey, StoredResponse};
use crate::sql::statement;
use domain::Timestamp;

/// What a key's claim found.
pub(crate) enum Claim {
    /// This transaction now holds the key.
    Taken,
    /// The key has a committed record (or, within one batch, an earlier request's claim).
    Existing {
        fingerprint: String,
        response: Option<StoredResponse>,
    },
}

/// Claims an idempotency key inside `transaction`. On PostgreSQL a concurrent
/// uncommitted claim of the same key makes this wait (bounded by `lock_timeout`), which
/// is reported as [`StoreError::KeyInFlight`].
pub(crate) async fn claim_key<C: Dialect>(
    transaction: &mut C,
    claim: &IdempotencyClaim,
    now: Timestamp,
) -> Result<Claim, StoreError> {
    let inserted = statement(
        "INSERT INTO idempotency_record (key, fingerprint, status_code, body, created_at) \
         VALUES ($1, $2, 0, '', $3) ON CONFLICT (key) DO NOTHING",
    )
    .bind(claim.key.as_str())
    .bind(&claim.fingerprint)
    .bind(now.unix_milliseconds())
    .execute(&mut *transaction)
    .await
    .map_err(|error| match error {
        StoreError::LockTimeout(_) => StoreError::KeyInFlight,
        other => other,
    })?;
    if inserted == 1 {
        return Ok(Claim::Taken);
    }
    // PostgreSQL's DO NOTHING locks nothing: a purge of the record (a retry that came
    // exactly as its retention ended) can commit between the two statements. The key
    // is then free; the unit of work runs again and claims it.
    let row =
        statement("SELECT fingerprint, status_code, body FROM idempotency_record WHERE key = $1")
            .bind(claim.key.as_str())
            .fetch_optional_row(&mut *transaction)
            .await?
            .ok_or_else(|| {
                StoreError::Retryable(
                    "the key's record was purged between its claim and its read".to_owned(),
                )
            })?;
    let response = stored_response(row.try_get("status_code")?, row.try_get("body")?)?;
    Ok(Claim::Existing {
        fingerprint: row.try_get("fingerprint")?,
        response,
    })
}

/// The answer for a key that already has a committed record.
pub(crate) fn resolve_existing(
    claim: &IdempotencyClaim,
    fingerprint: &str,
    response: Option<StoredResponse>,
) -> Result<Idempotent, StoreError> {
    if fingerprint != claim.fingerprint {
        return Ok(Idempotent::KeyReused);
    }
    response
        .map(Idempotent::Replayed)
        .ok_or_else(|| invariant("an idempotency claim without a response was visible"))
}

/// Claims `claim`'s key in this transaction, the opening of every keyed unit of work.
/// `Some` is the answer a retry gets (the stored response, or "key reused"): the
/// caller rolls back and returns it, having changed nothing.
pub(crate) async fn claim_or_answer<C: Dialect>(
    transaction: &mut C,
    claim: &IdempotencyClaim,
    now: Timestamp,
) -> Result<Option<Idempotent>, StoreError> {
    match claim_key(transaction, claim, now).await? {
        Claim::Taken => Ok(None),
        Claim::Existing {
            fingerprint,
            response,
        } => resolve_existing(claim, &fingerprint, response).map(Some),
    }
}

/// Stores the response for a key claimed by this transaction.
pub(crate) async fn complete_claim<C: Dialect>(
    transaction: &mut C,
    claim: &IdempotencyClaim,
    response: &StoredResponse,
) -> Result<(), StoreError> {
    let updated = statement(
        "UPDATE idempotency_record SET status_code = $2, body = $3 \
         WHERE key = $1 AND status_code = 0",
    )
    .bind(claim.key.as_str())
    .bind(i64::from(response.status))
    .bind(&response.body)
    .execute(&mut *transaction)
    .await?;
    expect_one_row(updated, "completing an idempotency claim")
}

/// Gives up a key claimed by this transaction without an answer: the unit of work
/// commits an effect whose answer is stored later (a payment the gateway has yet to
/// answer). The claim, held until here, kept a concurrent request under the same key
/// waiting; once this commits, it claims the key and finds the effect.
pub(crate) async fn withdraw_claim<C: Dialect>(
    transaction: &mut C,
    claim: &IdempotencyClaim,
) -> Result<(), StoreError> {
    let deleted = statement("DELETE FROM idempotency_record WHERE key = $1 AND status_code = 0")
        .bind(claim.key.as_str())
        .execute(&mut *transaction)
        .await?;
    expect_one_row(deleted, "withdrawing an idempotency claim")
}

/// Stores a unit of work's answer under its key and commits it with the unit's effect:
/// the closing counterpart of [`claim_or_answer`].
pub(crate) async fn commit_with_answer<T, C>(
    mut transaction: T,
    claim: &IdempotencyClaim,
    response: StoredResponse,
) -> Result<Idempotent, StoreError>
where
    T: std::ops::DerefMut<Target = C> + Finish,
    C: Dialect,
{
    complete_claim(&mut *transaction, claim, &response).await?;
    transaction.commit().await?;
    Ok(Idempotent::Executed(response))
}

impl<B: Backend> Units<B> {
    /// Stores `response` under `claim`'s key on its own (for answers reached across
    /// several transactions, like a payment's). A key that already has a record keeps
    /// it, and that one is the answer.
    pub async fn store_response(
        &self,
        claim: &IdempotencyClaim,
        response: &StoredResponse,
        now: Timestamp,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        complete_claim(&mut *transaction, claim, response).await?;
        transaction.commit().await?;
        Ok(Idempotent::Executed(response.clone()))
    }

    /// Which of `keys` hold a committed record. One read for many keys: what stands
    /// behind an answer from memory, for each of a burst's requests.
    pub async fn keys_with_records(
        &self,
        keys: &[&str],
    ) -> Result<std::collections::HashSet<String>, StoreError> {
        let mut connection = self.writer_read_connection().await?;
        let found = connection.existing_records(keys).await?;
        Ok(found.into_keys().collect())
    }

    /// The committed record of `key`, if any: `(fingerprint, response)`.
    pub async fn idempotency_record(
        &self,
        key: &ScopedKey,
    ) -> Result<Option<(String, StoredResponse)>, StoreError> {
        let row = statement(
            "SELECT fingerprint, status_code, body FROM idempotency_record WHERE key = $1",
        )
        .bind(key.as_str())
        .fetch_optional_row(&mut *self.writer_read_connection().await?)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let status_code: i64 = row.try_get("status_code")?;
        let status = u16::try_from(status_code).map_err(|error| corrupt("status code", error))?;
        Ok(Some((
            row.try_get("fingerprint")?,
            StoredResponse {
                status,
                body: row.try_get("body")?,
            },
        )))
    }

    /// Deletes up to `limit` idempotency records created before `created_before`.
    pub async fn purge_idempotency_records(
        &self,
        created_before: Timestamp,
        limit: i64,
    ) -> Result<u64, StoreError> {
        let mut transaction = self.begin_write().await?;
        let deleted = statement(<B::Connection as Dialect>::PURGE_IDEMPOTENCY_RECORDS)
            .bind(created_before.unix_milliseconds())
            .bind(limit)
            .execute(&mut *transaction)
            .await?;
        transaction.commit().await?;
        Ok(deleted)
    }
}
