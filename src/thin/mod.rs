//! dm-thin metadata (kernel on-disk format) and its tools.
pub mod cli;
pub mod error;
pub mod metadata;
pub mod superblock;
pub mod xml;
pub mod check;
pub mod dump;
pub mod restore;

pub use error::{Result, ThinError};
pub use metadata::{FormatOptions, Mapping, ThinPoolMetadata};
pub use superblock::DeviceDetails;
