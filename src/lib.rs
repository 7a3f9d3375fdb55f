//! dmkit: Linux device-mapper in userspace (its tables, on-disk formats and dm ioctl
//! interface), served over NBD and as ublk block devices. The module map is in
//! docs/design/how-it-is-built.md; how to write a target, in docs/targets.md.
pub mod cache;
pub mod client;
pub mod control;
pub mod copier;
pub mod daemon;
pub mod era;
pub mod export;
pub mod extents;
pub mod gf256;
pub mod io;
pub mod layout;
pub mod lograte;
pub mod lvmd;
pub mod mapper;
pub mod panics;
pub mod pdata;
pub mod rng;
pub mod sim;
pub mod sync;
pub mod table;
pub mod targets;
pub mod thin;
