//! The request engine: device-mapper's core under any frontend.
//!
//! An [`Engine`] belongs to one thread (an NBD connection, a ublk queue, a dm-io
//! caller) and owns its request slots and its io_uring. The device travels with
//! the request, so one engine serves every device its thread sends I/O to. A
//! frontend fills a [`Request`] (operation, range, data) and calls
//! [`Engine::start`] with the device; the engine maps it through the device's
//! table into leaves, issues them, runs the targets' end-of-I/O hooks, emulates FUA
//! on discards and zeroing with a flush, falls back to writing zeroes where a file
//! cannot zero natively, parks requests while a device on their path is suspended
//! and requeues them as the kernel does, and reports the request done. The frontend
//! only parses, validates and replies; its own socket operations share the ring
//! ([`Engine::push_io`]) so one wait covers both.
//!
//! A target may take a piece and finish it later from any thread (the kernel's
//! DM_MAPIO_SUBMITTED): [`MapCtx::submit`](crate::mapper::MapCtx::submit) hands it
//! a [`Pending`], which it completes, remaps or requeues. The completion is posted to
//! the owning engine's inbox and wakes its ring through an eventfd; nothing polls.

use super::target::{apply_end_io, Owned};
use super::{map_bio, release, Device, Hold};
use super::{Bio, MapCtx, MapErr};
use crate::io::queue::{IoQueue, Sqe};
use crate::io::{errno, AlignedBuf, BackingFile, EndIo, Leaf, LeafKind, Op, REMAP};
use crate::sync::Unpoison;
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const KIND_SHIFT: u32 = 60;
const KIND_LEAF: u64 = 0;
const KIND_WAKE: u64 = 1;
const KIND_FRONTEND: u64 = 2;
/// A frontend's readiness poll: it names no memory and may stay armed when the
/// engine is idle, so it is not counted in `ops`.
const KIND_POLL: u64 = 3;
/// The removal of a frontend's poll ([`Engine::cancel_poll`]): nothing waits for
/// its own completion, so it is neither counted nor reported.
const KIND_CANCEL: u64 = 4;
/// The frontend's tag in the user data below the kind.
const TAG_MASK: u64 = (1 << KIND_SHIFT) - 1;
const ZERO_BUF: usize = 1 << 20;

/// Largest read or write done inline on a memory filesystem.
const INLINE_MAX: u64 = 64 << 10;

fn ud_leaf(slot: usize, leaf: usize) -> u64 {
    (KIND_LEAF << KIND_SHIFT) | ((slot as u64) << 32) | leaf as u64
}

/// Where a target sends a piece it finishes later: a backing file or a dmkit device.
#[derive(Clone)]
pub enum Dest {
    File(Arc<BackingFile>),
    Dm(Arc<Device>),
}

/// How a target finishes a piece it took ([`Pending`]).
enum Resume {
    /// Done: 0 or an errno, and for a read whose bytes the target made (a
    /// raid5 leg rebuilt from the others) those bytes, put into the piece's
    /// data first.
    Done(i32, Option<Vec<u8>>),
    /// Send `bio` (in `dest`'s sectors) on now, running `end_io` once it is done.
    Remap {
        dest: Dest,
        bio: Bio,
        end_io: Option<EndIo>,
    },
    /// Map the piece again from its target (the condition that held it has passed,
    /// or its device is suspending: the kernel's DM_MAPIO_REQUEUE).
    Requeue,
}

/// Which piece of which request a target took, and where it was mapped.
pub(crate) struct Piece {
    pub(crate) slot: u32,
    pub(crate) gen: u32,
    /// (hold index, target index) and start sector of the target that took it.
    pub(crate) origin: (u16, u32),
    pub(crate) target_start: u64,
    /// The piece, in the target's sectors.
    pub(crate) bio: Bio,
    /// The hook of a piece above that this one belongs to.
    pub(crate) end_io: Option<EndIo>,
    /// That hook needs a FUA request's flush after it (`Leaf::hook_needs_flush`).
    pub(crate) hook_needs_flush: bool,
    /// Its failure only reaches that hook (`Leaf::tolerant`).
    pub(crate) tolerant: bool,
    /// The owned buffer the piece's data is in (None: the request's).
    pub(crate) owned: Option<u32>,
}

enum Msg {
    /// A target finished a piece it took.
    Piece { piece: Piece, resume: Resume },
    /// A worker ran a request's owned-buffer hooks ([`Engine::offload_hooks`]).
    Hooks(Box<HookJob>),
}

/// The owned buffers' hooks of a request whose leaves are all done, with the
/// request's data, run on a worker thread (a large read through dm-crypt: its
/// decryption) while the engine's thread goes on with other requests.
struct HookJob {
    slot: u32,
    gen: u32,
    /// The request's data (`n` bytes used) and owned buffers, taken from it
    /// until the job comes back; the owned buffers come back emptied into `free`.
    buf: AlignedBuf,
    n: usize,
    owned: Vec<Owned>,
    free: Vec<AlignedBuf>,
    dev: Option<Arc<Device>>,
    error: i32,
    requeue: bool,
}

impl HookJob {
    fn run(&mut self) {
        run_owned_hooks(
            &mut self.buf,
            self.n,
            &mut self.owned,
            self.dev.as_deref(),
            (&mut self.error, &mut self.requeue),
            &mut self.free,
        );
    }
}

/// A request whose owned buffers' hooks cover at least this many bytes has them
/// run on a worker (when its engine offloads): below it, handing the work over
/// and back costs more than the hooks (4 KiB of AES-XTS is about half a
/// microsecond, a wake-up of another thread several).
const OFFLOAD_MIN: usize = 256 << 10;

/// The threads that run offloaded hooks ([`Engine::offload_hooks`]), one per
/// core (at most 8). (rayon's pool was tried for this and to split dm-crypt's
/// cipher of a large write over the workers: its idle threads spin before they
/// sleep, and on two cores 1 MiB crypt writes went from 2,600–2,725 to
/// 1,901–2,925 IOPS.)
static HOOK_WORKERS: crate::sync::Workers = crate::sync::Workers::new("dm-hooks", 0);

/// Where other threads post completions for one engine.
pub struct Inbox {
    msgs: Mutex<Vec<Msg>>,
    efd: OwnedFd,
}

impl Inbox {
    fn new() -> std::io::Result<Inbox> {
        let efd = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC)?;
        Ok(Inbox {
            msgs: Mutex::new(Vec::new()),
            efd,
        })
    }

    fn post(&self, m: Msg) {
        let mut q = self.msgs.lock().unpoisoned();
        let wake = q.is_empty();
        q.push(m);
        drop(q);
        // One signal per batch: the engine takes the whole list when it wakes.
        if wake {
            crate::sync::sched::wake(self.key(), true);
            let _ = rustix::io::write(&self.efd, &1u64.to_ne_bytes());
        }
    }

    /// What a crash trial's engine waits on in its scheduler.
    fn key(&self) -> usize {
        self as *const Inbox as usize
    }
}

/// A piece of a request that a target took to finish later, from any thread.
/// Dropping it unfinished fails the piece with EIO, so a request never hangs on a
/// target that lost it.
pub struct Pending {
    inbox: Arc<Inbox>,
    piece: Piece,
    sent: bool,
}

impl Pending {
    pub(crate) fn new(inbox: Arc<Inbox>, piece: Piece) -> Pending {
        Pending {
            inbox,
            piece,
            sent: false,
        }
    }

    /// The piece, in the target's sectors.
    pub fn bio(&self) -> Bio {
        self.piece.bio
    }

    /// Post the piece's outcome to its engine, once.
    fn post(&mut self, resume: Resume) {
        if std::mem::replace(&mut self.sent, true) {
            return;
        }
        let piece = Piece {
            end_io: self.piece.end_io.take(),
            ..self.piece
        };
        self.inbox.post(Msg::Piece { piece, resume });
    }

    fn send(mut self, resume: Resume) {
        self.post(resume);
    }

    /// The piece is done.
    pub fn done(self) {
        self.send(Resume::Done(0, None));
    }

    /// The piece failed with `errno`.
    pub fn fail(self, errno: i32) {
        self.send(Resume::Done(errno, None));
    }

    /// Send the piece on as `bio` (in `dest`'s sectors); `end_io` runs once that
    /// I/O is done (with `false` if it failed or never ran).
    pub fn remap(self, dest: Dest, bio: Bio, end_io: Option<EndIo>) {
        self.send(Resume::Remap { dest, bio, end_io });
    }

    /// Map the piece again from its target: what held it has passed (a block was
    /// provisioned, space was added), or its device is suspending.
    pub fn requeue(self) {
        self.send(Resume::Requeue);
    }

    /// The piece, a read, is done with `bytes` as its data (as many as it
    /// covers; fewer fail it with EIO), followed by its integrity tags where
    /// the piece has them ([`Bio::tags`]: exactly as many, else EIO).
    pub fn done_with(self, bytes: Vec<u8>) {
        self.send(Resume::Done(0, Some(bytes)));
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.post(Resume::Done(errno::EIO, None));
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    Free,
    /// The frontend is filling it (a write's payload is arriving).
    Filling,
    InFlight,
    /// Waiting for a suspended device to resume.
    Parked,
    /// Done; the frontend replies and frees it.
    Done,
}

/// One request: what the frontend asked, its data, and the engine's progress.
pub struct Request {
    pub op: Op,
    pub sector: u64,
    pub nr_sectors: u64,
    /// REQ_FUA: durable before completion (discard and zeroing emulate it with a
    /// flush afterwards).
    pub fua: bool,
    /// WriteZeroes may deallocate.
    pub punch: bool,
    /// WriteZeroes must be fast: fail with EOPNOTSUPP rather than write zeroes.
    pub fast_zero: bool,
    /// The data: write payloads arrive here, reads land here.
    pub buf: AlignedBuf,
    /// 0, or the errno the request failed with.
    pub error: i32,
    state: State,
    gen: u32,
    leaves: Vec<Leaf>,
    holds: Vec<Hold>,
    /// Buffers targets allocated for parts of this request (`MapCtx::remap_owned`).
    owned: Vec<Owned>,
    /// Leaves issued and pieces out with targets, not yet finished.
    pending: u32,
    /// Of `pending`, the pieces out with targets: when they are all that is
    /// left, the request lets go of the devices below its own (`mapper::relax`).
    waits: u32,
    /// A device on the path is suspended: when nothing is pending, release every
    /// hold and map the whole request again once it resumes.
    requeue: bool,
    then_flush: bool,
    /// What is left of the request is its trailing flush (FUA emulated, or the
    /// commit a FUA write's metadata needs): the device was suspending when it
    /// was mapped, and the retry after the resume maps only the flush.
    flush_only: bool,
    /// A leaf ran an end-of-I/O hook (a target changed metadata): with FUA the
    /// request ends with a flush so that change is durable too.
    hooked: bool,
    /// The device the request was started on; kept when the slot is reused for
    /// the same device, so the fast path clones no `Arc`.
    dev: Option<Arc<Device>>,
    /// Counted in the device's statistics regions when it started.
    stats: Option<super::stats::Started>,
}

impl Request {
    fn new() -> Request {
        Request {
            op: Op::Read,
            sector: 0,
            nr_sectors: 0,
            fua: false,
            punch: false,
            fast_zero: false,
            buf: AlignedBuf::default(),
            error: 0,
            state: State::Free,
            gen: 0,
            leaves: Vec::with_capacity(8),
            holds: Vec::with_capacity(4),
            owned: Vec::new(),
            pending: 0,
            waits: 0,
            requeue: false,
            then_flush: false,
            flush_only: false,
            hooked: false,
            dev: None,
            stats: None,
        }
    }

    fn bytes(&self) -> usize {
        (self.nr_sectors * crate::io::SECTOR) as usize
    }
}

/// A completion of a frontend operation.
#[derive(Clone, Copy, Debug)]
pub struct IoEvent {
    pub tag: u64,
    pub res: i32,
    /// A multishot operation ([`Engine::poll_in`]) stays armed.
    pub more: bool,
}

pub struct Engine {
    q: IoQueue,
    inbox: Arc<Inbox>,
    wake_buf: Box<[u8; 8]>,
    wake_armed: bool,
    reqs: Vec<Request>,
    free: Vec<usize>,
    parked: VecDeque<usize>,
    /// Operations submitted to the ring and not yet completed (frontend's included).
    ops: u64,
    /// Pieces out with targets.
    asyncs: u64,
    done: VecDeque<usize>,
    io_events: Vec<IoEvent>,
    zero_buf: AlignedBuf,
    /// Free buffers for targets' owned data, reused from request to request.
    owned_pool: Vec<AlignedBuf>,
    cq: Vec<(u64, i32)>,
    msgs: Vec<Msg>,
    closing: bool,
    /// Slots the engine may grow to when all are taken ([`Engine::allow_growth`]).
    max_slots: usize,
    /// Large requests' owned-buffer hooks run on workers ([`Engine::offload_hooks`]).
    offload: bool,
}

/// The most request slots an engine can have: a leaf's completion carries its
/// slot in 16 bits.
pub const SLOTS_LIMIT: usize = 1 << 16;

impl Engine {
    /// An engine with `slots` request slots, for requests to any device.
    pub fn new(slots: usize) -> std::io::Result<Engine> {
        Ok(Engine {
            q: IoQueue::new(512),
            inbox: Arc::new(Inbox::new()?),
            wake_buf: Box::new([0; 8]),
            wake_armed: false,
            reqs: (0..slots).map(|_| Request::new()).collect(),
            free: (0..slots).rev().collect(),
            parked: VecDeque::new(),
            ops: 0,
            asyncs: 0,
            done: VecDeque::new(),
            io_events: Vec::with_capacity(64),
            zero_buf: AlignedBuf::default(),
            owned_pool: Vec::new(),
            cq: Vec::with_capacity(256),
            msgs: Vec::new(),
            closing: false,
            max_slots: slots,
            offload: false,
        })
    }

    /// Let the engine add slots, when all are taken, up to `max` (at most
    /// [`SLOTS_LIMIT`]). Nothing the ring or a target holds points into a
    /// request, so the slots may move as they grow.
    pub fn allow_growth(&mut self, max: usize) {
        self.max_slots = max.clamp(self.reqs.len(), SLOTS_LIMIT);
    }

    /// Hand the I/O queued so far to the kernel without waiting (a frontend
    /// serving several clients, between them: the first client's I/O need not
    /// wait for the others' requests to be parsed).
    pub fn submit(&mut self) {
        self.q.submit();
    }

    /// Run the owned-buffer hooks of a request that has at least [`OFFLOAD_MIN`]
    /// bytes of them (a large read's decryption, hashing or XOR) on a worker
    /// thread, so this thread serves other requests meanwhile: for a frontend
    /// whose thread serves many requests (an NBD reactor, a ublk queue). The
    /// request completes from the worker's answer, as a piece a target took.
    pub fn offload_hooks(&mut self, on: bool) {
        self.offload = on;
    }

    /// See [`IoQueue::set_io_workers`].
    pub fn set_io_workers(&mut self, n: u32) {
        self.q.set_io_workers(n);
    }

    /// Whether [`Engine::alloc`] would give a slot.
    pub fn can_alloc(&self) -> bool {
        !self.free.is_empty() || self.reqs.len() < self.max_slots
    }

    /// Whether the engine runs on io_uring (else system calls: no driver commands).
    pub fn uses_uring(&self) -> bool {
        self.q.is_uring()
    }

    /// A free request slot, to fill and `start`.
    pub fn alloc(&mut self) -> Option<usize> {
        if self.free.is_empty() && self.reqs.len() < self.max_slots {
            let n = self.reqs.len();
            let add = n.max(64).min(self.max_slots - n);
            self.reqs.extend((0..add).map(|_| Request::new()));
            self.free.extend((n..n + add).rev());
        }
        let r = self.free.pop()?;
        let q = &mut self.reqs[r];
        q.state = State::Filling;
        q.error = 0;
        Some(r)
    }

    pub fn nr_free(&self) -> usize {
        self.free.len()
    }

    pub fn nr_slots(&self) -> usize {
        self.reqs.len()
    }

    pub fn request(&self, r: usize) -> &Request {
        &self.reqs[r]
    }

    pub fn request_mut(&mut self, r: usize) -> &mut Request {
        &mut self.reqs[r]
    }

    /// Give a slot back (its reply has been sent).
    pub fn free(&mut self, r: usize) {
        let q = &mut self.reqs[r];
        q.state = State::Free;
        q.leaves.clear();
        self.owned_pool.extend(q.owned.drain(..).map(|o| o.buf));
        self.free.push(r);
    }

    /// Free slots let go of the devices they were last used for (a slot keeps
    /// its device for the next request to it, and so keeps the device alive).
    pub fn forget_devices(&mut self) {
        for &r in &self.free {
            self.reqs[r].dev = None;
        }
    }

    /// Finish `r` without mapping it (the frontend answered it itself).
    pub fn complete(&mut self, r: usize, error: i32) {
        let q = &mut self.reqs[r];
        q.error = error;
        q.state = State::Done;
        self.done.push_back(r);
    }

    /// The next request that is done (in completion order).
    pub fn pop_done(&mut self) -> Option<usize> {
        self.done.pop_front()
    }

    /// Completions of the frontend's own operations since the last call.
    pub fn io_events(&mut self, out: &mut Vec<IoEvent>) {
        out.append(&mut self.io_events);
    }

    /// Whether anything is still under way (the frontend may not free buffers the
    /// kernel or a target could still touch until this is false).
    pub fn busy(&self) -> bool {
        // the armed wake read is always there: it is not work under way
        self.ops > u64::from(self.wake_armed) || self.asyncs > 0
    }

    /// Queue a frontend operation; its completion comes back through `io_events`.
    ///
    /// # Safety
    /// As [`IoQueue::push`]: the memory `op` names must stay valid and untouched
    /// until its completion has been returned.
    pub unsafe fn push_io(&mut self, op: Sqe, tag: u64) {
        self.ops += 1;
        // SAFETY: the caller's guarantee, passed on.
        unsafe { self.q.push(op, (KIND_FRONTEND << KIND_SHIFT) | (tag & TAG_MASK)) };
    }

    /// Report (as an [`IoEvent`] with `tag`) whenever `fd` becomes readable, until
    /// an event comes with `more` false. It names no memory, so it may stay armed
    /// when the frontend goes: the ring's teardown cancels it.
    pub fn poll_in(&mut self, fd: RawFd, tag: u64) {
        // SAFETY: a poll names no memory.
        unsafe {
            self.q
                .push(Sqe::PollIn { fd }, (KIND_POLL << KIND_SHIFT) | (tag & TAG_MASK))
        };
    }

    /// Stop the poll armed with [`Engine::poll_in`] under `tag`: its last event
    /// (with `more` false) follows.
    pub fn cancel_poll(&mut self, tag: u64) {
        let tag = tag & TAG_MASK;
        self.q
            .cancel_poll((KIND_POLL << KIND_SHIFT) | tag, (KIND_CANCEL << KIND_SHIFT) | tag);
    }

    /// Give up the requests waiting for a resume that `drop` picks (their
    /// frontend is going): they end with EIO, having reached no device.
    pub fn drop_parked(&mut self, mut drop: impl FnMut(usize) -> bool) {
        let mut i = 0;
        while i < self.parked.len() {
            let r = self.parked[i];
            if !drop(r) {
                i += 1;
                continue;
            }
            self.parked.remove(i);
            let q = &mut self.reqs[r];
            q.state = State::Done;
            q.error = libc::EIO;
            end_stats(q);
            release(&mut q.holds);
            self.done.push_back(r);
        }
    }

    fn push(&mut self, op: Sqe, ud: u64) {
        self.ops += 1;
        // SAFETY: every pointer in `op` names memory the engine owns (request
        // buffers, the zero buffer, the wake buffer), which is neither freed nor
        // moved while `ops > 0`: slots are only freed once done, buffers only
        // resized in free slots, and the frontend waits for `busy()` to clear.
        unsafe { self.q.push(op, ud) };
    }

    /// What request `r` waits for, for a log line about one that takes long: its
    /// state, counts, leaves (kind, file, range, bytes done), whether its device
    /// is suspended, and the queue's state.
    pub fn describe(&self, r: usize) -> String {
        let Some(q) = self.reqs.get(r) else {
            return format!("no request {r}");
        };
        let leaves: Vec<String> = q
            .leaves
            .iter()
            .map(|l| {
                let file = l.file.map_or("-".to_string(), |f| {
                    // what the descriptors name now (a number reused would show here)
                    let names = match f.to {
                        crate::io::backing::HandleTo::Fd { buffered, direct } => {
                            let at = crate::io::fd_target;
                            format!("{buffered} = {}, {direct} = {}", at(buffered), at(direct))
                        }
                        crate::io::backing::HandleTo::Rbd(_) => "rbd".to_string(),
                    };
                    format!("{names}{}", if f.sim.is_some() { " (simulated)" } else { "" })
                });
                format!("{:?} {file} {}+{} done {}", l.kind, l.offset, l.len, l.done)
            })
            .collect();
        format!(
            "{:?} {:?} {}+{} on {} (suspended {}): pending {} waits {} requeue {} flush_only {} error {}; \
             leaves [{}]; engine: ops {} asyncs {} parked {} done {} wake armed {}; queue: {}",
            q.state,
            q.op,
            q.sector,
            q.nr_sectors,
            q.dev.as_ref().map_or("-".to_string(), |d| d.name()),
            q.dev.as_ref().is_some_and(|d| d.io_suspended()),
            q.pending,
            q.waits,
            q.requeue,
            q.flush_only,
            q.error,
            leaves.join("; "),
            self.ops,
            self.asyncs,
            self.parked.len(),
            self.done.len(),
            self.wake_armed,
            self.q.describe(),
        )
    }

    /// Submit what is queued, wait for something to happen (at most `timeout`),
    /// and handle every completion: leaves, target completions, and frontend
    /// operations (returned through `io_events`).
    pub fn turn(&mut self, timeout: Option<Duration>) -> std::io::Result<()> {
        if !self.parked.is_empty() {
            self.retry_parked();
        }
        // On a crash trial's thread the inbox is read at every turn and waited
        // for in the trial's scheduler (`sync::sched`), not through the ring.
        let scheduled = crate::sync::sched::active();
        if !scheduled && !self.wake_armed && (!self.closing || self.asyncs > 0) {
            let buf = self.wake_buf.as_mut_ptr();
            let fd = self.inbox.efd.as_raw_fd();
            self.push(Sqe::Wake { fd, buf }, KIND_WAKE << KIND_SHIFT);
            self.wake_armed = true;
        }
        let timeout = if self.parked.is_empty() {
            timeout
        } else {
            // Parked requests retry when their device resumes.
            Some(timeout.map_or(Duration::from_millis(1), |t| t.min(Duration::from_millis(1))))
        };
        if !self.done.is_empty() || scheduled {
            self.q.wait(Some(Duration::ZERO))?;
        } else {
            self.q.wait(timeout)?;
        }
        let mut cq = std::mem::take(&mut self.cq);
        self.q.drain_flags(|u, r, more| {
            if u >> KIND_SHIFT == KIND_POLL {
                self.io_events.push(IoEvent {
                    tag: u & TAG_MASK,
                    res: r,
                    more,
                });
            } else if u >> KIND_SHIFT == KIND_CANCEL {
                // the poll's own last event says it ended
            } else {
                cq.push((u, r));
            }
        });
        for &(u, r) in &cq {
            self.ops -= 1;
            match u >> KIND_SHIFT {
                KIND_LEAF => self.on_leaf(((u >> 32) & 0xffff) as usize, (u & 0xffff_ffff) as usize, r),
                KIND_WAKE => {
                    self.wake_armed = false;
                    self.take_inbox();
                }
                _ => self.io_events.push(IoEvent {
                    tag: u & TAG_MASK,
                    res: r,
                    more: false,
                }),
            }
        }
        if scheduled {
            let idle = cq.is_empty() && self.io_events.is_empty() && self.done.is_empty();
            if idle && self.inbox.msgs.lock().unpoisoned().is_empty() {
                crate::sync::sched::wait_for(self.inbox.key(), timeout);
            }
            self.take_inbox();
        }
        cq.clear();
        self.cq = cq;
        Ok(())
    }

    /// The frontend is going away: requests waiting for a resume are dropped (they
    /// never reached a device), and everything under way is waited for, pieces out
    /// with targets included, so no buffer is freed under the kernel or a target.
    pub fn shut_down(&mut self) {
        self.closing = true;
        loop {
            while let Some(r) = self.parked.pop_front() {
                self.reqs[r].state = State::Done;
                end_stats(&mut self.reqs[r]);
            }
            self.io_events.clear();
            self.done.clear();
            if self.asyncs == 0 && self.wake_armed {
                // complete the armed wake read, so the ring holds no pointer of ours
                let _ = rustix::io::write(&self.inbox.efd, &1u64.to_ne_bytes());
            }
            if self.ops == 0 && self.asyncs == 0 {
                break;
            }
            if self.turn(Some(Duration::from_millis(10))).is_err() {
                break;
            }
        }
        for q in &mut self.reqs {
            release(&mut q.holds);
        }
    }

    // ---- mapping ----

    /// Map request `r` through `dev` and issue it.
    pub fn start(&mut self, r: usize, dev: &Arc<Device>) {
        let q = &mut self.reqs[r];
        if !same_device(q, dev) {
            q.dev = Some(dev.clone());
        }
        q.gen = q.gen.wrapping_add(1);
        q.error = 0;
        q.requeue = false;
        q.hooked = false;
        q.flush_only = false;
        q.then_flush = q.fua && matches!(q.op, Op::Discard | Op::WriteZeroes);
        q.stats = if dev.stats.on() {
            dev.stats.start(q.op, q.sector, q.nr_sectors)
        } else {
            None
        };
        if self.parked.iter().any(|&p| same_device(&self.reqs[p], dev)) {
            // behind the device's requests waiting for a resume, to keep their order
            self.reqs[r].state = State::Parked;
            self.parked.push_back(r);
            return;
        }
        self.map_request(r);
    }

    /// Run `f` with a mapping context over request `r` (its leaves, holds and
    /// data) and its device; pieces targets took meanwhile are counted.
    fn map_with(
        &mut self,
        r: usize,
        f: impl FnOnce(&mut MapCtx, &Arc<Device>) -> Result<(), MapErr>,
    ) -> Result<(), MapErr> {
        let q = &mut self.reqs[r];
        let Some(dev) = q.dev.as_ref() else {
            return Err(MapErr::Errno(errno::EIO));
        };
        let n = if q.op.has_data() { q.bytes() } else { 0 };
        let data = &mut q.buf.as_mut_slice()[..n];
        let mut ctx = MapCtx::new(
            &mut q.leaves,
            &mut q.holds,
            data,
            &self.inbox,
            &mut q.owned,
            &mut self.owned_pool,
            (r as u32, q.gen),
        );
        // A target that panics fails the request and the device (crate::panics).
        let res = crate::panics::catching(|| f(&mut ctx, dev)).unwrap_or_else(|| {
            dev.fail();
            Err(MapErr::Errno(errno::EIO))
        });
        let (submitted, flush_after) = ctx.finish();
        q.then_flush |= flush_after;
        q.pending += submitted;
        q.waits += submitted;
        self.asyncs += u64::from(submitted);
        res
    }

    /// Map `r` from the top (or only its trailing flush, if that is what was
    /// left when it was parked); false if it was parked (a device is suspended).
    fn map_request(&mut self, r: usize) -> bool {
        let q = &mut self.reqs[r];
        q.state = State::InFlight;
        let bio = if q.flush_only {
            FLUSH
        } else {
            Bio {
                op: q.op,
                sector: q.sector,
                nr_sectors: q.nr_sectors,
                buf_off: 0,
                fua: q.fua && q.op == Op::Write,
                punch: q.punch,
                tags: None,
            }
        };
        q.leaves.clear();
        match self.map_with(r, |ctx, dev| map_bio(dev, bio, ctx)) {
            Ok(()) => {
                self.reqs[r].flush_only = false;
                crate::io::coalesce(&mut self.reqs[r].leaves);
                self.issue_from(r, 0);
            }
            Err(MapErr::Suspended) => {
                self.drop_leaves(r, 0);
                self.reqs[r].requeue = true;
                if self.reqs[r].pending == 0 {
                    self.leaves_done(r);
                }
                return self.reqs[r].state != State::Parked;
            }
            Err(MapErr::Errno(e)) => {
                self.drop_leaves(r, 0);
                let q = &mut self.reqs[r];
                q.flush_only = false;
                q.error = e;
                if q.pending == 0 {
                    self.leaves_done(r);
                }
            }
        }
        true
    }

    /// Leaves `from..` of `r` will not be issued: their hooks learn it (`false`).
    fn drop_leaves(&mut self, r: usize, from: usize) {
        let q = &mut self.reqs[r];
        for l in q.leaves.drain(from..) {
            if let Some(h) = l.end_io {
                guarded(q.dev.as_deref(), &mut q.error, || {
                    h(false, &mut []);
                });
            }
        }
    }

    /// Map parked requests again, in order; once one is parked again (a device on
    /// its path is still suspended) the rest of its device's stay behind it.
    fn retry_parked(&mut self) {
        let list = std::mem::take(&mut self.parked);
        let mut stuck: Vec<*const Device> = Vec::new();
        for r in list {
            let dev = self.reqs[r].dev.as_ref().map_or(std::ptr::null(), Arc::as_ptr);
            if stuck.contains(&dev) {
                self.parked.push_back(r);
            } else if !self.map_request(r) {
                // parked again: `park` put it back in line
                stuck.push(dev);
            }
        }
    }

    fn park(&mut self, r: usize) {
        let q = &mut self.reqs[r];
        release(&mut q.holds);
        q.leaves.clear();
        q.requeue = false;
        q.error = 0;
        q.state = State::Parked;
        self.parked.push_back(r);
    }

    // ---- completions from targets ----

    fn take_inbox(&mut self) {
        let mut msgs = std::mem::take(&mut self.msgs);
        std::mem::swap(&mut msgs, &mut self.inbox.msgs.lock().unpoisoned());
        for m in msgs.drain(..) {
            self.on_msg(m);
        }
        self.msgs = msgs;
    }

    fn on_msg(&mut self, m: Msg) {
        match m {
            Msg::Piece { piece, resume } => self.on_piece(piece, resume),
            Msg::Hooks(job) => self.on_hooks(*job),
        }
    }

    /// A worker ran request `job.slot`'s hooks: the request goes on from there.
    fn on_hooks(&mut self, job: HookJob) {
        self.asyncs -= 1;
        let HookJob {
            slot,
            gen,
            buf,
            owned,
            free,
            error,
            requeue,
            ..
        } = job;
        self.owned_pool.extend(free);
        let r = slot as usize;
        let Some(q) = self
            .reqs
            .get_mut(r)
            .filter(|q| q.gen == gen && q.state == State::InFlight)
        else {
            tracing::error!("engine: hooks came back for a request that is not in flight");
            return;
        };
        q.buf = buf;
        q.owned = owned;
        q.error = error;
        q.requeue = requeue;
        self.owned_done(r);
    }

    fn on_piece(&mut self, piece: Piece, resume: Resume) {
        let r = piece.slot as usize;
        self.asyncs -= 1;
        if self
            .reqs
            .get(r)
            .is_none_or(|q| q.gen != piece.gen || q.state != State::InFlight)
        {
            tracing::error!("engine: a target completed a piece of a request that is not in flight");
            return;
        }
        let first = self.reqs[r].leaves.len();
        let m = piece;
        let q = &mut self.reqs[r];
        q.waits -= 1;
        match resume {
            Resume::Done(e, bytes) => {
                let e = match bytes {
                    Some(b) if e == 0 => fill_piece(q, &m, &b),
                    _ => e,
                };
                if let Some(h) = m.end_io {
                    let mut he = 0;
                    guarded(q.dev.as_deref(), &mut q.error, || {
                        he = h(e == 0, &mut []);
                    });
                    q.hooked |= m.hook_needs_flush;
                    hook_answer(&mut q.error, &mut q.requeue, he);
                }
                if e != 0 && q.error == 0 && !m.tolerant {
                    q.error = e;
                }
            }
            Resume::Remap { dest, bio, end_io } => {
                let end_io = match (end_io, m.end_io) {
                    (Some(a), Some(b)) => Some(chain(a, b)),
                    (a, b) => a.or(b),
                };
                let res = self.map_with(r, |ctx, _| {
                    ctx.in_buffer(m.owned);
                    ctx.at_target(m.origin, m.target_start);
                    ctx.remap_dest_with(&dest, bio, end_io)
                });
                self.after_remap(r, first, res);
            }
            Resume::Requeue => {
                if let Some(h) = m.end_io {
                    // a piece of a piece: the piece above cannot finish; start over
                    guarded(q.dev.as_deref(), &mut q.error, || {
                        h(false, &mut []);
                    });
                    q.requeue = true;
                } else {
                    let dev = q.holds.get(m.origin.0 as usize).map(|h| h.dev.clone());
                    match dev {
                        Some(d) if !d.io_suspended() => {
                            let bio = Bio {
                                sector: m.target_start + m.bio.sector,
                                ..m.bio
                            };
                            let res = self.map_with(r, |ctx, _| {
                                ctx.in_buffer(m.owned);
                                map_bio(&d, bio, ctx)
                            });
                            self.after_remap(r, first, res);
                        }
                        _ => q.requeue = true,
                    }
                }
            }
        }
        self.reqs[r].pending -= 1;
        self.settle(r);
    }

    /// A leaf or piece of `r` finished, or leaves were issued: complete the
    /// request when nothing is left; let go of the devices below its own when
    /// only pieces waiting in targets are (`mapper::relax`).
    fn settle(&mut self, r: usize) {
        let q = &mut self.reqs[r];
        if q.pending == 0 {
            self.leaves_done(r);
        } else if q.pending == q.waits {
            super::relax(&mut q.holds);
        }
    }

    /// New leaves `first..` of `r` were mapped with result `res`: issue them, or
    /// drop them and requeue or fail the request.
    fn after_remap(&mut self, r: usize, first: usize, res: Result<(), MapErr>) {
        match res {
            Ok(()) => {
                // held while the new leaves are issued, so none completes the request early
                self.reqs[r].pending += 1;
                self.issue_from(r, first);
                self.reqs[r].pending -= 1;
            }
            Err(MapErr::Suspended) => {
                self.drop_leaves(r, first);
                self.reqs[r].requeue = true;
            }
            Err(MapErr::Errno(e)) => {
                self.drop_leaves(r, first);
                let q = &mut self.reqs[r];
                if q.error == 0 {
                    q.error = e;
                }
            }
        }
    }

    // ---- leaves ----

    /// Issue leaves `from..` of `r`; completes the request if nothing is pending.
    fn issue_from(&mut self, r: usize, from: usize) {
        let n = self.reqs[r].leaves.len();
        for i in from..n {
            self.issue_leaf(r, i);
        }
        self.settle(r);
    }

    /// Start (or continue, after a short transfer) leaf `i` of `r`. Leaves with no
    /// I/O complete here.
    fn issue_leaf(&mut self, r: usize, i: usize) {
        let q = &mut self.reqs[r];
        // The request buffer bounds every data leaf: the I/O below writes through a
        // raw pointer. A target that maps outside it (a bug, or metadata it did not
        // check) fails the request instead.
        let n = q.bytes();
        let l = &q.leaves[i];
        let data = leaf_buf(&mut q.buf, n, &mut q.owned, l.owned);
        let size = data.len();
        if matches!(l.kind, LeafKind::Read | LeafKind::Write | LeafKind::ZeroFill)
            && l.buf_off.checked_add(l.len as usize).is_none_or(|end| end > size)
        {
            tracing::error!(
                "engine: a target mapped {} bytes at offset {} of a {size}-byte buffer; failing it",
                l.len,
                l.buf_off,
            );
            q.leaves[i].kind = LeafKind::Fail(crate::io::errno::EIO);
        }
        let l = &q.leaves[i];
        let (off, rem) = (l.offset + l.done, l.len - l.done);
        let base = l.buf_off + l.done as usize;
        let data = leaf_buf(&mut q.buf, n, &mut q.owned, l.owned);
        let op = match (l.kind, l.file) {
            (LeafKind::Read, Some(f)) => f.read(data[base..].as_mut_ptr(), rem, off),
            (LeafKind::Write, Some(f)) => f.write(data[base..].as_ptr(), rem, off, l.fua),
            (LeafKind::Flush, Some(f)) => f.flush(),
            (LeafKind::Discard, Some(f)) => f.discard(off, rem),
            (LeafKind::WriteZeroes { punch }, Some(f)) => f.zero(punch, off, rem),
            (kind, _) => {
                let ok = match kind {
                    LeafKind::ZeroFill => {
                        data[l.buf_off..l.buf_off + l.len as usize].fill(0);
                        true
                    }
                    LeafKind::Fail(e) => {
                        if q.error == 0 && !l.tolerant {
                            q.error = e;
                        }
                        false
                    }
                    _ => true, // Drop
                };
                let l = &mut q.leaves[i];
                if let Some(h) = l.end_io.take() {
                    let mut e = 0;
                    let data = leaf_buf(&mut q.buf, n, &mut q.owned, l.owned);
                    guarded(q.dev.as_deref(), &mut q.error, || {
                        e = apply_end_io(&h, ok, l, data)
                    });
                    q.hooked |= l.hook_needs_flush;
                    hook_answer(&mut q.error, &mut q.requeue, e);
                }
                return;
            }
        };
        q.pending += 1;
        // Memory filesystems: a small copy costs less done here than handed to an
        // io_uring worker (4 KiB randwrite 10.1 -> 7.9 us CPU, randread 7.9 -> 4.3-5.1
        // us); a large one is better done by the workers beside this thread (512 KiB
        // writes 5.5K IOPS through them, 2.5K here).
        let file = l.file;
        let inline = l.file.is_some_and(|f| f.in_memory && f.sim.is_none())
            && match l.kind {
                LeafKind::Read | LeafKind::Write => rem <= INLINE_MAX,
                LeafKind::Flush => true,
                _ => false,
            };
        if inline {
            self.ops += 1;
            // SAFETY: as in `push`; the call completes before push_inline returns.
            unsafe { self.q.push_inline(op, ud_leaf(r, i)) };
        } else {
            self.push_to(file, op, ud_leaf(r, i));
        }
    }

    /// As `push`, for an operation on `file`: a file of a simulated disk goes
    /// through the disk (`io::sim`).
    fn push_to(&mut self, file: Option<crate::io::backing::FileHandle>, op: Sqe, ud: u64) {
        match file.and_then(|f| f.sim) {
            Some(sim) => {
                self.ops += 1;
                // SAFETY: as in `push`.
                unsafe { self.q.push_sim(op, ud, sim) };
            }
            None => self.push(op, ud),
        }
    }

    /// Write zeroes from the zero buffer: for files that cannot fallocate.
    fn issue_zero_write(&mut self, r: usize, i: usize) {
        if self.zero_buf.capacity() == 0 {
            self.zero_buf.ensure(ZERO_BUF);
        }
        let l = &self.reqs[r].leaves[i];
        let Some(f) = l.file else { return };
        let (off, rem) = (l.offset + l.done, (l.len - l.done).min(ZERO_BUF as u64));
        let buf = self.zero_buf.as_ptr();
        self.reqs[r].pending += 1;
        self.push_to(Some(f), f.write(buf, rem, off, false), ud_leaf(r, i));
    }

    fn on_leaf(&mut self, r: usize, i: usize, res: i32) {
        let q = &mut self.reqs[r];
        q.pending -= 1;
        let n = q.bytes();
        let l = &mut q.leaves[i];
        let zeroes = matches!(l.kind, LeafKind::WriteZeroes { .. });
        // A failed leaf fails the request, unless it is tolerant: then only its
        // hook learns it. `failed`: a tolerant write that wrote nothing.
        let mut failed = false;
        if res < 0 {
            let e = -res;
            if zeroes && matches!(e, libc::EOPNOTSUPP | libc::EINVAL | libc::ENODEV) {
                if q.fast_zero {
                    q.error = errno::EOPNOTSUPP;
                } else {
                    // The file cannot zero natively: write zeroes instead.
                    l.kind = LeafKind::ZeroWrite;
                    l.done = 0;
                    self.issue_zero_write(r, i);
                    return;
                }
            } else if !l.tolerant {
                if q.error == 0 {
                    q.error = e;
                }
                super::report_io_error(&q.holds, l.origin);
            }
        } else if matches!(l.kind, LeafKind::Read | LeafKind::Write | LeafKind::ZeroWrite) {
            if res == 0 {
                if l.kind == LeafKind::Read {
                    // Past the end of the file: the rest reads as zeroes.
                    let (a, b) = (l.buf_off + l.done as usize, l.buf_off + l.len as usize);
                    if let Some(d) = leaf_buf(&mut q.buf, n, &mut q.owned, l.owned).get_mut(a..b) {
                        d.fill(0);
                    }
                    l.done = l.len;
                } else if l.tolerant {
                    failed = true;
                } else if q.error == 0 {
                    q.error = errno::EIO;
                }
            } else {
                l.done += res as u64;
            }
            if l.done < l.len && q.error == 0 && !failed {
                if l.kind == LeafKind::ZeroWrite {
                    self.issue_zero_write(r, i);
                } else {
                    self.issue_leaf(r, i);
                }
                return;
            }
        }
        let l = &mut q.leaves[i];
        if let Some(h) = l.end_io.take() {
            let ok = res >= 0 && !(res == 0 && matches!(l.kind, LeafKind::Write | LeafKind::ZeroWrite));
            let mut e = 0;
            let data = leaf_buf(&mut q.buf, n, &mut q.owned, l.owned);
            guarded(q.dev.as_deref(), &mut q.error, || {
                e = apply_end_io(&h, ok, l, data)
            });
            q.hooked |= l.hook_needs_flush;
            hook_answer(&mut q.error, &mut q.requeue, e);
        }
        self.settle(r);
    }

    /// Every leaf and piece of `r` is done.
    fn leaves_done(&mut self, r: usize) {
        if self.offload && self.offload_owned(r) {
            return;
        }
        self.finish_owned(r);
        self.owned_done(r);
    }

    /// The owned buffers' hooks of `r` have run: requeue, flush or complete it.
    fn owned_done(&mut self, r: usize) {
        if self.reqs[r].requeue {
            self.park(r);
            return;
        }
        let q = &mut self.reqs[r];
        release(&mut q.holds);
        if (q.then_flush || (q.hooked && q.fua)) && q.error == 0 {
            q.then_flush = false;
            q.hooked = false;
            // once: the flush's own hooks (a target that records flushes, as
            // log-writes does) must not call for another
            q.fua = false;
            // FUA on a discard / write-zeroes, or on a write whose target changed
            // metadata: flush what it touched.
            q.leaves.clear();
            let res = self.map_with(r, |ctx, dev| map_bio(dev, FLUSH, ctx));
            match res {
                Ok(()) => return self.issue_from(r, 0),
                Err(MapErr::Suspended) => {
                    // A device on the path is suspending: the flush waits for the
                    // resume like any request (the request completes only after
                    // it), once the pieces a target took meanwhile are back.
                    self.drop_leaves(r, 0);
                    let q = &mut self.reqs[r];
                    q.flush_only = true;
                    q.requeue = true;
                    if q.pending == 0 {
                        self.park(r);
                    }
                    return;
                }
                Err(MapErr::Errno(e)) => {
                    self.drop_leaves(r, 0);
                    self.reqs[r].error = e;
                }
            }
            if self.reqs[r].pending > 0 {
                return;
            }
            release(&mut self.reqs[r].holds);
        }
        let q = &mut self.reqs[r];
        q.state = State::Done;
        end_stats(q);
        self.done.push_back(r);
    }
}

/// `q` is done: account its end in its device's statistics, if it was counted.
#[inline]
fn end_stats(q: &mut Request) {
    if let (Some(s), Some(dev)) = (q.stats.take(), q.dev.as_ref()) {
        dev.stats.end(q.op, q.sector, q.nr_sectors, s);
    }
}

impl Engine {
    /// Every leaf and piece of `r` is done: run the hooks of its owned buffers
    /// (innermost first, each with the data it stands for) and give the buffers
    /// back to the free list. A request that is requeued maps into new ones.
    fn finish_owned(&mut self, r: usize) {
        let q = &mut self.reqs[r];
        if q.owned.is_empty() {
            return;
        }
        let n = q.bytes();
        run_owned_hooks(
            &mut q.buf,
            n,
            &mut q.owned,
            q.dev.as_deref(),
            (&mut q.error, &mut q.requeue),
            &mut self.owned_pool,
        );
    }

    /// Hand `r`'s owned-buffer hooks to a worker if they are worth it (see
    /// [`OFFLOAD_MIN`]): its data and buffers go with them and come back in the
    /// inbox ([`Engine::on_hooks`]). False: run them here.
    fn offload_owned(&mut self, r: usize) -> bool {
        let q = &mut self.reqs[r];
        let heavy: usize = q.owned.iter().filter(|o| o.hook.is_some()).map(|o| o.len).sum();
        if heavy < OFFLOAD_MIN || self.closing {
            return false;
        }
        let mut job = HookJob {
            slot: r as u32,
            gen: q.gen,
            n: q.bytes(),
            buf: std::mem::take(&mut q.buf),
            owned: std::mem::take(&mut q.owned),
            free: Vec::new(),
            dev: q.dev.clone(),
            error: q.error,
            requeue: q.requeue,
        };
        let inbox = self.inbox.clone();
        // counted as a piece out with a target: the engine waits for it before
        // it shuts down, and its wake-up read stays armed meanwhile
        self.asyncs += 1;
        let work = move || {
            job.run();
            inbox.post(Msg::Hooks(Box::new(job)));
        };
        // a hook's panic is caught where it runs (`guarded`); anything else in
        // the job must not end the worker. Run here if no worker can: it comes
        // back through the inbox all the same
        HOOK_WORKERS.run(Box::new(move || {
            let _ = crate::panics::catching(work);
        }));
        true
    }
}

/// Run the hooks of a request's owned buffers, innermost first, each with the
/// data it stands for (`buf`'s first `n` bytes or an outer owned buffer's), the
/// answers going into the request's (error, requeue); the buffers go to `free`.
fn run_owned_hooks(
    buf: &mut AlignedBuf,
    n: usize,
    owned: &mut Vec<Owned>,
    dev: Option<&Device>,
    (error, requeue): (&mut i32, &mut bool),
    free: &mut Vec<AlignedBuf>,
) {
    while let Some(mut o) = owned.pop() {
        if let Some(h) = o.hook.take() {
            let ok = o.ok();
            let own = &mut o.buf.as_mut_slice()[..o.len + o.tag_len];
            let client = leaf_buf(buf, n, owned, o.client);
            let client = client
                .get_mut(o.client_off..o.client_off + o.len)
                .unwrap_or_default();
            let mut e = 0;
            guarded(dev, error, || e = h(ok, own, client));
            hook_answer(error, requeue, e);
        }
        free.push(o.buf);
    }
}

/// The buffer a leaf's data is in: request `r`'s (`n` bytes) or one of its owned
/// buffers.
fn leaf_buf<'b>(
    buf: &'b mut AlignedBuf,
    n: usize,
    owned: &'b mut [Owned],
    which: Option<u32>,
) -> &'b mut [u8] {
    match which.and_then(|i| owned.get_mut(i as usize)) {
        Some(o) => o.buf.as_mut_slice().get_mut(..o.len).unwrap_or_default(),
        // a request without data (discard, flush) has no buffer of its length
        None => buf.as_mut_slice().get_mut(..n).unwrap_or_default(),
    }
}

/// An empty flush (REQ_PREFLUSH with no data).
const FLUSH: Bio = Bio {
    op: Op::Flush,
    sector: 0,
    nr_sectors: 0,
    buf_off: 0,
    fua: false,
    punch: false,
    tags: None,
};

/// Copy `bytes`, a read's data a target made, into the part of `q`'s data
/// (or of the owned buffer it was mapped into) piece `m` covers, and the
/// integrity tags after them where the piece has tags: 0, or EIO if they are
/// fewer or the piece lies outside.
fn fill_piece(q: &mut Request, m: &Piece, bytes: &[u8]) -> i32 {
    let n = if q.op.has_data() { q.bytes() } else { 0 };
    let len = m.bio.bytes() as usize;
    let dst = super::target::bio_data(&mut q.owned, &mut q.buf.as_mut_slice()[..n], m.owned, &m.bio);
    match (dst, bytes.get(..len)) {
        (Some(dst), Some(src)) => dst.copy_from_slice(src),
        _ => return errno::EIO,
    }
    if m.bio.tags.is_some() {
        let dst = super::target::bio_tags(&mut q.owned, m.owned, &m.bio);
        match (dst, bytes.get(len..)) {
            (Some(dst), Some(src)) if src.len() == dst.len() => dst.copy_from_slice(src),
            _ => return errno::EIO,
        }
    }
    0
}

/// What a hook answered: an errno fails the request (the first one counts),
/// [`REMAP`] has it mapped again once everything under way for it is done.
fn hook_answer(error: &mut i32, requeue: &mut bool, e: i32) {
    if e == REMAP {
        *requeue = true;
    } else if e != 0 && *error == 0 {
        *error = e;
    }
}

/// Run a target's end-of-I/O hook: a panic in it fails the request (`error`)
/// and the device, as one in the map path does.
fn guarded(dev: Option<&Device>, error: &mut i32, f: impl FnOnce()) {
    if crate::panics::catching(f).is_none() {
        if let Some(dev) = dev {
            dev.fail();
        }
        if *error == 0 {
            *error = errno::EIO;
        }
    }
}

/// Whether `q` was started on `dev`.
fn same_device(q: &Request, dev: &Arc<Device>) -> bool {
    q.dev.as_ref().is_some_and(|d| Arc::ptr_eq(d, dev))
}

/// Run `a` then `b`.
fn chain(a: EndIo, b: EndIo) -> EndIo {
    Arc::new(move |ok, data: &mut [u8]| {
        let e = a(ok, data);
        let be = b(ok && e == 0, &mut []);
        if e != 0 {
            e
        } else {
            be
        }
    })
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;
