//! Every bound stockd enforces, in one place. Units come last in each name.

/// Largest quantity one reservation line or one stock movement may carry.
pub const QUANTITY_MAX: i64 = 1_000_000;

/// Largest counter value a stock row may reach (available + reserved), so sums over a
/// batch of movements can never overflow an `i64`.
pub const STOCK_ON_HAND_MAX: i64 = 1_000_000_000_000;

/// Most lines one reservation may hold.
pub const RESERVATION_LINES_MAX: usize = 50;

/// Shortest and longest reservation hold a caller may ask for.
pub const RESERVATION_TTL_SECONDS_MIN: i64 = 1;
pub const RESERVATION_TTL_SECONDS_MAX: i64 = 86_400;
/// Hold used when a request names no `ttl_seconds`.
pub const RESERVATION_TTL_SECONDS_DEFAULT: i64 = 900;

/// Length bounds of codes and keys (in bytes, ASCII only).
pub const SKU_CODE_LENGTH_MAX: usize = 64;
pub const WAREHOUSE_CODE_LENGTH_MAX: usize = 32;
pub const IDEMPOTENCY_KEY_LENGTH_MAX: usize = 255;
pub const TITLE_LENGTH_MAX: usize = 200;

/// Largest price in minor units (ten billion major units of a two-decimal currency).
pub const PRICE_MINOR_MAX: i64 = 1_000_000_000_000;

/// Largest low-stock threshold a SKU may carry.
pub const LOW_STOCK_THRESHOLD_MAX: i64 = QUANTITY_MAX;

/// Largest request body the HTTP layer reads.
pub const REQUEST_BODY_BYTES_MAX: usize = 64 * 1024;

/// Shop, category, supplier, operator and user codes.
pub const CATALOG_CODE_LENGTH_MAX: usize = 64;
/// Longest order number a shop may give (`order_ref`).
pub const ORDER_REF_LENGTH_MAX: usize = 64;
/// Longest channel name (`source`).
pub const REQUEST_SOURCE_LENGTH_MAX: usize = 32;
pub const IMAGE_URL_LENGTH_MAX: usize = 2048;
/// A product's SKUs, and the targets one shelf operation may resolve to.
pub const PRODUCT_SKUS_MAX: usize = 100;
pub const SHELF_TARGETS_MAX: usize = 1000;
/// Lines in one cart.
pub const CART_LINES_MAX: usize = 100;
/// A SKU's spec (`250ml x 24`).
pub const SPEC_LENGTH_MAX: usize = 200;
/// Shelf-log entries per page.
pub const SHELF_LOG_PAGE_SIZE_MAX: i64 = 500;
/// How far ahead a shelf change may be scheduled (one year).
pub const SCHEDULE_HORIZON_SECONDS_MAX: i64 = 366 * 86_400;
/// How far ahead a campaign may end (one year): its units leave regular stock at its
/// creation and come back at its end, so a mistyped year would hold them for ever.
pub const CAMPAIGN_HORIZON_SECONDS_MAX: i64 = 366 * 86_400;
/// Campaigns one shop may have open at once (not closed: scheduled, running, or ended
/// with a unit still held): each has a waiting room of its own in every process, and
/// every process reads them all again each second.
pub const CAMPAIGNS_OPEN_PER_SHOP_MAX: i64 = 1_000;
/// Schedules one shop may have pending at once: each is a row the schedule worker
/// scans and a change that fires unattended.
pub const SCHEDULES_PENDING_PER_SHOP_MAX: i64 = 10_000;
/// Remarks in the shelf log.
pub const REMARK_LENGTH_MAX: usize = 500;
/// Characters of a reason stockd records (an order's status change, a payment's or a
/// refund's failure): the gateway's words are part of some, and a gateway may say a
/// lot. MySQL's columns hold 1,000; a longer reason is cut, with a mark.
pub const REASON_LENGTH_MAX: usize = 900;

/// `text` cut to [`REASON_LENGTH_MAX`] characters, ending with `…` when it was cut.
pub fn bounded_reason(text: &str) -> std::borrow::Cow<'_, str> {
    match text.char_indices().nth(REASON_LENGTH_MAX) {
        None => std::borrow::Cow::Borrowed(text),
        Some((end, _)) => std::borrow::Cow::Owned(format!("{}…", &text[..end])),
    }
}

/// Open holds one shopper may have at once, by default (`STOCKD_USER_OPEN_HOLDS_MAX`).
pub const USER_OPEN_HOLDS_MAX_DEFAULT: i64 = 20;
/// The largest per-user limit a SKU may carry.
pub const PER_USER_LIMIT_MAX: i64 = QUANTITY_MAX;
/// Service keys' names.
pub const SERVICE_KEY_NAME_LENGTH_MAX: usize = 64;
/// Credentials of any kind that one listing returns at most.
pub const SERVICE_KEYS_LISTED_MAX: i64 = 1000;
/// Service keys one shop may have unrevoked at once: a listing shows active keys
/// first, so every shop's can be seen (and revoked) however many were revoked.
pub const SERVICE_KEYS_ACTIVE_PER_SHOP_MAX: i64 = 100;
/// Longest bearer token stockd reads (every token it issues is shorter).
pub const BEARER_TOKEN_LENGTH_MAX: usize = 128;
/// Most products, schedules or orders one page of a staff list shows.
pub const LIST_PAGE_SIZE_MAX: i64 = 200;
/// Entries of a staff list page when the caller names no `limit`.
pub const LIST_PAGE_SIZE_DEFAULT: i64 = 50;
/// Payment attempts one order takes. A declined order may be paid again with another
/// card while its hold lasts, but each attempt adds rows every view of the order
/// renders, and a card tried again and again is what card testing looks like.
pub const PAYMENT_ATTEMPTS_PER_ORDER_MAX: i64 = 10;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reason_within_the_bound_is_kept_and_a_longer_one_is_cut_on_a_character_with_a_mark() {
        let short = "card declined";
        assert_eq!(bounded_reason(short), short);
        let exact = "é".repeat(REASON_LENGTH_MAX);
        assert_eq!(bounded_reason(&exact), exact);
        let long = "é".repeat(REASON_LENGTH_MAX + 300);
        let cut = bounded_reason(&long);
        assert_eq!(cut.chars().count(), REASON_LENGTH_MAX + 1);
        assert!(cut.ends_with("é…"), "{cut}");
    }
}
