//! Who calls, and what each caller may do (the trust model of DESIGN.md, principle 11).
//!
//! Every call is made by a [`Principal`]: the admin (every shop), an operator (the staff
//! of one shop) or a service key (one shop's checkout backend). What a role may do is
//! one table, [`PERMISSIONS`]; where it may do it is its shop. [`authorize`] answers
//! both at once, so no use case decides permissions with an `if` of its own.

use std::fmt;

use crate::code::{OperatorId, ShopCode};
use crate::id::ServiceKeyId;

/// The three kinds of caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Holder of the admin token: everything, in every shop.
    Admin,
    /// Staff of one shop: catalog, shelf, stock, returns, views; never deletes.
    Operator,
    /// One shop's checkout backend: reservations, orders, payments, carts.
    Service,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Operator => "operator",
            Role::Service => "service",
        }
    }
}

/// What a call does, as far as permission goes. Each route maps to one action.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Create, list or revoke operators and service keys.
    ManageCredentials,
    /// Delete a product or SKU (soft, terminal).
    DeleteCatalog,
    /// Create or change products and SKUs.
    EditCatalog,
    /// Put SKUs on or off the shelf, now or on a schedule.
    ChangeShelf,
    /// Receive or adjust stock.
    MoveStock,
    /// Take an after-sale return back into stock.
    ReturnGoods,
    /// Cancel an order that was paid (a refund follows): a staff decision.
    CancelPaidOrder,
    /// Decide what becomes of a refund the gateway refused: a staff decision.
    ResolveRefund,
    /// The staff views: a product with versions and stock, the shelf log.
    ViewStaffData,
    /// Run the audit and read the metrics.
    Audit,
    /// Read a SKU's counters.
    ViewStock,
    /// Read an order.
    ViewOrders,
    /// Create, read, confirm or release a reservation.
    Reserve,
    /// Create an order, pay it, cancel it while unpaid.
    PlaceOrder,
    /// Read and change carts, check them out.
    UseCarts,
    /// Read the shop's events (the pull feed).
    ReadEvents,
    /// Read who this credential is (its role and shop): every credential may.
    Identify,
}

impl Action {
    pub fn describe(self) -> &'static str {
        match self {
            Action::ManageCredentials => "manage credentials",
            Action::DeleteCatalog => "delete catalog entries",
            Action::EditCatalog => "edit the catalog",
            Action::ChangeShelf => "change sale status",
            Action::MoveStock => "move stock",
            Action::ReturnGoods => "take returns",
            Action::CancelPaidOrder => "cancel a paid order",
            Action::ResolveRefund => "resolve a refused refund",
            Action::ViewStaffData => "read staff views",
            Action::Audit => "run the audit",
            Action::ViewStock => "read stock",
            Action::ViewOrders => "read orders",
            Action::Reserve => "reserve stock",
            Action::PlaceOrder => "place and pay orders",
            Action::UseCarts => "use carts",
            Action::ReadEvents => "read events",
            Action::Identify => "read who it is",
        }
    }
}

/// Which roles may take each action. The admin may take every one; the table lists
/// the others. Anything not listed is refused.
pub const PERMISSIONS: [(Action, &[Role]); 17] = [
    (Action::ManageCredentials, &[Role::Admin]),
    (Action::DeleteCatalog, &[Role::Admin]),
    (Action::EditCatalog, &[Role::Admin, Role::Operator]),
    (Action::ChangeShelf, &[Role::Admin, Role::Operator]),
    (Action::MoveStock, &[Role::Admin, Role::Operator]),
    (Action::ReturnGoods, &[Role::Admin, Role::Operator]),
    (Action::CancelPaidOrder, &[Role::Admin, Role::Operator]),
    (Action::ResolveRefund, &[Role::Admin, Role::Operator]),
    (Action::ViewStaffData, &[Role::Admin, Role::Operator]),
    (Action::Audit, &[Role::Admin, Role::Operator]),
    (
        Action::ViewStock,
        &[Role::Admin, Role::Operator, Role::Service],
    ),
    (
        Action::ViewOrders,
        &[Role::Admin, Role::Operator, Role::Service],
    ),
    (Action::Reserve, &[Role::Admin, Role::Service]),
    (Action::PlaceOrder, &[Role::Admin, Role::Service]),
    (Action::UseCarts, &[Role::Admin, Role::Service]),
    (
        Action::ReadEvents,
        &[Role::Admin, Role::Operator, Role::Service],
    ),
    (
        Action::Identify,
        &[Role::Admin, Role::Operator, Role::Service],
    ),
];

/// Whether `role` may take `action` at all (in its own shop).
pub fn role_may(role: Role, action: Action) -> bool {
    PERMISSIONS
        .iter()
        .any(|(listed, roles)| *listed == action && roles.contains(&role))
}

/// A caller, authenticated.
#[derive(Clone, PartialEq, Eq, Hash)]
pub enum Principal {
    Admin,
    Operator { id: OperatorId, shop: ShopCode },
    Service { key: ServiceKeyId, shop: ShopCode },
}

/// How the scope of a shop's queue intake begins (`intake:<shop>`).
pub const QUEUE_INTAKE_SCOPE_PREFIX: &str = "intake:";

impl fmt::Debug for Principal {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.scope())
    }
}

impl Principal {
    pub fn role(&self) -> Role {
        match self {
            Principal::Admin => Role::Admin,
            Principal::Operator { .. } => Role::Operator,
            Principal::Service { .. } => Role::Service,
        }
    }

    /// The shop a principal is confined to; `None` for the admin (every shop).
    pub fn shop(&self) -> Option<&ShopCode> {
        match self {
            Principal::Admin => None,
            Principal::Operator { shop, .. } | Principal::Service { shop, .. } => Some(shop),
        }
    }

    /// Whether this principal may act on things of `shop`.
    pub fn may_touch(&self, shop: &ShopCode) -> bool {
        self.shop().is_none_or(|own| own == shop)
    }

    /// The namespace of this principal's idempotency keys and its name in logs:
    /// `admin`, `operator:<id>`, `service:<key id>`, and `intake:<shop>` for a shop's
    /// queue intake (one id serves every shop's intake, and two shops never share a key
    /// space). Never contains a space, so `"<scope> <key>"` is unambiguous.
    pub fn scope(&self) -> String {
        let mut scope = String::new();
        self.write_scope(&mut scope);
        scope
    }

    /// Appends [`Principal::scope`] to `out`.
    pub fn write_scope(&self, out: &mut String) {
        let (kind, name) = match self {
            Principal::Admin => ("admin", ""),
            Principal::Operator { id, .. } => ("operator:", id.as_str()),
            Principal::Service { key, shop } if key.is_queue_intake() => {
                (QUEUE_INTAKE_SCOPE_PREFIX, shop.as_str())
            }
            Principal::Service { key, .. } => ("service:", key.as_str()),
        };
        out.push_str(kind);
        out.push_str(name);
    }
}

/// Why a call was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denied(pub String);

impl fmt::Display for Denied {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.0)
    }
}

/// May `principal` take `action` on something of `shop` (`None`: something of no
/// particular shop, such as a credential, or a list the caller's shop filters)?
pub fn authorize(
    principal: &Principal,
    action: Action,
    shop: Option<&ShopCode>,
) -> Result<(), Denied> {
    let role = principal.role();
    if role != Role::Admin && !role_may(role, action) {
        return Err(Denied(format!(
            "a {} credential may not {}",
            role.as_str(),
            action.describe()
        )));
    }
    if let Some(shop) = shop
        && !principal.may_touch(shop)
    {
        let own = principal.shop().unwrap_or(shop);
        return Err(Denied(outside_own_shop(own)));
    }
    Ok(())
}

/// The refusal of a credential of shop `own` reaching outside it. It names the
/// caller's own shop, never the other: a SKU, schedule or campaign of another shop
/// would otherwise tell a caller which shop holds it.
pub fn outside_own_shop(own: &ShopCode) -> String {
    format!("this credential acts only within its own shop ('{own}')")
}

/// Names an operator may not take: stockd writes them into the shelf log itself.
pub const RESERVED_OPERATOR_IDS: [&str; 3] = ["admin", "scheduler", "system"];

#[cfg(test)]
mod tests {
    use super::*;

    fn shop(code: &str) -> ShopCode {
        ShopCode::parse(code).unwrap()
    }

    fn operator(of: &str) -> Principal {
        Principal::Operator {
            id: OperatorId::parse("alice").unwrap(),
            shop: shop(of),
        }
    }

    fn service(of: &str) -> Principal {
        Principal::Service {
            key: ServiceKeyId::parse("key_0192f3a4b5c6d7e8f9a0b1c2d3e4").unwrap(),
            shop: shop(of),
        }
    }

    #[test]
    fn the_admin_may_do_everything_in_every_shop() {
        for (action, _) in PERMISSIONS {
            assert!(authorize(&Principal::Admin, action, Some(&shop("north"))).is_ok());
            assert!(authorize(&Principal::Admin, action, None).is_ok());
        }
    }

    #[test]
    fn an_operator_runs_its_shop_but_never_deletes_or_sells() {
        let alice = operator("north");
        for allowed in [
            Action::EditCatalog,
            Action::ChangeShelf,
            Action::MoveStock,
            Action::ReturnGoods,
            Action::CancelPaidOrder,
            Action::ResolveRefund,
            Action::Audit,
            Action::ViewOrders,
        ] {
            assert!(authorize(&alice, allowed, Some(&shop("north"))).is_ok());
            assert!(authorize(&alice, allowed, Some(&shop("south"))).is_err());
        }
        for refused in [
            Action::DeleteCatalog,
            Action::ManageCredentials,
            Action::Reserve,
            Action::PlaceOrder,
            Action::UseCarts,
        ] {
            assert!(authorize(&alice, refused, Some(&shop("north"))).is_err());
        }
    }

    #[test]
    fn a_service_key_sells_in_its_shop_and_touches_nothing_of_the_catalog() {
        let checkout = service("north");
        for allowed in [
            Action::Reserve,
            Action::PlaceOrder,
            Action::UseCarts,
            Action::ViewStock,
        ] {
            assert!(authorize(&checkout, allowed, Some(&shop("north"))).is_ok());
            assert!(authorize(&checkout, allowed, Some(&shop("south"))).is_err());
        }
        for refused in [
            Action::EditCatalog,
            Action::ChangeShelf,
            Action::MoveStock,
            Action::ReturnGoods,
            Action::CancelPaidOrder,
            Action::ResolveRefund,
            Action::Audit,
            Action::ManageCredentials,
        ] {
            assert!(authorize(&checkout, refused, Some(&shop("north"))).is_err());
        }
    }

    #[test]
    fn idempotency_scopes_differ_between_principals_and_hold_no_space() {
        let scopes = [
            Principal::Admin.scope(),
            operator("north").scope(),
            service("north").scope(),
        ];
        assert_eq!(scopes[0], "admin");
        assert_eq!(scopes[1], "operator:alice");
        assert!(scopes[2].starts_with("service:key_"));
        assert!(scopes.iter().all(|scope| !scope.contains(' ')));
    }

    #[test]
    fn each_shops_queue_intake_has_a_key_space_of_its_own() {
        let intake_of = |name| Principal::Service {
            key: ServiceKeyId::queue_intake(),
            shop: shop(name),
        };

        assert_eq!(intake_of("north").scope(), "intake:north");
        assert_eq!(intake_of("south").scope(), "intake:south");
        assert_eq!(
            service("north").scope(),
            "service:key_0192f3a4b5c6d7e8f9a0b1c2d3e4",
            "a minted key keeps its own"
        );
    }
}
