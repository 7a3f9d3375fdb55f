//! Errors of the cache metadata layer: the metadata layers' shared type.

pub use crate::pdata::error::MetadataError as CacheError;

pub type Result<T> = std::result::Result<T, CacheError>;
