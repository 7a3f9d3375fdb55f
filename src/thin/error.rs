//! Errors of the thin metadata layer.

use crate::pdata::PdataError;

#[derive(Debug, thiserror::Error)]
pub enum ThinError {
    #[error(transparent)]
    Pdata(#[from] PdataError),
    #[error("thin device {0} already exists")]
    DeviceExists(u64),
    #[error("thin device {0} does not exist")]
    NoSuchDevice(u64),
    /// A data block size the format does not allow (sectors).
    #[error("data block size {0} sectors: must be 128..2097152 and a multiple of 128")]
    DataBlockSize(u32),
    /// A device a table uses, which a message may not delete.
    #[error("thin device {0} is active (busy)")]
    Active(u64),
    #[error("transaction id mismatch: expected {expected}, current is {current}")]
    TransactionIdMismatch { expected: u64, current: u64 },
    #[error("a metadata snapshot is already held (block {0})")]
    SnapshotHeld(u64),
    #[error("no metadata snapshot is held")]
    NoSnapshotHeld,
    #[error("data block {block} is beyond the data device ({nr_blocks} blocks)")]
    DataBlockOutOfRange { block: u64, nr_blocks: u64 },
    #[error("superblock: {0}")]
    BadSuperblock(String),
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("metadata is read-only")]
    ReadOnly,
    /// A message as the thin tools print it.
    #[error("{0}")]
    Plain(String),
    #[error("output error: {0}")]
    Output(std::io::Error),
}

pub type Result<T> = std::result::Result<T, ThinError>;

impl From<crate::pdata::xml::XmlError> for ThinError {
    fn from(e: crate::pdata::xml::XmlError) -> ThinError {
        ThinError::Plain(e.to_string())
    }
}

/// The thin layer's errors, as the cache and era tools print them.
impl From<ThinError> for crate::pdata::error::MetadataError {
    fn from(e: ThinError) -> crate::pdata::error::MetadataError {
        crate::pdata::error::MetadataError::Plain(e.to_string())
    }
}
