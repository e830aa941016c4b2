//! One module per database stockd speaks. Each implements the traits of
//! `crate::backend` for its sqlx types, and holds everything that differs between
//! databases: connecting, beginning transactions, the statements whose text differs,
//! row locks, how a reservation batch's rows travel, and its migrations' list.

pub mod mysql;
pub mod postgres;
pub(crate) mod replicas;
pub mod sqlite;
