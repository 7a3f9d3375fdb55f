//! The ublk driver's user interface (include/uapi/linux/ublk_cmd.h), as far as
//! dmkit uses it: the control commands on /dev/ublk-control, the I/O commands on
//! /dev/ublkcN, the per-queue request descriptors and the device parameters.
//! Layouts are the kernel's; the sizes are checked below at compile time.

pub const CONTROL: &str = "/dev/ublk-control";

const fn ioc(dir: u32, nr: u32, size: usize) -> u32 {
    (dir << 30) | ((size as u32) << 16) | ((b'u' as u32) << 8) | nr
}
const fn ior(nr: u32, size: usize) -> u32 {
    ioc(2, nr, size)
}
const fn iowr(nr: u32, size: usize) -> u32 {
    ioc(3, nr, size)
}
const CTRL: usize = std::mem::size_of::<CtrlCmd>();
const IO: usize = std::mem::size_of::<IoCmd>();

// Control commands, ioctl-encoded (UBLK_F_CMD_IOCTL_ENCODE).
pub const CMD_GET_DEV_INFO: u32 = ior(0x02, CTRL);
pub const CMD_ADD_DEV: u32 = iowr(0x04, CTRL);
pub const CMD_DEL_DEV: u32 = iowr(0x05, CTRL);
pub const CMD_START_DEV: u32 = iowr(0x06, CTRL);
pub const CMD_STOP_DEV: u32 = iowr(0x07, CTRL);
pub const CMD_SET_PARAMS: u32 = iowr(0x08, CTRL);
pub const CMD_START_USER_RECOVERY: u32 = iowr(0x10, CTRL);
pub const CMD_END_USER_RECOVERY: u32 = iowr(0x11, CTRL);
pub const CMD_GET_FEATURES: u32 = ior(0x13, CTRL);

// I/O commands on a queue.
pub const IO_FETCH_REQ: u32 = iowr(0x20, IO);
pub const IO_COMMIT_AND_FETCH_REQ: u32 = iowr(0x21, IO);

/// A fetch's result: a request is there.
pub const IO_RES_OK: i32 = 0;
/// A fetch's result: the queue is going away (the device stops, or the daemon).
pub const IO_RES_ABORT: i32 = -libc::ENODEV;

pub const MAX_QUEUE_DEPTH: usize = 4096;

// Device flags (ADD_DEV) and features (GET_FEATURES).
pub const F_USER_RECOVERY: u64 = 1 << 3;
pub const F_USER_RECOVERY_REISSUE: u64 = 1 << 4;
pub const F_UNPRIVILEGED_DEV: u64 = 1 << 5;
pub const F_CMD_IOCTL_ENCODE: u64 = 1 << 6;
pub const F_USER_COPY: u64 = 1 << 7;
pub const F_ZONED: u64 = 1 << 8;
/// Flags by name, for `info` and logs.
pub const FEATURE_NAMES: &[(u64, &str)] = &[
    (1 << 0, "zero-copy"),
    (1 << 1, "comp-in-task"),
    (1 << 2, "need-get-data"),
    (F_USER_RECOVERY, "user-recovery"),
    (F_USER_RECOVERY_REISSUE, "user-recovery-reissue"),
    (F_UNPRIVILEGED_DEV, "unprivileged-dev"),
    (F_CMD_IOCTL_ENCODE, "cmd-ioctl-encode"),
    (F_USER_COPY, "user-copy"),
    (F_ZONED, "zoned"),
    (1 << 9, "user-recovery-fail-io"),
    (1 << 10, "update-size"),
    (1 << 11, "auto-buf-reg"),
];

// Device states (GET_DEV_INFO).
pub const S_DEV_DEAD: u16 = 0;
pub const S_DEV_LIVE: u16 = 1;
pub const S_DEV_QUIESCED: u16 = 2;

// Request operations and flags (ublksrv_io_desc.op_flags).
pub const OP_READ: u8 = 0;
pub const OP_WRITE: u8 = 1;
pub const OP_FLUSH: u8 = 2;
pub const OP_DISCARD: u8 = 3;
pub const OP_WRITE_ZEROES: u8 = 5;
pub const IO_F_FUA: u32 = 1 << 13;
pub const IO_F_NOUNMAP: u32 = 1 << 15;

// Device attributes (ublk_param_basic.attrs) and parameter types.
pub const ATTR_READ_ONLY: u32 = 1 << 0;
pub const ATTR_VOLATILE_CACHE: u32 = 1 << 2;
pub const ATTR_FUA: u32 = 1 << 3;
pub const PARAM_TYPE_BASIC: u32 = 1 << 0;
pub const PARAM_TYPE_DISCARD: u32 = 1 << 1;

/// struct ublksrv_ctrl_cmd: the 32 bytes of a control command's SQE.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct CtrlCmd {
    pub dev_id: u32,
    /// u16::MAX when the command is not for one queue.
    pub queue_id: u16,
    pub len: u16,
    pub addr: u64,
    pub data: u64,
    pub dev_path_len: u16,
    pub pad: u16,
    pub reserved: u32,
}

impl CtrlCmd {
    /// The command area of a 128-byte SQE (80 bytes), this command first.
    pub fn bytes(&self) -> [u8; 80] {
        let mut b = [0u8; 80];
        b[0..4].copy_from_slice(&self.dev_id.to_ne_bytes());
        b[4..6].copy_from_slice(&self.queue_id.to_ne_bytes());
        b[6..8].copy_from_slice(&self.len.to_ne_bytes());
        b[8..16].copy_from_slice(&self.addr.to_ne_bytes());
        b[16..24].copy_from_slice(&self.data.to_ne_bytes());
        b[24..26].copy_from_slice(&self.dev_path_len.to_ne_bytes());
        b[26..28].copy_from_slice(&self.pad.to_ne_bytes());
        b[28..32].copy_from_slice(&self.reserved.to_ne_bytes());
        b
    }
}

/// struct ublksrv_ctrl_dev_info.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct DevInfo {
    pub nr_hw_queues: u16,
    pub queue_depth: u16,
    pub state: u16,
    pub pad0: u16,
    pub max_io_buf_bytes: u32,
    pub dev_id: u32,
    pub ublksrv_pid: i32,
    pub pad1: u32,
    pub flags: u64,
    /// For the server's own use: dmkit leaves it 0.
    pub ublksrv_flags: u64,
    pub owner_uid: u32,
    pub owner_gid: u32,
    pub reserved1: u64,
    pub reserved2: u64,
}

/// struct ublksrv_io_desc: one request, in the queue's shared descriptor array.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct IoDesc {
    /// Operation in bits 0-7, flags above.
    pub op_flags: u32,
    pub nr_sectors: u32,
    pub start_sector: u64,
    pub addr: u64,
}

/// struct ublksrv_io_cmd: the 16 bytes of an I/O command's SQE.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct IoCmd {
    pub q_id: u16,
    pub tag: u16,
    /// COMMIT: bytes done, or a negative errno.
    pub result: i32,
    /// The request's buffer in this process.
    pub addr: u64,
}

impl IoCmd {
    pub fn bytes(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..2].copy_from_slice(&self.q_id.to_ne_bytes());
        b[2..4].copy_from_slice(&self.tag.to_ne_bytes());
        b[4..8].copy_from_slice(&self.result.to_ne_bytes());
        b[8..16].copy_from_slice(&self.addr.to_ne_bytes());
        b
    }
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ParamBasic {
    pub attrs: u32,
    pub logical_bs_shift: u8,
    pub physical_bs_shift: u8,
    pub io_opt_shift: u8,
    pub io_min_shift: u8,
    pub max_sectors: u32,
    pub chunk_sectors: u32,
    pub dev_sectors: u64,
    pub virt_boundary_mask: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ParamDiscard {
    pub discard_alignment: u32,
    pub discard_granularity: u32,
    pub max_discard_sectors: u32,
    pub max_write_zeroes_sectors: u32,
    pub max_discard_segments: u16,
    pub reserved0: u16,
}

/// struct ublk_params up to its zoned part (Linux 6.6-6.13); a kernel with a
/// shorter struct takes the prefix it knows, one with a longer one zeroes the rest.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct Params {
    pub len: u32,
    pub types: u32,
    pub basic: ParamBasic,
    pub discard: ParamDiscard,
    /// ublk_param_devt: filled by the kernel.
    pub devt: [u32; 4],
    /// ublk_param_zoned: unused.
    pub zoned: [u32; 8],
}

const _: () = assert!(std::mem::size_of::<CtrlCmd>() == 32);
// where `CtrlCmd::bytes` puts each field
const _: () = assert!(std::mem::offset_of!(CtrlCmd, queue_id) == 4);
const _: () = assert!(std::mem::offset_of!(CtrlCmd, len) == 6);
const _: () = assert!(std::mem::offset_of!(CtrlCmd, addr) == 8);
const _: () = assert!(std::mem::offset_of!(CtrlCmd, data) == 16);
const _: () = assert!(std::mem::offset_of!(CtrlCmd, dev_path_len) == 24);
const _: () = assert!(std::mem::offset_of!(CtrlCmd, reserved) == 28);
const _: () = assert!(std::mem::size_of::<DevInfo>() == 64);
const _: () = assert!(std::mem::size_of::<IoDesc>() == 24);
const _: () = assert!(std::mem::size_of::<IoCmd>() == 16);
const _: () = assert!(std::mem::size_of::<ParamBasic>() == 32);
const _: () = assert!(std::mem::offset_of!(Params, discard) == 40);
const _: () = assert!(std::mem::offset_of!(Params, devt) == 60);
const _: () = assert!(std::mem::size_of::<Params>() == 112);

/// The names of the feature bits in `f`.
pub fn feature_names(f: u64) -> Vec<&'static str> {
    FEATURE_NAMES
        .iter()
        .filter(|(b, _)| f & b != 0)
        .map(|(_, n)| *n)
        .collect()
}

/// Where queue `q`'s descriptor array is mapped in /dev/ublkcN.
pub fn desc_offset(q: u16) -> i64 {
    let page = rustix::param::page_size();
    let per_queue = (MAX_QUEUE_DEPTH * std::mem::size_of::<IoDesc>()).div_ceil(page) * page;
    (q as usize * per_queue) as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opcodes_are_the_kernels() {
        // values from the kernel's header (ublk_cmd.h, _IOR/_IOWR('u', nr, size))
        assert_eq!(CMD_ADD_DEV, 0xc020_7504);
        assert_eq!(CMD_GET_FEATURES, 0x8020_7513);
        assert_eq!(IO_FETCH_REQ, 0xc010_7520);
        assert_eq!(IO_COMMIT_AND_FETCH_REQ, 0xc010_7521);
    }
}
