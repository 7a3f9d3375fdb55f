//! Errors of the cache metadata layer.

use crate::pdata::PdataError;

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error(transparent)]
    Pdata(#[from] PdataError),
    #[error("superblock: {0}")]
    BadSuperblock(String),
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// A message as the cache tools print it.
    #[error("{0}")]
    Plain(String),
    #[error("output error: {0}")]
    Output(std::io::Error),
}

impl From<crate::thin::ThinError> for CacheError {
    fn from(e: crate::thin::ThinError) -> CacheError {
        CacheError::Plain(e.to_string())
    }
}

pub type Result<T> = std::result::Result<T, CacheError>;
