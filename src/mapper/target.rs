//! The target interface: what a target is given to map (a [`Bio`] in a
//! [`MapCtx`]), what it answers ([`MapErr`], leaves, pieces it takes), the devices
//! it opens ([`DevRef`]), its queue [`Limits`], and how a table line becomes one
//! ([`TargetType`], [`Resolver`]). The targets themselves live in `crate::targets`;
//! the core knows them only through the list of [`TargetType`]s it is handed.

use super::engine::{Dest, Inbox, Pending, Piece};
use super::{Device, Hold};
use crate::io::{AlignedBuf, BackingFile, EndIo, Leaf, LeafKind, Op, SECTOR};
use crate::mapper::TargetError;
use crate::sync::Unpoison;
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::sync::Mutex;

/// A piece of a request handed to a target: sectors relative to the target's start.
#[derive(Clone, Copy, Debug)]
pub struct Bio {
    pub op: Op,
    pub sector: u64,
    pub nr_sectors: u64,
    /// Byte offset of this piece in the request buffer.
    pub buf_off: usize,
    pub fua: bool,
    /// For WriteZeroes: deallocation is allowed (NBD without NO_HOLE).
    pub punch: bool,
    /// The integrity tags that go with the data (the kernel's bio integrity
    /// payload): dm-crypt's AEAD tags, stored by the integrity device below.
    pub tags: Option<Tags>,
}

/// Where a bio's integrity tags are: in the buffer its data is in, from byte
/// `off`, `size` bytes for each block of `1 << shift` bytes of its data (the
/// kernel's DM-DIF-EXT-TAG profile: a tuple of `size` bytes an interval).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tags {
    pub off: u32,
    pub size: u16,
    pub shift: u8,
}

impl Tags {
    /// The tags of `profile`, from byte `off` of the buffer.
    pub fn new(off: u32, profile: TagProfile) -> Tags {
        Tags {
            off,
            size: profile.tag_size,
            shift: profile.block_size.trailing_zeros() as u8,
        }
    }

    /// The profile they are tags of (the device below must offer it).
    pub fn profile(&self) -> TagProfile {
        TagProfile {
            tag_size: self.size,
            block_size: 1u32.checked_shl(self.shift.into()).unwrap_or(0),
        }
    }

    /// Bytes of tags that `bytes` bytes of data have.
    pub fn len(&self, bytes: u64) -> usize {
        (bytes.checked_shr(self.shift.into()).unwrap_or(0) * u64::from(self.size)) as usize
    }
}

/// The integrity profile a device offers a device above (dm-crypt with
/// `integrity:N:aead` asks for one): tags of `tag_size` bytes, one for each
/// block of `block_size` bytes, which it stores and gives back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TagProfile {
    pub tag_size: u16,
    pub block_size: u32,
}

impl Bio {
    pub fn bytes(&self) -> u64 {
        self.nr_sectors * SECTOR
    }
    /// This bio on a device where the target's sector 0 is sector `offset` (a
    /// flush has no sector and stays at 0): what linear-like targets send down.
    pub fn shifted(&self, offset: u64) -> Bio {
        let sector = if self.op == Op::Flush {
            0
        } else {
            offset + self.sector
        };
        Bio { sector, ..*self }
    }
    /// The piece `[skip, skip+n)` sectors of this bio, at relative sector `sector`.
    pub fn sub(&self, skip: u64, n: u64, sector: u64) -> Bio {
        let (buf_off, tags) = if self.op.has_data() {
            let tags = self.tags.map(|t| Tags {
                off: t.off + t.len(skip * SECTOR) as u32,
                ..t
            });
            (self.buf_off + (skip * SECTOR) as usize, tags)
        } else {
            (self.buf_off, self.tags)
        };
        Bio {
            sector,
            nr_sectors: n,
            buf_off,
            tags,
            ..*self
        }
    }
}

/// Why mapping did not produce leaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapErr {
    /// A device on the path is suspended: retry the whole request after resume.
    Suspended,
    /// Fail the request with this errno.
    Errno(i32),
}

/// A device a table refers to: a backing file/block device or another dmkit device.
pub enum DevRef {
    File(Arc<BackingFile>),
    Dm(DmHold),
}

/// A table's reference to another dmkit device; while it exists the device is held
/// (it cannot be removed).
pub struct DmHold(pub Arc<Device>);

impl DmHold {
    pub fn new(dev: Arc<Device>) -> DmHold {
        dev.holders.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        DmHold(dev)
    }
}

impl Drop for DmHold {
    fn drop(&mut self) {
        self.0.holders.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl DevRef {
    /// How `dmsetup table` prints the device: `major:minor` for block devices and
    /// dmkit devices, the path for regular files (which have no device number),
    /// escaped as the table parser reads it back.
    pub fn table_name(&self) -> String {
        match self {
            DevRef::File(f) => match f.rdev {
                Some((ma, mi)) => format!("{ma}:{mi}"),
                None => crate::table::escape(&f.path.to_string_lossy()).into_owned(),
            },
            DevRef::Dm(d) => format!("{}:{}", super::DM_MAJOR, d.0.minor),
        }
    }

    /// Where a piece finished later goes ([`Pending::remap`]).
    pub fn dest(&self) -> Dest {
        match self {
            DevRef::File(f) => Dest::File(f.clone()),
            DevRef::Dm(d) => Dest::Dm(d.0.clone()),
        }
    }

    /// Size in sectors now.
    pub fn size_sectors(&self) -> u64 {
        match self {
            DevRef::File(f) => f.size().map(|b| b / SECTOR).unwrap_or(0),
            DevRef::Dm(d) => d.0.size_sectors(),
        }
    }

    pub fn logical_block_size(&self) -> u32 {
        match self {
            DevRef::File(f) => f.logical_block_size,
            DevRef::Dm(d) => d.0.logical_block_size(),
        }
    }

    /// The integrity profile it offers a device above ([`TagProfile`]).
    pub fn tag_profile(&self) -> Option<TagProfile> {
        match self {
            DevRef::File(_) => None,
            DevRef::Dm(d) => d.0.tag_profile(),
        }
    }

    pub fn limits(&self) -> Limits {
        match self {
            DevRef::File(f) => Limits {
                read_only: f.read_only,
                ..Limits::FILE
            },
            DevRef::Dm(d) => Limits {
                read_only: d.0.read_only() || d.0.limits().read_only,
                ..d.0.limits()
            },
        }
    }
}

/// What a device can do, as the kernel's queue limits say it: composed up the stack
/// from the backing files, each target adjusting what it maps onto (the kernel's
/// `io_hints` and feature checks, nbdkit's filter capabilities). The export offers
/// exactly these.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Discards are honoured (TRIM is offered; the kernel's max_discard_sectors > 0).
    pub discard: bool,
    /// Ranges can be zeroed natively (FAST_ZERO is offered).
    pub write_zeroes: bool,
    /// FUA is honoured (every file takes RWF_DSYNC; a target could refuse it).
    pub fua: bool,
    /// Every connection sees one state and a flush on one covers writes completed
    /// on all (NBD's CAN_MULTI_CONN).
    pub multi_conn: bool,
    /// Nothing beneath takes writes (a read-only file, a read-only pool).
    pub read_only: bool,
    /// Minimum optimal I/O size in bytes (the kernel's io_min; 0: none): NBD's
    /// preferred block size.
    pub io_min: u64,
    /// Optimal I/O size in bytes (0: none); read-ahead is twice it, at least 128 KiB.
    pub io_opt: u64,
}

impl Limits {
    /// Nothing beyond reads and writes (a device without a table).
    pub const NONE: Limits = Limits {
        discard: false,
        write_zeroes: false,
        fua: true,
        multi_conn: true,
        read_only: false,
        io_min: 0,
        io_opt: 0,
    };

    /// A backing file or block device: punch-hole discards, native zeroing.
    pub const FILE: Limits = Limits {
        discard: true,
        write_zeroes: true,
        ..Limits::NONE
    };

    /// The limits of a target that passes I/O on to `devs` unchanged: it can do
    /// what all of them can (nothing, with none), at the common multiple of their
    /// optimal sizes (blk_stack_limits).
    pub fn stacked(devs: &[&DevRef]) -> Limits {
        let mut l = Limits {
            discard: !devs.is_empty(),
            write_zeroes: !devs.is_empty(),
            ..Limits::NONE
        };
        for d in devs {
            l = l.and(d.limits());
        }
        l
    }

    /// Both sets of limits at once: a table of several targets, or a target over
    /// several devices.
    pub fn and(self, o: Limits) -> Limits {
        Limits {
            discard: self.discard && o.discard,
            write_zeroes: self.write_zeroes && o.write_zeroes,
            fua: self.fua && o.fua,
            multi_conn: self.multi_conn && o.multi_conn,
            read_only: self.read_only || o.read_only,
            io_min: self.io_min.max(o.io_min),
            io_opt: lcm_not_zero(self.io_opt, o.io_opt),
        }
    }

    /// Read-ahead in sectors, as the kernel sets it for a new disk: twice the
    /// optimal I/O size, and at least VM_READAHEAD_PAGES (128 KiB).
    pub fn read_ahead_sectors(&self) -> u64 {
        (self.io_opt * 2 / SECTOR).max(256)
    }
}

fn lcm_not_zero(a: u64, b: u64) -> u64 {
    fn gcd(a: u64, b: u64) -> u64 {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    match (a, b) {
        (0, x) | (x, 0) => x,
        _ => a / gcd(a, b) * b,
    }
}

/// The state of one mapping: the leaves produced so far, the devices entered, the
/// request's data, and how a target takes a piece to finish later.
pub struct MapCtx<'a> {
    leaves: &'a mut Vec<Leaf>,
    holds: &'a mut Vec<Hold>,
    /// The request's data (reads land here, writes carry it; empty without data):
    /// a target may change it, as flakey corrupts a write.
    data: &'a mut [u8],
    /// Devices entered on the way down (bounded by `MAX_DEPTH`).
    depth: u32,
    /// (index in `holds`, target index) of the target being mapped, recorded on each
    /// leaf so an I/O error can be reported to the target that issued it.
    origin: (u16, u32),
    /// Start sector of the target being mapped, in its device.
    target_start: u64,
    /// Pieces handed to targets by `submit` during this mapping.
    submitted: u32,
    /// A target asked for an empty flush through the device once the request's
    /// I/O is done (see [`MapCtx::flush_after`]).
    flush_after: bool,
    inbox: &'a Arc<Inbox>,
    /// The request's owned buffers ([`remap_owned`](Self::remap_owned)), and the
    /// engine's free ones to take them from.
    owned: &'a mut Vec<Owned>,
    pool: &'a mut Vec<AlignedBuf>,
    /// The owned buffer the bios being mapped now address (None: the request's).
    cur: Option<u32>,
    slot: u32,
    gen: u32,
    /// Every leaf and piece produced while set joins this hook (`remap_dest_with`).
    join: Option<Arc<Join>>,
}

/// One end-of-I/O hook run once after every leaf and piece that joined it.
struct Join {
    left: AtomicUsize,
    failed: AtomicBool,
    hook: EndIo,
    /// This hook or one it belongs to changes what a FUA request's flush after
    /// must make durable ([`MapCtx::remap_noting`] hooks do not).
    needs_flush: bool,
    /// The I/O under it fails only into `hook` ([`MapCtx::remap_tolerant`]).
    tolerant: bool,
}

impl Join {
    fn child(self: &Arc<Join>) -> EndIo {
        self.left.fetch_add(1, Ordering::SeqCst);
        let j = self.clone();
        Arc::new(move |ok, _: &mut [u8]| j.finish(ok))
    }

    /// One member is done; the last runs the hook (and reports its errno).
    fn finish(&self, ok: bool) -> i32 {
        if !ok {
            self.failed.store(true, Ordering::SeqCst);
        }
        if self.left.fetch_sub(1, Ordering::SeqCst) == 1 {
            return (self.hook)(!self.failed.load(Ordering::SeqCst), &mut []);
        }
        0
    }
}

/// The end-of-I/O hook of [`MapCtx::remap_owned`]: whether the I/O happened and
/// succeeded, the target's buffer, the request's data it stands for; 0 or an
/// errno that fails the request.
pub type OwnedEndIo = Box<dyn FnOnce(bool, &mut [u8], &mut [u8]) -> i32 + Send>;

const OWNED_PENDING: u8 = 0;
const OWNED_OK: u8 = 1;
const OWNED_FAILED: u8 = 2;

/// A buffer a target allocated for part of a request ([`MapCtx::remap_owned`]).
pub(crate) struct Owned {
    pub(super) buf: AlignedBuf,
    /// Bytes of data.
    pub(super) len: usize,
    /// Bytes of integrity tags after the data ([`MapCtx::remap_owned_tagged`]).
    pub(super) tag_len: usize,
    /// The data it stands for: the request's (None) or an outer owned buffer, at
    /// `client_off`.
    pub(super) client: Option<u32>,
    pub(super) client_off: usize,
    pub(super) hook: Option<OwnedEndIo>,
    /// `OWNED_*`: whether everything mapped into it is done, and how.
    done: Arc<AtomicU8>,
}

impl Owned {
    /// Whether everything mapped into the buffer happened and succeeded.
    pub(super) fn ok(&self) -> bool {
        self.done.load(Ordering::SeqCst) == OWNED_OK
    }
}

/// A point in a mapping's list of leaves ([`MapCtx::mark`]): what a target
/// produced after it can be changed or abandoned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mark(usize);

/// A hold on a device that [`MapCtx::hold_device`] took ([`MapCtx::release_hold`]).
#[derive(Debug)]
pub struct HoldMark(usize);

impl<'a> MapCtx<'a> {
    pub(crate) fn new(
        leaves: &'a mut Vec<Leaf>,
        holds: &'a mut Vec<Hold>,
        data: &'a mut [u8],
        inbox: &'a Arc<Inbox>,
        owned: &'a mut Vec<Owned>,
        pool: &'a mut Vec<AlignedBuf>,
        (slot, gen): (u32, u32),
    ) -> MapCtx<'a> {
        MapCtx {
            leaves,
            holds,
            data,
            depth: 0,
            origin: (0, 0),
            target_start: 0,
            submitted: 0,
            flush_after: false,
            inbox,
            owned,
            pool,
            cur: None,
            slot,
            gen,
            join: None,
        }
    }

    /// The bios mapped from now on address owned buffer `b` (None: the request's
    /// data): a piece taken while mapping into an owned buffer comes back to it.
    pub(super) fn in_buffer(&mut self, b: Option<u32>) {
        self.cur = b;
    }

    /// Send `bio` (in `dev`'s sectors) to `dev` with data in a buffer of the
    /// target's own instead of the request's (dm-crypt's): a buffer of
    /// `bio.bytes()` is taken from the engine's free list, `fill` gets it and the
    /// request's data `bio` covers (a write encrypts into it), and `end_io` (if
    /// any) runs once everything the mapping produced is done, before the request
    /// completes, with whether all of it happened and succeeded, the buffer, and
    /// the request's data (a read decrypts into it). A frontend's engine may run
    /// the hooks of a large request on a worker thread (`Engine::offload_hooks`),
    /// so the hook must not rely on the thread it runs on. The request's data is never
    /// changed on the way down, so a requeue that maps the request again finds
    /// it as the client sent it. Only reads and writes carry data; other
    /// operations go on as [`remap`](Self::remap) sends them.
    pub fn remap_owned(
        &mut self,
        dev: &DevRef,
        bio: Bio,
        fill: impl FnOnce(&mut [u8], &mut [u8]),
        end_io: Option<OwnedEndIo>,
    ) -> Result<(), MapErr> {
        self.remap_owned_tagged(dev, bio, None, |own, _, client| fill(own, client), end_io)
    }

    /// As [`remap_owned`](Self::remap_owned), with integrity tags of
    /// `profile` going down with the data (dm-crypt's AEAD tags): the
    /// buffer holds `bio`'s data and then a tag for each block; `fill` gets
    /// (data, tags, the request's data), and `end_io` the buffer's data and
    /// tags together (a read's tags are there once the device below gave
    /// them back). Without a profile, as `remap_owned`.
    pub fn remap_owned_tagged(
        &mut self,
        dev: &DevRef,
        bio: Bio,
        profile: Option<TagProfile>,
        fill: impl FnOnce(&mut [u8], &mut [u8], &mut [u8]),
        end_io: Option<OwnedEndIo>,
    ) -> Result<(), MapErr> {
        if !matches!(bio.op, Op::Read | Op::Write) {
            return self.remap(dev, Bio { tags: None, ..bio }, 0);
        }
        let len = bio.bytes() as usize;
        let tags = profile.map(|p| Tags::new(len as u32, p));
        let tag_len = tags.map_or(0, |t| t.len(bio.bytes()));
        let mut buf = match self.pool.iter().position(|b| b.capacity() >= len + tag_len) {
            Some(i) => self.pool.swap_remove(i),
            None => AlignedBuf::new(len + tag_len),
        };
        let (own, own_tags) = buf.as_mut_slice()[..len + tag_len].split_at_mut(len);
        fill(own, own_tags, self.data_of(&bio));
        let idx = self.owned.len() as u32;
        let done = Arc::new(AtomicU8::new(OWNED_PENDING));
        self.owned.push(Owned {
            buf,
            len,
            tag_len,
            client: self.cur,
            client_off: bio.buf_off,
            hook: end_io,
            done: done.clone(),
        });
        let outer = self.cur.replace(idx);
        let mark: EndIo = Arc::new(move |ok, _: &mut [u8]| {
            done.store(if ok { OWNED_OK } else { OWNED_FAILED }, Ordering::SeqCst);
            0
        });
        let r = self.joined(mark, |ctx| {
            ctx.remap(
                dev,
                Bio {
                    buf_off: 0,
                    tags,
                    ..bio
                },
                0,
            )
        });
        self.cur = outer;
        r
    }

    // ---- for the core: the engine and `map_bio` ----

    /// Count the request in `dev` (see `mapper::enter`): its index among the holds.
    pub(super) fn enter(&mut self, dev: &Arc<Device>) -> Result<u16, MapErr> {
        super::enter(dev, self.holds)
    }

    /// Mapping goes one device further down; Err past `max` devices.
    pub(super) fn descend(&mut self, max: u32) -> Result<(), MapErr> {
        if self.depth >= max {
            return Err(MapErr::Errno(crate::io::errno::EIO));
        }
        self.depth += 1;
        Ok(())
    }

    /// Back up from a device [`descend`](Self::descend) entered.
    pub(super) fn ascend(&mut self) {
        self.depth -= 1;
    }

    /// The target mapping from now on: (hold index, target index) and its start.
    pub(super) fn at_target(&mut self, origin: (u16, u32), start: u64) {
        self.origin = origin;
        self.target_start = start;
    }

    /// The mapping is over: how many pieces targets took, and whether one asked
    /// for a flush after the request's I/O.
    pub(super) fn finish(self) -> (u32, bool) {
        (self.submitted, self.flush_after)
    }

    // ---- for targets ----

    /// Where the leaves produced from now on begin: [`wrap_hook_at`](Self::wrap_hook_at)
    /// and [`abandon_since`](Self::abandon_since) take it.
    pub fn mark(&self) -> Mark {
        Mark(self.leaves.len())
    }

    /// Run `hook` before the end-of-I/O hook of the read or write leaf produced
    /// since `mark` that holds byte `at` of the request's data (a bio's `buf_off`
    /// plus an index in it), with whether its I/O happened, the leaf's data and
    /// where byte `at` lies in it: flakey corrupts a read as it completes. False
    /// if no leaf since `mark` holds that byte (a target took it as a piece).
    pub fn wrap_hook_at(
        &mut self,
        mark: Mark,
        at: usize,
        hook: impl Fn(bool, &mut [u8], usize) + Send + Sync + 'static,
    ) -> bool {
        let found = self.leaves.get_mut(mark.0..).and_then(|ls| {
            ls.iter_mut().find(|l| {
                matches!(l.kind, LeafKind::Read | LeafKind::Write)
                    && l.buf_off <= at
                    && at - l.buf_off < l.len as usize
            })
        });
        let Some(l) = found else { return false };
        let skip = at - l.buf_off;
        let prev = l.end_io.take();
        l.end_io = Some(Arc::new(move |ok, data: &mut [u8]| {
            hook(ok, data, skip);
            prev.as_ref().map_or(0, |p| p(ok, data))
        }));
        true
    }

    /// Give up the leaves produced since `mark` (they will not be issued): their
    /// hooks run now, with `false`, so every one learns its I/O did not happen.
    pub fn abandon_since(&mut self, mark: Mark) {
        let from = mark.0.min(self.leaves.len());
        for l in self.leaves.drain(from..) {
            if let Some(h) = l.end_io {
                h(false, &mut []);
            }
        }
    }

    /// Enter `dev` for this request before mapping through it: for a target that
    /// must be counted in a device's in-flight epoch before it looks something up
    /// (thin's lock-free fast path). Some when this call took a new hold, which
    /// [`release_hold`](Self::release_hold) may give back.
    pub fn hold_device(&mut self, dev: &Arc<Device>) -> Result<Option<HoldMark>, MapErr> {
        if dev.removed.load(Ordering::SeqCst) {
            return Err(MapErr::Errno(crate::io::errno::EIO));
        }
        let before = self.holds.len();
        self.enter(dev)?;
        Ok((self.holds.len() > before).then_some(HoldMark(before)))
    }

    /// Give back the hold [`hold_device`](Self::hold_device) took, if nothing was
    /// mapped through it since (it is still the last one).
    pub fn release_hold(&mut self, h: HoldMark) {
        if h.0 + 1 == self.holds.len() {
            if let Some(h) = self.holds.pop().filter(|h| h.counted) {
                super::leave(&h.dev, h.epoch);
            }
        }
    }

    /// Once the request's I/O is done, send an empty flush down the device before
    /// completing it: for a FUA write whose durability needs more than its own
    /// data (dm-thin: a mapping not yet committed).
    pub fn flush_after(&mut self) {
        self.flush_after = true;
    }

    /// Send `bio` (already in `dev`'s sector space) to `dev`; `tag` is passed back to
    /// the target's `io_error` if the resulting I/O fails.
    pub fn remap(&mut self, dev: &DevRef, bio: Bio, tag: u16) -> Result<(), MapErr> {
        match dev {
            DevRef::File(f) => {
                self.push_file_leaf(f, bio, tag);
                Ok(())
            }
            DevRef::Dm(d) => self.remap_dm(&d.0, bio),
        }
    }

    fn remap_dm(&mut self, d: &Arc<Device>, bio: Bio) -> Result<(), MapErr> {
        let saved = (self.origin, self.target_start);
        let r = super::map_bio(d, bio, self);
        (self.origin, self.target_start) = saved;
        r
    }

    /// As `remap`, to a [`Dest`], running `end_io` (if any) once everything it
    /// produced is done (with `false` if any of it failed or was never issued).
    pub fn remap_dest_with(&mut self, dest: &Dest, bio: Bio, end_io: Option<EndIo>) -> Result<(), MapErr> {
        let go = |ctx: &mut Self| match dest {
            Dest::File(f) => {
                ctx.push_file_leaf(f, bio, 0);
                Ok(())
            }
            Dest::Dm(d) => ctx.remap_dm(d, bio),
        };
        match end_io {
            Some(hook) => self.joined(hook, go),
            None => go(self),
        }
    }

    /// Run `end_io` once every leaf and piece `bio`'s mapping onto `dev` produces
    /// is done: dm-thin maps a new block once the write to it has landed. What
    /// the hook changes is made durable as the request's: a FUA request whose
    /// hooks ran ends with a flush down the device.
    pub fn remap_with(&mut self, dev: &DevRef, bio: Bio, tag: u16, end_io: EndIo) -> Result<(), MapErr> {
        self.joined(end_io, |ctx| ctx.remap(dev, bio, tag))
    }

    /// As [`remap_with`](Self::remap_with), for a hook that only notes the
    /// completion and changes nothing a flush must make durable (log-writes
    /// records it in memory): a FUA request ends without a flush for it.
    pub fn remap_noting(&mut self, dev: &DevRef, bio: Bio, tag: u16, end_io: EndIo) -> Result<(), MapErr> {
        self.joined_as(end_io, false, false, |ctx| ctx.remap(dev, bio, tag))
    }

    /// As [`remap_noting`](Self::remap_noting), where a failure of the I/O it
    /// produces does not fail the request: only `end_io` learns it (`false`),
    /// and its answer decides: 0 (the request goes on as if that I/O had
    /// succeeded: a mirror's other leg has the data), an errno, or
    /// [`crate::io::REMAP`] (map the request again). raid1 sends each leg's
    /// copy of a write and each read this way. An errno a hook of a device
    /// below returns still fails the request.
    pub fn remap_tolerant(&mut self, dev: &DevRef, bio: Bio, tag: u16, end_io: EndIo) -> Result<(), MapErr> {
        self.joined_as(end_io, false, true, |ctx| ctx.remap(dev, bio, tag))
    }

    /// Run `f` with every leaf and piece it produces joined to `hook`; a hook
    /// already collecting (an outer one) waits for this one too.
    fn joined(&mut self, hook: EndIo, f: impl FnOnce(&mut Self) -> Result<(), MapErr>) -> Result<(), MapErr> {
        self.joined_as(hook, true, false, f)
    }

    /// [`joined`](Self::joined), saying whether `hook` needs a FUA request's
    /// flush after it, and whether a failure under it fails only into it.
    fn joined_as(
        &mut self,
        hook: EndIo,
        needs_flush: bool,
        tolerant: bool,
        f: impl FnOnce(&mut Self) -> Result<(), MapErr>,
    ) -> Result<(), MapErr> {
        let outer = self.join.take();
        let needs_flush = needs_flush || outer.as_ref().is_some_and(|o| o.needs_flush);
        let own_verdict = tolerant;
        let tolerant = tolerant || outer.as_ref().is_some_and(|o| o.tolerant);
        let hook = match &outer {
            Some(o) => {
                let up = o.child();
                Arc::new(move |ok, d: &mut [u8]| {
                    let e = hook(ok, d);
                    // a tolerant hook's answer replaces the outcome of the I/O under it
                    let up_e = up((ok || own_verdict) && e == 0, &mut []);
                    if e != 0 {
                        e
                    } else {
                        up_e
                    }
                }) as EndIo
            }
            None => hook,
        };
        let j = Arc::new(Join {
            left: AtomicUsize::new(1),
            failed: AtomicBool::new(false),
            hook,
            needs_flush,
            tolerant,
        });
        self.join = Some(j.clone());
        let r = f(self);
        self.join = outer;
        // the mapping's own share: its errno, if it is the last, fails nothing
        // more than the map result below does
        let _ = j.finish(r.is_ok());
        r
    }

    pub(super) fn push_file_leaf(&mut self, f: &Arc<BackingFile>, bio: Bio, tag: u16) {
        let handle = f.handle();
        let kind = match bio.op {
            Op::Read => LeafKind::Read,
            Op::Write => {
                if bio.fua {
                    f.fua_writes.fetch_add(1, Ordering::Relaxed);
                }
                LeafKind::Write
            }
            Op::Flush => {
                // One flush per underlying file, however many targets or stacked
                // devices lead to it.
                if self
                    .leaves
                    .iter()
                    .any(|l| l.kind == LeafKind::Flush && l.file == Some(handle))
                {
                    return;
                }
                // `dmkit stats` counts flushes sent to each file, NBD ones included.
                f.flushes.fetch_add(1, Ordering::Relaxed);
                LeafKind::Flush
            }
            Op::Discard => LeafKind::Discard,
            Op::WriteZeroes => LeafKind::WriteZeroes { punch: bio.punch },
        };
        let end_io = self.join.as_ref().map(|j| j.child());
        let hook_needs_flush = self.join.as_ref().is_some_and(|j| j.needs_flush);
        let tolerant = self.join.as_ref().is_some_and(|j| j.tolerant);
        self.leaves.push(Leaf {
            kind,
            file: Some(handle),
            offset: bio.sector * SECTOR,
            len: bio.bytes(),
            buf_off: bio.buf_off,
            owned: self.cur,
            fua: bio.fua,
            done: 0,
            origin: (self.origin.0, self.origin.1, tag),
            end_io,
            hook_needs_flush,
            tolerant,
        });
    }

    /// Take `bio` (relative to the current target) to finish later, from any thread
    /// (the kernel's DM_MAPIO_SUBMITTED): the request waits for the [`Pending`].
    pub fn submit(&mut self, bio: Bio) -> Pending {
        self.submitted += 1;
        let end_io = self.join.as_ref().map(|j| j.child());
        let hook_needs_flush = self.join.as_ref().is_some_and(|j| j.needs_flush);
        let tolerant = self.join.as_ref().is_some_and(|j| j.tolerant);
        let piece = Piece {
            owned: self.cur,
            slot: self.slot,
            gen: self.gen,
            origin: self.origin,
            target_start: self.target_start,
            bio,
            end_io,
            hook_needs_flush,
            tolerant,
        };
        Pending::new(self.inbox.clone(), piece)
    }

    /// Complete `bio` without I/O: zero-fill it (reads), fail it, or drop it.
    pub fn complete(&mut self, bio: Bio, kind: LeafKind) {
        let mut l = Leaf::new(kind, if bio.op.has_data() { bio.bytes() } else { 0 }, bio.buf_off);
        l.origin = (self.origin.0, self.origin.1, 0);
        l.owned = self.cur;
        l.end_io = self.join.as_ref().map(|j| j.child());
        l.hook_needs_flush = self.join.as_ref().is_some_and(|j| j.needs_flush);
        l.tolerant = self.join.as_ref().is_some_and(|j| j.tolerant);
        self.leaves.push(l);
    }

    /// The part of the request's data `bio` covers (empty without data).
    pub fn data_of(&mut self, bio: &Bio) -> &mut [u8] {
        bio_data(self.owned, self.data, self.cur, bio).unwrap_or_default()
    }

    /// The integrity tags that go with `bio`'s data (None: it has none).
    pub fn tags_of(&mut self, bio: &Bio) -> Option<&mut [u8]> {
        bio_tags(self.owned, self.cur, bio)
    }
}

/// The integrity tags of `bio`, in owned buffer `cur` (a request's own data
/// has none); None if it has none or they lie outside.
pub(crate) fn bio_tags<'a>(owned: &'a mut [Owned], cur: Option<u32>, bio: &Bio) -> Option<&'a mut [u8]> {
    let t = bio.tags?;
    let o = owned.get_mut(cur? as usize)?;
    let a = t.off as usize;
    o.buf.as_mut_slice()[..o.len + o.tag_len].get_mut(a..a + t.len(bio.bytes()))
}

/// The part of a request's data (`data`), or of its owned buffer `cur`, that
/// `bio` covers; None if it lies outside.
pub(crate) fn bio_data<'a>(
    owned: &'a mut [Owned],
    data: &'a mut [u8],
    cur: Option<u32>,
    bio: &Bio,
) -> Option<&'a mut [u8]> {
    let (a, n) = (bio.buf_off, bio.bytes() as usize);
    let all = match cur.and_then(|b| owned.get_mut(b as usize)) {
        Some(o) => &mut o.buf.as_mut_slice()[..o.len],
        None => data,
    };
    all.get_mut(a..a + n)
}

/// Run a leaf's end-of-I/O hook with its part of the request buffer.
pub(crate) fn apply_end_io(h: &EndIo, ok: bool, l: &Leaf, buf: &mut [u8]) -> i32 {
    let data = if matches!(l.kind, LeafKind::Read | LeafKind::Write) {
        let a = l.buf_off;
        buf.get_mut(a..a + l.len as usize).unwrap_or_default()
    } else {
        &mut []
    };
    h(ok, data)
}

/// One target type's instance in a table.
pub trait Target: Send + Sync {
    fn type_name(&self) -> &'static str;
    /// Map `bio` (sectors relative to the target's start).
    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr>;
    /// `dmsetup table` parameters.
    fn table_params(&self) -> String;
    /// The table parameters with every key in them zeroed, as `dmsetup table`
    /// shows them without `--showkeys` and as the state file records them;
    /// None when the table holds no key.
    fn table_params_keyless(&self) -> Option<String> {
        None
    }
    /// `dmsetup status` parameters.
    fn status_params(&self) -> String {
        String::new()
    }
    /// The same asked with DM_NOFLUSH_FLAG (LVM and dmeventd poll with it): a
    /// target whose status commits first (a thin pool's) answers without the
    /// commit, as the kernel's.
    fn status_params_noflush(&self) -> String {
        self.status_params()
    }
    /// `dmsetup message`; Ok(response) or Err(reason).
    fn message(&self, words: &[String]) -> Result<String, TargetError> {
        let _ = words;
        Err(format!("target {} takes no messages", self.type_name()).into())
    }
    /// The devices this target maps onto, in table order.
    fn devices(&self) -> Vec<&DevRef> {
        Vec::new()
    }
    /// Every device the target's table line opened, in table order, as the
    /// kernel's table lists them for `deps`: the devices it maps onto and any it
    /// keeps metadata on (a thin pool's metadata device).
    fn held_devices(&self) -> Vec<&DevRef> {
        self.devices()
    }
    /// The messages that make the state earlier messages set again (writecache
    /// `cleaner`), in order: recorded with the table for `serve --restore`, as a
    /// reboot would lose them in the kernel but a daemon restart must not.
    fn replay_messages(&self) -> Vec<String> {
        Vec::new()
    }
    /// An empty flush may go straight to each underlying device, once, without the
    /// target's map (the kernel's flush_bypasses_map: linear and striped).
    fn flush_bypasses_map(&self) -> bool {
        false
    }
    /// The largest read or write `map` is given, in sectors, at boundaries that are
    /// multiples of it from the target's start (the kernel's `max_io_len`: thin's
    /// block, a stripe's chunk, a snapshot's chunk); 0: no limit. The engine splits
    /// there, so `map` sees one block, chunk or stripe at a time. Discards and
    /// zeroing are not split: targets take them by range.
    fn max_io_len(&self) -> u64 {
        0
    }
    /// The smallest I/O the target takes, in bytes (0: whatever its devices take):
    /// raises the device's logical block size (writecache's block size).
    fn logical_block_size(&self) -> u32 {
        0
    }
    /// The target's queue limits. Default: those of the devices it maps onto.
    fn limits(&self) -> Limits {
        Limits::stacked(&self.devices())
    }
    /// The integrity profile the target offers a device above: it stores and
    /// gives back the tags a bio carries ([`Bio::tags`]). Default: none (a
    /// bio's tags go no further).
    fn tag_profile(&self) -> Option<TagProfile> {
        None
    }
    /// Allocation status of `[sector, sector+nr)` (relative): pushes (bytes, flags)
    /// with NBD's base:allocation bits (1 hole, 2 zero). Default: all data. Err: the
    /// status cannot be known (metadata failed): the request fails, never guesses.
    fn extents(&self, sector: u64, nr: u64, out: &mut Vec<(u64, u32)>) -> Result<(), TargetError> {
        let _ = sector;
        out.push((nr * SECTOR, 0));
        Ok(())
    }
    /// The target type of a read-only view of this device at a point in time
    /// (`cdp-point`): a device whose table is one such target is offered as
    /// `NAME@SPEC` ([`crate::mapper::Registry::open_view`]).
    fn view_type(&self) -> Option<&'static str> {
        None
    }
    /// Changed-block tracking (the NBD context `qemu:dirty-bitmap:BASE`): whether
    /// `base` names something this target compares against; Err says why not.
    fn check_base(&self, base: &str) -> Result<(), TargetError> {
        let _ = base;
        Err("the target keeps no changed-block information".into())
    }
    /// Ranges of `[sector, sector+nr)` (relative) where the contents may differ
    /// from `base`: pushes (bytes, 1 changed / 0 unchanged). Default: all changed.
    fn changed_extents(
        &self,
        base: &str,
        sector: u64,
        nr: u64,
        out: &mut Vec<(u64, u32)>,
    ) -> Result<(), TargetError> {
        let _ = (base, sector);
        out.push((nr * SECTOR, 1));
        Ok(())
    }
    /// An I/O this target issued failed; `tag` is what it passed to `remap`.
    fn io_error(&self, tag: u16) {
        let _ = tag;
    }
    /// Called when the device starts to suspend, before in-flight I/O is drained.
    fn presuspend(&self) {}
    /// Called before the device resumes with this table; Err refuses the resume
    /// (the device stays suspended, the table inactive).
    fn preresume(&self) -> Result<(), TargetError> {
        Ok(())
    }
    /// Called when the device resumes with this table.
    fn resume(&self) {}
    /// Called once a suspending device has drained (thin-pool commits here).
    fn postsuspend(&self) {}
    /// Events the target raised (dm_table_event): added to the device's event number.
    fn events(&self) -> u64 {
        0
    }
}

/// Extents of a device range through a device reference (file holes, or a stacked
/// dmkit device's own extents).
pub fn dev_extents(dev: &DevRef, sector: u64, nr: u64, out: &mut Vec<(u64, u32)>) -> Result<(), TargetError> {
    match dev {
        DevRef::File(f) => {
            // a file that cannot say where its holes are is all data
            let mut ext = Vec::new();
            if f.extents(sector * SECTOR, nr * SECTOR, &mut ext).is_err() {
                out.push((nr * SECTOR, 0));
                return Ok(());
            }
            out.extend(ext.into_iter().map(|(len, hole)| (len, if hole { 3 } else { 0 })));
            Ok(())
        }
        DevRef::Dm(d) => super::device_extents(&d.0, sector, nr, out),
    }
}

/// State targets share across tables and devices, found by type (the kernel's
/// module-wide lists): a target type keeps its own there (the snapshots of each
/// origin, the thin pools, a copy engine). The registry of devices owns it; the
/// core never looks inside.
#[derive(Default)]
pub struct Shared {
    by_type: Mutex<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>,
    /// The directory of the restart logs (`io::restart_log`), if kept.
    pub restart_logs: Option<std::path::PathBuf>,
}

impl Shared {
    pub fn new(restart_logs: Option<std::path::PathBuf>) -> Shared {
        Shared {
            restart_logs,
            ..Shared::default()
        }
    }

    /// The shared `T`, made with `T::default()` the first time it is asked for.
    pub fn get_or_init<T: Any + Default + Send + Sync>(&self) -> Arc<T> {
        let mut m = self.by_type.lock().unpoisoned();
        let any = m
            .entry(TypeId::of::<T>())
            .or_insert_with(|| Arc::new(T::default()))
            .clone();
        // the entry for T's TypeId only ever holds a T
        any.downcast::<T>().unwrap_or_else(|_| Arc::new(T::default()))
    }

    /// The shared `T`, if some target made it.
    pub fn get<T: Any + Send + Sync>(&self) -> Option<Arc<T>> {
        let m = self.by_type.lock().unpoisoned();
        m.get(&TypeId::of::<T>()).cloned()?.downcast::<T>().ok()
    }
}

/// Context for constructing targets: how to open the devices a table names.
pub trait Resolver {
    fn open(&self, name: &str) -> Result<DevRef, TargetError>;
    /// State shared between targets.
    fn shared(&self) -> &Shared;
    /// The device whose table is being built.
    fn device(&self) -> &Arc<Device>;
    /// The daemon's options, which targets read when they are constructed.
    fn config(&self) -> &crate::mapper::config::Config;
    /// The table is loaded read-only (DM_READONLY_FLAG, `--readonly`).
    fn read_only(&self) -> bool;
    /// The table needs sectors up to `end` of the dmkit device `dev` (named
    /// `name` in the table): checked when the table is resumed, as the kernel
    /// checks device areas when it swaps a table in, so a table over a device
    /// that grows at its own resume can be loaded first (libdevmapper loads a
    /// stack's tables before it resumes any of them).
    fn size_check(&self, dev: &Arc<Device>, name: &str, end: u64);
}

/// Builds a target from its table arguments, its length in sectors and the
/// table's [`Resolver`]; Err says what is wrong (naming the field).
pub type Constructor = fn(&[String], u64, &dyn Resolver) -> Result<Box<dyn Target>, TargetError>;

/// One target type: its name in tables, its version as the kernel reports it
/// (`dmsetup targets`, DM_LIST_VERSIONS), and how to build one. Each target
/// declares its own; `crate::targets::types()` lists them, and the registry
/// builds tables from that list.
#[derive(Clone, Copy, Debug)]
pub struct TargetType {
    pub name: &'static str,
    pub version: [u32; 3],
    pub new: Constructor,
    /// Run at daemon shutdown, after the devices' flushes: make the type's shared
    /// state durable (thin pools commit).
    pub sync: Option<fn(&Shared)>,
}

/// Parse a numeric target argument, naming the field on error.
pub fn arg_u64(args: &[String], i: usize, field: &str) -> Result<u64, TargetError> {
    let v = args.get(i).ok_or_else(|| format!("missing argument {field}"))?;
    v.parse::<u64>()
        .map_err(|_| TargetError::from(format!("invalid {field} '{v}'")))
}

/// Open the device argument `i` and check that `[offset, offset+len)` lies inside it
/// and is aligned to its logical block size, as the kernel checks at table load.
pub fn arg_dev(
    args: &[String],
    i: usize,
    offset: u64,
    len: u64,
    r: &dyn Resolver,
) -> Result<DevRef, TargetError> {
    let name = args.get(i).ok_or("missing argument device")?;
    let dev = r.open(name).map_err(|e| format!("device '{name}': {e}"))?;
    let size = dev.size_sectors();
    if let (DevRef::Dm(d), Some(end)) = (&dev, offset.checked_add(len)) {
        r.size_check(&d.0, name, end);
    } else if offset.checked_add(len).is_none_or(|end| end > size) {
        return Err(format!(
            "device '{name}' too small for target: offset {offset} + length {len} sectors > device size {size} sectors"
        ).into());
    }
    let lbs = u64::from(dev.logical_block_size() / 512).max(1);
    if !offset.is_multiple_of(lbs) || !len.is_multiple_of(lbs) {
        return Err(format!(
            "device '{name}': offset {offset} and length {len} not aligned to its logical block size ({} bytes)",
            lbs * 512
        ).into());
    }
    Ok(dev)
}
