//! Errors of the era metadata layer: the metadata layers' shared type.

pub use crate::pdata::error::MetadataError as EraError;

pub type Result<T> = std::result::Result<T, EraError>;
