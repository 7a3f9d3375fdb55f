//! dm-era metadata (the kernel's on-disk format) and the era tools: check,
//! dump, restore and invalidate, as thin-provisioning-tools 1.x has them.
pub mod error;
pub mod metadata;
pub mod superblock;
pub mod tools;
pub mod xml;

pub use error::{EraError, Result};
pub use metadata::EraMetadata;
