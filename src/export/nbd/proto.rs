//! NBD protocol constants (fixed newstyle, structured replies).

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

pub const FLAG_FIXED_NEWSTYLE: u16 = 1;
pub const FLAG_NO_ZEROES: u16 = 2;
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1;
pub const FLAG_C_NO_ZEROES: u32 = 2;

pub const TF_HAS_FLAGS: u16 = 0x0001;
pub const TF_READ_ONLY: u16 = 0x0002;
pub const TF_SEND_FLUSH: u16 = 0x0004;
pub const TF_SEND_FUA: u16 = 0x0008;
pub const TF_SEND_TRIM: u16 = 0x0020;
pub const TF_SEND_WRITE_ZEROES: u16 = 0x0040;
pub const TF_SEND_DF: u16 = 0x0080;
pub const TF_CAN_MULTI_CONN: u16 = 0x0100;
pub const TF_SEND_CACHE: u16 = 0x0400;
pub const TF_SEND_FAST_ZERO: u16 = 0x0800;

pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_ERR_UNSUP: u32 = 0x8000_0001;
pub const REP_ERR_POLICY: u32 = 0x8000_0002;
pub const REP_ERR_INVALID: u32 = 0x8000_0003;
pub const REP_ERR_TLS_REQD: u32 = 0x8000_0005;
pub const REP_ERR_UNKNOWN: u32 = 0x8000_0006;

pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

pub const CMD_FLAG_FUA: u16 = 0x0001;
pub const CMD_FLAG_NO_HOLE: u16 = 0x0002;
pub const CMD_FLAG_DF: u16 = 0x0004;
pub const CMD_FLAG_REQ_ONE: u16 = 0x0008;
pub const CMD_FLAG_FAST_ZERO: u16 = 0x0010;

pub const REPLY_FLAG_DONE: u16 = 1;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = 0x8001;

pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const ENOMEM: u32 = 12;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

/// The metadata contexts served: allocation, and changed blocks against a base
/// (`qemu:dirty-bitmap:BASE`, the name qemu's clients read a dirty bitmap by).
pub const BASE_ALLOCATION: &str = "base:allocation";
pub const BASE_ALLOCATION_ID: u32 = 1;
pub const DIRTY_BITMAP_PREFIX: &str = "qemu:dirty-bitmap:";
pub const DIRTY_BITMAP_ID: u32 = 2;

/// Limits: advertised block sizes and the defences against hostile clients.
pub const MIN_BLOCK: u32 = 512;
pub const PREF_BLOCK: u32 = 4096;
pub const MAX_PAYLOAD: u32 = 32 << 20;
/// Options a client may send before it must have chosen an export.
pub const MAX_OPTIONS: u32 = 64;
/// Largest option payload accepted (longer: disconnect).
pub const MAX_OPTION_LEN: u32 = 64 << 10;
/// Descriptors in one BLOCK_STATUS reply.
pub const MAX_EXTENTS: usize = 1 << 16;

/// Linux errno → NBD error value.
pub fn nbd_errno(e: i32) -> u32 {
    match e {
        libc::EPERM | libc::EROFS => EPERM,
        libc::ENOSPC | libc::EDQUOT | libc::EFBIG => ENOSPC,
        libc::EINVAL => EINVAL,
        libc::ENOMEM => ENOMEM,
        libc::EOVERFLOW => EOVERFLOW,
        libc::EOPNOTSUPP => ENOTSUP,
        libc::ESHUTDOWN => ESHUTDOWN,
        _ => EIO,
    }
}
