//! Authentication: a bearer token to a [`Principal`], and the credentials the admin
//! creates, lists and revokes.
//!
//! Secrets are stored as SHA-256 hashes and never leave the process that minted them
//! except in the one answer that creates them. Looking a token up is a hash and a map
//! lookup: the database is asked only when this process has not seen the token within
//! [`EngineConfig::credential_cache_milliseconds`] (by the injected clock). That bound
//! is also how long another instance may keep accepting a revoked key; the instance
//! that revokes forgets everything it cached at once.
//!
//! [`EngineConfig::credential_cache_milliseconds`]: crate::EngineConfig

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};

use domain::limits::{BEARER_TOKEN_LENGTH_MAX, SERVICE_KEYS_LISTED_MAX};
use domain::{
    Action, OperatorId, Principal, Secret, ServiceKeyId, ShopCode, Timestamp, authorize,
    principal::RESERVED_OPERATOR_IDS,
};
use sha2::{Digest, Sha256};
use store::{IdempotencyClaim, ServiceKey};

use crate::{Engine, EngineError, Reply, log_store_error};

/// Entries the credential cache holds at most. Unknown tokens are cached too (so a
/// client retrying a wrong token does not query the database each time); when the
/// cache is full they go first, then everything.
const CREDENTIAL_CACHE_ENTRIES_MAX: usize = 10_000;

/// The prefix of service key secrets, so a leaked one is recognisable in a scan.
const SERVICE_SECRET_PREFIX: &str = "stockd_sk_";

/// The lengths of every secret stockd stores (a generated admin token, an operator
/// token: 32 random bytes in hex; a service key: the prefix and the same). A token of
/// another length (the configured admin token aside, which is compared in memory) is
/// unknown without asking the database.
const STORED_SECRET_LENGTHS: [usize; 2] = [64, SERVICE_SECRET_PREFIX.len() + 64];

/// Database lookups of tokens this process has not found before, running at once at
/// most, and how long a lookup waits for its turn before the request is shed (429).
/// Anyone may send a token: without a bound, a flood of made-up ones would take the
/// writer pool's connections from the sales. A known credential's refresh (its cached
/// answer expired) is not bounded.
const CREDENTIAL_LOOKUPS_CONCURRENT_MAX: usize = 4;
const CREDENTIAL_LOOKUP_WAIT_MILLISECONDS_MAX: u64 = 1_000;

/// SHA-256 of a bearer token: how a credential is looked up, cached and counted.
pub type TokenDigest = [u8; 32];

pub fn digest(token: &str) -> TokenDigest {
    Sha256::digest(token.as_bytes()).into()
}

/// SHA-256 of a token, hex: the form the database stores.
pub fn token_hash(token: &str) -> String {
    domain::lower_hex(&digest(token))
}

/// Whether a bearer header can carry `token` as the admin token (`serve` checks it
/// before opening the database). A token no header can carry would lock the admin out
/// without a word: every call would hear "unknown credential". A header value holds
/// printable ASCII and tabs; the bearer token is read from it trimmed.
pub fn check_admin_token(token: &Secret) -> Result<(), EngineError> {
    let text = token.expose();
    let carried = |byte: u8| byte == b'\t' || (b' '..=b'~').contains(&byte);
    if text.is_empty()
        || text.len() > BEARER_TOKEN_LENGTH_MAX
        || !text.bytes().all(carried)
        || text.trim() != text
    {
        return Err(EngineError::InvalidArgument(format!(
            "the admin token must be 1 to {BEARER_TOKEN_LENGTH_MAX} printable ASCII characters, not starting or ending with a space (it has {} characters)",
            text.chars().count()
        )));
    }
    Ok(())
}

/// A fresh random secret: 32 bytes, hex.
fn random_secret() -> String {
    domain::lower_hex(&rand::random::<[u8; 32]>())
}

#[derive(Clone)]
struct Cached {
    principal: Option<Arc<Principal>>,
    fetched_at: Timestamp,
}

/// What this process knows about tokens. Read on every request, written on a miss:
/// read-write locks, and principals shared rather than copied.
pub struct Credentials {
    /// The digest of `STOCKD_ADMIN_TOKEN` when it is configured; then the admin token
    /// stored in the database (a generated one) is not accepted.
    configured_admin: RwLock<Option<TokenDigest>>,
    cache: RwLock<HashMap<TokenDigest, Cached>>,
    /// Digests that were found to be a credential here, kept when the cache is
    /// forgotten: their next lookup is a refresh, exempt from the bound on strangers'
    /// lookups, even right after a revocation, when every answer was forgotten.
    /// Never a reason to trust a token: only to let its lookup through.
    found_before: RwLock<HashSet<TokenDigest>>,
    /// Counts `forget_all`s: a lookup that read the database before a revocation
    /// here and finishes after it must not cache what it read.
    generation: std::sync::atomic::AtomicU64,
    admin: Arc<Principal>,
    /// Turns for the database lookups of cache misses
    /// ([`CREDENTIAL_LOOKUPS_CONCURRENT_MAX`]).
    lookups: tokio::sync::Semaphore,
}

impl Default for Credentials {
    fn default() -> Credentials {
        Credentials {
            configured_admin: RwLock::default(),
            cache: RwLock::default(),
            found_before: RwLock::default(),
            generation: std::sync::atomic::AtomicU64::new(0),
            admin: Arc::new(Principal::Admin),
            lookups: tokio::sync::Semaphore::new(CREDENTIAL_LOOKUPS_CONCURRENT_MAX),
        }
    }
}

impl Credentials {
    fn configured_admin(&self) -> Option<TokenDigest> {
        *self
            .configured_admin
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn cached(&self, key: &TokenDigest, now: Timestamp, ttl_milliseconds: i64) -> Option<Cached> {
        let cache = self
            .cache
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // An age below zero is the wall clock stepped back since the answer was read:
        // kept, it would be trusted for as long as the step, past the bound.
        cache
            .get(key)
            .filter(|entry| {
                (0..ttl_milliseconds)
                    .contains(&(now.unix_milliseconds() - entry.fetched_at.unix_milliseconds()))
            })
            .cloned()
    }

    /// Whether `key` was found to be a credential here before, however long ago and
    /// whatever was forgotten since: its lookup again is a refresh, not a stranger's
    /// guess.
    fn known(&self, key: &TokenDigest) -> bool {
        self.found_before
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .contains(key)
    }

    /// Notes that `key` was found to be a credential (see [`Credentials::known`]).
    fn note_found(&self, key: TokenDigest) {
        if self.known(&key) {
            return;
        }
        let mut found = self
            .found_before
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // Bounded as the cache is: only digests that were real credentials get here.
        if found.len() >= CREDENTIAL_CACHE_ENTRIES_MAX {
            found.clear();
        }
        found.insert(key);
    }

    /// The generation a lookup starts in; pass it to [`Credentials::remember`].
    fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Caches a lookup's answer, unless the cache was forgotten since the lookup began
    /// (`generation`): what it read may predate a revocation.
    fn remember(&self, key: TokenDigest, entry: Cached, generation: u64) {
        let mut cache = self
            .cache
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if self.generation() != generation {
            return;
        }
        if cache.len() >= CREDENTIAL_CACHE_ENTRIES_MAX {
            cache.retain(|_, cached| cached.principal.is_some());
            if cache.len() >= CREDENTIAL_CACHE_ENTRIES_MAX {
                cache.clear();
            }
        }
        cache.insert(key, entry);
    }

    /// Forgets every cached answer when dropped: held across a revocation or rotation
    /// here, so the cache goes however it ends. A commit whose answer was lost, or a
    /// caller that went away, may have revoked.
    fn forget_all_when_done(&self) -> ForgetAllWhenDone<'_> {
        ForgetAllWhenDone(self)
    }

    /// Forgets every cached answer (after a revocation or rotation here).
    pub fn forget_all(&self) {
        let mut cache = self
            .cache
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        cache.clear();
    }
}

/// See [`Credentials::forget_all_when_done`].
struct ForgetAllWhenDone<'credentials>(&'credentials Credentials);

impl Drop for ForgetAllWhenDone<'_> {
    fn drop(&mut self) {
        self.0.forget_all();
    }
}

impl Engine {
    /// Makes `token` the admin token (`STOCKD_ADMIN_TOKEN`); the one stored in the
    /// database, if any, is then refused.
    pub fn configure_admin_token(&self, token: &Secret) -> Result<(), EngineError> {
        check_admin_token(token)?;
        *self
            .inner
            .credentials
            .configured_admin
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(digest(token.expose()));
        Ok(())
    }

    /// With a configured admin token: the generated one stored in the database, if
    /// any, is deleted, so it never works again, also on a later start without
    /// `STOCKD_ADMIN_TOKEN` (which then generates and prints a new one). Setting the
    /// variable is how an operator retires a generated token that was seen. Answers
    /// whether one was stored.
    pub async fn retire_stored_admin_token(&self) -> Result<bool, EngineError> {
        let _forget = self.inner.credentials.forget_all_when_done();
        self.inner
            .store
            .retire_admin_secret()
            .await
            .map_err(|error| log_store_error("admin_token", error))
    }

    /// Without a configured admin token: the admin token stored in the database is the
    /// one. When none is stored yet, one is generated, its hash stored, and the token
    /// returned (to print once); `None` when one was stored before (kept across
    /// restarts; `stockd rotate-admin-token` replaces it).
    pub async fn ensure_admin_token(&self) -> Result<Option<Secret>, EngineError> {
        let exists = self
            .inner
            .store
            .admin_credential_exists()
            .await
            .map_err(|error| log_store_error("admin_token", error))?;
        if exists {
            return Ok(None);
        }
        // Another instance starting on the same new database may store its own first:
        // then that one is the token (it printed it), and this one is not printed.
        let token = Secret::new(random_secret());
        let stored = self
            .inner
            .store
            .store_first_admin_secret(&token_hash(token.expose()), self.now())
            .await
            .map_err(|error| log_store_error("admin_token", error))?;
        Ok(stored.then_some(token))
    }

    /// A new admin token: its hash replaces the stored one. Other instances accept the
    /// old one for at most the credential cache's bound.
    pub async fn rotate_admin_token(&self) -> Result<Secret, EngineError> {
        let token = Secret::new(random_secret());
        let _forget = self.inner.credentials.forget_all_when_done();
        self.inner
            .store
            .replace_admin_secret(&token_hash(token.expose()), self.now())
            .await
            .map_err(|error| log_store_error("admin_token", error))?;
        Ok(token)
    }

    /// The principal a bearer token belongs to, if any.
    pub async fn authenticate(&self, token: &str) -> Result<Option<Principal>, EngineError> {
        Ok(self
            .authenticate_digest(&digest(token), token.len())
            .await?
            .map(|principal| Principal::clone(&principal)))
    }

    /// [`Engine::authenticate`] for a token already hashed (the HTTP layer counts its
    /// rate by the same digest); `token_length` bounds what is looked up at all.
    pub async fn authenticate_digest(
        &self,
        key: &TokenDigest,
        token_length: usize,
    ) -> Result<Option<Arc<Principal>>, EngineError> {
        if token_length == 0 || token_length > BEARER_TOKEN_LENGTH_MAX {
            return Ok(None);
        }
        let key = *key;
        let configured_admin = self.inner.credentials.configured_admin();
        if let Some(admin) = configured_admin
            && domain::constant_time_equal(&admin, &key)
        {
            return Ok(Some(Arc::clone(&self.inner.credentials.admin)));
        }
        let now = self.now();
        let ttl = self.inner.config.credential_cache_milliseconds;
        if let Some(cached) = self.inner.credentials.cached(&key, now, ttl) {
            return Ok(cached.principal);
        }
        if !STORED_SECRET_LENGTHS.contains(&token_length) {
            return Ok(None);
        }
        // A credential known here, whose cached answer expired, is refreshed as it
        // comes: the bound is for tokens this process has never found, anyone's to
        // send, and must not shed the shop's own staff and checkouts while it is full.
        let _turn = if self.inner.credentials.known(&key) {
            None
        } else {
            let waited = tokio::time::timeout(
                std::time::Duration::from_millis(CREDENTIAL_LOOKUP_WAIT_MILLISECONDS_MAX),
                self.inner.credentials.lookups.acquire(),
            )
            .await;
            let Ok(Ok(turn)) = waited else {
                return Err(EngineError::Overloaded(
                    "too many credentials this instance has not seen lately are being looked up; retry shortly".to_owned(),
                ));
            };
            Some(turn)
        };
        // A cache miss: boxed, so every request's future does not carry the lookup's.
        let generation = self.inner.credentials.generation();
        let found = crate::cold(
            self.inner
                .store
                .principal_by_secret_hash(&domain::lower_hex(&key)),
        )
        .await
        .map_err(|error| log_store_error("authenticate", error))?;
        // With a configured admin token, a stored (generated) one is not the admin's.
        let principal = found
            .filter(|principal| !(configured_admin.is_some() && *principal == Principal::Admin))
            .map(Arc::new);
        if principal.is_some() {
            self.inner.credentials.note_found(key);
        }
        self.inner.credentials.remember(
            key,
            Cached {
                principal: principal.clone(),
                fetched_at: now,
            },
            generation,
        );
        Ok(principal)
    }

    /// `POST /v1/admin/operators`: a token bound to one shop. The token is in the first
    /// answer only; only its hash is stored.
    pub async fn create_operator(
        &self,
        principal: &Principal,
        claim: &IdempotencyClaim,
        operator: &OperatorId,
        shop: &ShopCode,
    ) -> Result<Reply, EngineError> {
        authorize(principal, Action::ManageCredentials, None)
            .map_err(|denied| EngineError::Forbidden(denied.0))?;
        // Taken by stockd itself, as an operator's id is taken once created: a well
        // formed request naming a name that is not free (409, like any taken id).
        // In any case: `Admin` in the shelf log reads as the admin's change.
        if RESERVED_OPERATOR_IDS
            .iter()
            .any(|reserved| reserved.eq_ignore_ascii_case(operator.as_str()))
        {
            return Err(EngineError::Refused {
                code: domain::ErrorCode::AlreadyExists,
                detail: format!(
                    "'{operator}' is taken: stockd writes it into the shelf log itself; choose another"
                ),
            });
        }
        let token = random_secret();
        let hash = token_hash(&token);
        let renderer = self.inner.renderer.as_ref();
        let reply = self
            .idempotent("create_operator", claim, || {
                self.retried("create_operator", || {
                    self.inner.store.create_operator(
                        claim,
                        operator,
                        shop,
                        &hash,
                        self.now(),
                        renderer,
                    )
                })
            })
            .await?;
        if !reply.replayed && reply.response.status == 201 {
            return Ok(Reply {
                response: renderer.operator_created(operator, shop, Some(&token)),
                replayed: false,
                consistency_token: None,
            });
        }
        Ok(reply)
    }

    /// `POST /v1/admin/service-keys`: a shop's checkout backend's credential. The
    /// secret is in the first answer only.
    pub async fn create_service_key(
        &self,
        principal: &Principal,
        claim: &IdempotencyClaim,
        shop: &ShopCode,
        name: &str,
    ) -> Result<Reply, EngineError> {
        authorize(principal, Action::ManageCredentials, None)
            .map_err(|denied| EngineError::Forbidden(denied.0))?;
        let now = self.now();
        let key = ServiceKey {
            id: ServiceKeyId::generate(now, rand::random()),
            name: name.to_owned(),
            shop: shop.clone(),
            created_at: now,
            revoked_at: None,
        };
        let secret = format!("{SERVICE_SECRET_PREFIX}{}", random_secret());
        let hash = token_hash(&secret);
        let renderer = self.inner.renderer.as_ref();
        let reply = self
            .idempotent("create_service_key", claim, || {
                self.retried("create_service_key", || {
                    self.inner
                        .store
                        .create_service_key(claim, &key, &hash, self.now(), renderer)
                })
            })
            .await?;
        if !reply.replayed && reply.response.status == 201 {
            return Ok(Reply {
                response: renderer.service_key_created(&key, Some(&secret)),
                replayed: false,
                consistency_token: None,
            });
        }
        Ok(reply)
    }

    /// `GET /v1/admin/service-keys`.
    pub async fn service_keys(
        &self,
        principal: &Principal,
    ) -> Result<Vec<ServiceKey>, EngineError> {
        authorize(principal, Action::ManageCredentials, None)
            .map_err(|denied| EngineError::Forbidden(denied.0))?;
        self.inner
            .store
            .service_keys(principal.shop(), SERVICE_KEYS_LISTED_MAX)
            .await
            .map_err(|error| log_store_error("service_keys", error))
    }

    /// `DELETE /v1/admin/service-keys/{key_id}`: refused on this instance at once, on
    /// the others within the credential cache's bound.
    pub async fn revoke_service_key(
        &self,
        principal: &Principal,
        claim: &IdempotencyClaim,
        key: &ServiceKeyId,
    ) -> Result<Reply, EngineError> {
        authorize(principal, Action::ManageCredentials, None)
            .map_err(|denied| EngineError::Forbidden(denied.0))?;
        let renderer = self.inner.renderer.as_ref();
        let _forget = self.inner.credentials.forget_all_when_done();
        let reply = self
            .idempotent("revoke_service_key", claim, || {
                self.retried("revoke_service_key", || {
                    self.inner
                        .store
                        .revoke_service_key(claim, key, self.now(), renderer)
                })
            })
            .await?;
        Ok(reply)
    }

    /// `DELETE /v1/admin/operators/{operator_id}`: the operator's token stops working
    /// (a staff member who left); refused at once here, within the credential cache's
    /// bound on other instances.
    pub async fn revoke_operator(
        &self,
        principal: &Principal,
        claim: &IdempotencyClaim,
        operator: &OperatorId,
    ) -> Result<Reply, EngineError> {
        authorize(principal, Action::ManageCredentials, None)
            .map_err(|denied| EngineError::Forbidden(denied.0))?;
        let renderer = self.inner.renderer.as_ref();
        let _forget = self.inner.credentials.forget_all_when_done();
        let reply = self
            .idempotent("revoke_operator", claim, || {
                self.retried("revoke_operator", || {
                    self.inner
                        .store
                        .revoke_operator(claim, operator, self.now(), renderer)
                })
            })
            .await?;
        Ok(reply)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_hashes_are_hex_sha256() {
        assert_eq!(
            token_hash("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn a_lookup_that_began_before_a_revocation_here_is_not_cached() {
        let credentials = Credentials::default();
        let token = digest("revoked-meanwhile");
        let entry = Cached {
            principal: Some(Arc::new(Principal::Admin)),
            fetched_at: Timestamp::from_unix_milliseconds(0),
        };
        let before_revocation = credentials.generation();
        credentials.forget_all();
        credentials.remember(token, entry.clone(), before_revocation);
        assert!(
            credentials
                .cached(&token, Timestamp::from_unix_milliseconds(1), 2_000)
                .is_none()
        );
        credentials.remember(token, entry, credentials.generation());
        assert!(
            credentials
                .cached(&token, Timestamp::from_unix_milliseconds(1), 2_000)
                .is_some()
        );
    }

    #[test]
    fn an_answer_read_after_the_clock_now_is_not_trusted() {
        let credentials = Credentials::default();
        let token = digest("read-before-the-clock-stepped-back");
        let entry = Cached {
            principal: Some(Arc::new(Principal::Admin)),
            fetched_at: Timestamp::from_unix_milliseconds(600_000),
        };
        credentials.remember(token, entry, credentials.generation());
        assert!(
            credentials
                .cached(&token, Timestamp::from_unix_milliseconds(600_001), 2_000)
                .is_some()
        );
        assert!(
            credentials
                .cached(&token, Timestamp::from_unix_milliseconds(0), 2_000)
                .is_none(),
            "the wall clock stepped back ten minutes: the answer's age is unknown"
        );
    }

    #[test]
    fn a_revocation_forgets_the_cache_however_it_ends() {
        let credentials = Credentials::default();
        let token = digest("revoked-but-the-answer-was-lost");
        let entry = Cached {
            principal: Some(Arc::new(Principal::Admin)),
            fetched_at: Timestamp::from_unix_milliseconds(0),
        };
        credentials.remember(token, entry, credentials.generation());
        let failed_revocation = || -> Result<(), EngineError> {
            let _forget = credentials.forget_all_when_done();
            Err(EngineError::Unavailable(
                "the commit's answer was lost".into(),
            ))
        };
        assert!(failed_revocation().is_err());
        assert!(
            credentials
                .cached(&token, Timestamp::from_unix_milliseconds(1), 2_000)
                .is_none()
        );
    }

    #[test]
    fn digests_compare_only_when_equal() {
        assert!(domain::constant_time_equal(&digest("a"), &digest("a")));
        assert!(!domain::constant_time_equal(&digest("a"), &digest("b")));
    }
}
