//! Targets: each owns its table arguments, status line, messages and map
//! function, and declares its [`TargetType`] once; [`types`] lists them for the
//! registry. The interface they implement is `crate::mapper`'s.

pub mod delay;
pub mod flakey;
pub mod linear;
pub mod snapshot;
pub mod striped;
pub mod thin;
pub mod writecache;
pub mod xor;
pub mod zero;

use crate::mapper::TargetType;

/// Every target type this build knows, in the order `dmsetup targets` lists them.
pub fn types() -> &'static [TargetType] {
    const TYPES: &[TargetType] = &[
        striped::TYPE,
        linear::TYPE,
        crate::mapper::error::TYPE,
        zero::TYPE,
        flakey::TYPE,
        delay::TYPE,
        thin::pool::TYPE,
        thin::device::TYPE,
        snapshot::ORIGIN_TYPE,
        snapshot::SNAPSHOT_TYPE,
        snapshot::MERGE_TYPE,
        writecache::TYPE,
        xor::TYPE,
    ];
    TYPES
}
