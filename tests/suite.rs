//! The integration tests, one crate: each file under `tests/` is a module of
//! it (`tests/sim.rs` is `sim`, so `cargo nextest run --release -E 'test(/^sim::/)'`
//! runs its tests), built and linked once instead of once a file. `thin_bench.rs`,
//! a benchmark `bench/thin_meta.py` runs by its own binary, stays a target of its own.

mod common;
mod oracle;
mod thin_util;

mod cache;
mod cache_oracle;
mod cache_tools;
mod cli_format;
mod clients;
mod crypt;
mod crypt_oracle;
mod dm_compat;
mod dm_versions;
mod dmsetup_door;
mod door_trust;
mod engine;
mod era;
mod era_oracle;
mod exclusive;
mod first_hour;
mod integrity;
mod integrity_guest;
mod kernel_nbd;
mod lifecycle;
mod log_writes;
mod luks;
mod lvm_door;
mod lvm_guest;
mod lvmd;
mod lying_metadata;
mod nbd_protocol;
mod nbd_scale;
mod nbd_tls;
mod owned_buffers;
mod raid;
mod raid_guest;
mod raid_levels;
mod rbd;
mod readme;
mod restore;
mod sim;
mod snapshot;
mod snapshot_fs;
mod snapshot_oracle;
mod thin_api;
mod thin_cbt;
mod thin_corruption;
mod thin_crash;
mod thin_fs_crash;
mod thin_grow;
mod thin_oracle;
mod thin_props;
mod thin_restore;
mod thin_targets;
mod thin_tools;
mod ublk;
mod verity;
mod verity_fec;
mod verity_oracle;
mod verity_table;
mod vhost_user;
mod writecache;
mod writecache_oracle;
