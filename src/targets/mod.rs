//! Targets: each owns its table arguments, status line, messages and map
//! function, and declares its [`TargetType`] once; [`types`] lists them for the
//! registry. The interface they implement is `crate::mapper`'s.

use crate::mapper::TargetType;

/// Declares each target's module and lists its types for [`types`], one line a
/// module: `module => its TargetType constants;` (a line without a module lists
/// a type of the core's).
macro_rules! targets {
    ($($($module:ident)? => $($ty:path),+;)*) => {
        $($(pub mod $module;)?)*

        /// Every target type this build knows, in the order `dmsetup targets` lists them.
        pub fn types() -> &'static [TargetType] {
            const TYPES: &[TargetType] = &[$($($ty,)+)*];
            TYPES
        }
    };
}

targets! {
    striped => striped::TYPE;
    linear => linear::TYPE;
    => crate::mapper::error::TYPE;
    zero => zero::TYPE;
    flakey => flakey::TYPE;
    delay => delay::TYPE;
    thin => thin::pool::TYPE, thin::device::TYPE;
    snapshot => snapshot::ORIGIN_TYPE, snapshot::SNAPSHOT_TYPE, snapshot::MERGE_TYPE;
    writecache => writecache::TYPE;
    era => era::TYPE;
    cache => cache::TYPE;
    crypt => crypt::TYPE;
    verity => verity::TYPE;
    log_writes => log_writes::TYPE;
    raid => raid::TYPE;
    integrity => integrity::TYPE;
    xor => xor::TYPE;
}
