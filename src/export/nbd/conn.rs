//! The transmission phase: one thread per connection, one io_uring per thread.
//!
//! Requests are parsed from a receive buffer into slots; each slot's request is
//! mapped through the device's table into leaf I/Os submitted to the same ring;
//! replies are gathered into one sendmsg per batch. Nothing is shared with other
//! connections but the device (an atomic in-flight count and its table), and the
//! steady state allocates nothing.

use super::proto::*;
use crate::io::queue::{IoQueue, Sqe};
use crate::io::{AlignedBuf, Leaf, LeafKind, Op, SECTOR};
use crate::mapper::{self, Device};
use crate::targets::{apply_corrupt, Bio, MapCtx, MapErr};
use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

const RBUF_LEN: usize = 256 << 10;
/// Requests in flight per connection; more wait in the socket.
const MAX_SLOTS: usize = 256;
/// Payload bytes held by requests of one connection before parsing pauses.
const MAX_INFLIGHT_BYTES: u64 = 96 << 20;
/// Slot buffers larger than this are given back when the slot is freed.
const KEEP_BUF: usize = 4 << 20;
/// Replies gathered into one sendmsg.
const SEND_BATCH: usize = 64;
/// Largest write payload read (and thrown away) from a client before hanging up.
const MAX_DISCARDED_PAYLOAD: u64 = 2 * MAX_PAYLOAD as u64;
const ZERO_BUF: usize = 1 << 20;

const KIND_SHIFT: u32 = 60;
const KIND_LEAF: u64 = 0;
const KIND_RECV: u64 = 1;
const KIND_SEND: u64 = 2;

fn ud_leaf(slot: usize, leaf: usize) -> u64 {
    (KIND_LEAF << KIND_SHIFT) | ((slot as u64) << 32) | leaf as u64
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    Free,
    /// Receiving its write payload.
    Payload,
    /// Waiting for a suspended device to resume.
    Parked,
    InFlight,
    /// Reply queued or being sent.
    Reply,
}

struct Slot {
    state: State,
    cookie: u64,
    cmd: u16,
    flags: u16,
    offset: u64,
    len: u32,
    buf: AlignedBuf,
    leaves: Vec<Leaf>,
    holds: Vec<mapper::Hold>,
    pending: u32,
    /// NBD error of the request (0 = success).
    error: u32,
    /// After the leaves: make the effect durable (FUA on discard / write-zeroes).
    then_flush: bool,
    /// A leaf ran a completion hook (a target changed metadata after the I/O): with
    /// FUA, the request ends with a flush so that change is durable too.
    hooked: bool,
    hdr: [u8; 32],
    hdr_len: usize,
    data_len: usize,
    extra: Vec<u8>,
    /// BLOCK_STATUS: the first chunk's payload is `extra[..extra_first]`; the rest
    /// of `extra` is further chunks, headers included.
    extra_first: usize,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            state: State::Free,
            cookie: 0,
            cmd: 0,
            flags: 0,
            offset: 0,
            len: 0,
            buf: AlignedBuf::default(),
            leaves: Vec::with_capacity(8),
            holds: Vec::with_capacity(4),
            pending: 0,
            error: 0,
            then_flush: false,
            hooked: false,
            hdr: [0; 32],
            hdr_len: 0,
            data_len: 0,
            extra: Vec::new(),
            extra_first: 0,
        }
    }
}

/// Where the next receive lands.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RecvInto {
    Rbuf,
    Slot(usize),
}

pub struct Conn {
    fd: RawFd,
    dev: Arc<Device>,
    size: u64,
    /// The transmission flags the client was given: commands and flags they do not
    /// offer are refused.
    tflags: u16,
    structured: bool,
    base_allocation: bool,
    /// The base of the negotiated `qemu:dirty-bitmap:BASE` context.
    dirty_base: Option<String>,
    q: IoQueue,
    rbuf: AlignedBuf,
    rpos: usize,
    rend: usize,
    recv_inflight: Option<RecvInto>,
    /// The slot whose write payload is being received, and bytes received so far.
    payload: Option<(usize, usize)>,
    /// Payload bytes of a refused write still to be read and thrown away.
    discard: u64,
    slots: Vec<Slot>,
    free: Vec<usize>,
    inflight_bytes: u64,
    sendq: VecDeque<usize>,
    sending: Vec<usize>,
    iov: Vec<libc::iovec>,
    iov_pos: usize,
    msg: libc::msghdr,
    send_inflight: bool,
    parked: VecDeque<usize>,
    delayed: Vec<(Instant, usize, usize)>,
    /// Leaves (slot, leaf) of pieces a target deferred: mapped again each turn.
    deferred: Vec<(usize, usize)>,
    ops: u64,
    closing: bool,
    dead: bool,
    zero_buf: AlignedBuf,
    cq: Vec<(u64, i32)>,
}

impl Conn {
    pub fn new(fd: RawFd, n: super::handshake::Negotiated) -> Conn {
        // SAFETY: msghdr is a plain C struct for which all-zero is a valid value.
        let msg: libc::msghdr = unsafe { std::mem::zeroed() };
        Conn {
            fd,
            dev: n.dev,
            size: n.size,
            tflags: n.flags,
            structured: n.structured,
            base_allocation: n.base_allocation,
            dirty_base: n.dirty_base,
            q: IoQueue::new(512),
            rbuf: AlignedBuf::new(RBUF_LEN),
            rpos: 0,
            rend: 0,
            recv_inflight: None,
            payload: None,
            discard: 0,
            slots: (0..MAX_SLOTS).map(|_| Slot::new()).collect(),
            free: (0..MAX_SLOTS).rev().collect(),
            inflight_bytes: 0,
            sendq: VecDeque::new(),
            sending: Vec::with_capacity(SEND_BATCH),
            iov: Vec::with_capacity(2 * SEND_BATCH),
            iov_pos: 0,
            msg,
            send_inflight: false,
            parked: VecDeque::new(),
            delayed: Vec::new(),
            deferred: Vec::new(),
            ops: 0,
            closing: false,
            dead: false,
            zero_buf: AlignedBuf::default(),
            cq: Vec::with_capacity(256),
        }
    }

    /// Serve until the client disconnects; every submitted operation has completed
    /// when this returns (buffers are never freed under the kernel).
    pub fn run(&mut self) {
        loop {
            if !self.parked.is_empty() {
                self.retry_parked();
            }
            if !self.delayed.is_empty() {
                self.release_delayed();
            }
            if !self.deferred.is_empty() {
                self.retry_deferred();
            }
            if !self.dead && !self.closing {
                self.parse();
                self.arm_recv();
            }
            if !self.dead && !self.send_inflight && !self.sendq.is_empty() {
                self.send_batch();
            }
            let busy = self.free.len() < MAX_SLOTS;
            if self.ops == 0 && (self.dead || (self.closing && !busy)) {
                break;
            }
            if self.dead {
                // Wake a receive that would otherwise wait for the client forever.
                // SAFETY: shutdown on our own socket descriptor.
                unsafe { libc::shutdown(self.fd, libc::SHUT_RDWR) };
            }
            let waiting = !self.parked.is_empty() || !self.delayed.is_empty() || !self.deferred.is_empty();
            let timeout = waiting.then_some(Duration::from_millis(1));
            if self.q.wait(timeout).is_err() {
                self.dead = true;
            }
            let mut cq = std::mem::take(&mut self.cq);
            self.q.drain(|u, r| cq.push((u, r)));
            for &(u, r) in &cq {
                self.ops -= 1;
                self.complete_op(u, r);
            }
            cq.clear();
            self.cq = cq;
            if self.dead && self.ops == 0 {
                // Requests parked or delayed never reach the kernel now.
                self.parked.clear();
                self.delayed.clear();
                self.deferred.clear();
                break;
            }
        }
        for s in &mut self.slots {
            mapper::release(&mut s.holds);
        }
    }

    fn push(&mut self, op: Sqe, ud: u64) {
        self.ops += 1;
        // SAFETY: every pointer in `op` names memory owned by `self` (the receive
        // buffer, slot buffers, the zero buffer, iovecs and msghdr), which is neither
        // freed nor moved while `ops > 0`: `run` only returns once every submitted
        // operation has completed, and buffers are only resized in free slots.
        unsafe { self.q.push(op, ud) };
    }

    // ---- receiving and parsing ----

    fn arm_recv(&mut self) {
        if self.recv_inflight.is_some() {
            return;
        }
        if let Some((slot, got)) = self.payload {
            if self.rpos == self.rend {
                // Large payloads land in the slot's buffer directly.
                let need = self.slots[slot].len as usize - got;
                if need >= 64 << 10 {
                    let ptr = self.slots[slot].buf.as_mut_slice()[got..].as_mut_ptr();
                    self.push(
                        Sqe::Recv {
                            fd: self.fd,
                            buf: ptr,
                            len: need as u32,
                        },
                        KIND_RECV << KIND_SHIFT,
                    );
                    self.recv_inflight = Some(RecvInto::Slot(slot));
                    return;
                }
            }
        } else if self.discard == 0 && (self.free.is_empty() || self.inflight_bytes >= MAX_INFLIGHT_BYTES) {
            return; // back-pressure: the client waits in the socket
        }
        if self.rend == self.rbuf.capacity() {
            if self.rpos == 0 {
                return; // full of unparsed bytes; parsing must make room first
            }
            self.compact();
        }
        let ptr = self.rbuf.as_mut_slice()[self.rend..].as_mut_ptr();
        let len = (self.rbuf.capacity() - self.rend) as u32;
        self.push(
            Sqe::Recv {
                fd: self.fd,
                buf: ptr,
                len,
            },
            KIND_RECV << KIND_SHIFT,
        );
        self.recv_inflight = Some(RecvInto::Rbuf);
    }

    fn compact(&mut self) {
        let n = self.rend - self.rpos;
        self.rbuf.as_mut_slice().copy_within(self.rpos..self.rend, 0);
        self.rpos = 0;
        self.rend = n;
    }

    fn on_recv(&mut self, into: RecvInto, r: i32) {
        if r <= 0 {
            // EOF at a request boundary is a normal disconnect (fio just closes).
            if r < 0 || self.payload.is_some() || self.rpos != self.rend {
                self.dead = true;
            }
            self.closing = true;
            return;
        }
        match into {
            RecvInto::Rbuf => self.rend += r as usize,
            RecvInto::Slot(slot) => {
                if let Some((s, got)) = self.payload.as_mut() {
                    *got += r as usize;
                    if *s == slot && *got == self.slots[slot].len as usize {
                        self.payload = None;
                        self.dispatch(slot);
                    }
                }
            }
        }
    }

    fn parse(&mut self) {
        loop {
            let avail = self.rend - self.rpos;
            if self.discard > 0 {
                let n = (self.discard as usize).min(avail);
                self.rpos += n;
                self.discard -= n as u64;
                if self.discard > 0 {
                    break;
                }
                continue;
            }
            if let Some((slot, got)) = self.payload {
                let need = self.slots[slot].len as usize - got;
                let n = need.min(avail);
                if n == 0 {
                    break;
                }
                let (rpos, src) = (self.rpos, self.rbuf.as_slice());
                self.slots[slot].buf.as_mut_slice()[got..got + n].copy_from_slice(&src[rpos..rpos + n]);
                self.rpos += n;
                if n == need {
                    self.payload = None;
                    self.dispatch(slot);
                } else {
                    self.payload = Some((slot, got + n));
                    break;
                }
                continue;
            }
            if avail < 28 || self.closing || self.free.is_empty() || self.inflight_bytes >= MAX_INFLIGHT_BYTES
            {
                break;
            }
            let h = &self.rbuf.as_slice()[self.rpos..self.rpos + 28];
            let magic = u32::from_be_bytes([h[0], h[1], h[2], h[3]]);
            if magic != REQUEST_MAGIC {
                tracing::warn!(
                    "nbd {}: bad request magic {magic:#x}; disconnecting",
                    self.dev.name()
                );
                self.dead = true;
                return;
            }
            let flags = u16::from_be_bytes([h[4], h[5]]);
            let cmd = u16::from_be_bytes([h[6], h[7]]);
            let cookie = u64::from_be_bytes(h[8..16].try_into().unwrap_or_default());
            let offset = u64::from_be_bytes(h[16..24].try_into().unwrap_or_default());
            let len = u32::from_be_bytes([h[24], h[25], h[26], h[27]]);
            self.rpos += 28;
            if cmd == CMD_DISC {
                self.closing = true;
                return;
            }
            let Some(slot) = self.free.pop() else { return };
            let s = &mut self.slots[slot];
            s.cookie = cookie;
            s.cmd = cmd;
            s.flags = flags;
            s.offset = offset;
            s.len = len;
            s.error = 0;
            s.then_flush = false;
            s.hooked = false;
            s.extra.clear();
            s.extra_first = 0;
            if cmd == CMD_WRITE {
                if u64::from(len) > MAX_PAYLOAD as u64 {
                    if u64::from(len) > MAX_DISCARDED_PAYLOAD {
                        tracing::warn!(
                            "nbd {}: write payload of {len} bytes; disconnecting",
                            self.dev.name()
                        );
                        self.free.push(slot);
                        self.dead = true;
                        return;
                    }
                    self.discard = u64::from(len);
                    self.finish_err(slot, EOVERFLOW);
                    continue;
                }
                s.buf.ensure(len as usize);
                s.state = State::Payload;
                self.inflight_bytes += u64::from(len);
                self.payload = Some((slot, 0));
                continue;
            }
            if cmd == CMD_READ && len <= MAX_PAYLOAD {
                s.buf.ensure(len as usize);
                self.inflight_bytes += u64::from(len);
            }
            self.dispatch(slot);
        }
        if self.rpos == self.rend {
            self.rpos = 0;
            self.rend = 0;
        } else if self.rpos > self.rbuf.capacity() / 2 {
            self.compact();
        }
    }

    // ---- requests ----

    /// Validate a request against the protocol's rules; Err(nbd errno) refuses it.
    fn validate(&self, s: &Slot) -> Result<(), u32> {
        let end = s.offset.checked_add(u64::from(s.len));
        let aligned = (s.offset | u64::from(s.len)).is_multiple_of(SECTOR);
        let known = match s.cmd {
            CMD_READ => CMD_FLAG_FUA | CMD_FLAG_DF,
            CMD_WRITE | CMD_TRIM => CMD_FLAG_FUA,
            CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
            CMD_BLOCK_STATUS => CMD_FLAG_FUA | CMD_FLAG_REQ_ONE,
            CMD_FLUSH | CMD_CACHE => CMD_FLAG_FUA,
            _ => return Err(EINVAL),
        };
        if s.flags & !known != 0 {
            return Err(EINVAL);
        }
        let writes = matches!(s.cmd, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
        if writes && self.dev.read_only {
            return Err(EPERM);
        }
        // Not offered: the device cannot honour it (the kernel's EOPNOTSUPP); the
        // protocol answers an unadvertised command or flag with EINVAL.
        let offered = match s.cmd {
            CMD_TRIM => self.tflags & TF_SEND_TRIM != 0,
            CMD_WRITE_ZEROES if s.flags & CMD_FLAG_FAST_ZERO != 0 => self.tflags & TF_SEND_FAST_ZERO != 0,
            _ => true,
        };
        if !offered {
            return Err(EINVAL);
        }
        if s.cmd == CMD_FLUSH {
            return if s.offset == 0 && s.len == 0 {
                Ok(())
            } else {
                Err(EINVAL)
            };
        }
        if s.cmd == CMD_BLOCK_STATUS
            && !(self.structured && (self.base_allocation || self.dirty_base.is_some()))
        {
            return Err(EINVAL);
        }
        if end.is_none_or(|e| e > self.size) {
            return Err(if matches!(s.cmd, CMD_WRITE | CMD_WRITE_ZEROES) {
                ENOSPC
            } else {
                EINVAL
            });
        }
        if !aligned {
            return Err(EINVAL);
        }
        if s.cmd == CMD_READ && s.len > MAX_PAYLOAD {
            return Err(EOVERFLOW);
        }
        Ok(())
    }

    fn dispatch(&mut self, slot: usize) {
        if let Err(e) = self.validate(&self.slots[slot]) {
            return self.finish_err(slot, e);
        }
        let s = &self.slots[slot];
        if s.cmd == CMD_BLOCK_STATUS {
            return self.block_status(slot);
        }
        // CACHE is advisory and the range is valid; empty reads and writes have nothing to do.
        let Some(op) = Self::op_of(s.cmd).filter(|&op| s.len > 0 || op == Op::Flush) else {
            return self.finish(slot);
        };
        // Behind requests waiting for a resume, to keep their order.
        if !self.parked.is_empty() || !self.map_and_submit(slot, op) {
            self.slots[slot].state = State::Parked;
            self.parked.push_back(slot);
        }
    }

    /// The operation an NBD command maps to (None: handled by the export itself).
    fn op_of(cmd: u16) -> Option<Op> {
        match cmd {
            CMD_READ => Some(Op::Read),
            CMD_WRITE => Some(Op::Write),
            CMD_FLUSH => Some(Op::Flush),
            CMD_TRIM => Some(Op::Discard),
            CMD_WRITE_ZEROES => Some(Op::WriteZeroes),
            _ => None,
        }
    }

    /// Map the request through the device and submit its leaves. False when a device
    /// on its path is suspended: the caller parks it where its order requires.
    fn map_and_submit(&mut self, slot: usize, op: Op) -> bool {
        let dev = self.dev.clone();
        let s = &mut self.slots[slot];
        let fua = s.flags & CMD_FLAG_FUA != 0;
        let bio = Bio {
            op,
            sector: s.offset / SECTOR,
            nr_sectors: u64::from(s.len) / SECTOR,
            buf_off: 0,
            fua: fua && op == Op::Write,
            punch: s.flags & CMD_FLAG_NO_HOLE == 0,
            token: 0,
        };
        s.then_flush = fua && matches!(op, Op::Discard | Op::WriteZeroes);
        s.leaves.clear();
        let r = {
            let mut ctx = MapCtx::new(&mut s.leaves, &mut s.holds);
            mapper::map_bio(&dev, bio, &mut ctx)
        };
        match r {
            Ok(()) => {
                crate::io::coalesce(&mut s.leaves);
                s.state = State::InFlight;
                self.submit_leaves(slot);
                true
            }
            Err(MapErr::Suspended) => {
                mapper::release(&mut s.holds);
                s.leaves.clear();
                s.state = State::Parked;
                false
            }
            Err(MapErr::Errno(e)) => {
                mapper::release(&mut s.holds);
                self.finish_err(slot, nbd_errno(e));
                true
            }
        }
    }

    fn retry_parked(&mut self) {
        while let Some(slot) = self.parked.pop_front() {
            let Some(op) = Self::op_of(self.slots[slot].cmd) else {
                continue;
            };
            if !self.map_and_submit(slot, op) {
                self.parked.push_front(slot); // still suspended: first in line again
                return;
            }
        }
    }

    fn submit_leaves(&mut self, slot: usize) {
        self.submit_leaves_from(slot, 0);
    }

    /// Issue leaves `from..` of `slot` (deferred and delayed ones wait their turn).
    fn submit_leaves_from(&mut self, slot: usize, from: usize) {
        let n = self.slots[slot].leaves.len();
        let now = Instant::now();
        for i in from..n {
            let l = &self.slots[slot].leaves[i];
            if matches!(l.kind, LeafKind::Deferred { .. }) {
                self.slots[slot].pending += 1;
                self.deferred.push((slot, i));
                continue;
            }
            if l.delay_ms > 0 && !l.release.as_ref().is_some_and(|r| r.load(Ordering::Relaxed)) {
                if let Some(h) = &l.held {
                    h.fetch_add(1, Ordering::Relaxed);
                }
                let due = now + Duration::from_millis(u64::from(l.delay_ms));
                self.slots[slot].pending += 1;
                self.delayed.push((due, slot, i));
                continue;
            }
            self.issue_leaf(slot, i);
        }
        if self.slots[slot].pending == 0 {
            self.leaves_done(slot);
        }
    }

    /// Map deferred pieces again; those still blocked stay for the next turn.
    fn retry_deferred(&mut self) {
        let list = std::mem::take(&mut self.deferred);
        for (slot, i) in list {
            let s = &mut self.slots[slot];
            let l = &s.leaves[i];
            let LeafKind::Deferred { op, punch } = l.kind else {
                continue;
            };
            let bio = Bio {
                op,
                sector: l.offset,
                nr_sectors: l.len,
                buf_off: l.buf_off,
                fua: l.fua,
                punch,
                token: l.done,
            };
            let Some(dev) = s.holds.get(l.origin.0 as usize).map(|h| h.dev.clone()) else {
                continue;
            };
            let first = s.leaves.len();
            let r = {
                let mut ctx = MapCtx::new(&mut s.leaves, &mut s.holds);
                mapper::map_bio(&dev, bio, &mut ctx)
            };
            match r {
                Err(MapErr::Suspended) => {
                    s.leaves.truncate(first);
                    self.deferred.push((slot, i));
                    continue;
                }
                Err(MapErr::Errno(e)) => {
                    s.leaves.truncate(first);
                    if s.error == 0 {
                        s.error = nbd_errno(e);
                    }
                }
                Ok(()) => {}
            }
            s.leaves[i].kind = LeafKind::Drop;
            s.pending += 1; // held while the new leaves are issued
            self.submit_leaves_from(slot, first);
            self.slots[slot].pending -= 2;
            if self.slots[slot].pending == 0 {
                self.leaves_done(slot);
            }
        }
    }

    fn release_delayed(&mut self) {
        let now = Instant::now();
        let mut i = 0;
        while i < self.delayed.len() {
            let (due, slot, leaf) = self.delayed[i];
            let l = &self.slots[slot].leaves[leaf];
            if due <= now || l.release.as_ref().is_some_and(|r| r.load(Ordering::Relaxed)) {
                if let Some(h) = &l.held {
                    h.fetch_sub(1, Ordering::Relaxed);
                }
                self.delayed.swap_remove(i);
                self.slots[slot].pending -= 1;
                self.issue_leaf(slot, leaf);
                if self.slots[slot].pending == 0 {
                    self.leaves_done(slot);
                }
            } else {
                i += 1;
            }
        }
    }

    /// Start (or continue, after a short transfer) leaf `i` of `slot`. Leaves with no
    /// I/O complete here.
    fn issue_leaf(&mut self, slot: usize, i: usize) {
        let s = &mut self.slots[slot];
        let l = &mut s.leaves[i];
        let ud = ud_leaf(slot, i);
        let (file, off, rem) = (l.file, l.offset + l.done, l.len - l.done);
        let base = l.buf_off + l.done as usize;
        let op = match (l.kind, file) {
            (LeafKind::Read, Some(f)) => {
                let buf = s.buf.as_mut_slice()[base..].as_mut_ptr();
                Sqe::Read {
                    fd: f.fd_for(buf as usize, off, rem),
                    buf,
                    len: rem as u32,
                    offset: off,
                }
            }
            (LeafKind::Write, Some(f)) => {
                if l.done == 0 {
                    apply_corrupt(
                        l.corrupt,
                        &mut s.buf.as_mut_slice()[l.buf_off..l.buf_off + l.len as usize],
                    );
                }
                let buf = s.buf.as_slice()[base..].as_ptr();
                Sqe::Write {
                    fd: f.fd_for(buf as usize, off, rem),
                    buf,
                    len: rem as u32,
                    offset: off,
                    dsync: l.fua,
                }
            }
            (LeafKind::Flush, Some(f)) => Sqe::Fsync { fd: f.buffered_fd },
            (LeafKind::Discard, Some(f)) => Sqe::Fallocate {
                fd: f.buffered_fd,
                mode: libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset: off,
                len: rem,
            },
            (LeafKind::WriteZeroes { punch }, Some(f)) => Sqe::Fallocate {
                fd: f.buffered_fd,
                mode: if punch {
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
                } else {
                    libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
                },
                offset: off,
                len: rem,
            },
            (LeafKind::ZeroFill, _) => {
                s.buf.as_mut_slice()[l.buf_off..l.buf_off + l.len as usize].fill(0);
                return;
            }
            (LeafKind::Fail(e), _) => {
                if s.error == 0 {
                    s.error = nbd_errno(e);
                }
                return;
            }
            _ => return, // Drop
        };
        s.pending += 1;
        self.push(op, ud);
    }

    /// Write zeroes by writing from the zero buffer: for files that cannot fallocate.
    fn issue_zero_write(&mut self, slot: usize, i: usize) {
        if self.zero_buf.capacity() == 0 {
            self.zero_buf.ensure(ZERO_BUF);
        }
        let l = &self.slots[slot].leaves[i];
        let Some(f) = l.file else { return };
        let (off, rem) = (l.offset + l.done, (l.len - l.done).min(ZERO_BUF as u64));
        let buf = self.zero_buf.as_ptr();
        self.slots[slot].pending += 1;
        let op = Sqe::Write {
            fd: f.fd_for(buf as usize, off, rem),
            buf,
            len: rem as u32,
            offset: off,
            dsync: false,
        };
        self.push(op, ud_leaf(slot, i));
    }

    fn complete_op(&mut self, ud: u64, r: i32) {
        match ud >> KIND_SHIFT {
            KIND_RECV => {
                let into = self.recv_inflight.take().unwrap_or(RecvInto::Rbuf);
                self.on_recv(into, r);
            }
            KIND_SEND => self.on_sent(r),
            _ => self.on_leaf(((ud >> 32) & 0xffff) as usize, (ud & 0xffff_ffff) as usize, r),
        }
    }

    fn on_leaf(&mut self, slot: usize, i: usize, r: i32) {
        let s = &mut self.slots[slot];
        s.pending -= 1;
        let l = &mut s.leaves[i];
        let zeroes = matches!(l.kind, LeafKind::WriteZeroes { .. });
        if r < 0 {
            let e = -r;
            if zeroes && matches!(e, libc::EOPNOTSUPP | libc::EINVAL | libc::ENODEV) {
                if s.flags & CMD_FLAG_FAST_ZERO != 0 {
                    s.error = ENOTSUP;
                } else {
                    // The file cannot zero natively: write zeroes instead.
                    l.kind = LeafKind::ZeroWrite;
                    l.done = 0;
                    self.issue_zero_write(slot, i);
                    return;
                }
            } else {
                if s.error == 0 {
                    s.error = nbd_errno(e);
                }
                mapper::report_io_error(&s.holds, l.origin);
            }
        } else if matches!(l.kind, LeafKind::Read | LeafKind::Write | LeafKind::ZeroWrite) {
            if r == 0 {
                if l.kind == LeafKind::Read {
                    // Past the end of the file: the rest reads as zeroes.
                    let (a, b) = (l.buf_off + l.done as usize, l.buf_off + l.len as usize);
                    s.buf.as_mut_slice()[a..b].fill(0);
                    l.done = l.len;
                } else if s.error == 0 {
                    s.error = EIO;
                }
            } else {
                l.done += r as u64;
            }
            if l.done < l.len && s.error == 0 {
                if l.kind == LeafKind::ZeroWrite {
                    self.issue_zero_write(slot, i);
                } else {
                    self.issue_leaf(slot, i);
                }
                return;
            }
            if l.kind == LeafKind::Read {
                let (c, a) = (l.corrupt, l.buf_off);
                let n = l.len as usize;
                apply_corrupt(c, &mut s.buf.as_mut_slice()[a..a + n]);
            }
        }
        let l = &mut s.leaves[i];
        if let Some(after) = l.after.take() {
            let ok = r >= 0 && !(r == 0 && matches!(l.kind, LeafKind::Write | LeafKind::ZeroWrite));
            after(ok);
            s.hooked = true;
        }
        if self.slots[slot].pending == 0 {
            self.leaves_done(slot);
        }
    }

    /// Every leaf of `slot` is done.
    fn leaves_done(&mut self, slot: usize) {
        let s = &mut self.slots[slot];
        mapper::release(&mut s.holds);
        let fua = s.flags & CMD_FLAG_FUA != 0;
        if (s.then_flush || (s.hooked && fua)) && s.error == 0 {
            s.then_flush = false;
            s.hooked = false;
            // FUA on a discard / write-zeroes: flush what it touched.
            let dev = self.dev.clone();
            s.leaves.clear();
            let bio = Bio {
                op: Op::Flush,
                sector: 0,
                nr_sectors: 0,
                buf_off: 0,
                fua: false,
                punch: false,
                token: 0,
            };
            let r = {
                let mut ctx = MapCtx::new(&mut s.leaves, &mut s.holds);
                mapper::map_bio(&dev, bio, &mut ctx)
            };
            match r {
                Ok(()) => return self.submit_leaves(slot),
                Err(MapErr::Suspended) => {
                    // Its effect is on the files; the next flush covers it.
                    mapper::release(&mut s.holds);
                }
                Err(MapErr::Errno(e)) => {
                    mapper::release(&mut s.holds);
                    s.error = nbd_errno(e);
                }
            }
        }
        self.finish(slot);
    }

    fn finish_err(&mut self, slot: usize, e: u32) {
        self.slots[slot].error = e;
        self.finish(slot);
    }

    /// Build the reply of `slot` and queue it.
    fn finish(&mut self, slot: usize) {
        let structured = self.structured;
        let s = &mut self.slots[slot];
        let mut h = Hdr { b: &mut s.hdr, n: 0 };
        s.data_len = 0;
        if s.error != 0 {
            if structured {
                h.chunk(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, s.cookie, 6);
                h.u32(s.error);
                h.u16(0);
            } else {
                h.simple(s.error, s.cookie);
            }
        } else if s.cmd == CMD_READ {
            if structured {
                h.chunk(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, s.cookie, 8 + s.len);
                h.u64(s.offset);
            } else {
                h.simple(0, s.cookie);
            }
            s.data_len = s.len as usize;
        } else if s.cmd == CMD_BLOCK_STATUS {
            let last = s.extra_first >= s.extra.len();
            h.chunk(
                if last { REPLY_FLAG_DONE } else { 0 },
                REPLY_TYPE_BLOCK_STATUS,
                s.cookie,
                s.extra_first.min(s.extra.len()) as u32,
            );
        } else {
            h.simple(0, s.cookie);
        }
        s.hdr_len = h.n;
        s.state = State::Reply;
        self.sendq.push_back(slot);
    }

    /// One BLOCK_STATUS chunk per negotiated context: base:allocation, then the
    /// changed blocks against the dirty-bitmap base.
    fn block_status(&mut self, slot: usize) {
        let (sector, nr, len, req_one, cookie) = {
            let s = &self.slots[slot];
            (
                s.offset / SECTOR,
                u64::from(s.len) / SECTOR,
                u64::from(s.len),
                s.flags & CMD_FLAG_REQ_ONE != 0,
                s.cookie,
            )
        };
        let mut contexts: Vec<(u32, Vec<(u64, u32)>)> = Vec::new();
        let mut failed = None;
        if self.base_allocation {
            let mut ext = Vec::new();
            if let Err(e) = mapper::device_extents(&self.dev, sector, nr.max(1), &mut ext) {
                failed = Some(e);
            }
            contexts.push((BASE_ALLOCATION_ID, ext));
        }
        if let (Some(base), None) = (&self.dirty_base, &failed) {
            let mut ext = Vec::new();
            if let Err(e) = mapper::device_changed_extents(&self.dev, base, sector, nr.max(1), &mut ext) {
                failed = Some(e);
            }
            contexts.push((DIRTY_BITMAP_ID, ext));
        }
        if let Some(e) = failed {
            // the status cannot be known: the request fails, it is never guessed
            tracing::error!(
                "NBD: export '{}': block status at byte {}: {e}",
                self.dev.name(),
                sector * SECTOR
            );
            let s = &mut self.slots[slot];
            s.error = EIO;
            s.extra.clear();
            s.extra_first = 0;
            return self.finish(slot);
        }
        let s = &mut self.slots[slot];
        s.extra.clear();
        s.extra_first = 0;
        let n = contexts.len();
        for (k, (id, mut ext)) in contexts.into_iter().enumerate() {
            mapper::coalesce(&mut ext);
            if ext.is_empty() {
                ext.push((len.max(SECTOR), 0));
            }
            let mut payload = id.to_be_bytes().to_vec();
            let mut total = 0u64;
            for (l, flags) in ext.into_iter().take(if req_one { 1 } else { MAX_EXTENTS }) {
                // Descriptor lengths are 32-bit; a REQ_ONE answer may not exceed the request.
                let mut l = l.min(u64::from(u32::MAX) & !(SECTOR - 1));
                if req_one {
                    l = l.min(len.max(SECTOR));
                }
                payload.extend_from_slice(&(l as u32).to_be_bytes());
                payload.extend_from_slice(&flags.to_be_bytes());
                total += l;
                if total >= len {
                    break;
                }
            }
            if k == 0 {
                s.extra.extend_from_slice(&payload);
                s.extra_first = payload.len();
            } else {
                // a chunk header of its own: magic, flags, type, cookie, length
                let flags = if k + 1 == n { REPLY_FLAG_DONE } else { 0 };
                s.extra.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
                s.extra.extend_from_slice(&flags.to_be_bytes());
                s.extra.extend_from_slice(&REPLY_TYPE_BLOCK_STATUS.to_be_bytes());
                s.extra.extend_from_slice(&cookie.to_be_bytes());
                s.extra.extend_from_slice(&(payload.len() as u32).to_be_bytes());
                s.extra.extend_from_slice(&payload);
            }
        }
        self.finish(slot);
    }

    // ---- sending ----

    fn send_batch(&mut self) {
        self.iov.clear();
        self.sending.clear();
        while self.sending.len() < SEND_BATCH {
            let Some(slot) = self.sendq.pop_front() else { break };
            let s = &self.slots[slot];
            self.iov.push(libc::iovec {
                iov_base: s.hdr.as_ptr() as *mut libc::c_void,
                iov_len: s.hdr_len,
            });
            if s.data_len > 0 {
                self.iov.push(libc::iovec {
                    iov_base: s.buf.as_ptr() as *mut libc::c_void,
                    iov_len: s.data_len,
                });
            }
            if !s.extra.is_empty() {
                self.iov.push(libc::iovec {
                    iov_base: s.extra.as_ptr() as *mut libc::c_void,
                    iov_len: s.extra.len(),
                });
            }
            self.sending.push(slot);
        }
        self.iov_pos = 0;
        self.submit_send();
    }

    fn submit_send(&mut self) {
        let rest = &mut self.iov[self.iov_pos..];
        self.msg.msg_iov = rest.as_mut_ptr();
        self.msg.msg_iovlen = rest.len() as _;
        let msg = &self.msg as *const libc::msghdr;
        self.push(Sqe::SendMsg { fd: self.fd, msg }, KIND_SEND << KIND_SHIFT);
        self.send_inflight = true;
    }

    fn on_sent(&mut self, r: i32) {
        self.send_inflight = false;
        if r < 0 {
            if r == -libc::EINTR || r == -libc::EAGAIN {
                return self.submit_send();
            }
            self.dead = true;
            self.sendq.extend(self.sending.drain(..));
            return;
        }
        let mut n = r as usize;
        while n > 0 && self.iov_pos < self.iov.len() {
            let v = &mut self.iov[self.iov_pos];
            if n >= v.iov_len {
                n -= v.iov_len;
                self.iov_pos += 1;
            } else {
                // SAFETY: advancing within the same buffer; n < iov_len.
                v.iov_base = unsafe { (v.iov_base as *mut u8).add(n) } as *mut libc::c_void;
                v.iov_len -= n;
                n = 0;
            }
        }
        if self.iov_pos < self.iov.len() {
            return self.submit_send();
        }
        for i in 0..self.sending.len() {
            let slot = self.sending[i];
            self.free_slot(slot);
        }
        self.sending.clear();
    }

    fn free_slot(&mut self, slot: usize) {
        let s = &mut self.slots[slot];
        if matches!(s.cmd, CMD_READ | CMD_WRITE) && s.len <= MAX_PAYLOAD {
            self.inflight_bytes -= u64::from(s.len);
        }
        if s.buf.capacity() > KEEP_BUF {
            s.buf = AlignedBuf::default();
        }
        s.state = State::Free;
        s.leaves.clear();
        self.free.push(slot);
    }
}

/// A reply header being written into a slot's header buffer.
struct Hdr<'a> {
    b: &'a mut [u8; 32],
    n: usize,
}

impl Hdr<'_> {
    fn put(&mut self, v: &[u8]) {
        self.b[self.n..self.n + v.len()].copy_from_slice(v);
        self.n += v.len();
    }
    fn u16(&mut self, v: u16) {
        self.put(&v.to_be_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.put(&v.to_be_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.put(&v.to_be_bytes());
    }
    fn simple(&mut self, error: u32, cookie: u64) {
        self.u32(SIMPLE_REPLY_MAGIC);
        self.u32(error);
        self.u64(cookie);
    }
    fn chunk(&mut self, flags: u16, typ: u16, cookie: u64, len: u32) {
        self.u32(STRUCTURED_REPLY_MAGIC);
        self.u16(flags);
        self.u16(typ);
        self.u64(cookie);
        self.u32(len);
    }
}
