//! The transmission phase: parse, validate, reply. One thread per connection.
//!
//! Requests are parsed from a receive buffer into the slots of the connection's
//! request engine (`mapper::engine`), which maps and executes them. The socket is
//! read with plain non-blocking receives while it has bytes; a multishot poll on
//! the engine's ring says when it has more, and sends go through the ring, so one
//! wait covers the socket, the backing I/O and targets' completions. Replies are
//! gathered into one sendmsg per batch. Nothing is shared with other
//! connections but the device (an atomic in-flight count and its table), and the
//! steady state allocates nothing.
//!
//! Over TLS the same loop runs with the session as a transform: a receive
//! decrypts what the socket has into the same buffers, and a batch of replies is
//! encrypted into one buffer sent by one sendmsg. A plain connection takes the
//! same paths as before, past one test of `tls`.

use super::proto::*;
use super::tls::Session;
use crate::io::queue::Sqe;
use crate::io::{AlignedBuf, Op, SECTOR};
use crate::mapper::engine::{Engine, IoEvent};
use crate::mapper::{self, Device};
use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::Arc;

const RBUF_LEN: usize = 256 << 10;
/// Requests in flight per connection; more wait in the socket.
const MAX_SLOTS: usize = 256;
/// Bytes one connection may hold for its requests: a read's data and a write's
/// payload from the moment the request is taken until its reply has been written
/// to the socket, and a block-status reply until it is written. Requests wait in
/// the socket while a new one would go past this, so a client that sends and never
/// reads its replies costs the daemon this much and no more, however many requests
/// it sends (before this bound it was 96 MiB of requests under way, and unsent
/// replies on top). 8 MiB keeps the deepest queues of the common clients in
/// flight (fio's 8 x 512 KiB, nbdcopy's 32 x 256 KiB, qemu's 16 x 512 KiB); a
/// request larger than that (up to the 32 MiB maximum payload) is taken alone.
const MAX_HELD_BYTES: u64 = 8 << 20;
/// Buffer capacity kept in the slots of one connection (so that steady I/O does
/// not allocate); a buffer freed while the slots hold more is given back. Without
/// a bound, a client could leave a large buffer in each of the 256 slots in turn.
const MAX_KEPT_BYTES: usize = MAX_HELD_BYTES as usize;
/// A block-status reply kept no larger than this in a freed slot.
const KEEP_EXTRA: usize = 4096;
/// Replies gathered into one sendmsg.
const SEND_BATCH: usize = 64;
/// Capacity kept in a TLS connection's plaintext and ciphertext buffers between
/// batches: a batch holds at most [`MAX_HELD_BYTES`] of replies, plus the records'
/// overhead (22 bytes in 16 KiB); a larger batch's buffer is given back once sent.
/// Regrowing the buffer batch after batch costs more than the encryption.
const TLS_KEPT_BYTES: usize = MAX_KEPT_BYTES + (1 << 20);
/// Reply pieces smaller than this are copied together before encryption (one TLS
/// record holds up to 16 KiB).
const TLS_GATHER: usize = 16 << 10;
/// Largest write payload read (and thrown away) from a client before hanging up.
const MAX_DISCARDED_PAYLOAD: u64 = 2 * MAX_PAYLOAD as u64;

const TAG_POLL: u64 = 1;
const TAG_SEND: u64 = 2;

/// The protocol's side of a request; the engine's request of the same index holds
/// the operation, the data and the progress.
struct Slot {
    cookie: u64,
    cmd: u16,
    flags: u16,
    offset: u64,
    len: u32,
    /// NBD error decided by the export itself (validation); 0 = the engine's verdict.
    error: u32,
    hdr: [u8; 32],
    hdr_len: usize,
    data_len: usize,
    extra: Vec<u8>,
    /// BLOCK_STATUS: the first chunk's payload is `extra[..extra_first]`; the rest
    /// of `extra` is further chunks, headers included.
    extra_first: usize,
    /// What this request counts in the connection's held bytes.
    held: u64,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            cookie: 0,
            cmd: 0,
            flags: 0,
            offset: 0,
            len: 0,
            error: 0,
            hdr: [0; 32],
            hdr_len: 0,
            data_len: 0,
            extra: Vec::new(),
            extra_first: 0,
            held: 0,
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
    engine: Engine,
    rbuf: AlignedBuf,
    rpos: usize,
    rend: usize,
    /// The socket may hold bytes not yet received.
    readable: bool,
    /// The readiness poll is armed on the ring.
    poll_armed: bool,
    /// The poll saw the client hang up (or an error): receive until the end.
    hangup: bool,
    /// The client's end of the stream was seen: nothing more comes, and what
    /// is buffered is still parsed and answered (`finish_input`).
    eof: bool,
    /// The slot whose write payload is being received, and bytes received so far.
    payload: Option<(usize, usize)>,
    /// Payload bytes of a refused write still to be read and thrown away.
    discard: u64,
    slots: Vec<Slot>,
    /// Bytes held for requests taken and not yet answered on the wire (see
    /// [`MAX_HELD_BYTES`]).
    held_bytes: u64,
    /// Capacity of the slots' data buffers, taken or free.
    buf_bytes: usize,
    sendq: VecDeque<usize>,
    sending: Vec<usize>,
    iov: Vec<libc::iovec>,
    iov_pos: usize,
    msg: libc::msghdr,
    send_inflight: bool,
    closing: bool,
    dead: bool,
    events: Vec<IoEvent>,
    /// The TLS session of a connection that started TLS.
    tls: Option<Tls>,
}

/// A TLS connection's session and buffers.
struct Tls {
    session: Session,
    /// A batch of replies gathered for encryption.
    plain: Vec<u8>,
    /// The encrypted bytes being sent.
    out: Vec<u8>,
}

impl Conn {
    pub fn new(fd: RawFd, n: super::handshake::Negotiated, tls: Option<Session>) -> std::io::Result<Conn> {
        // SAFETY: msghdr is a plain C struct for which all-zero is a valid value.
        let msg: libc::msghdr = unsafe { std::mem::zeroed() };
        // this thread serves `n.dev`: a panic on it is logged under the device's name
        crate::panics::set_device(&n.dev.name());
        Ok(Conn {
            fd,
            engine: Engine::new(MAX_SLOTS)?,
            dev: n.dev,
            size: n.size,
            tflags: n.flags,
            structured: n.structured,
            base_allocation: n.base_allocation,
            dirty_base: n.dirty_base,
            rbuf: AlignedBuf::new(RBUF_LEN),
            rpos: 0,
            rend: 0,
            readable: true,
            poll_armed: false,
            hangup: false,
            eof: false,
            payload: None,
            discard: 0,
            slots: (0..MAX_SLOTS).map(|_| Slot::new()).collect(),
            held_bytes: 0,
            buf_bytes: 0,
            sendq: VecDeque::new(),
            sending: Vec::with_capacity(SEND_BATCH),
            iov: Vec::with_capacity(3 * SEND_BATCH),
            iov_pos: 0,
            msg,
            send_inflight: false,
            closing: false,
            dead: false,
            events: Vec::with_capacity(8),
            tls: tls.map(|session| Tls {
                session,
                plain: Vec::new(),
                out: Vec::new(),
            }),
        })
    }

    /// Serve until the client disconnects; every submitted operation has completed
    /// when this returns (buffers are never freed under the kernel or a target).
    pub fn run(&mut self) {
        loop {
            if !self.dead && !self.closing {
                self.parse();
                self.receive();
            }
            while let Some(r) = self.engine.pop_done() {
                self.finish(r);
            }
            if !self.dead && !self.send_inflight && !self.sendq.is_empty() {
                self.send_batch();
            } else if !self.dead
                && !self.send_inflight
                && self.tls.as_ref().is_some_and(|t| t.session.has_output())
            {
                self.send_batch(); // what the session has to say of its own (a key update)
            }
            let busy = self.engine.nr_free() < MAX_SLOTS;
            if !self.engine.busy() && (self.dead || (self.closing && !busy)) {
                break;
            }
            if self.dead {
                // Wake a receive that would otherwise wait for the client forever.
                // SAFETY: shutdown on our own socket descriptor.
                unsafe { libc::shutdown(self.fd, libc::SHUT_RDWR) };
                break;
            }
            if self.engine.turn(None).is_err() {
                self.dead = true;
            }
            let mut ev = std::mem::take(&mut self.events);
            self.engine.io_events(&mut ev);
            for e in &ev {
                match e.tag {
                    TAG_POLL => {
                        self.readable = true;
                        self.poll_armed = e.more;
                        let end = i32::from(libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR);
                        if e.res < 0 || e.res & end != 0 {
                            self.hangup = true;
                        }
                    }
                    _ => self.on_sent(e.res),
                }
            }
            ev.clear();
            self.events = ev;
        }
        // the receive and send in flight name our buffers: the engine waits for them
        self.engine.shut_down();
    }

    fn push(&mut self, op: Sqe, tag: u64) {
        // SAFETY: every pointer in `op` names memory owned by `self` (the receive
        // buffer, request buffers, iovecs and msghdr), which is neither freed nor
        // moved until the engine is idle: `run` only returns after `shut_down`,
        // which waits for every operation, and buffers are only resized in free slots.
        unsafe { self.engine.push_io(op, tag) };
    }

    // ---- receiving and parsing ----

    /// Where the next bytes from the socket go, and how many fit; None while
    /// back-pressure holds the client in the socket.
    fn recv_target(&mut self) -> Option<(RecvInto, *mut u8, usize)> {
        if let Some((slot, got)) = self.payload {
            if self.rpos == self.rend {
                // Large payloads land in the request's buffer directly.
                let need = self.slots[slot].len as usize - got;
                if need >= 64 << 10 {
                    let ptr = self.engine.request_mut(slot).buf.as_mut_slice()[got..].as_mut_ptr();
                    return Some((RecvInto::Slot(slot), ptr, need));
                }
            }
        } else if self.discard == 0 && (self.engine.nr_free() == 0 || self.held_bytes >= MAX_HELD_BYTES) {
            return None; // back-pressure: the client waits in the socket
        }
        if self.rend == self.rbuf.capacity() {
            if self.rpos == 0 {
                return None; // full of unparsed bytes; parsing must make room first
            }
            self.compact();
        }
        let ptr = self.rbuf.as_mut_slice()[self.rend..].as_mut_ptr();
        Some((RecvInto::Rbuf, ptr, self.rbuf.capacity() - self.rend))
    }

    /// Receive and parse while the socket has bytes and there is room for them.
    ///
    /// Receives are plain non-blocking calls; a multishot poll on the ring says
    /// when the socket has bytes again. One armed poll serves the whole connection,
    /// where a receive queued on the ring would arm and disarm a poll every time
    /// it finds the socket empty (that was 43% of the server's CPU when the
    /// client, not the server, was the bottleneck).
    fn receive(&mut self) {
        while self.readable && !self.dead && !self.closing {
            let Some((into, ptr, len)) = self.recv_target() else {
                break;
            };
            let r = match self.tls.as_mut() {
                None => {
                    // SAFETY: `ptr..ptr + len` lies in the receive buffer or the request's
                    // buffer, which we own and which nothing else touches meanwhile.
                    let r = unsafe { libc::recv(self.fd, ptr.cast(), len, libc::MSG_DONTWAIT) };
                    if r < 0 {
                        Err(std::io::Error::last_os_error()
                            .raw_os_error()
                            .unwrap_or(libc::EIO))
                    } else {
                        Ok(r as usize)
                    }
                }
                // SAFETY: as above; the slice lives only for this call.
                Some(t) => t
                    .session
                    .recv(unsafe { std::slice::from_raw_parts_mut(ptr, len) }),
            };
            let r = match r {
                Ok(r) => r,
                Err(libc::EINTR) => continue,
                Err(libc::EAGAIN) => {
                    self.readable = false;
                    break;
                }
                Err(e) => {
                    self.on_recv(into, -e);
                    break;
                }
            };
            if r < len && !self.hangup {
                // Drained: bytes that come later wake the poll. Not so once the
                // client has hung up: the end of the stream is only seen by a
                // receive that returns 0, and no later wake-up would announce it.
                self.readable = false;
            }
            self.on_recv(into, r as i32);
            self.parse();
        }
        if !self.readable && !self.poll_armed && !self.dead && !self.closing && !self.eof {
            self.engine.poll_in(self.fd, TAG_POLL);
            self.poll_armed = true;
        }
    }

    fn compact(&mut self) {
        let n = self.rend - self.rpos;
        self.rbuf.as_mut_slice().copy_within(self.rpos..self.rend, 0);
        self.rpos = 0;
        self.rend = n;
    }

    fn on_recv(&mut self, into: RecvInto, r: i32) {
        if r < 0 {
            self.dead = true;
            self.closing = true;
            return;
        }
        if r == 0 {
            self.eof = true;
            self.readable = false;
            self.finish_input();
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

    /// After the client's end of stream: once every whole request it sent has
    /// been parsed (back-pressure may hold some in the buffer until replies go
    /// out), the connection closes once they are answered, as at a disconnect
    /// between requests (fio just closes). A request cut short by the end of
    /// the stream ends the connection at once.
    fn finish_input(&mut self) {
        if !self.eof || self.closing || self.dead {
            return;
        }
        let avail = self.rend - self.rpos;
        if self.payload.is_some() || self.discard > 0 || (avail > 0 && avail < 28) {
            self.dead = true;
            self.closing = true;
        } else if avail == 0 {
            self.closing = true;
        }
        // else whole requests wait in the buffer for back-pressure to lift
    }

    fn parse(&mut self) {
        self.parse_buffered();
        self.finish_input();
    }

    fn parse_buffered(&mut self) {
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
                self.engine.request_mut(slot).buf.as_mut_slice()[got..got + n]
                    .copy_from_slice(&src[rpos..rpos + n]);
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
            if avail < 28 || self.closing || self.engine.nr_free() == 0 {
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
            // What the request will hold: the data of a read or write it serves
            // (a larger one is refused, its payload thrown away as it comes).
            let cost = if matches!(cmd, CMD_READ | CMD_WRITE) && len <= MAX_PAYLOAD {
                u64::from(len)
            } else {
                0
            };
            if self.held_bytes > 0 && self.held_bytes + cost > MAX_HELD_BYTES {
                break; // back-pressure: wait for replies to go out
            }
            self.rpos += 28;
            if cmd == CMD_DISC {
                self.closing = true;
                return;
            }
            let Some(slot) = self.engine.alloc() else { return };
            let s = &mut self.slots[slot];
            s.cookie = cookie;
            s.cmd = cmd;
            s.flags = flags;
            s.offset = offset;
            s.len = len;
            s.error = 0;
            s.extra.clear();
            s.extra_first = 0;
            s.held = cost;
            self.held_bytes += cost;
            if cost > 0 {
                let buf = &mut self.engine.request_mut(slot).buf;
                let had = buf.capacity();
                buf.ensure(len as usize);
                self.buf_bytes += buf.capacity() - had;
            }
            // A zero-length write has no payload to wait for.
            if cmd == CMD_WRITE && len > 0 {
                if u64::from(len) > MAX_PAYLOAD as u64 {
                    if u64::from(len) > MAX_DISCARDED_PAYLOAD {
                        tracing::warn!(
                            "nbd {}: write payload of {len} bytes; disconnecting",
                            self.dev.name()
                        );
                        self.engine.free(slot);
                        self.dead = true;
                        return;
                    }
                    self.discard = u64::from(len);
                    self.refuse(slot, EOVERFLOW);
                    continue;
                }
                self.payload = Some((slot, 0));
                continue;
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
        // FUA and DF only where the export offered them (DF: structured replies)
        let mut flags_offered = known;
        if self.tflags & TF_SEND_FUA == 0 {
            flags_offered &= !CMD_FLAG_FUA;
        }
        if self.tflags & TF_SEND_DF == 0 {
            flags_offered &= !CMD_FLAG_DF;
        }
        if s.flags & !flags_offered != 0 {
            return Err(EINVAL);
        }
        let writes = matches!(s.cmd, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
        if writes && self.tflags & TF_READ_ONLY != 0 {
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
        // No descriptor (each is non-empty) can describe an empty range.
        if s.cmd == CMD_BLOCK_STATUS && s.len == 0 {
            return Err(EINVAL);
        }
        if s.cmd == CMD_READ && s.len > MAX_PAYLOAD {
            return Err(EOVERFLOW);
        }
        Ok(())
    }

    fn dispatch(&mut self, slot: usize) {
        if let Err(e) = self.validate(&self.slots[slot]) {
            return self.refuse(slot, e);
        }
        let s = &self.slots[slot];
        if s.cmd == CMD_BLOCK_STATUS {
            return self.block_status(slot);
        }
        // CACHE is advisory and the range is valid; empty reads and writes have nothing to do.
        let Some(op) = Self::op_of(s.cmd).filter(|&op| s.len > 0 || op == Op::Flush) else {
            return self.engine.complete(slot, 0);
        };
        let (offset, len, flags) = (s.offset, s.len, s.flags);
        let q = self.engine.request_mut(slot);
        q.op = op;
        q.sector = offset / SECTOR;
        q.nr_sectors = u64::from(len) / SECTOR;
        q.fua = flags & CMD_FLAG_FUA != 0;
        q.punch = flags & CMD_FLAG_NO_HOLE == 0;
        q.fast_zero = flags & CMD_FLAG_FAST_ZERO != 0;
        self.engine.start(slot, &self.dev);
    }

    /// Answer `slot` with an NBD error of the export's own (the request never reaches
    /// the device).
    fn refuse(&mut self, slot: usize, e: u32) {
        self.slots[slot].error = e;
        self.engine.complete(slot, 0);
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

    /// Build the reply of `slot` and queue it.
    fn finish(&mut self, slot: usize) {
        let structured = self.structured;
        let engine_error = self.engine.request(slot).error;
        let s = &mut self.slots[slot];
        if s.error == 0 && engine_error != 0 {
            s.error = nbd_errno(engine_error);
        }
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
        } else if s.cmd == CMD_READ && s.len == 0 && structured {
            // an OFFSET_DATA chunk carries at least one byte
            h.chunk(REPLY_FLAG_DONE, REPLY_TYPE_NONE, s.cookie, 0);
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
            s.extra.clear();
            s.extra_first = 0;
            return self.refuse(slot, EIO);
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
        let n = s.extra.len() as u64;
        s.held += n;
        self.held_bytes += n;
        self.engine.complete(slot, 0);
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
                    iov_base: self.engine.request(slot).buf.as_ptr() as *mut libc::c_void,
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
        if self.tls.is_some() {
            self.encrypt_batch();
        }
        self.submit_send();
    }

    /// TLS: replace the batch's iovecs by one over its encryption. Small pieces
    /// (headers, small reads) are gathered so that they share records; a large
    /// piece is encrypted where it lies.
    fn encrypt_batch(&mut self) {
        let Some(t) = self.tls.as_mut() else { return };
        t.plain.clear();
        let bytes: usize = self.iov.iter().map(|v| v.iov_len).sum();
        t.session.reserve_output(bytes + bytes / 512 + 64);
        let mut ok = true;
        for v in &self.iov {
            // SAFETY: each iovec names a slot's header, data or extra bytes, owned by
            // `self` and unchanged while the slot waits to be sent.
            let piece = unsafe { std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len) };
            if piece.len() < TLS_GATHER {
                t.plain.extend_from_slice(piece);
                continue;
            }
            ok &= t.session.encrypt(&t.plain).is_ok() && t.session.encrypt(piece).is_ok();
            t.plain.clear();
        }
        ok &= t.session.encrypt(&t.plain).is_ok();
        if !ok {
            self.dead = true;
        }
        t.session.take_output(&mut t.out);
        self.iov.clear();
        self.iov.push(libc::iovec {
            iov_base: t.out.as_ptr() as *mut libc::c_void,
            iov_len: t.out.len(),
        });
    }

    fn submit_send(&mut self) {
        let rest = &mut self.iov[self.iov_pos..];
        self.msg.msg_iov = rest.as_mut_ptr();
        self.msg.msg_iovlen = rest.len() as _;
        let msg = &self.msg as *const libc::msghdr;
        self.push(Sqe::SendMsg { fd: self.fd, msg }, TAG_SEND);
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
        if let Some(t) = self.tls.as_mut() {
            for b in [&mut t.plain, &mut t.out] {
                if b.capacity() > TLS_KEPT_BYTES {
                    *b = Vec::new();
                }
            }
        }
    }

    fn free_slot(&mut self, slot: usize) {
        let s = &mut self.slots[slot];
        self.held_bytes -= s.held;
        s.held = 0;
        if s.extra.capacity() > KEEP_EXTRA {
            s.extra = Vec::new();
        }
        let q = self.engine.request_mut(slot);
        if self.buf_bytes > MAX_KEPT_BYTES {
            self.buf_bytes -= q.buf.capacity();
            q.buf = AlignedBuf::default();
        }
        self.engine.free(slot);
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
