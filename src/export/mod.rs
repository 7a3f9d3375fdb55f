//! Exports: how clients reach mapped devices.
pub mod files;
pub mod nbd;
pub mod ublk;
pub mod vhost;
