//! dm-thin metadata (kernel on-disk format) and its tools.
pub mod check;
pub mod delta;
pub mod dump;
pub mod error;
pub mod ir;
pub mod ls;
pub mod map_cache;
pub mod metadata;
pub mod online;
pub mod progress;
pub mod repair;
pub mod restore;
pub mod rmap;
pub mod runs;
pub mod superblock;
pub mod trim;
pub mod xml;

pub use error::{Result, ThinError};
pub use metadata::{FormatOptions, Mapping, ThinPoolMetadata};
pub use superblock::DeviceDetails;
