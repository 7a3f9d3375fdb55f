//! Exports: how clients reach mapped devices.
pub mod nbd;
pub mod ublk;
