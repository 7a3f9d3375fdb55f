//! dm-cache metadata (the kernel's on-disk format, versions 1 and 2) and the
//! cache tools: check, dump, restore, repair, metadata_size and writeback, as
//! thin-provisioning-tools 1.x has them. The `cache` target builds on
//! [`metadata::CacheMetadata`].
pub mod error;
pub mod metadata;
pub mod superblock;
pub mod tools;
pub mod xml;

pub use error::{CacheError, Result};
pub use metadata::CacheMetadata;
