//! Typed errors of the persistent-data layer. Each names the block at fault.

use std::fmt;

/// What a metadata block is expected to hold; selects the checksum salt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockKind {
    Superblock,
    BtreeNode,
    Bitmap,
    Index,
    /// A dm-array block (header: max_entries, nr_entries, value_size, blocknr).
    Array,
    /// The dm-era superblock.
    EraSuperblock,
    /// The dm-cache superblock.
    CacheSuperblock,
}

impl BlockKind {
    pub fn salt(self) -> u32 {
        match self {
            BlockKind::Superblock => 160_774,
            BlockKind::BtreeNode => 121_107,
            BlockKind::Bitmap => 240_779,
            BlockKind::Index => 160_478,
            BlockKind::Array => 595_846_735,
            BlockKind::EraSuperblock => 146_538_381,
            BlockKind::CacheSuperblock => 9_031_977,
        }
    }

    /// Where the block's own number is stored: 16 in an array block (after
    /// its three u32 counts), 8 everywhere else.
    pub fn blocknr_offset(self) -> usize {
        match self {
            BlockKind::Array => 16,
            _ => 8,
        }
    }
}

impl fmt::Display for BlockKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BlockKind::Superblock => "superblock",
            BlockKind::BtreeNode => "btree node",
            BlockKind::Bitmap => "space map bitmap",
            BlockKind::Index => "space map index block",
            BlockKind::Array => "array block",
            BlockKind::EraSuperblock => "era superblock",
            BlockKind::CacheSuperblock => "cache superblock",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PdataError {
    #[error("metadata block {block}: I/O error: {source}")]
    Io {
        block: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("metadata block {block} is beyond the end of the device ({nr_blocks} blocks)")]
    OutOfRange { block: u64, nr_blocks: u64 },
    #[error(
        "metadata block {block} ({kind}): bad checksum (on disk {stored:#010x}, computed {computed:#010x})"
    )]
    Checksum {
        block: u64,
        kind: BlockKind,
        stored: u32,
        computed: u32,
    },
    #[error("metadata block {block} ({kind}): block number field is {found}")]
    BlockNr { block: u64, kind: BlockKind, found: u64 },
    #[error("metadata block {block}: {what}")]
    Corrupt { block: u64, what: String },
    #[error("metadata block {block}: {field} is {value}, more than {why} ({limit})")]
    Field {
        block: u64,
        field: &'static str,
        value: u64,
        limit: u64,
        why: String,
    },
    #[error("out of metadata space ({nr_blocks} blocks, none free)")]
    NoMetadataSpace { nr_blocks: u64 },
    #[error("out of data space ({nr_blocks} blocks, none free)")]
    NoDataSpace { nr_blocks: u64 },
    #[error("invalid request: {0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, PdataError>;

pub(crate) fn corrupt(block: u64, what: impl Into<String>) -> PdataError {
    PdataError::Corrupt {
        block,
        what: what.into(),
    }
}

/// Errors of a metadata layer built on persistent data with tools of its own
/// (cache, era): one type for both, `CacheError` and `EraError` by name.
#[derive(Debug, thiserror::Error)]
pub enum MetadataError {
    #[error(transparent)]
    Pdata(#[from] PdataError),
    /// A line of an XML input the tools read.
    #[error(transparent)]
    Xml(#[from] super::xml::XmlError),
    #[error("superblock: {0}")]
    BadSuperblock(String),
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// A message as the tools print it.
    #[error("{0}")]
    Plain(String),
    #[error("output error: {0}")]
    Output(std::io::Error),
}
