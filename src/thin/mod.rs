//! dm-thin metadata (kernel on-disk format) and its tools.
pub mod cli;
