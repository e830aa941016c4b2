//! Flash-sale campaigns (issue 19): carving a campaign's units out of a SKU's stock into
//! its buckets, reading where its units are, and the worker's step that returns what is
//! left at its end. See `domain::campaign` for why buckets are stock rows.
//!
//! Written once for every backend: generic over `crate::backend::Backend` (or the
//! `Dialect` of its connection), with no SQL text that differs per database.

use super::Units;
use super::decode::{expect_one_row, invariant, parse_stored};
use super::idempotency::{claim_or_answer, commit_with_answer};
use super::outbox::{NewEvent, Sequence, append_event};
use super::stock::{LedgerEntry, STOCK_ON_HAND_MAX, insert_ledger_row};
use crate::backend::{Backend, Dialect, Finish};
use crate::catalog::{Campaign, EndStep, NewCampaign};
use crate::error::StoreError;
use crate::model::{IdempotencyClaim, Idempotent, Rejection, ResponseRenderer};
use crate::sql::{Row, statement};
use domain::campaign::{bucket_of, is_bucket_warehouse, split};
use domain::{
    CampaignCode, CampaignId, ErrorCode, EventType, SaleStatus, ShopCode, SkuCode, Timestamp,
    WarehouseCode,
};
use serde_json::json;

/// A movement of units between a regular stock row and a bucket, or the reverse: the
/// counters, its ledger row (an `adjust` referencing the campaign) and its event.
struct Transfer<'a> {
    sku: &'a SkuCode,
    warehouse: &'a WarehouseCode,
    delta: i64,
    campaign: &'a CampaignId,
    shop: &'a str,
}

async fn apply_transfer<C: Dialect>(
    transaction: &mut C,
    transfer: Transfer<'_>,
    now: Timestamp,
) -> Result<Option<(i64, i64)>, StoreError> {
    let counters = if transfer.delta > 0 {
        transaction
            .receive_stock(
                transfer.sku.as_str(),
                transfer.warehouse.as_str(),
                transfer.delta,
                now,
                STOCK_ON_HAND_MAX,
            )
            .await?
    } else {
        transaction
            .adjust_stock(
                transfer.sku.as_str(),
                transfer.warehouse.as_str(),
                transfer.delta,
                now,
            )
            .await?
    };
    let Some((available, reserved)) = counters else {
        return Ok(None);
    };
    insert_ledger_row(
        transaction,
        LedgerEntry {
            sku: transfer.sku,
            warehouse: transfer.warehouse,
            kind: "adjust",
            available_delta: transfer.delta,
            reserved_delta: 0,
            reference: transfer.campaign.as_str(),
            idempotency_key: None,
        },
        now,
    )
    .await?;
    append_event(
        transaction,
        NewEvent {
            event_type: EventType::StockMoved,
            aggregate_id: transfer.sku.as_str(),
            shop: transfer.shop,
            sequence: Sequence::Counted,
            data: json!({
                "campaign_id": transfer.campaign.as_str(),
                "sku": transfer.sku.as_str(),
                "shop": transfer.shop,
                "warehouse": transfer.warehouse.as_str(),
                "kind": "campaign",
                "available_delta": transfer.delta,
                "available": available,
                "reserved": reserved,
            }),
        },
        now,
    )
    .await?;
    Ok(Some((available, reserved)))
}

fn decode_campaign(row: &Row) -> Result<Campaign, StoreError> {
    let id: String = row.try_get("id")?;
    let shop: String = row.try_get("shop")?;
    let sku: String = row.try_get("sku")?;
    let warehouse: String = row.try_get("warehouse")?;
    let buckets: i64 = row.try_get("buckets")?;
    let ended_at: Option<i64> = row.try_get("ended_at")?;
    let closed_at: Option<i64> = row.try_get("closed_at")?;
    let id = parse_stored("campaign id", &id, CampaignId::parse)?;
    Ok(Campaign {
        code: CampaignCode::of(&id),
        id,
        shop: parse_stored("shop", &shop, ShopCode::parse)?,
        sku: parse_stored("sku code", &sku, SkuCode::parse)?,
        warehouse: parse_stored("warehouse", &warehouse, WarehouseCode::parse)?,
        quantity: row.try_get("quantity")?,
        buckets: u32::try_from(buckets).map_err(|_| invariant("a campaign's bucket count"))?,
        per_user_limit: row.try_get("per_user_limit")?,
        starts_at: Timestamp::from_unix_milliseconds(row.try_get("starts_at")?),
        ends_at: Timestamp::from_unix_milliseconds(row.try_get("ends_at")?),
        created_at: Timestamp::from_unix_milliseconds(row.try_get("created_at")?),
        ended_at: ended_at.map(Timestamp::from_unix_milliseconds),
        closed_at: closed_at.map(Timestamp::from_unix_milliseconds),
        left: 0,
        held: 0,
        returned: row.try_get("returned")?,
        bucket_counts: Vec::new(),
    })
}

/// The campaign with its buckets' counters.
async fn load_campaign<C: Dialect>(
    connection: &mut C,
    id: &CampaignId,
) -> Result<Option<Campaign>, StoreError> {
    let Some(row) = statement(
        "SELECT id, code, shop, sku, warehouse, quantity, buckets, per_user_limit, \
         starts_at, ends_at, returned, ended_at, closed_at, created_at FROM campaign WHERE id = $1",
    )
    .bind(id.as_str())
    .fetch_optional_row(&mut *connection)
    .await?
    else {
        return Ok(None);
    };
    let mut campaign = decode_campaign(&row)?;
    with_bucket_counts(connection, &mut campaign).await?;
    Ok(Some(campaign))
}

async fn with_bucket_counts<C: Dialect>(
    connection: &mut C,
    campaign: &mut Campaign,
) -> Result<(), StoreError> {
    let mut counts = Vec::with_capacity(campaign.buckets as usize);
    for bucket in 0..campaign.buckets {
        let row =
            statement("SELECT available, reserved FROM stock WHERE sku = $1 AND warehouse = $2")
                .bind(campaign.sku.as_str())
                .bind(campaign.code.bucket_warehouse(bucket).as_str())
                .fetch_optional_row(&mut *connection)
                .await?;
        let pair = match row {
            Some(row) => (row.try_get("available")?, row.try_get("reserved")?),
            None => (0, 0),
        };
        counts.push(pair);
    }
    campaign.left = counts.iter().map(|(available, _)| available).sum();
    campaign.held = counts.iter().map(|(_, reserved)| reserved).sum();
    campaign.bucket_counts = counts;
    Ok(())
}

impl<B: Backend> Units<B> {
    /// Creates a campaign: its units leave the SKU's row in `warehouse` and are split
    /// over its buckets, each move ledgered under the campaign's id, with the campaign
    /// row, in one transaction. Refused (and stored) when the row has too few units
    /// available (`insufficient_stock`) or the SKU has an open campaign
    /// (`failed_precondition`).
    pub async fn create_campaign(
        &self,
        claim: &IdempotencyClaim,
        campaign: &NewCampaign,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        let response = match carve(&mut *transaction, campaign, now).await? {
            Ok(()) => {
                let created = load_campaign(&mut *transaction, &campaign.id)
                    .await?
                    .ok_or_else(|| invariant("a campaign vanished inside its own transaction"))?;
                renderer.campaign_created(&created)
            }
            Err(rejection) => renderer.rejected(&rejection),
        };
        commit_with_answer(transaction, claim, response).await
    }

    /// A person's end of a campaign before its time: its end moves to `ends_at` (the
    /// caller's clock held back, as the end step judges an end), and a campaign not
    /// started yet starts just before it, so it never runs. The end step then gives
    /// what is left back, as at any end. Refused (and stored) when the campaign has
    /// ended already (`illegal_transition`) or does not exist (`not_found`).
    pub async fn end_campaign_early(
        &self,
        claim: &IdempotencyClaim,
        id: &CampaignId,
        ends_at: Timestamp,
        now: Timestamp,
        renderer: &dyn ResponseRenderer,
    ) -> Result<Idempotent, StoreError> {
        let mut transaction = self.begin_write().await?;
        if let Some(answer) = claim_or_answer(&mut *transaction, claim, now).await? {
            transaction.rollback().await?;
            return Ok(answer);
        }
        // One conditional write: of two ends at once, the second finds it ended.
        let moved = statement(
            "UPDATE campaign SET ends_at = $2, \
             starts_at = CASE WHEN starts_at < $2 THEN starts_at ELSE $2 - 1 END \
             WHERE id = $1 AND ends_at > $2 AND closed_at IS NULL",
        )
        .bind(id.as_str())
        .bind(ends_at.unix_milliseconds())
        .execute(&mut *transaction)
        .await?;
        let campaign = load_campaign(&mut *transaction, id).await?;
        let response = match campaign {
            None => renderer.rejected(&Rejection::new(
                ErrorCode::NotFound,
                format!("campaign '{id}' does not exist"),
            )),
            Some(campaign) if moved == 0 => renderer.rejected(&Rejection::new(
                ErrorCode::IllegalTransition,
                format!("campaign '{id}' ended at {}", campaign.ends_at),
            )),
            Some(campaign) => {
                expect_one_row(moved, "ending a campaign early")?;
                renderer.campaign_ended_early(&campaign)
            }
        };
        commit_with_answer(transaction, claim, response).await
    }

    /// A campaign with its buckets' counters, read on the writer in one snapshot: its
    /// `sold` is what the row's `returned` and the buckets' counters leave, and read
    /// at two moments (an end step committing between them) it counted the units
    /// going back as sold.
    pub async fn campaign(&self, id: &CampaignId) -> Result<Option<Campaign>, StoreError> {
        let mut transaction = self.begin_snapshot().await?;
        let campaign = load_campaign(&mut *transaction, id).await;
        transaction.rollback().await?;
        campaign
    }

    /// The campaigns not closed yet (scheduled, running, or ended with units still
    /// held), without their counters: what the engine routes by.
    pub async fn open_campaigns(&self) -> Result<Vec<Campaign>, StoreError> {
        let rows = statement(
            "SELECT id, code, shop, sku, warehouse, quantity, buckets, per_user_limit, \
             starts_at, ends_at, returned, ended_at, closed_at, created_at FROM campaign \
             WHERE closed_at IS NULL ORDER BY id",
        )
        .fetch_all_rows(&mut *self.writer_read_connection().await?)
        .await?;
        rows.iter().map(decode_campaign).collect()
    }

    /// One step of the campaign worker: up to `limit` campaigns past their end and not
    /// closed, by id after `after`, give what their buckets have available back to
    /// their SKU's row (ledgered); one whose buckets hold nothing more is closed. Each
    /// campaign in a transaction of its own, its row locked first: two processes running
    /// the step move each unit once. The caller passes the last id of a full step as
    /// the next step's `after` (and `None` after a short one), so campaigns kept open by
    /// a unit still held cannot hold the ones after them back for good.
    pub async fn end_campaigns(
        &self,
        (now, ends_by): (Timestamp, Timestamp),
        limit: i64,
        after: Option<&CampaignId>,
    ) -> Result<EndStep, StoreError> {
        // Ended by `ends_by` (the caller's clock held back by how far it runs ahead of
        // the database's): a clock ahead must not end a sale early. Written at `now`.
        // A campaign whose SKU was deleted ends now, whenever its end was to be: the
        // SKU is never sold again, and its carved units would wait in the buckets,
        // where no movement reaches them, until then.
        let due: Vec<String> = statement(
            "SELECT id FROM campaign WHERE closed_at IS NULL \
             AND (ends_at <= $1 OR EXISTS (SELECT 1 FROM sku \
                 WHERE sku.code = campaign.sku AND sku.sale_status = 'DELETED')) \
             AND ($3 IS NULL OR id > $3) ORDER BY id LIMIT $2",
        )
        .bind(ends_by.unix_milliseconds())
        .bind(limit)
        .bind(after.map(CampaignId::as_str))
        .fetch_all_scalar(&mut *self.writer_read_connection().await?)
        .await?;
        let mut step = EndStep {
            closed: Vec::new(),
            units_returned: 0,
            last: None,
            full: i64::try_from(due.len()).unwrap_or(i64::MAX) >= limit,
            failed: Vec::new(),
        };
        for id in due {
            let id = parse_stored("campaign id", &id, CampaignId::parse)?;
            // Ended already and kept open only by units still held (an unpaid order's,
            // for up to a day): nothing to move until one comes back. Read without a
            // lock first, so such a campaign does not lock its buckets and its SKU's
            // row, where the SKU's sales go now, at every step of every instance. A
            // unit that comes back after this read is moved by the next step.
            let unlocked = load_campaign(&mut *self.writer_read_connection().await?, &id).await?;
            if unlocked.is_some_and(|campaign| {
                campaign.ended_at.is_some() && campaign.left == 0 && campaign.held > 0
            }) {
                step.last = Some(id);
                continue;
            }
            let mut transaction = self.begin_write().await?;
            let outcome = end_campaign(&mut *transaction, &id, now).await;
            match outcome {
                Ok((closed, returned)) => {
                    transaction.commit().await?;
                    step.units_returned += returned;
                    if closed {
                        step.closed.push(id.clone());
                    }
                }
                Err(error) => {
                    transaction.rollback().await?;
                    step.failed.push((id.clone(), error.to_string()));
                }
            }
            step.last = Some(id);
        }
        Ok(step)
    }
}

/// The carve: the SKU's row gives `quantity`, each bucket receives its share.
async fn carve<C: Dialect>(
    transaction: &mut C,
    campaign: &NewCampaign,
    now: Timestamp,
) -> Result<Result<(), Rejection>, StoreError> {
    // The shop first, then the SKU's stock rows (the order a shelf change takes them
    // in): two creations in one shop count its open campaigns one after the other, so
    // both cannot take the last place; two for one SKU look for an open campaign one
    // after the other, and the second finds the first's instead of breaking
    // `campaign_open_sku` (a 500).
    transaction.lock_shop(&campaign.shop).await?;
    transaction.lock_stock_of_skus(&[&campaign.sku]).await?;
    // A deleted SKU is never sold again (seed 003: 已删除状态禁止任何流转): its units
    // would sit in buckets nothing may draw from. Read after its stock rows' locks,
    // which a shelf change takes first.
    let status: Option<String> = statement("SELECT sale_status FROM sku WHERE code = $1")
        .bind(campaign.sku.as_str())
        .fetch_optional_scalar(&mut *transaction)
        .await?;
    if status.as_deref() == Some(SaleStatus::Deleted.as_str()) {
        return Ok(Err(Rejection::new(
            ErrorCode::IllegalTransition,
            format!(
                "sku '{}' is deleted: it cannot be sold in a campaign",
                campaign.sku
            ),
        )));
    }
    let open: Option<String> = statement("SELECT id FROM campaign WHERE open_sku = $1")
        .bind(campaign.sku.as_str())
        .fetch_optional_scalar(&mut *transaction)
        .await?;
    if let Some(open) = open {
        return Ok(Err(Rejection::new(
            ErrorCode::FailedPrecondition,
            format!(
                "sku '{}' already has campaign '{open}' open; one campaign per SKU at a time",
                campaign.sku
            ),
        )));
    }
    let open_in_shop: i64 =
        statement("SELECT COUNT(*) FROM campaign WHERE shop = $1 AND closed_at IS NULL")
            .bind(campaign.shop.as_str())
            .fetch_one_scalar(&mut *transaction)
            .await?;
    if open_in_shop >= campaign.open_in_shop_max {
        return Ok(Err(Rejection::new(
            ErrorCode::FailedPrecondition,
            format!(
                "shop '{}' has {open_in_shop} campaigns open; at most {} may be open at once (end one, or wait for one to close)",
                campaign.shop, campaign.open_in_shop_max
            ),
        )));
    }
    let taken = apply_transfer(
        transaction,
        Transfer {
            sku: &campaign.sku,
            warehouse: &campaign.warehouse,
            delta: -campaign.quantity,
            campaign: &campaign.id,
            shop: campaign.shop.as_str(),
        },
        now,
    )
    .await?;
    if taken.is_none() {
        return Ok(Err(Rejection::new(
            ErrorCode::InsufficientStock,
            format!(
                "sku '{}' in warehouse '{}' has fewer than {} units available",
                campaign.sku, campaign.warehouse, campaign.quantity
            ),
        )));
    }
    let code = CampaignCode::of(&campaign.id);
    for (bucket, share) in (0..campaign.buckets).zip(split(campaign.quantity, campaign.buckets)) {
        let warehouse = code.bucket_warehouse(bucket);
        apply_transfer(
            transaction,
            Transfer {
                sku: &campaign.sku,
                warehouse: &warehouse,
                delta: share,
                campaign: &campaign.id,
                shop: campaign.shop.as_str(),
            },
            now,
        )
        .await?
        .ok_or_else(|| invariant("a new bucket refused its units"))?;
    }
    // A campaign named no per-user limit: its SKU's, as it stands now, holds for its
    // units (a shop's "one per customer" is not lifted by a sale that forgot it).
    let inserted = statement(
        "INSERT INTO campaign (id, code, tally_sku, shop, sku, warehouse, quantity, buckets, \
         per_user_limit, starts_at, ends_at, returned, open_sku, created_at) \
         VALUES ($1, $2, $12, $3, $4, $5, $6, $7, \
         COALESCE($8, (SELECT per_user_limit FROM sku WHERE code = $4)), $9, $10, 0, $4, $11)",
    )
    .bind(campaign.id.as_str())
    .bind(code.as_str())
    .bind(campaign.shop.as_str())
    .bind(campaign.sku.as_str())
    .bind(campaign.warehouse.as_str())
    .bind(campaign.quantity)
    .bind(i64::from(campaign.buckets))
    .bind(campaign.per_user_limit)
    .bind(campaign.starts_at.unix_milliseconds())
    .bind(campaign.ends_at.unix_milliseconds())
    .bind(now.unix_milliseconds())
    .bind(code.tally_sku().as_str())
    .execute(&mut *transaction)
    .await?;
    expect_one_row(inserted, "inserting a campaign")?;
    Ok(Ok(()))
}

/// Returns what the buckets have available to the SKU's row; closes the campaign when
/// they hold nothing more. Answers whether it closed, and how many units went back.
async fn end_campaign<C: Dialect>(
    transaction: &mut C,
    id: &CampaignId,
    now: Timestamp,
) -> Result<(bool, i64), StoreError> {
    // The campaign's row first: a second worker waits here, then finds nothing to move.
    let locked = statement(
        "UPDATE campaign SET ended_at = COALESCE(ended_at, $2), open_sku = NULL \
         WHERE id = $1 AND closed_at IS NULL",
    )
    .bind(id.as_str())
    .bind(now.unix_milliseconds())
    .execute(&mut *transaction)
    .await?;
    if locked != 1 {
        return Ok((false, 0));
    }
    let Some(mut campaign) = load_campaign(transaction, id).await? else {
        return Err(invariant("a campaign vanished under its lock"));
    };
    // The stock rows in the global (sku, warehouse) order, as every writer takes them.
    let mut rows: Vec<(SkuCode, WarehouseCode)> = (0..campaign.buckets)
        .map(|bucket| (campaign.sku.clone(), campaign.code.bucket_warehouse(bucket)))
        .chain([(campaign.sku.clone(), campaign.warehouse.clone())])
        .collect();
    rows.sort();
    let (available, _) = transaction.lock_stock_rows(&rows).await?;
    // The counters again, under the rows' locks: a batch routed before the end may
    // have committed a hold while this step waited for them, and the campaign closes
    // only when nothing is held (READ COMMITTED reads the committed rows afresh).
    with_bucket_counts(transaction, &mut campaign).await?;
    let mut returned = 0;
    for (sku, warehouse) in &rows {
        if !is_bucket_warehouse(warehouse) {
            continue;
        }
        let left = available
            .get(&(sku.clone(), warehouse.clone()))
            .copied()
            .unwrap_or(0);
        if left == 0 {
            continue;
        }
        let shop = campaign.shop.as_str();
        apply_transfer(
            transaction,
            Transfer {
                sku,
                warehouse,
                delta: -left,
                campaign: id,
                shop,
            },
            now,
        )
        .await?
        .ok_or_else(|| invariant("a locked bucket refused to give its units back"))?;
        apply_transfer(
            transaction,
            Transfer {
                sku,
                warehouse: &campaign.warehouse,
                delta: left,
                campaign: id,
                shop,
            },
            now,
        )
        .await?
        .ok_or_else(|| invariant("a SKU's row refused its campaign's units back"))?;
        returned += left;
    }
    let closed = campaign.held == 0;
    let updated = statement(
        "UPDATE campaign SET returned = returned + $2, \
         closed_at = CASE WHEN $3 = 1 THEN $4 ELSE closed_at END WHERE id = $1",
    )
    .bind(id.as_str())
    .bind(returned)
    .bind(i64::from(closed))
    .bind(now.unix_milliseconds())
    .execute(&mut *transaction)
    .await?;
    expect_one_row(updated, "recording a campaign's return")?;
    Ok((closed, returned))
}

/// The units of `sku` a shopper's reservation could take at `now`
/// ([`domain::campaign::shopper_available`]), read inside `transaction`: a shelf
/// operation's result says what its commit leaves shoppers, with the stock rows locked.
pub(crate) async fn shopper_available<C: Dialect>(
    transaction: &mut C,
    sku: &SkuCode,
    now: Timestamp,
) -> Result<i64, StoreError> {
    let levels: Vec<(WarehouseCode, i64)> =
        statement("SELECT warehouse, available FROM stock WHERE sku = $1")
            .bind(sku.as_str())
            .fetch_all_rows(&mut *transaction)
            .await?
            .iter()
            .map(|row| {
                let warehouse: String = row.try_get("warehouse")?;
                Ok((
                    parse_stored("warehouse", &warehouse, WarehouseCode::parse)?,
                    row.try_get("available")?,
                ))
            })
            .collect::<Result<_, StoreError>>()?;
    let running = statement(
        "SELECT id, warehouse FROM campaign \
         WHERE open_sku = $1 AND starts_at <= $2 AND ends_at > $2",
    )
    .bind(sku.as_str())
    .bind(now.unix_milliseconds())
    .fetch_optional_row(&mut *transaction)
    .await?
    .map(|row| {
        let id: String = row.try_get("id")?;
        let warehouse: String = row.try_get("warehouse")?;
        Ok::<_, StoreError>((
            CampaignCode::of(&parse_stored("campaign id", &id, CampaignId::parse)?),
            parse_stored("warehouse", &warehouse, WarehouseCode::parse)?,
        ))
    })
    .transpose()?;
    Ok(domain::campaign::shopper_available(
        levels
            .iter()
            .map(|(warehouse, available)| (warehouse, *available)),
        running.as_ref().map(|(code, source)| (code, source)),
    ))
}

/// The source warehouse of the campaign whose bucket `warehouse` is (`None`: not a
/// bucket, or of no campaign of this SKU), open or closed: the row a return into the
/// bucket may pass its units on to.
pub(crate) async fn source_of_bucket<C: Dialect>(
    transaction: &mut C,
    sku: &SkuCode,
    warehouse: &WarehouseCode,
) -> Result<Option<WarehouseCode>, StoreError> {
    let Some((code, _)) = bucket_of(warehouse) else {
        return Ok(None);
    };
    let source: Option<String> =
        statement("SELECT warehouse FROM campaign WHERE code = $1 AND sku = $2")
            .bind(code.as_str())
            .bind(sku.as_str())
            .fetch_optional_scalar(&mut *transaction)
            .await?;
    source
        .map(|source| parse_stored("warehouse", &source, WarehouseCode::parse))
        .transpose()
}

/// After goods came back into `warehouse` (an after-sale return): when it is a bucket of
/// a campaign that has closed, nothing can sell or return those units any more, so they
/// go on to the campaign's source row, ledgered under the campaign and counted in its
/// `returned`, as the end step moves what is left. An open campaign keeps them: while
/// it runs they sell again, and its end step returns them with the rest.
///
/// Races with the end step are safe without locking the campaign: the caller updated
/// the bucket's row first and holds its lock, so an end step either closed before that
/// update (and this reads it closed) or waits for the lock and then counts these units
/// itself (it reads the bucket's counters under the lock).
pub(crate) async fn pass_on_to_a_closed_campaigns_source<C: Dialect>(
    transaction: &mut C,
    sku: &SkuCode,
    warehouse: &WarehouseCode,
    quantity: i64,
    now: Timestamp,
) -> Result<(), StoreError> {
    let Some((code, _)) = bucket_of(warehouse) else {
        return Ok(());
    };
    let Some(row) = statement(
        "SELECT id, shop, warehouse FROM campaign \
         WHERE code = $1 AND sku = $2 AND closed_at IS NOT NULL",
    )
    .bind(code.as_str())
    .bind(sku.as_str())
    .fetch_optional_row(&mut *transaction)
    .await?
    else {
        return Ok(());
    };
    let id: String = row.try_get("id")?;
    let shop: String = row.try_get("shop")?;
    let source: String = row.try_get("warehouse")?;
    let id = parse_stored("campaign id", &id, CampaignId::parse)?;
    let source = parse_stored("warehouse", &source, WarehouseCode::parse)?;
    for (warehouse, delta) in [(warehouse, -quantity), (&source, quantity)] {
        apply_transfer(
            transaction,
            Transfer {
                sku,
                warehouse,
                delta,
                campaign: &id,
                shop: &shop,
            },
            now,
        )
        .await?
        .ok_or_else(|| invariant("a closed campaign's row refused returned units"))?;
    }
    let updated = statement("UPDATE campaign SET returned = returned + $2 WHERE id = $1")
        .bind(id.as_str())
        .bind(quantity)
        .execute(&mut *transaction)
        .await?;
    expect_one_row(updated, "counting a closed campaign's returned units")
}
