//! The transmission phase of one connection: parse, validate, reply.
//!
//! A connection lives on a reactor (`super::reactor`), whose request engine
//! (`mapper::engine`) and ring it shares with the reactor's other connections:
//! requests are parsed from a receive buffer into the engine's slots, which map
//! and execute them. The socket is read with plain non-blocking receives while it
//! has bytes; a multishot poll on the ring says when it has more, and sends go
//! through the ring, so one wait covers every socket of the reactor, the backing
//! I/O and targets' completions. Replies are gathered into one sendmsg per batch.
//! A connection with nothing under way holds its socket and a few hundred bytes:
//! receive buffers come from the reactor's pool while bytes wait in them, and
//! request buffers belong to the engine's slots. The steady state allocates
//! nothing.
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
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;

const RBUF_LEN: usize = 256 << 10;
/// A request header's length on the wire.
const HEADER_LEN: usize = 28;
/// A write payload from which the next header is received alone (see
/// `Conn::large_writes`): the size from which a payload is received directly.
const LARGE_WRITE: u32 = 64 << 10;
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
/// Buffer capacity kept in the slots of one reactor's engine (so that steady I/O
/// does not allocate); a buffer freed while the slots hold more is given back.
/// Without a bound, clients could leave a large buffer in every slot in turn.
const MAX_KEPT_BYTES: usize = 32 << 20;
/// Receive buffers kept for the reactor's connections between bursts.
const KEPT_RBUFS: usize = 4;
/// Capacity a TLS connection keeps in its buffers once it has nothing under way.
const TLS_IDLE_KEPT: usize = 64 << 10;
/// A block-status reply kept no larger than this in a freed slot.
const KEEP_EXTRA: usize = 4096;
/// Replies gathered into one sendmsg.
const SEND_BATCH: usize = 64;
/// Capacity kept in a TLS connection's plaintext and ciphertext buffers between
/// batches: a batch holds at most [`MAX_HELD_BYTES`] of replies, plus the records'
/// overhead (22 bytes in 16 KiB); a larger batch's buffer is given back once sent.
/// Regrowing the buffer batch after batch costs more than the encryption.
const TLS_KEPT_BYTES: usize = MAX_HELD_BYTES as usize + (1 << 20);
/// Reply pieces smaller than this are copied together before encryption (one TLS
/// record holds up to 16 KiB).
const TLS_GATHER: usize = 16 << 10;
/// Largest write payload read (and thrown away) from a client before hanging up.
const MAX_DISCARDED_PAYLOAD: u64 = 2 * MAX_PAYLOAD as u64;

/// A frontend tag names a connection and what completed for it.
pub const TAG_POLL: u64 = 1;
pub const TAG_SEND: u64 = 2;
const TAG_KINDS: u32 = 2;

pub fn tag(id: u32, kind: u64) -> u64 {
    (u64::from(id) << TAG_KINDS) | kind
}

/// The connection and the kind of a tag made by [`tag`].
pub fn untag(tag: u64) -> (u32, u64) {
    ((tag >> TAG_KINDS) as u32, tag & ((1 << TAG_KINDS) - 1))
}

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
    /// The connection the request belongs to.
    conn: u32,
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
            conn: 0,
        }
    }
}

/// What the connections of one reactor share: the engine with its ring and
/// request slots, the protocol side of each slot, and the receive buffers.
pub struct Shared {
    pub engine: Engine,
    slots: Slots,
    rbufs: Vec<AlignedBuf>,
    /// Capacity of the engine slots' data buffers, taken or free.
    buf_bytes: usize,
    /// Connections that stopped taking requests for want of a free slot; they go
    /// on once one is freed.
    pub starved: Vec<u32>,
    /// The device the panic log names for this thread (the last one served).
    named: usize,
}

impl Shared {
    /// `slots` request slots to begin with, growing to `max` while clients
    /// keep them all taken.
    pub fn new(slots: usize, max: usize) -> std::io::Result<Shared> {
        let mut engine = Engine::new(slots)?;
        engine.allow_growth(max);
        // a reactor serves many connections: large decryptions go to workers
        engine.offload_hooks(true);
        Ok(Shared {
            engine,
            slots: Slots(Vec::new()),
            rbufs: Vec::new(),
            buf_bytes: 0,
            starved: Vec::new(),
            named: 0,
        })
    }

    /// The connection request `slot` belongs to.
    pub fn owner(&self, slot: usize) -> u32 {
        self.slots[slot].conn
    }

    /// Bytes of buffers the reactor holds (request data, receive buffers).
    pub fn buffer_bytes(&self) -> usize {
        self.buf_bytes + self.rbufs.len() * RBUF_LEN
    }

    /// Name `dev` in this thread's panic log, if it is not already named.
    fn name(&mut self, dev: &Arc<Device>) {
        let p = Arc::as_ptr(dev) as usize;
        if self.named != p {
            self.named = p;
            crate::panics::set_device(&dev.name());
        }
    }
}

/// The protocol side of the engine's slots, by slot, in chunks that never move
/// as more are added (a send under way points at a slot's reply header).
struct Slots(Vec<Box<[Slot]>>);

const SLOT_CHUNK: usize = 1024;

impl Slots {
    /// Make slot `i` exist.
    fn cover(&mut self, i: usize) {
        while self.0.len() * SLOT_CHUNK <= i {
            self.0.push((0..SLOT_CHUNK).map(|_| Slot::new()).collect());
        }
    }
}

impl std::ops::Index<usize> for Slots {
    type Output = Slot;
    fn index(&self, i: usize) -> &Slot {
        &self.0[i / SLOT_CHUNK][i % SLOT_CHUNK]
    }
}

impl std::ops::IndexMut<usize> for Slots {
    fn index_mut(&mut self, i: usize) -> &mut Slot {
        &mut self.0[i / SLOT_CHUNK][i % SLOT_CHUNK]
    }
}

/// Where the next receive lands.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RecvInto {
    Rbuf,
    Slot(usize),
}

/// A client that finished its handshake, for a reactor to serve.
pub struct NewConn {
    pub sock: OwnedFd,
    pub neg: super::handshake::Negotiated,
    pub session: Option<Session>,
    pub track: super::placement::Track,
    /// Moved from another reactor (not a new connection).
    pub moved: bool,
}

pub struct Conn {
    id: u32,
    /// The socket; None once closed.
    sock: Option<OwnedFd>,
    fd: RawFd,
    pub dev: Arc<Device>,
    size: u64,
    /// The transmission flags the client was given: commands and flags they do not
    /// offer are refused.
    tflags: u16,
    structured: bool,
    base_allocation: bool,
    /// The base of the negotiated `qemu:dirty-bitmap:BASE` context.
    dirty_base: Option<String>,
    /// Taken from the reactor's pool while bytes wait in it.
    rbuf: Option<AlignedBuf>,
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
    /// The last request parsed was a write of a large payload: the next header
    /// is received alone, so the payload after it lands in the request's buffer
    /// directly instead of being copied there from the receive buffer (a 64 KiB
    /// copy costs more than the extra receive).
    large_writes: bool,
    /// Engine slots this connection has taken and not freed.
    taken: usize,
    /// On the reactor's list of connections waiting for a free slot.
    starved: bool,
    /// Bytes held for requests taken and not yet answered on the wire (see
    /// [`MAX_HELD_BYTES`]).
    held_bytes: u64,
    sendq: VecDeque<usize>,
    sending: Vec<usize>,
    iov: Vec<libc::iovec>,
    iov_pos: usize,
    /// Boxed: the ring reads it while a send is under way.
    msg: Box<libc::msghdr>,
    send_inflight: bool,
    closing: bool,
    dead: bool,
    /// The socket is shut and closed; the connection waits for its poll's end.
    closed: bool,
    /// The TLS session of a connection that started TLS.
    tls: Option<Tls>,
    /// Requests taken, in all.
    served: u64,
    /// Where its client runs, for placement.
    pub track: super::placement::Track,
    /// The reactor it is to move to, once idle.
    pub move_to: Option<usize>,
    /// Moving: it takes nothing more and waits for its poll to end.
    detaching: bool,
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
    pub fn new(id: u32, c: NewConn) -> Conn {
        let NewConn {
            sock,
            neg: n,
            session: tls,
            track,
            ..
        } = c;
        // SAFETY: msghdr is a plain C struct for which all-zero is a valid value.
        let msg: libc::msghdr = unsafe { std::mem::zeroed() };
        Conn {
            id,
            fd: sock.as_raw_fd(),
            sock: Some(sock),
            dev: n.dev,
            size: n.size,
            tflags: n.flags,
            structured: n.structured,
            base_allocation: n.base_allocation,
            dirty_base: n.dirty_base,
            rbuf: None,
            rpos: 0,
            rend: 0,
            readable: true,
            poll_armed: false,
            hangup: false,
            eof: false,
            payload: None,
            large_writes: false,
            discard: 0,
            taken: 0,
            starved: false,
            held_bytes: 0,
            sendq: VecDeque::new(),
            sending: Vec::new(),
            iov: Vec::new(),
            iov_pos: 0,
            msg: Box::new(msg),
            send_inflight: false,
            closing: false,
            dead: false,
            closed: false,
            tls: tls.map(|session| Tls {
                session,
                plain: Vec::new(),
                out: Vec::new(),
            }),
            served: 0,
            track,
            move_to: None,
            detaching: false,
        }
    }

    /// Whether nothing of the connection is under way or buffered here: it
    /// may move to another reactor (what the client sends next waits in the
    /// socket).
    fn idle(&self) -> bool {
        self.taken == 0
            && self.payload.is_none()
            && self.discard == 0
            && self.rpos == self.rend
            && self.sendq.is_empty()
            && self.sending.is_empty()
            && !self.send_inflight
            && !self.starved
            && !(self.closing || self.dead || self.closed || self.eof || self.hangup)
            // (a TLS batch's buffers hold nothing once its send is over; what the
            // session has received and not yet given out goes with it)
            && self.tls.as_ref().is_none_or(|t| !t.session.has_output())
    }

    /// Whether the socket is open.
    pub fn is_open(&self) -> bool {
        self.sock.is_some()
    }

    /// Look where the client runs ([`Track::look`](super::placement::Track::look));
    /// None when the socket is closed.
    pub fn look(&mut self) -> Option<Option<usize>> {
        use std::os::fd::AsFd;
        let sock = self.sock.as_ref()?;
        Some(self.track.look(sock.as_fd(), self.served))
    }

    /// Whether a move was asked and has begun (nothing more is taken here).
    pub fn is_moving(&self) -> bool {
        self.detaching
    }

    /// Whether the connection has stopped here and may be handed to another
    /// reactor with [`Conn::detach`].
    pub fn detached(&self) -> bool {
        self.detaching && !self.poll_armed
    }

    /// The connection as a reactor takes it in, leaving this one.
    pub fn detach(mut self: Box<Self>, sh: &mut Shared) -> Option<NewConn> {
        if let Some(b) = self.rbuf.take() {
            give_rbuf(sh, b);
        }
        let sock = self.sock.take()?;
        let this = *self;
        Some(NewConn {
            sock,
            neg: super::handshake::Negotiated {
                dev: this.dev,
                size: this.size,
                flags: this.tflags,
                structured: this.structured,
                base_allocation: this.base_allocation,
                dirty_base: this.dirty_base,
            },
            session: this.tls.map(|t| t.session),
            track: this.track,
            moved: true,
        })
    }

    /// Do what the connection can do now: take requests from the socket while
    /// it has bytes and there is room for them, and send the replies that are
    /// ready. The reactor calls this whenever something happened to it.
    pub fn step(&mut self, sh: &mut Shared) {
        if self.closed {
            return;
        }
        if self.move_to.is_some() && !self.detaching && self.idle() {
            self.detaching = true;
            if self.poll_armed {
                sh.engine.cancel_poll(tag(self.id, TAG_POLL));
            }
        }
        if self.detaching {
            return;
        }
        sh.name(&self.dev);
        if !self.dead && !self.closing {
            self.parse(sh);
            self.receive(sh);
        }
        if !self.dead && !self.send_inflight && !self.sendq.is_empty() {
            self.send_batch(sh);
        } else if !self.dead
            && !self.send_inflight
            && self.tls.as_ref().is_some_and(|t| t.session.has_output())
        {
            self.send_batch(sh); // what the session has to say of its own (a key update)
        }
        if self.taken == 0 && !self.send_inflight {
            self.shrink_idle(sh);
        }
    }

    /// A completion of the connection's own operation on the ring.
    pub fn on_event(&mut self, sh: &mut Shared, kind: u64, e: &IoEvent) {
        match kind {
            TAG_POLL => {
                self.readable = true;
                self.poll_armed = e.more;
                if (self.closed || self.detaching) && e.more {
                    // the poll fired while its removal ran (which then fails with
                    // EALREADY): remove it again
                    sh.engine.cancel_poll(tag(self.id, TAG_POLL));
                }
                let end = i32::from(libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR);
                if e.res < 0 || e.res & end != 0 {
                    self.hangup = true;
                }
            }
            _ => self.on_sent(sh, e.res),
        }
    }

    /// The engine could not take the connection's requests: it failed (the
    /// reactor's ring is gone).
    pub fn fail(&mut self) {
        self.dead = true;
        self.closing = true;
    }

    /// Whether nothing of the connection is under way any more (requests,
    /// sends), so that it can close: the client left, broke the protocol or
    /// disconnected and every request has its answer out.
    pub fn finished(&self) -> bool {
        if self.send_inflight || !(self.dead || self.closing) {
            return false;
        }
        if self.dead {
            let waiting = self.sendq.len() + self.sending.len() + usize::from(self.payload.is_some());
            self.taken == waiting
        } else {
            self.taken == 0 && self.payload.is_none()
        }
    }

    /// Close a [`finished`](Conn::finished) connection: requests that never
    /// reached a device are given up, the socket is shut and closed, and the
    /// readiness poll is stopped. Returns whether the connection may be dropped
    /// now (else once its poll's last event came).
    pub fn close(&mut self, sh: &mut Shared) -> bool {
        if !self.closed {
            self.closed = true;
            let mut slots: Vec<usize> = self.sendq.drain(..).chain(self.sending.drain(..)).collect();
            slots.extend(self.payload.take().map(|(s, _)| s));
            for slot in slots {
                self.free_slot(sh, slot);
            }
            if self.dead {
                // SAFETY: shutdown on our own socket descriptor.
                unsafe { libc::shutdown(self.fd, libc::SHUT_RDWR) };
            }
            if self.poll_armed {
                sh.engine.cancel_poll(tag(self.id, TAG_POLL));
            }
            // (the ring's poll keeps its own reference to the socket until it ends)
            self.sock = None;
            if let Some(b) = self.rbuf.take() {
                give_rbuf(sh, b);
            }
        }
        !self.poll_armed
    }

    /// Whether [`Conn::close`] has closed the socket.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// A dead connection's requests still waiting for a resume are given up.
    pub fn drop_parked(&self, sh: &mut Shared) {
        if self.dead {
            let id = self.id;
            let slots = &sh.slots;
            sh.engine.drop_parked(|r| slots[r].conn == id);
        }
    }

    pub fn is_dead(&self) -> bool {
        self.dead
    }

    /// Give back what an idle connection need not keep: the receive buffer when
    /// nothing waits in it (a connection with requests under way keeps it, as
    /// more are bound to come: handing it back and forth costs a fresh 256 KiB
    /// buffer whenever more connections are busy than the pool keeps), and large
    /// TLS buffers.
    fn shrink_idle(&mut self, sh: &mut Shared) {
        if self.rpos == self.rend && self.payload.is_none() {
            (self.rpos, self.rend) = (0, 0);
            if let Some(b) = self.rbuf.take() {
                give_rbuf(sh, b);
            }
        }
        if let Some(t) = self.tls.as_mut() {
            for b in [&mut t.plain, &mut t.out] {
                if b.capacity() > TLS_IDLE_KEPT {
                    *b = Vec::new();
                }
            }
        }
    }

    fn push(&mut self, sh: &mut Shared, op: Sqe, tag: u64) {
        // SAFETY: every pointer in `op` names memory owned by `self` (the receive
        // buffer, request buffers, iovecs and msghdr), which is neither freed nor
        // moved until the engine is idle: `run` only returns after `shut_down`,
        // which waits for every operation, and buffers are only resized in free slots.
        unsafe { sh.engine.push_io(op, tag) };
    }

    // ---- receiving and parsing ----

    /// Where the next bytes from the socket go, and how many fit; None while
    /// back-pressure holds the client in the socket.
    fn recv_target(&mut self, sh: &mut Shared) -> Option<(RecvInto, *mut u8, usize)> {
        if let Some((slot, got)) = self.payload {
            if self.rpos == self.rend {
                // Large payloads land in the request's buffer directly.
                let need = sh.slots[slot].len as usize - got;
                if need >= 64 << 10 {
                    let ptr = sh.engine.request_mut(slot).buf.as_mut_slice()[got..].as_mut_ptr();
                    return Some((RecvInto::Slot(slot), ptr, need));
                }
            }
        } else if self.discard == 0 && (self.no_slot(sh) || self.held_bytes >= MAX_HELD_BYTES) {
            return None; // back-pressure: the client waits in the socket
        }
        let rbuf = self.rbuf.get_or_insert_with(|| take_rbuf(sh));
        if self.rend == rbuf.capacity() {
            if self.rpos == 0 {
                return None; // full of unparsed bytes; parsing must make room first
            }
            self.compact();
        }
        let rbuf = self.rbuf.as_mut()?;
        let ptr = rbuf.as_mut_slice()[self.rend..].as_mut_ptr();
        let room = rbuf.capacity() - self.rend;
        // after a large write, a header at a time (the rest of one if part came)
        let want = if self.large_writes && self.payload.is_none() && self.discard == 0 {
            (HEADER_LEN - (self.rend - self.rpos).min(HEADER_LEN - 1)).min(room)
        } else {
            room
        };
        Some((RecvInto::Rbuf, ptr, want))
    }

    /// Receive and parse while the socket has bytes and there is room for them.
    ///
    /// Receives are plain non-blocking calls; a multishot poll on the ring says
    /// when the socket has bytes again. One armed poll serves the whole connection,
    /// where a receive queued on the ring would arm and disarm a poll every time
    /// it finds the socket empty (that was 43% of the server's CPU when the
    /// client, not the server, was the bottleneck).
    fn receive(&mut self, sh: &mut Shared) {
        while self.readable && !self.dead && !self.closing {
            let Some((into, ptr, len)) = self.recv_target(sh) else {
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
                    self.on_recv(sh, into, -e);
                    break;
                }
            };
            if r < len && !self.hangup {
                // Drained: bytes that come later wake the poll. Not so once the
                // client has hung up: the end of the stream is only seen by a
                // receive that returns 0, and no later wake-up would announce it.
                self.readable = false;
            }
            self.on_recv(sh, into, r as i32);
            self.parse(sh);
        }
        if !self.readable && !self.poll_armed && !self.dead && !self.closing && !self.eof {
            sh.engine.poll_in(self.fd, tag(self.id, TAG_POLL));
            self.poll_armed = true;
        }
    }

    /// Whether the connection can take no request now: it has as many under way
    /// as one connection may, or the reactor's slots are all taken (then it
    /// waits on the reactor's list until one is freed).
    fn no_slot(&mut self, sh: &mut Shared) -> bool {
        if self.taken >= MAX_SLOTS {
            return true;
        }
        if sh.engine.can_alloc() {
            return false;
        }
        if !self.starved {
            self.starved = true;
            sh.starved.push(self.id);
        }
        true
    }

    /// Back on the reactor's list of connections to step: a slot is free.
    pub fn unstarve(&mut self) {
        self.starved = false;
    }

    /// The receive buffer's bytes (none while it is back in the pool).
    fn received(&self) -> &[u8] {
        self.rbuf.as_ref().map_or(&[], |b| b.as_slice())
    }

    fn compact(&mut self) {
        let n = self.rend - self.rpos;
        if let Some(b) = self.rbuf.as_mut() {
            b.as_mut_slice().copy_within(self.rpos..self.rend, 0);
        }
        self.rpos = 0;
        self.rend = n;
    }

    fn on_recv(&mut self, sh: &mut Shared, into: RecvInto, r: i32) {
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
                    if *s == slot && *got == sh.slots[slot].len as usize {
                        self.payload = None;
                        self.dispatch(sh, slot);
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

    fn parse(&mut self, sh: &mut Shared) {
        self.parse_buffered(sh);
        self.finish_input();
    }

    // Long: the per-request receive loop (a header, its payload, a refused
    // payload thrown away); not split until bench/run.py shows that a split
    // costs nothing on this path, which every request takes.
    fn parse_buffered(&mut self, sh: &mut Shared) {
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
                let need = sh.slots[slot].len as usize - got;
                let n = need.min(avail);
                if n == 0 {
                    break;
                }
                let (rpos, src) = (self.rpos, self.received());
                sh.engine.request_mut(slot).buf.as_mut_slice()[got..got + n]
                    .copy_from_slice(&src[rpos..rpos + n]);
                self.rpos += n;
                if n == need {
                    self.payload = None;
                    self.dispatch(sh, slot);
                } else {
                    self.payload = Some((slot, got + n));
                    break;
                }
                continue;
            }
            if avail < 28 || self.closing || self.no_slot(sh) {
                break;
            }
            let h = &self.received()[self.rpos..self.rpos + 28];
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
            let Some(slot) = sh.engine.alloc() else { return };
            sh.slots.cover(slot);
            self.taken += 1;
            self.served += 1;
            let s = &mut sh.slots[slot];
            s.conn = self.id;
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
                let buf = &mut sh.engine.request_mut(slot).buf;
                let had = buf.capacity();
                buf.ensure(len as usize);
                sh.buf_bytes += buf.capacity() - had;
            }
            // A zero-length write has no payload to wait for.
            if cmd == CMD_WRITE && len > 0 {
                if u64::from(len) > MAX_PAYLOAD as u64 {
                    if u64::from(len) > MAX_DISCARDED_PAYLOAD {
                        tracing::warn!(
                            "nbd {}: write payload of {len} bytes; disconnecting",
                            self.dev.name()
                        );
                        sh.engine.free(slot);
                        self.taken -= 1;
                        self.dead = true;
                        return;
                    }
                    self.discard = u64::from(len);
                    self.refuse(sh, slot, EOVERFLOW);
                    continue;
                }
                self.payload = Some((slot, 0));
                self.large_writes = len >= LARGE_WRITE;
                continue;
            }
            self.large_writes = false;
            self.dispatch(sh, slot);
        }
        if self.rpos == self.rend {
            self.rpos = 0;
            self.rend = 0;
        } else if self.rpos > RBUF_LEN / 2 {
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

    fn dispatch(&mut self, sh: &mut Shared, slot: usize) {
        if let Err(e) = self.validate(&sh.slots[slot]) {
            return self.refuse(sh, slot, e);
        }
        let s = &sh.slots[slot];
        if s.cmd == CMD_BLOCK_STATUS {
            return self.block_status(sh, slot);
        }
        // CACHE is advisory and the range is valid; empty reads and writes have nothing to do.
        let Some(op) = Self::op_of(s.cmd).filter(|&op| s.len > 0 || op == Op::Flush) else {
            return sh.engine.complete(slot, 0);
        };
        let (offset, len, flags) = (s.offset, s.len, s.flags);
        let q = sh.engine.request_mut(slot);
        q.op = op;
        q.sector = offset / SECTOR;
        q.nr_sectors = u64::from(len) / SECTOR;
        q.fua = flags & CMD_FLAG_FUA != 0;
        q.punch = flags & CMD_FLAG_NO_HOLE == 0;
        q.fast_zero = flags & CMD_FLAG_FAST_ZERO != 0;
        sh.engine.start(slot, &self.dev);
    }

    /// Answer `slot` with an NBD error of the export's own (the request never reaches
    /// the device).
    fn refuse(&mut self, sh: &mut Shared, slot: usize, e: u32) {
        sh.slots[slot].error = e;
        sh.engine.complete(slot, 0);
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
    pub fn finish(&mut self, sh: &mut Shared, slot: usize) {
        let structured = self.structured;
        let engine_error = sh.engine.request(slot).error;
        let s = &mut sh.slots[slot];
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
    fn block_status(&mut self, sh: &mut Shared, slot: usize) {
        let (sector, nr, len, req_one, cookie) = {
            let s = &sh.slots[slot];
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
            let s = &mut sh.slots[slot];
            s.extra.clear();
            s.extra_first = 0;
            return self.refuse(sh, slot, EIO);
        }
        let s = &mut sh.slots[slot];
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
        sh.engine.complete(slot, 0);
    }

    // ---- sending ----

    fn send_batch(&mut self, sh: &mut Shared) {
        self.iov.clear();
        self.sending.clear();
        while self.sending.len() < SEND_BATCH {
            let Some(slot) = self.sendq.pop_front() else { break };
            let s = &sh.slots[slot];
            self.iov.push(libc::iovec {
                iov_base: s.hdr.as_ptr() as *mut libc::c_void,
                iov_len: s.hdr_len,
            });
            if s.data_len > 0 {
                self.iov.push(libc::iovec {
                    iov_base: sh.engine.request(slot).buf.as_ptr() as *mut libc::c_void,
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
            if self.iov.iter().all(|v| v.iov_len == 0) {
                // all of it went straight to the socket: the batch is sent
                self.iov.clear();
                self.send_inflight = true;
                return self.on_sent(sh, 0);
            }
        }
        self.submit_send(sh);
    }

    /// TLS: replace the batch's iovecs by one over its encryption. Small pieces
    /// (headers, small reads) are gathered so that they share records; a large
    /// piece is encrypted where it lies.
    fn encrypt_batch(&mut self) {
        let Some(t) = self.tls.as_mut() else { return };
        t.plain.clear();
        // nothing of ours is on the ring (a batch is encrypted only between sends)
        t.session.direct(true);
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
        t.session.direct(false);
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

    fn submit_send(&mut self, sh: &mut Shared) {
        let rest = &mut self.iov[self.iov_pos..];
        self.msg.msg_iov = rest.as_mut_ptr();
        self.msg.msg_iovlen = rest.len() as _;
        let msg = &*self.msg as *const libc::msghdr;
        self.push(sh, Sqe::SendMsg { fd: self.fd, msg }, tag(self.id, TAG_SEND));
        self.send_inflight = true;
    }

    fn on_sent(&mut self, sh: &mut Shared, r: i32) {
        self.send_inflight = false;
        if r < 0 {
            if r == -libc::EINTR || r == -libc::EAGAIN {
                return self.submit_send(sh);
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
            return self.submit_send(sh);
        }
        for i in 0..self.sending.len() {
            let slot = self.sending[i];
            self.free_slot(sh, slot);
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

    fn free_slot(&mut self, sh: &mut Shared, slot: usize) {
        let s = &mut sh.slots[slot];
        self.held_bytes -= s.held;
        s.held = 0;
        if s.extra.capacity() > KEEP_EXTRA {
            s.extra = Vec::new();
        }
        let q = sh.engine.request_mut(slot);
        if sh.buf_bytes > MAX_KEPT_BYTES {
            sh.buf_bytes -= q.buf.capacity();
            q.buf = AlignedBuf::default();
        }
        sh.engine.free(slot);
        self.taken -= 1;
    }
}

fn take_rbuf(sh: &mut Shared) -> AlignedBuf {
    sh.rbufs.pop().unwrap_or_else(|| AlignedBuf::new(RBUF_LEN))
}

fn give_rbuf(sh: &mut Shared, b: AlignedBuf) {
    if sh.rbufs.len() < KEPT_RBUFS {
        sh.rbufs.push(b);
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
