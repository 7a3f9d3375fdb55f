//! The dm ioctl interface, version 4 (`include/uapi/linux/dm-ioctl.h`): the
//! buffer layouts, the kernel's checks of a request buffer (with its errnos), and
//! the encoders of the replies (`dm_name_list`, `dm_target_versions`,
//! `dm_target_deps`, `dm_target_spec` + status text, message results).
//!
//! Pure: no device is touched here. A request is a byte buffer as the caller's
//! memory holds it (native byte order: the door runs on the caller's machine);
//! the reply is written into the same buffer, and the caller copies back the
//! first `out_len` bytes, as the kernel's `copy_to_user` of `data_size` does.
//!
//! Every offset a buffer carries (`data_start`, a target spec's `next`) is
//! checked against the buffer before use, every string must end inside it, and
//! nothing is allocated by a size the buffer claims beyond [`BUFFER_LIMIT`].

/// `sizeof(struct dm_ioctl)`.
pub const HEADER_SIZE: usize = 312;
/// `offsetof(struct dm_ioctl, data)`: the smallest `data_size` the kernel takes,
/// and the `data_size` of a reply that carries no data.
pub const MIN_DATA_SIZE: usize = 305;
/// Where replies put their data: `sizeof(struct dm_ioctl)` aligned to 8.
pub const DATA_START: usize = 312;
/// `sizeof(struct dm_target_spec)`.
pub const SPEC_SIZE: usize = 40;
pub const NAME_LEN: usize = 128;
pub const UUID_LEN: usize = 129;
pub const TYPE_NAME_LEN: usize = 16;

/// The interface version reported: Linux 6.4 to 6.12's (4.48.0, "2023-03-01").
pub const VERSION: [u32; 3] = [4, 48, 0];
/// `DM_IOCTL`: the ioctl type byte.
pub const IOCTL_TYPE: u32 = 0xfd;
/// The kernel's bound on `data_size` (DM_MAX_TARGETS * DM_MAX_TARGET_PARAMS):
/// above it, EINVAL.
pub const KERNEL_MAX_DATA_SIZE: u32 = 1 << 30;
/// dmkit's bound on a request buffer (the kernel's is its memory): above it,
/// ENOMEM, as the kernel's allocation failing.
pub const BUFFER_LIMIT: usize = 64 << 20;

// Header field offsets.
const OFF_DATA_SIZE: usize = 12;
const OFF_DATA_START: usize = 16;
const OFF_TARGET_COUNT: usize = 20;
const OFF_OPEN_COUNT: usize = 24;
const OFF_FLAGS: usize = 28;
const OFF_EVENT_NR: usize = 32;
const OFF_DEV: usize = 40;
const OFF_NAME: usize = 48;
const OFF_UUID: usize = 176;

/// The commands (`DM_*_CMD`), by ioctl number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Cmd {
    Version = 0,
    RemoveAll = 1,
    ListDevices = 2,
    DevCreate = 3,
    DevRemove = 4,
    DevRename = 5,
    DevSuspend = 6,
    DevStatus = 7,
    DevWait = 8,
    TableLoad = 9,
    TableClear = 10,
    TableDeps = 11,
    TableStatus = 12,
    ListVersions = 13,
    TargetMsg = 14,
    DevSetGeometry = 15,
    DevArmPoll = 16,
    GetTargetVersion = 17,
}

impl Cmd {
    pub const ALL: [Cmd; 18] = [
        Cmd::Version,
        Cmd::RemoveAll,
        Cmd::ListDevices,
        Cmd::DevCreate,
        Cmd::DevRemove,
        Cmd::DevRename,
        Cmd::DevSuspend,
        Cmd::DevStatus,
        Cmd::DevWait,
        Cmd::TableLoad,
        Cmd::TableClear,
        Cmd::TableDeps,
        Cmd::TableStatus,
        Cmd::ListVersions,
        Cmd::TargetMsg,
        Cmd::DevSetGeometry,
        Cmd::DevArmPoll,
        Cmd::GetTargetVersion,
    ];

    /// The ioctl request number: `_IOWR(DM_IOCTL, cmd, struct dm_ioctl)`.
    pub fn request(self) -> u32 {
        (3 << 30) | ((HEADER_SIZE as u32) << 16) | (IOCTL_TYPE << 8) | self as u32
    }

    /// The commands that read something the caller put after the header
    /// (at `data_start`: a table, a new name, a message, a geometry, a target's
    /// name). The others only write there, so the door's library carries the
    /// header alone of their buffer, and their result is written in a buffer
    /// grown as it needs (see [`Request::room`]).
    pub fn reads_data(self) -> bool {
        matches!(
            self,
            Cmd::TableLoad | Cmd::DevRename | Cmd::TargetMsg | Cmd::DevSetGeometry | Cmd::GetTargetVersion
        )
    }

    /// The commands whose data part the kernel does not read
    /// (`IOCTL_FLAGS_NO_PARAMS`): their buffer is the header alone.
    pub fn no_params(self) -> bool {
        matches!(
            self,
            Cmd::RemoveAll
                | Cmd::DevCreate
                | Cmd::DevRemove
                | Cmd::DevSuspend
                | Cmd::DevStatus
                | Cmd::TableClear
                | Cmd::DevArmPoll
        )
    }
}

// Flags (`DM_*_FLAG`).
pub const READONLY_FLAG: u32 = 1 << 0;
pub const SUSPEND_FLAG: u32 = 1 << 1;
pub const PERSISTENT_DEV_FLAG: u32 = 1 << 3;
pub const STATUS_TABLE_FLAG: u32 = 1 << 4;
pub const ACTIVE_PRESENT_FLAG: u32 = 1 << 5;
pub const INACTIVE_PRESENT_FLAG: u32 = 1 << 6;
pub const BUFFER_FULL_FLAG: u32 = 1 << 8;
pub const SKIP_BDGET_FLAG: u32 = 1 << 9;
pub const SKIP_LOCKFS_FLAG: u32 = 1 << 10;
pub const NOFLUSH_FLAG: u32 = 1 << 11;
pub const QUERY_INACTIVE_TABLE_FLAG: u32 = 1 << 12;
pub const UEVENT_GENERATED_FLAG: u32 = 1 << 13;
pub const UUID_FLAG: u32 = 1 << 14;
pub const SECURE_DATA_FLAG: u32 = 1 << 15;
pub const DATA_OUT_FLAG: u32 = 1 << 16;
pub const DEFERRED_REMOVE: u32 = 1 << 17;
pub const INTERNAL_SUSPEND_FLAG: u32 = 1 << 18;
pub const IMA_MEASUREMENT_FLAG: u32 = 1 << 19;

/// `dm_name_list` entry flags (after the event number).
pub const NAME_LIST_FLAG_HAS_UUID: u32 = 1;
pub const NAME_LIST_FLAG_DOESNT_HAVE_UUID: u32 = 2;

/// An errno the door answers with (positive, as `errno` holds it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Errno(pub i32);

pub const EINVAL: Errno = Errno(libc::EINVAL);
pub const ENXIO: Errno = Errno(libc::ENXIO);
pub const ENOTTY: Errno = Errno(libc::ENOTTY);
pub const EFAULT: Errno = Errno(libc::EFAULT);
pub const ENOMEM: Errno = Errno(libc::ENOMEM);
pub const EBUSY: Errno = Errno(libc::EBUSY);

/// The command of an ioctl request number: ENOTTY for another driver's ioctl
/// or a command number the interface does not have.
pub fn command(request: u32) -> Result<Cmd, Errno> {
    if (request >> 8) & 0xff != IOCTL_TYPE {
        return Err(ENOTTY);
    }
    Cmd::ALL.get((request & 0xff) as usize).copied().ok_or(ENOTTY)
}

/// The kernel's `huge_encode_dev(MKDEV(major, minor))`, as `dev` fields carry it.
pub fn encode_dev(major: u32, minor: u32) -> u64 {
    let (major, minor) = (u64::from(major), u64::from(minor));
    (minor & 0xff) | ((major & 0xfff) << 8) | ((minor & !0xff) << 12) | ((major & !0xfff) << 32)
}

/// `huge_decode_dev` / glibc's `major()` and `minor()`.
pub fn decode_dev(dev: u64) -> (u32, u32) {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    (major as u32, minor as u32)
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    let mut x = [0u8; 4];
    if let Some(s) = b.get(off..off + 4) {
        x.copy_from_slice(s);
    }
    u32::from_ne_bytes(x)
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut x = [0u8; 8];
    if let Some(s) = b.get(off..off + 8) {
        x.copy_from_slice(s);
    }
    u64::from_ne_bytes(x)
}

fn put_u32(b: &mut [u8], off: usize, v: u32) {
    if let Some(s) = b.get_mut(off..off + 4) {
        s.copy_from_slice(&v.to_ne_bytes());
    }
}

fn put_u64(b: &mut [u8], off: usize, v: u64) {
    if let Some(s) = b.get_mut(off..off + 8) {
        s.copy_from_slice(&v.to_ne_bytes());
    }
}

/// The string at `b[off..]` up to its NUL; None if no NUL comes before `end`
/// (the kernel's `invalid_str`).
fn c_str(b: &[u8], off: usize, end: usize) -> Option<&[u8]> {
    let s = b.get(off..end.min(b.len()))?;
    let n = s.iter().position(|&c| c == 0)?;
    s.get(..n)
}

/// Copy `s` and a NUL into `b[off..]`.
fn put_c_str(b: &mut [u8], off: usize, s: &[u8]) {
    if let Some(d) = b.get_mut(off..off + s.len() + 1) {
        let (text, nul) = d.split_at_mut(s.len());
        text.copy_from_slice(s);
        nul[0] = 0;
    }
}

fn align8(x: usize) -> usize {
    (x + 7) & !7
}

/// A request being served: the caller's buffer (at least [`HEADER_SIZE`] bytes
/// here, zero-padded; all `param_size` of them for a command that
/// [reads data](Cmd::reads_data), and grown as a result is written for the
/// others), the size the kernel would have copied in (`param_size`), and the
/// command.
#[derive(Debug)]
pub struct Request {
    pub cmd: Cmd,
    pub buf: Vec<u8>,
    pub param_size: usize,
}

/// How a request ended: the ioctl's result (0 or an errno) and how many bytes
/// of the buffer go back to the caller.
#[derive(Debug, PartialEq, Eq)]
pub struct Outcome {
    pub errno: i32,
    pub out_len: usize,
}

/// The kernel's checks before a command runs (`ctl_ioctl`: `check_version`,
/// `lookup_ioctl`, `copy_params`, `validate_params`). `len` is the length of
/// the caller's buffer (the door's library gives `data_size`, or the header's
/// size when `data_size` is out of range), `raw` its first bytes as carried:
/// all of them for a command that [reads data](Cmd::reads_data), at least the
/// header for the others (a frame that carries less than a command reads is
/// refused with EFAULT, as a buffer the kernel cannot read). Err: the errno and
/// the buffer to copy back (the version, which the kernel writes back even when
/// it refuses).
pub fn decode(request: u32, mut raw: Vec<u8>, len: usize) -> Result<Request, (Errno, Vec<u8>, usize)> {
    if (request >> 8) & 0xff != IOCTL_TYPE {
        return Err((ENOTTY, raw, 0));
    }
    let len = len.max(raw.len());
    if raw.len() < 12 {
        return Err((EFAULT, raw, 0));
    }
    let v = [u32_at(&raw, 0), u32_at(&raw, 4), u32_at(&raw, 8)];
    for (i, x) in VERSION.iter().enumerate() {
        put_u32(&mut raw, i * 4, *x);
    }
    if v[0] != VERSION[0] || v[1] > VERSION[1] {
        return Err((EINVAL, raw, 12));
    }
    let cmd = match command(request) {
        Ok(c) => c,
        Err(e) => return Err((e, raw, 12)),
    };
    if cmd == Cmd::Version {
        return Ok(Request {
            cmd,
            buf: raw,
            param_size: 12,
        });
    }
    // (`raw` is never longer than `len`)
    if raw.len() < MIN_DATA_SIZE {
        return Err((EFAULT, raw, 12));
    }
    let data_size = u32_at(&raw, OFF_DATA_SIZE);
    if (data_size as usize) < MIN_DATA_SIZE || data_size > KERNEL_MAX_DATA_SIZE {
        return Err((EINVAL, raw, 12));
    }
    let param_size = if cmd.no_params() {
        MIN_DATA_SIZE
    } else if data_size as usize > BUFFER_LIMIT {
        return Err((ENOMEM, raw, 12));
    } else if len < data_size as usize || (cmd.reads_data() && raw.len() < data_size as usize) {
        return Err((EFAULT, raw, 12));
    } else {
        data_size as usize
    };
    raw.truncate(param_size.max(MIN_DATA_SIZE));
    if raw.len() < HEADER_SIZE {
        raw.resize(HEADER_SIZE, 0);
    }
    let mut r = Request {
        cmd,
        buf: raw,
        param_size,
    };
    // validate_params
    let flags = r.flags() & !(BUFFER_FULL_FLAG | UEVENT_GENERATED_FLAG | SECURE_DATA_FLAG | DATA_OUT_FLAG);
    r.set_flags(flags);
    if !matches!(
        cmd,
        Cmd::RemoveAll | Cmd::ListDevices | Cmd::ListVersions | Cmd::GetTargetVersion
    ) {
        if cmd == Cmd::DevCreate {
            if r.buf[OFF_NAME] == 0 {
                return Err((EINVAL, r.buf, 12));
            }
        } else if r.buf[OFF_UUID] != 0 && r.buf[OFF_NAME] != 0 {
            return Err((EINVAL, r.buf, 12));
        }
    }
    r.buf[OFF_NAME + NAME_LEN - 1] = 0;
    r.buf[OFF_UUID + UUID_LEN - 1] = 0;
    r.set_data_size(MIN_DATA_SIZE as u32);
    Ok(r)
}

/// One target of a table load: `dm_target_spec` and its parameter string.
#[derive(Debug, PartialEq, Eq, Clone)]
pub struct Spec {
    pub start: u64,
    pub len: u64,
    pub target_type: String,
    pub params: String,
}

impl Request {
    /// The header's flags as the caller sent them (less the output flags).
    pub fn flags(&self) -> u32 {
        u32_at(&self.buf, OFF_FLAGS)
    }
    pub fn set_flags(&mut self, f: u32) {
        put_u32(&mut self.buf, OFF_FLAGS, f);
    }
    pub fn add_flags(&mut self, f: u32) {
        self.set_flags(self.flags() | f);
    }
    pub fn clear_flags(&mut self, f: u32) {
        self.set_flags(self.flags() & !f);
    }
    pub fn has(&self, f: u32) -> bool {
        self.flags() & f != 0
    }
    pub fn event_nr(&self) -> u32 {
        u32_at(&self.buf, OFF_EVENT_NR)
    }
    pub fn dev(&self) -> u64 {
        u64_at(&self.buf, OFF_DEV)
    }
    pub fn target_count(&self) -> u32 {
        u32_at(&self.buf, OFF_TARGET_COUNT)
    }
    pub fn data_start(&self) -> u32 {
        u32_at(&self.buf, OFF_DATA_START)
    }
    pub fn data_size(&self) -> u32 {
        u32_at(&self.buf, OFF_DATA_SIZE)
    }
    pub fn set_data_size(&mut self, n: u32) {
        put_u32(&mut self.buf, OFF_DATA_SIZE, n);
    }
    /// The name field (NUL-terminated by [`decode`]); lossy UTF-8.
    pub fn name(&self) -> String {
        field(&self.buf, OFF_NAME, NAME_LEN)
    }
    pub fn uuid(&self) -> String {
        field(&self.buf, OFF_UUID, UUID_LEN)
    }
    /// Write the device's name and uuid into the header, as the kernel's lookup
    /// does ("sneakily write in both the name and the uuid").
    pub fn set_identity(&mut self, name: &str, uuid: Option<&str>) {
        set_field(&mut self.buf, OFF_NAME, NAME_LEN, name.as_bytes());
        set_field(&mut self.buf, OFF_UUID, UUID_LEN, uuid.unwrap_or("").as_bytes());
    }

    /// `__dev_status`: the device's state in the header.
    pub fn set_status(&mut self, s: &DevStatus) {
        self.clear_flags(SUSPEND_FLAG | READONLY_FLAG | ACTIVE_PRESENT_FLAG | INTERNAL_SUSPEND_FLAG);
        let mut f = 0;
        if s.suspended {
            f |= SUSPEND_FLAG;
        }
        if s.deferred_remove {
            f |= DEFERRED_REMOVE;
        }
        put_u64(&mut self.buf, OFF_DEV, encode_dev(s.major, s.minor));
        put_u32(&mut self.buf, OFF_OPEN_COUNT, s.open_count);
        put_u32(&mut self.buf, OFF_EVENT_NR, s.event_nr);
        let mut count = 0;
        let inactive_query = self.has(QUERY_INACTIVE_TABLE_FLAG);
        if let Some(n) = s.live_targets {
            if !inactive_query {
                if s.read_only {
                    f |= READONLY_FLAG;
                }
                count = n;
            }
            f |= ACTIVE_PRESENT_FLAG;
        }
        if inactive_query {
            if let Some(n) = s.inactive_targets {
                if s.read_only {
                    f |= READONLY_FLAG;
                }
                count = n;
            }
        }
        put_u32(&mut self.buf, OFF_TARGET_COUNT, count);
        self.add_flags(f);
    }

    /// The data part the kernel's result buffer gives a command: it starts at
    /// [`DATA_START`] (written into the header) and holds `len` bytes.
    fn result_space(&mut self) -> (usize, usize) {
        put_u32(&mut self.buf, OFF_DATA_START, DATA_START as u32);
        (DATA_START, self.param_size.saturating_sub(DATA_START))
    }

    /// The buffer made at least `end` bytes long (no longer than the caller's)
    /// before a result is written up to there: the bytes the door did not
    /// carry read as zeros (the result's alignment padding is all that is
    /// copied back of them).
    fn room(&mut self, end: usize) {
        let end = end.min(self.param_size);
        if self.buf.len() < end {
            self.buf.resize(end, 0);
        }
    }

    /// A string the caller put at `data_start` (rename's new name, a target
    /// version's name): EINVAL if it starts inside the header or has no NUL
    /// inside the buffer.
    pub fn data_string(&self) -> Result<String, Errno> {
        let off = self.data_start() as usize;
        if off < MIN_DATA_SIZE {
            return Err(EINVAL);
        }
        c_str(&self.buf, off, self.param_size)
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .ok_or(EINVAL)
    }

    /// A `dm_target_msg`: the sector and the message text (EINVAL as the kernel:
    /// inside the header, or no NUL inside the buffer).
    pub fn message(&self) -> Result<(u64, String), Errno> {
        let off = self.data_start() as usize;
        if off < MIN_DATA_SIZE {
            return Err(EINVAL);
        }
        let text = c_str(&self.buf, off.saturating_add(8), self.param_size).ok_or(EINVAL)?;
        Ok((u64_at(&self.buf, off), String::from_utf8_lossy(text).into_owned()))
    }

    /// The targets of a table load (`populate_table` and `next_target`): the
    /// first spec at `data_start`, each next one `next` bytes after the one
    /// before, none overlapping the header or the previous parameters, each
    /// 8-byte aligned, each type and parameter string NUL-terminated inside
    /// the buffer.
    pub fn table(&self) -> Result<Vec<Spec>, Errno> {
        let count = self.target_count();
        if count == 0 {
            return Err(EINVAL);
        }
        let end = self.param_size;
        let mut out = Vec::new();
        let mut spec = 0usize; // the first `next` is from the header
        let mut next = self.data_start() as usize;
        let mut min_size = HEADER_SIZE;
        for _ in 0..count {
            if next < min_size {
                return Err(EINVAL);
            }
            let remaining = end.saturating_sub(spec);
            if remaining.saturating_sub(SPEC_SIZE) <= next || remaining < SPEC_SIZE {
                return Err(EINVAL);
            }
            if !next.is_multiple_of(8) {
                return Err(EINVAL);
            }
            spec += next;
            let params_at = spec + SPEC_SIZE;
            let params = c_str(&self.buf, params_at, end).ok_or(EINVAL)?;
            let ty = c_str(&self.buf, spec + 24, spec + 24 + TYPE_NAME_LEN).ok_or(EINVAL)?;
            min_size = params_at + params.len() + 1 - spec;
            out.push(Spec {
                start: u64_at(&self.buf, spec),
                len: u64_at(&self.buf, spec + 8),
                target_type: String::from_utf8_lossy(ty).into_owned(),
                params: String::from_utf8_lossy(params).into_owned(),
            });
            next = u32_at(&self.buf, spec + 20) as usize;
        }
        Ok(out)
    }

    /// `list_devices`: the entries (sorted by name), filtered as the kernel
    /// filters them (the name and uuid fields as prefixes); with
    /// [`UUID_FLAG`] each entry carries its uuid. BUFFER_FULL if they do not fit.
    pub fn put_name_list(&mut self, devs: &[ListEntry]) {
        let pfx_name = self.name();
        let pfx_uuid = self.uuid();
        let with_uuid = self.has(UUID_FLAG);
        let keep = |d: &&ListEntry| {
            d.name.as_bytes().starts_with(pfx_name.as_bytes())
                && d.uuid
                    .as_deref()
                    .unwrap_or("")
                    .as_bytes()
                    .starts_with(pfx_uuid.as_bytes())
        };
        let mut needed = 0usize;
        for d in devs.iter().filter(keep) {
            needed += align8(12 + d.name.len() + 1) + 8;
            if let (true, Some(u)) = (with_uuid, &d.uuid) {
                needed += align8(u.len() + 1);
            }
        }
        let (start, len) = self.result_space();
        if len < needed || len < 8 {
            self.add_flags(BUFFER_FULL_FLAG);
            return;
        }
        self.room(start + needed.max(8));
        self.set_data_size((start + needed) as u32);
        put_u64(&mut self.buf, start, 0); // no devices
        let mut at = start;
        let mut prev: Option<usize> = None;
        for d in devs.iter().filter(keep) {
            if let Some(p) = prev {
                put_u32(&mut self.buf, p + 8, (at - p) as u32);
            }
            put_u64(&mut self.buf, at, encode_dev(d.major, d.minor));
            put_u32(&mut self.buf, at + 8, 0);
            put_c_str(&mut self.buf, at + 12, d.name.as_bytes());
            prev = Some(at);
            let ev = align8(at + 12 + d.name.len() + 1);
            put_u32(&mut self.buf, ev, d.event_nr);
            let mut flags = 0;
            let mut next = ev + 8;
            if with_uuid {
                match &d.uuid {
                    Some(u) => {
                        flags = NAME_LIST_FLAG_HAS_UUID;
                        put_c_str(&mut self.buf, next, u.as_bytes());
                        next = align8(next + u.len() + 1);
                    }
                    None => flags = NAME_LIST_FLAG_DOESNT_HAVE_UUID,
                }
            }
            put_u32(&mut self.buf, ev + 4, flags);
            at = next;
        }
    }

    /// `list_versions` / `get_target_version`: `dm_target_versions` records.
    pub fn put_versions(&mut self, targets: &[(&str, [u32; 3])]) {
        let needed: usize = targets.iter().map(|(n, _)| 16 + n.len() + 1 + 7).sum();
        let (start, len) = self.result_space();
        if len < needed {
            self.add_flags(BUFFER_FULL_FLAG);
            return;
        }
        self.room(start + needed);
        self.set_data_size((start + needed) as u32);
        let mut at = start;
        let mut prev: Option<usize> = None;
        for (name, v) in targets {
            if let Some(p) = prev {
                put_u32(&mut self.buf, p, (at - p) as u32);
            }
            put_u32(&mut self.buf, at, 0);
            for (i, x) in v.iter().enumerate() {
                put_u32(&mut self.buf, at + 4 + 4 * i, *x);
            }
            put_c_str(&mut self.buf, at + 16, name.as_bytes());
            prev = Some(at);
            at = align8(at + 16 + name.len() + 1);
        }
    }

    /// `retrieve_deps`: a `dm_target_deps` with each device number.
    pub fn put_deps(&mut self, devs: &[(u32, u32)]) {
        let (start, len) = self.result_space();
        let needed = 8 + 8 * devs.len();
        if len < needed {
            self.add_flags(BUFFER_FULL_FLAG);
            return;
        }
        self.room(start + needed);
        put_u32(&mut self.buf, start, devs.len() as u32);
        put_u32(&mut self.buf, start + 4, 0);
        for (i, (ma, mi)) in devs.iter().enumerate() {
            put_u64(&mut self.buf, start + 8 + 8 * i, encode_dev(*ma, *mi));
        }
        self.set_data_size((start + needed) as u32);
    }

    /// `retrieve_status`: one `dm_target_spec` and its text per target; `next`
    /// counts from the first spec. Stops with BUFFER_FULL where one does not fit.
    pub fn put_status(&mut self, targets: &[(u64, u64, &str, String)]) {
        let (start, len) = self.result_space();
        // each spec, its text, its NUL and its alignment
        let most: usize = targets.iter().map(|t| SPEC_SIZE + t.3.len() + 8).sum();
        self.room(start.saturating_add(most));
        let mut at = 0usize; // from `start`
        let mut used = 0usize;
        for (s, l, ty, text) in targets {
            if len.saturating_sub(at) <= SPEC_SIZE {
                self.add_flags(BUFFER_FULL_FLAG);
                break;
            }
            let spec = start + at;
            put_u64(&mut self.buf, spec, *s);
            put_u64(&mut self.buf, spec + 8, *l);
            put_u32(&mut self.buf, spec + 16, 0);
            set_field(&mut self.buf, spec + 24, TYPE_NAME_LEN, ty.as_bytes());
            at += SPEC_SIZE;
            let remaining = len - at;
            // the target writes at most remaining - 1 bytes and a NUL
            let t = text.as_bytes();
            let t = t.get(..remaining.saturating_sub(1)).unwrap_or(t);
            put_c_str(&mut self.buf, start + at, t);
            let l = t.len() + 1;
            if l == remaining {
                self.add_flags(BUFFER_FULL_FLAG);
                break;
            }
            at += l;
            used = start + at;
            at = align8(at);
            put_u32(&mut self.buf, spec + 20, at as u32);
        }
        if used != 0 {
            self.set_data_size(used as u32);
        }
        put_u32(&mut self.buf, OFF_TARGET_COUNT, targets.len() as u32);
    }

    /// A target message's result (`DM_DATA_OUT_FLAG`), or BUFFER_FULL if it and
    /// its NUL do not fit.
    pub fn put_message_result(&mut self, text: &str) {
        if !self.message_result_fits(text.len()) {
            return;
        }
        let (start, _) = self.result_space();
        self.room(start + text.len() + 1);
        put_c_str(&mut self.buf, start, text.as_bytes());
        self.set_data_size((start + text.len() + 1) as u32);
    }

    /// Whether a message result of `len` bytes fits the caller's buffer; if not,
    /// the reply says so (DM_BUFFER_FULL_FLAG: libdevmapper retries with a larger
    /// buffer). A message that must not run twice (`@stats_create`) asks first.
    pub fn message_result_fits(&mut self, len: usize) -> bool {
        let (_, room) = self.result_space();
        self.add_flags(DATA_OUT_FLAG);
        if len + 1 >= room {
            self.add_flags(BUFFER_FULL_FLAG);
            return false;
        }
        true
    }

    /// The bytes to copy back after success: `data_size` of them.
    pub fn out_len(&self) -> usize {
        if self.cmd == Cmd::Version {
            return 12;
        }
        (self.data_size() as usize).min(self.buf.len())
    }
}

/// What `__dev_status` reports of a device.
#[derive(Debug, Default, Clone)]
pub struct DevStatus {
    pub major: u32,
    pub minor: u32,
    pub suspended: bool,
    pub deferred_remove: bool,
    pub read_only: bool,
    pub open_count: u32,
    pub event_nr: u32,
    /// The live table's number of targets, if there is a live table.
    pub live_targets: Option<u32>,
    pub inactive_targets: Option<u32>,
}

/// One device in a `dm_name_list`.
#[derive(Debug, Clone)]
pub struct ListEntry {
    pub name: String,
    pub uuid: Option<String>,
    pub major: u32,
    pub minor: u32,
    pub event_nr: u32,
}

fn field(b: &[u8], off: usize, len: usize) -> String {
    let s = c_str(b, off, off + len).unwrap_or(&[]);
    String::from_utf8_lossy(s).into_owned()
}

/// Copy `s` into a fixed field, truncated to leave its NUL, the rest zeroed
/// (`strscpy`).
fn set_field(b: &mut [u8], off: usize, len: usize, s: &[u8]) {
    if let Some(d) = b.get_mut(off..off + len) {
        d.fill(0);
        let n = s.len().min(len - 1);
        d[..n].copy_from_slice(&s[..n]);
    }
}

// ---- the client side: building requests and reading replies (tests, the fuzz
// corpus, and anything that speaks to the door without libdevmapper) ----

/// A request buffer of `size` bytes (at least the header): version 4.x, the
/// name or uuid, the flags, and `data` at [`DATA_START`].
pub fn build(size: usize, name: &str, uuid: &str, flags: u32, data: &[u8]) -> Vec<u8> {
    let size = size.max(HEADER_SIZE + data.len());
    let mut b = vec![0u8; size];
    put_u32(&mut b, 0, 4);
    put_u32(&mut b, 4, 0);
    put_u32(&mut b, OFF_DATA_SIZE, size as u32);
    put_u32(&mut b, OFF_DATA_START, DATA_START as u32);
    put_u32(&mut b, OFF_FLAGS, flags);
    set_field(&mut b, OFF_NAME, NAME_LEN, name.as_bytes());
    set_field(&mut b, OFF_UUID, UUID_LEN, uuid.as_bytes());
    if let Some(d) = b.get_mut(DATA_START..DATA_START + data.len()) {
        d.copy_from_slice(data);
    }
    b
}

/// The data of a table load: the specs, each `next` pointing past its
/// parameters (8-aligned), as libdevmapper lays them out. Sets nothing in a
/// header: the caller writes `target_count`.
pub fn table_data(specs: &[Spec]) -> Vec<u8> {
    let mut d = Vec::new();
    for s in specs {
        let at = d.len();
        d.resize(at + SPEC_SIZE, 0);
        put_u64(&mut d, at, s.start);
        put_u64(&mut d, at + 8, s.len);
        set_field(&mut d, at + 24, TYPE_NAME_LEN, s.target_type.as_bytes());
        d.extend_from_slice(s.params.as_bytes());
        d.push(0);
        d.resize(align8(d.len()), 0);
        let next = (d.len() - at) as u32;
        put_u32(&mut d, at + 20, next);
    }
    d
}

/// Set a header field of a built buffer (tests and the fuzz corpus).
pub fn set_target_count(b: &mut [u8], n: u32) {
    put_u32(b, OFF_TARGET_COUNT, n);
}
pub fn set_data_size(b: &mut [u8], n: u32) {
    put_u32(b, OFF_DATA_SIZE, n);
}
pub fn set_data_start(b: &mut [u8], n: u32) {
    put_u32(b, OFF_DATA_START, n);
}
pub fn set_event_nr(b: &mut [u8], n: u32) {
    put_u32(b, OFF_EVENT_NR, n);
}

/// A reply's header fields, for readers of replies.
#[derive(Debug, PartialEq, Eq)]
pub struct ReplyHeader {
    pub version: [u32; 3],
    pub data_size: u32,
    pub data_start: u32,
    pub target_count: u32,
    pub open_count: u32,
    pub flags: u32,
    pub event_nr: u32,
    pub dev: u64,
    pub name: String,
    pub uuid: String,
}

pub fn reply_header(b: &[u8]) -> ReplyHeader {
    ReplyHeader {
        version: [u32_at(b, 0), u32_at(b, 4), u32_at(b, 8)],
        data_size: u32_at(b, OFF_DATA_SIZE),
        data_start: u32_at(b, OFF_DATA_START),
        target_count: u32_at(b, OFF_TARGET_COUNT),
        open_count: u32_at(b, OFF_OPEN_COUNT),
        flags: u32_at(b, OFF_FLAGS),
        event_nr: u32_at(b, OFF_EVENT_NR),
        dev: u64_at(b, OFF_DEV),
        name: field(b, OFF_NAME, NAME_LEN),
        uuid: field(b, OFF_UUID, UUID_LEN),
    }
}

/// The names in a `dm_name_list` reply (following `next` within the reply;
/// stops at a `next` that leaves it).
pub fn read_name_list(b: &[u8]) -> Vec<(String, u64)> {
    let h = reply_header(b);
    let end = (h.data_size as usize).min(b.len());
    let mut at = h.data_start as usize;
    let mut out = Vec::new();
    if u64_at(b, at) == 0 {
        return out;
    }
    while at + 12 < end {
        let Some(n) = c_str(b, at + 12, end) else { break };
        out.push((String::from_utf8_lossy(n).into_owned(), u64_at(b, at)));
        let next = u32_at(b, at + 8) as usize;
        if next == 0 {
            break;
        }
        at += next;
    }
    out
}

/// The (start, len, type, text) of each spec of a status reply.
pub fn read_status(b: &[u8]) -> Vec<(u64, u64, String, String)> {
    let h = reply_header(b);
    let base = h.data_start as usize;
    let end = (h.data_size as usize).min(b.len());
    let mut at = base;
    let mut out = Vec::new();
    for _ in 0..h.target_count {
        if at + SPEC_SIZE > end {
            break;
        }
        let Some(text) = c_str(b, at + SPEC_SIZE, end) else {
            break;
        };
        out.push((
            u64_at(b, at),
            u64_at(b, at + 8),
            field(b, at + 24, TYPE_NAME_LEN),
            String::from_utf8_lossy(text).into_owned(),
        ));
        at = base + u32_at(b, at + 20) as usize;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(cmd: Cmd, b: Vec<u8>) -> Result<Request, Errno> {
        let n = b.len();
        decode(cmd.request(), b, n).map_err(|e| e.0)
    }

    #[test]
    fn request_numbers_are_the_kernels() {
        // DM_VERSION and DM_TABLE_LOAD as <linux/dm-ioctl.h> defines them on x86-64
        assert_eq!(Cmd::Version.request(), 0xc138_fd00);
        assert_eq!(Cmd::TableLoad.request(), 0xc138_fd09);
        assert_eq!(command(0xc138_fd11), Ok(Cmd::GetTargetVersion));
        assert_eq!(command(0xc138_fd12), Err(ENOTTY));
        assert_eq!(command(0x5401), Err(ENOTTY)); // TCGETS
    }

    #[test]
    fn dev_numbers_round_trip_as_glibc_makes_them() {
        assert_eq!(encode_dev(253, 0), 0xfd00);
        assert_eq!(encode_dev(253, 300), 0x10_fd2c);
        assert_eq!(decode_dev(libc::makedev(253, 70000)), (253, 70000));
        assert_eq!(encode_dev(253, 70000), libc::makedev(253, 70000));
    }

    #[test]
    fn version_is_written_back_even_when_refused() {
        let mut b = build(16384, "", "", 0, &[]);
        put_u32(&mut b, 0, 5);
        let (e, out, n) = decode(Cmd::DevStatus.request(), b, 16384).expect_err("major 5");
        assert_eq!((e, n), (EINVAL, 12));
        assert_eq!(reply_header(&out).version, VERSION);
        let mut b = build(16384, "", "", 0, &[]);
        put_u32(&mut b, 4, 49); // a newer minor than ours
        assert_eq!(req(Cmd::DevStatus, b).map(|_| ()), Err(EINVAL));
        // an older minor is fine
        let r = req(Cmd::Version, build(16384, "", "", 0, &[])).expect("version");
        assert_eq!(r.out_len(), 12);
        assert_eq!(reply_header(&r.buf).version, VERSION);
        // an unknown command still gets the version
        let (e, out, n) = decode(0xc138_fd40, build(400, "", "", 0, &[]), 400).expect_err("cmd 0x40");
        assert_eq!((e, n, reply_header(&out).version), (ENOTTY, 12, VERSION));
    }

    #[test]
    fn data_size_and_buffer_bounds() {
        let mut b = build(400, "a", "", 0, &[]);
        set_data_size(&mut b, 304);
        assert_eq!(req(Cmd::TableStatus, b).map(|_| ()), Err(EINVAL));
        let mut b = build(400, "a", "", 0, &[]);
        set_data_size(&mut b, (1 << 30) + 1);
        assert_eq!(req(Cmd::TableStatus, b).map(|_| ()), Err(EINVAL));
        let mut b = build(400, "a", "", 0, &[]);
        set_data_size(&mut b, 100 << 20);
        assert_eq!(req(Cmd::TableStatus, b).map(|_| ()), Err(ENOMEM));
        // a buffer shorter than its data_size: the kernel's copy faults
        let mut b = build(400, "a", "", 0, &[]);
        set_data_size(&mut b, 800);
        assert_eq!(req(Cmd::TableStatus, b).map(|_| ()), Err(EFAULT));
        assert_eq!(req(Cmd::TableStatus, vec![4, 0, 0, 0]).map(|_| ()), Err(EFAULT));
        let mut short = build(400, "a", "", 0, &[]);
        short.truncate(200);
        assert_eq!(req(Cmd::DevStatus, short).map(|_| ()), Err(EFAULT));
        // a header-only command ignores the rest of a large buffer
        let mut b = build(400, "a", "", 0, &[]);
        set_data_size(&mut b, 800);
        let r = req(Cmd::DevStatus, b).expect("no params");
        assert_eq!(r.param_size, MIN_DATA_SIZE);
    }

    #[test]
    fn name_and_uuid_rules() {
        assert_eq!(
            req(Cmd::DevCreate, build(400, "", "u", 0, &[])).map(|_| ()),
            Err(EINVAL)
        );
        assert_eq!(
            req(Cmd::DevStatus, build(400, "a", "u", 0, &[])).map(|_| ()),
            Err(EINVAL)
        );
        assert!(req(Cmd::DevCreate, build(400, "a", "u", 0, &[])).is_ok());
        assert!(req(Cmd::ListDevices, build(400, "a", "u", 0, &[])).is_ok());
        // an unterminated name is cut at its last byte, as the kernel does
        let mut b = build(400, "", "", 0, &[]);
        b[OFF_NAME..OFF_NAME + NAME_LEN].fill(b'x');
        let r = req(Cmd::DevStatus, b).expect("terminated");
        assert_eq!(r.name().len(), NAME_LEN - 1);
        // output flags the caller set are cleared
        let r = req(
            Cmd::DevStatus,
            build(400, "a", "", BUFFER_FULL_FLAG | DATA_OUT_FLAG | 4, &[]),
        )
        .expect("ok");
        assert_eq!(r.flags(), 4);
    }

    fn load(specs: &[Spec], count: u32) -> Vec<u8> {
        let d = table_data(specs);
        let mut b = build(HEADER_SIZE + d.len(), "a", "", 0, &d);
        set_target_count(&mut b, count);
        b
    }

    fn spec(start: u64, len: u64, t: &str, p: &str) -> Spec {
        Spec {
            start,
            len,
            target_type: t.into(),
            params: p.into(),
        }
    }

    #[test]
    fn a_table_is_read_as_libdevmapper_lays_it_out() {
        let specs = vec![spec(0, 8, "zero", ""), spec(8, 16, "linear", "/dev/x 0")];
        let r = req(Cmd::TableLoad, load(&specs, 2)).expect("load");
        assert_eq!(r.table(), Ok(specs));
    }

    #[test]
    fn a_table_with_bad_offsets_is_refused() {
        let specs = vec![spec(0, 8, "zero", ""), spec(8, 16, "zero", "")];
        // no targets
        assert_eq!(
            req(Cmd::TableLoad, load(&specs, 0)).expect("decode").table(),
            Err(EINVAL)
        );
        // more targets than the buffer holds: the last `next` is 0 (overlaps)
        assert_eq!(
            req(Cmd::TableLoad, load(&specs, 3)).expect("decode").table(),
            Err(EINVAL)
        );
        // data_start inside the header
        let mut b = load(&specs, 2);
        set_data_start(&mut b, 100);
        assert_eq!(req(Cmd::TableLoad, b).expect("decode").table(), Err(EINVAL));
        // data_start past the end
        let mut b = load(&specs, 2);
        set_data_start(&mut b, 0xffff_fff8);
        assert_eq!(req(Cmd::TableLoad, b).expect("decode").table(), Err(EINVAL));
        // a `next` pointing outside the buffer, and an unaligned one
        for bad in [0x7fff_0000u32, 52, 8] {
            let mut b = load(&specs, 2);
            put_u32(&mut b, DATA_START + 20, bad);
            assert_eq!(
                req(Cmd::TableLoad, b).expect("decode").table(),
                Err(EINVAL),
                "next {bad}"
            );
        }
        // parameters without their NUL
        let mut b = load(&[spec(0, 8, "zero", "abc")], 1);
        b[DATA_START + SPEC_SIZE..].fill(b'x');
        assert_eq!(req(Cmd::TableLoad, b).expect("decode").table(), Err(EINVAL));
        // a type name without its NUL
        let mut b = load(&[spec(0, 8, "zero", "")], 1);
        b[DATA_START + 24..DATA_START + 40].fill(b'z');
        assert_eq!(req(Cmd::TableLoad, b).expect("decode").table(), Err(EINVAL));
    }

    #[test]
    fn name_list_layout_and_buffer_full() {
        let devs = vec![
            ListEntry {
                name: "a".into(),
                uuid: Some("U-1".into()),
                major: 253,
                minor: 0,
                event_nr: 3,
            },
            ListEntry {
                name: "bb".into(),
                uuid: None,
                major: 253,
                minor: 1,
                event_nr: 0,
            },
        ];
        let mut r = req(Cmd::ListDevices, build(16384, "", "", UUID_FLAG, &[])).expect("list");
        r.put_name_list(&devs);
        let b = &r.buf;
        let h = reply_header(b);
        // a: 12 + 2 -> 16, + 8; uuid "U-1\0" -> 8; bb: 12 + 3 -> 16, + 8
        assert_eq!(h.data_size as usize, DATA_START + 32 + 24);
        assert_eq!(u32_at(b, DATA_START + 8), 32);
        assert_eq!(u32_at(b, DATA_START + 16), 3); // event_nr
        assert_eq!(u32_at(b, DATA_START + 20), NAME_LIST_FLAG_HAS_UUID);
        assert_eq!(c_str(b, DATA_START + 24, b.len()), Some(&b"U-1"[..]));
        assert_eq!(u32_at(b, DATA_START + 32 + 20), NAME_LIST_FLAG_DOESNT_HAVE_UUID);
        assert_eq!(
            read_name_list(b),
            vec![("a".to_string(), 0xfd00), ("bb".to_string(), 0xfd01)]
        );
        // prefix filter
        let mut r = req(Cmd::ListDevices, build(16384, "b", "", 0, &[])).expect("list");
        r.put_name_list(&devs);
        assert_eq!(read_name_list(&r.buf), vec![("bb".to_string(), 0xfd01)]);
        // too small
        let mut r = req(Cmd::ListDevices, build(330, "", "", 0, &[])).expect("list");
        r.put_name_list(&devs);
        assert!(r.has(BUFFER_FULL_FLAG));
        assert_eq!(r.out_len(), MIN_DATA_SIZE);
    }

    #[test]
    fn status_layout_and_buffer_full() {
        let t = vec![
            (0u64, 8u64, "zero", String::new()),
            (8, 16, "linear", "253:0 0".to_string()),
        ];
        let mut r = req(Cmd::TableStatus, build(16384, "a", "", 0, &[])).expect("status");
        r.put_status(&t);
        let got = read_status(&r.buf);
        assert_eq!(
            got,
            vec![
                (0, 8, "zero".to_string(), String::new()),
                (8, 16, "linear".to_string(), "253:0 0".to_string())
            ]
        );
        assert_eq!(u32_at(&r.buf, DATA_START + 20), 48); // from the first spec
        assert!(!r.has(BUFFER_FULL_FLAG));
        // room for the first only
        let mut r = req(Cmd::TableStatus, build(DATA_START + 60, "a", "", 0, &[])).expect("status");
        r.put_status(&t);
        assert!(r.has(BUFFER_FULL_FLAG));
    }

    #[test]
    fn a_result_needs_only_the_header_carried_and_data_must_be() {
        // the door's library carries the header of a status request's 16 KiB
        let b = build(16384, "a", "", 0, &[]);
        let mut r = decode(Cmd::TableStatus.request(), b[..HEADER_SIZE].to_vec(), 16384).expect("status");
        assert_eq!(r.buf.len(), HEADER_SIZE);
        r.put_status(&[(0u64, 8u64, "linear", "253:0 0".to_string())]);
        assert_eq!(
            read_status(&r.buf),
            vec![(0, 8, "linear".to_string(), "253:0 0".to_string())]
        );
        assert_eq!(r.out_len(), DATA_START + SPEC_SIZE + 8);
        assert!(r.buf.len() < 1024, "grown to {}", r.buf.len());
        let mut r = decode(Cmd::ListDevices.request(), b[..HEADER_SIZE].to_vec(), 16384).expect("list");
        r.put_name_list(&[]);
        // none: the kernel's `dev` 0 lies past data_size, not copied back
        assert_eq!(r.out_len(), DATA_START);
        // still no more than the caller's buffer: a result that does not fit is
        // BUFFER_FULL, not a longer reply
        let b = build(330, "", "", 0, &[]);
        let mut r = decode(Cmd::TableStatus.request(), b[..HEADER_SIZE].to_vec(), 330).expect("status");
        r.put_status(&[(0u64, 8u64, "linear", "253:0 0".to_string())]);
        assert!(r.has(BUFFER_FULL_FLAG) && r.buf.len() <= 330);
        // a command that reads its data refuses a frame that left it out
        let mut data = 5u64.to_ne_bytes().to_vec();
        data.extend_from_slice(b"x\0");
        let b = build(400, "a", "", 0, &data);
        let e = decode(Cmd::TargetMsg.request(), b[..HEADER_SIZE].to_vec(), 400).expect_err("short");
        assert_eq!(e.0, EFAULT);
        assert!(decode(Cmd::TargetMsg.request(), b, 400).is_ok());
    }

    #[test]
    fn message_and_strings_must_end_inside_the_buffer() {
        let mut data = 5u64.to_ne_bytes().to_vec();
        data.extend_from_slice(b"create_thin 0\0");
        let r = req(Cmd::TargetMsg, build(400, "a", "", 0, &data)).expect("msg");
        assert_eq!(r.message(), Ok((5, "create_thin 0".to_string())));
        let mut b = build(HEADER_SIZE + 12, "a", "", 0, &[]);
        b[DATA_START..].copy_from_slice(b"\0\0\0\0\0\0\0\0abcd");
        assert_eq!(req(Cmd::TargetMsg, b).expect("msg").message(), Err(EINVAL));
        let mut b = build(400, "a", "", 0, b"new\0");
        set_data_start(&mut b, 48);
        assert_eq!(req(Cmd::DevRename, b).expect("rename").data_string(), Err(EINVAL));
        let r = req(Cmd::DevRename, build(400, "a", "", 0, b"new\0")).expect("rename");
        assert_eq!(r.data_string(), Ok("new".to_string()));
    }
}
