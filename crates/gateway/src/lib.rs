//! The payment gateway protocol stockd speaks — a documented subset of Stripe's
//! PaymentIntents API (see `docs/PAYMENTS.md`) — and the HTTP client that speaks it.
//! The sandbox (`sandbox` crate) serves the same subset.

pub mod client;
pub mod protocol;
pub mod signature;

pub use client::{
    CallOutcome, GatewayClient, GatewayConfig, SANDBOX_API_KEY, install_crypto_provider,
};
pub use protocol::{CreatePaymentIntent, Event, PaymentIntent, PaymentIntentStatus, Refund};
