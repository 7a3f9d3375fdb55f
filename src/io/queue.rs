//! The per-thread I/O queue: io_uring where the kernel allows it, else synchronous
//! system calls executed at submission (containers often forbid io_uring).
//!
//! Each connection thread owns one queue; nothing here is shared between threads.

use io_uring::{opcode, types, IoUring};
use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use super::rbd::{self, Done, RbdOp, RbdRef, RbdSink};
use super::sim::SimRef;

/// One operation. Raw pointers name memory the caller keeps alive and untouched until
/// the operation's completion has been drained (the contract of [`IoQueue::push`]).
#[derive(Clone, Copy, Debug)]
pub enum Sqe {
    Read {
        fd: RawFd,
        buf: *mut u8,
        len: u32,
        offset: u64,
    },
    Write {
        fd: RawFd,
        buf: *const u8,
        len: u32,
        offset: u64,
        dsync: bool,
    },
    Fsync {
        fd: RawFd,
    },
    Fallocate {
        fd: RawFd,
        mode: i32,
        offset: u64,
        len: u64,
    },
    SendMsg {
        fd: RawFd,
        msg: *const libc::msghdr,
    },
    /// Report when `fd` is readable (the result is the poll mask), multishot: every
    /// time data arrives another completion follows, until one comes without
    /// [`more`](IoQueue::drain_flags) (the synchronous backend reports once).
    PollIn {
        fd: RawFd,
    },
    /// Read an eventfd's counter (8 bytes) once it is signalled: how another thread
    /// wakes this queue's owner.
    Wake {
        fd: RawFd,
        buf: *mut u8,
    },
    /// A driver command (IORING_OP_URING_CMD) with its 16 command bytes: the
    /// ublk frontend's fetch and commit. io_uring only.
    UringCmd {
        fd: RawFd,
        cmd_op: u32,
        cmd: [u8; 16],
    },
    /// An operation on an RBD image (`io::rbd`), completed by librbd; `buf` and
    /// `len` as for a read or write (null and the range for the others).
    Rbd {
        img: RbdRef,
        op: RbdOp,
        buf: *mut u8,
        len: u64,
        offset: u64,
    },
}

/// An operation of the synchronous backend waiting for its descriptor.
struct Waiting {
    user_data: u64,
    fd: RawFd,
    what: WaitFor,
}

enum WaitFor {
    /// Report readiness to read (a poll names no buffer).
    Poll,
    /// Read `len` bytes into `buf` once readable (an eventfd's counter).
    Read { buf: *mut u8, len: u32 },
    /// Send the message once the socket has room again.
    Send { msg: *const libc::msghdr },
}

impl Waiting {
    fn events(&self) -> i16 {
        match self.what {
            WaitFor::Send { .. } => libc::POLLOUT,
            _ => libc::POLLIN | libc::POLLRDHUP,
        }
    }
}

/// The user data of the queue's own read of its RBD sink's eventfd.
const RBD_WAKE: u64 = u64::MAX;

/// The queue's RBD operations: librbd's callbacks leave results in `sink`, whose
/// eventfd a read on the ring (or the synchronous poll) waits for.
struct RbdState {
    sink: Arc<RbdSink>,
    in_flight: usize,
    /// The eventfd read is queued.
    armed: bool,
    /// The eventfd read's buffer (boxed: it must not move while the read is queued).
    wake_buf: Box<u64>,
    taken: Vec<Done>,
}

pub struct IoQueue {
    ring: Option<IoUring>,
    /// Completions of the synchronous backend, and of io_uring submissions that failed.
    done: VecDeque<(u64, i32)>,
    /// The synchronous backend's operations that wait for their descriptor:
    /// readiness polls, wake reads and sends a full socket refused. They block
    /// only in `wait`, which polls them together.
    pending_recv: Vec<Waiting>,
    queued: usize,
    rbd: Option<RbdState>,
    /// Operations on files of a simulated disk ([`super::sim`]) pushed and not
    /// yet carried out. They run at the next wait, in a seed-chosen order, as a
    /// device with several I/Os in flight carries them out in any order; a flush
    /// covers only the writes that ran before it.
    held: Vec<(Sqe, u64, SimRef)>,
    /// The simulated disk whose seed orders the ready completions: that of the
    /// held operations last carried out, until their completions are handed
    /// on. Cleared then: the disk lives only as long as the files whose
    /// operations are under way (the queue may outlive it).
    sim: Option<SimRef>,
}

static NO_URING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Use the synchronous queue instead of io_uring (`serve --no-io-uring`).
pub fn disable_io_uring() {
    NO_URING.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Whether io_uring is to be tried (the kernel may still refuse a ring).
fn uring_wanted() -> bool {
    !NO_URING.load(std::sync::atomic::Ordering::Relaxed)
}

/// The simulated disk's view of an operation about to run (see `io::sim`).
fn sim_hook(sim: &super::sim::SimDisk, op: &Sqe) -> Result<(), i32> {
    match *op {
        Sqe::Read { fd, .. } => sim.on_read(fd),
        Sqe::Write {
            fd,
            buf,
            len,
            offset,
            dsync,
        } => {
            // SAFETY: `buf`/`len` come from an operation pushed under `push`'s contract.
            let data = unsafe { std::slice::from_raw_parts(buf, len as usize) };
            sim.on_write(fd, offset, data, dsync)
        }
        // FALLOC_FL_KEEP_SIZE alone allocates and changes no byte
        Sqe::Fallocate {
            fd,
            mode,
            offset,
            len,
        } if mode & !libc::FALLOC_FL_KEEP_SIZE != 0 => sim.on_zero(fd, offset, len),
        _ => Ok(()),
    }
}

impl IoQueue {
    pub fn new(entries: u32) -> IoQueue {
        let ring = if uring_wanted() {
            // Completions run as task work only when this thread waits for them
            // (DEFER_TASKRUN), not whenever a socket or a worker wakes it; the flag
            // in the ring says when such work is pending. Kernels before 6.1 lack
            // it and get the plain ring.
            IoUring::builder()
                .setup_single_issuer()
                .setup_defer_taskrun()
                .setup_taskrun_flag()
                .build(entries)
                .or_else(|_| IoUring::builder().setup_single_issuer().build(entries))
                .ok()
        } else {
            None
        };
        IoQueue {
            ring,
            done: VecDeque::new(),
            pending_recv: Vec::new(),
            queued: 0,
            rbd: None,
            held: Vec::new(),
            sim: None,
        }
    }

    /// A queue that always executes synchronously (tests of the fallback path).
    pub fn synchronous() -> IoQueue {
        IoQueue {
            ring: None,
            done: VecDeque::new(),
            pending_recv: Vec::new(),
            queued: 0,
            rbd: None,
            held: Vec::new(),
            sim: None,
        }
    }

    pub fn is_uring(&self) -> bool {
        self.ring.is_some()
    }

    /// Queue `op`; its completion is reported with `user_data`.
    ///
    /// # Safety
    /// Every pointer in `op` must stay valid, and the memory it names must not be
    /// moved or otherwise accessed, until the completion for `user_data` is drained.
    pub unsafe fn push(&mut self, op: Sqe, user_data: u64) {
        if let Sqe::Rbd {
            img,
            op,
            buf,
            len,
            offset,
        } = op
        {
            // SAFETY: the caller's guarantee, passed on.
            unsafe { self.push_rbd(img, op, buf, len, offset, user_data) };
            return;
        }
        let Some(ring) = self.ring.as_mut() else {
            self.sync_exec(op, user_data);
            return;
        };
        let entry = match op {
            Sqe::Read { fd, buf, len, offset } => {
                opcode::Read::new(types::Fd(fd), buf, len).offset(offset).build()
            }
            Sqe::Write {
                fd,
                buf,
                len,
                offset,
                dsync,
            } => opcode::Write::new(types::Fd(fd), buf, len)
                .offset(offset)
                .rw_flags(if dsync { libc::RWF_DSYNC } else { 0 })
                .build(),
            Sqe::Fsync { fd } => opcode::Fsync::new(types::Fd(fd))
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            Sqe::Fallocate {
                fd,
                mode,
                offset,
                len,
            } => opcode::Fallocate::new(types::Fd(fd), len)
                .offset(offset)
                .mode(mode)
                .build(),
            Sqe::SendMsg { fd, msg } => opcode::SendMsg::new(types::Fd(fd), msg)
                .flags(libc::MSG_NOSIGNAL as u32)
                .build(),
            Sqe::PollIn { fd } => {
                opcode::PollAdd::new(types::Fd(fd), (libc::POLLIN | libc::POLLRDHUP) as u32)
                    .multi(true)
                    .build()
            }
            Sqe::Wake { fd, buf } => opcode::Read::new(types::Fd(fd), buf, 8).build(),
            Sqe::UringCmd { fd, cmd_op, cmd } => {
                opcode::UringCmd16::new(types::Fd(fd), cmd_op).cmd(cmd).build()
            }
            Sqe::Rbd { .. } => return, // taken above
        }
        .user_data(user_data);
        // SAFETY: the caller guarantees the memory named by the entry outlives it.
        while unsafe { ring.submission().push(&entry) }.is_err() {
            if let Err(e) = ring.submit() {
                self.done
                    .push_back((user_data, -e.raw_os_error().unwrap_or(libc::EIO)));
                return;
            }
        }
        self.queued += 1;
    }

    /// Let the kernel run up to `n` workers at once for this ring's file I/O
    /// that cannot complete inline (buffered writes among them); its default
    /// is four per CPU, made for a ring per thread, which a ring serving many
    /// clients outgrows. Nothing on the synchronous backend.
    pub fn set_io_workers(&mut self, n: u32) {
        if let Some(ring) = self.ring.as_ref() {
            let mut max = [n, 0]; // bounded (file I/O) workers; unbounded unchanged
            if let Err(e) = ring.submitter().register_iowq_max_workers(&mut max) {
                tracing::debug!("io_uring: cannot set the number of io workers: {e}");
            }
        }
    }

    /// Stop the multishot poll queued with `user_data`: its last completion
    /// (without `more`) follows, as when it ends of itself. The removal's own
    /// completion comes with `remove_data`.
    pub fn cancel_poll(&mut self, user_data: u64, remove_data: u64) {
        let Some(ring) = self.ring.as_mut() else {
            if let Some(i) = self.pending_recv.iter().position(|w| w.user_data == user_data) {
                self.pending_recv.remove(i);
                self.done.push_back((user_data, -libc::ECANCELED));
            }
            return;
        };
        let entry = opcode::PollRemove::new(user_data).build().user_data(remove_data);
        // SAFETY: a poll removal names no memory.
        while unsafe { ring.submission().push(&entry) }.is_err() {
            if ring.submit().is_err() {
                return; // the poll stays armed; its socket's end still ends it
            }
        }
        self.queued += 1;
    }

    /// Do `op` now, on this thread, with a plain system call; its completion is
    /// reported with `user_data` by the next [`IoQueue::drain`], and `wait`
    /// does not block while it is there. For files whose I/O cannot wait for a
    /// device (memory filesystems).
    ///
    /// # Safety
    /// As [`IoQueue::push`] (the call completes before this returns).
    pub unsafe fn push_inline(&mut self, op: Sqe, user_data: u64) {
        if matches!(op, Sqe::Rbd { .. }) {
            // SAFETY: the caller's guarantee, passed on (librbd is never inline).
            unsafe { self.push(op, user_data) };
            return;
        }
        self.sync_exec(op, user_data);
    }

    /// Queue `op` on a file of the simulated disk `sim` (a [`FileHandle`]'s
    /// `sim`): it runs synchronously, through the disk's hooks, at the next wait.
    ///
    /// # Safety
    /// As [`IoQueue::push`].
    ///
    /// [`FileHandle`]: super::backing::FileHandle
    pub unsafe fn push_sim(&mut self, op: Sqe, user_data: u64, sim: SimRef) {
        self.held.push((op, user_data, sim));
    }

    /// Carry out the held operations of simulated disks, in a seed-chosen order
    /// (the last one's disk orders them: its file is open while it is held).
    fn run_held(&mut self) {
        let Some(&(_, _, order)) = self.held.last() else {
            return;
        };
        self.sim = Some(order);
        let mut held = std::mem::take(&mut self.held);
        order.disk().shuffle(&mut held);
        for (op, user_data, sim) in held.drain(..) {
            if let Err(e) = sim_hook(sim.disk(), &op) {
                self.done.push_back((user_data, -e));
                continue;
            }
            self.sync_exec(op, user_data);
            if let Sqe::Fsync { fd } = op {
                if self.done.back() == Some(&(user_data, 0)) {
                    sim.disk().on_flush(fd);
                }
            }
        }
        if self.held.is_empty() {
            self.held = held; // keep the allocation
        }
    }

    /// Start an RBD operation; its result arrives through the sink.
    ///
    /// # Safety
    /// As [`IoQueue::push`].
    unsafe fn push_rbd(
        &mut self,
        img: RbdRef,
        op: RbdOp,
        buf: *mut u8,
        len: u64,
        offset: u64,
        user_data: u64,
    ) {
        if self.rbd.is_none() {
            match RbdSink::new() {
                Ok(sink) => {
                    self.rbd = Some(RbdState {
                        sink,
                        in_flight: 0,
                        armed: false,
                        wake_buf: Box::new(0),
                        taken: Vec::new(),
                    })
                }
                Err(e) => {
                    self.done
                        .push_back((user_data, -e.raw_os_error().unwrap_or(libc::EIO)));
                    return;
                }
            }
        }
        let Some(st) = self.rbd.as_mut() else { return };
        let Ok(len_us) = usize::try_from(len) else {
            self.done.push_back((user_data, -libc::EINVAL));
            return;
        };
        // SAFETY: the caller keeps `buf` alive and untouched until the result is
        // drained, which is after the sink has it.
        match unsafe { rbd::submit(img, op, buf, len_us, offset, &st.sink, user_data) } {
            Ok(()) => {
                st.in_flight += 1;
                self.arm_rbd();
            }
            Err(e) => self.done.push_back((user_data, -e)),
        }
    }

    /// Queue the read of the sink's eventfd, once, while RBD operations are out.
    fn arm_rbd(&mut self) {
        let Some(st) = self.rbd.as_mut() else { return };
        if st.armed || st.in_flight == 0 {
            return;
        }
        st.armed = true;
        let (fd, buf) = (
            st.sink.fd(),
            std::ptr::from_mut::<u64>(&mut st.wake_buf).cast::<u8>(),
        );
        // SAFETY: `wake_buf` is boxed in the queue and outlives the read, which
        // completes (or is cancelled with the ring) before the queue is dropped.
        unsafe { self.push(Sqe::Wake { fd, buf }, RBD_WAKE) };
    }

    /// Hand the results librbd has left to `f`; a FUA write whose data is in goes
    /// out again as its flush.
    fn reap_rbd(&mut self, woke: bool, f: &mut impl FnMut(u64, i32, bool)) {
        let Some(st) = self.rbd.as_mut() else { return };
        if woke {
            st.armed = false;
        }
        if st.in_flight == 0 {
            return;
        }
        let mut taken = std::mem::take(&mut st.taken);
        st.sink.take(&mut taken);
        st.in_flight -= taken.len();
        for d in taken.drain(..) {
            match d.then_flush {
                // SAFETY: a flush names no memory; a positive length is only the
                // result it reports (the write's).
                Some(img) => unsafe {
                    self.push_rbd(
                        img,
                        RbdOp::Flush,
                        std::ptr::null_mut(),
                        d.res as u64,
                        0,
                        d.user_data,
                    )
                },
                None => f(d.user_data, d.res, false),
            }
        }
        if let Some(st) = self.rbd.as_mut() {
            st.taken = taken;
        }
        self.arm_rbd();
    }

    /// The queue's state, for a log line about a request that takes long.
    pub fn describe(&self) -> String {
        let ring = self.ring.as_ref().map_or("none".to_string(), |r| {
            // SAFETY: reading the ring's shared heads and tails changes nothing.
            let (sq, cq) = unsafe { (r.submission_shared().len(), r.completion_shared().len()) };
            format!("sq {sq} cq {cq}")
        });
        format!(
            "ring {ring}, queued {}, ready {}, held {}, waiting {}, rbd {}",
            self.queued,
            self.done.len(),
            self.held.len(),
            self.pending_recv.len(),
            self.rbd.as_ref().map_or(0, |s| s.in_flight),
        )
    }

    /// Hand what was queued to the kernel now, without waiting for anything.
    pub fn submit(&mut self) {
        if self.queued == 0 {
            return;
        }
        if let Some(ring) = self.ring.as_mut() {
            if ring.submit().is_ok() {
                self.queued = 0;
            }
        }
    }

    /// Submit what was queued and wait until at least one completion is ready, or the
    /// timeout passes. Returns without waiting when completions are already there.
    pub fn wait(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        self.run_held();
        let ready = !self.done.is_empty();
        let Some(ring) = self.ring.as_mut() else {
            if ready {
                return Ok(());
            }
            if timeout.is_some_and(|t| t.is_zero()) && self.pending_recv.is_empty() {
                return Ok(());
            }
            return self.sync_wait_recv(timeout);
        };
        if ready && self.queued == 0 {
            // Completions of inline operations are there and nothing is to be
            // submitted: an enter would be a system call for nothing (the ring's
            // own completions are collected at the next wait).
            return Ok(());
        }
        let want = if ready || !ring.completion().is_empty() {
            0
        } else {
            1
        };
        let r = match timeout {
            Some(t) if want > 0 => {
                let ts = types::Timespec::from(t);
                let args = types::SubmitArgs::new().timespec(&ts);
                ring.submitter().submit_with_args(want, &args)
            }
            _ => ring.submitter().submit_and_wait(want),
        };
        self.queued = 0;
        match r {
            Ok(_) => Ok(()),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME | libc::EINTR | libc::EBUSY)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Hand every ready completion to `f(user_data, result)`.
    pub fn drain(&mut self, mut f: impl FnMut(u64, i32)) {
        self.drain_flags(|u, r, _| f(u, r));
    }

    /// Hand every ready completion to `f(user_data, result, more)`; `more` says a
    /// multishot operation stays armed and will complete again.
    pub fn drain_flags(&mut self, mut f: impl FnMut(u64, i32, bool)) {
        self.run_held();
        // the completions handed on below end the operations that keep the
        // disk alive: the reference goes with them
        if let Some(sim) = self.sim.take() {
            sim.disk().shuffle(self.done.make_contiguous());
        }
        let mut woke = false;
        while let Some((u, r)) = self.done.pop_front() {
            if u == RBD_WAKE {
                woke = true;
                continue;
            }
            f(u, r, false);
        }
        if let Some(ring) = self.ring.as_mut() {
            for cqe in ring.completion() {
                if cqe.user_data() == RBD_WAKE {
                    woke = true;
                    continue;
                }
                f(cqe.user_data(), cqe.result(), io_uring::cqueue::more(cqe.flags()));
            }
        }
        if self.rbd.is_some() {
            self.reap_rbd(woke, &mut f);
        }
    }

    fn sync_exec(&mut self, op: Sqe, user_data: u64) {
        // SAFETY (all calls below): the pointers come from `push`, whose caller
        // guarantees they are valid for the lengths given.
        let r: isize = unsafe {
            match op {
                Sqe::Read { fd, buf, len, offset } => {
                    libc::pread(fd, buf.cast(), len as usize, offset as libc::off_t)
                }
                Sqe::Write {
                    fd,
                    buf,
                    len,
                    offset,
                    dsync,
                } => libc::pwritev2(
                    fd,
                    &libc::iovec {
                        iov_base: buf as *mut libc::c_void,
                        iov_len: len as usize,
                    },
                    1,
                    offset as libc::off_t,
                    if dsync { libc::RWF_DSYNC } else { 0 },
                ),
                Sqe::Fsync { fd } => libc::fdatasync(fd) as isize,
                Sqe::Fallocate {
                    fd,
                    mode,
                    offset,
                    len,
                } => libc::fallocate(fd, mode, offset as libc::off_t, len as libc::off_t) as isize,
                Sqe::Wake { fd, buf } => {
                    self.pending_recv.push(Waiting {
                        user_data,
                        fd,
                        what: WaitFor::Read { buf, len: 8 },
                    });
                    return;
                }
                Sqe::PollIn { fd } => {
                    // no buffer: `sync_wait_recv` reports readiness without reading
                    self.pending_recv.push(Waiting {
                        user_data,
                        fd,
                        what: WaitFor::Poll,
                    });
                    return;
                }
                Sqe::SendMsg { fd, msg } => {
                    // A full socket must not stop the thread (it serves other
                    // clients): the send waits in `wait` for room, as on a ring.
                    let r = libc::sendmsg(fd, msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT);
                    if r < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EAGAIN) {
                        self.pending_recv.push(Waiting {
                            user_data,
                            fd,
                            what: WaitFor::Send { msg },
                        });
                        return;
                    }
                    r
                }
                Sqe::Rbd { .. } => {
                    // `push` takes these
                    self.done.push_back((user_data, -libc::EINVAL));
                    return;
                }
                Sqe::UringCmd { .. } => {
                    // a driver command exists only on a ring
                    self.done.push_back((user_data, -libc::EOPNOTSUPP));
                    return;
                }
            }
        };
        let res = if r < 0 {
            -io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
        } else {
            r as i32
        };
        self.done.push_back((user_data, res));
    }

    fn sync_wait_recv(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        if self.pending_recv.is_empty() {
            if let Some(t) = timeout {
                std::thread::sleep(t);
            }
            return Ok(());
        }
        let mut pfds: Vec<libc::pollfd> = self
            .pending_recv
            .iter()
            .map(|w| libc::pollfd {
                fd: w.fd,
                events: w.events(),
                revents: 0,
            })
            .collect();
        let ms = timeout.map_or(-1, |t| {
            if t.is_zero() {
                0
            } else {
                t.as_millis().clamp(1, i32::MAX as u128) as i32
            }
        });
        // SAFETY: `pfds` is a live array of `pfds.len()` pollfds.
        let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
        if n <= 0 {
            return Ok(());
        }
        let mut i = 0;
        for p in pfds {
            if p.revents == 0 {
                i += 1;
                continue;
            }
            let w = self.pending_recv.remove(i);
            // SAFETY: the buffers and messages come from operations pushed under
            // `push`'s contract.
            let r = unsafe {
                match w.what {
                    WaitFor::Poll => {
                        self.done.push_back((w.user_data, i32::from(p.revents)));
                        continue;
                    }
                    WaitFor::Read { buf, len } => libc::read(w.fd, buf.cast(), len as usize),
                    WaitFor::Send { msg } => {
                        libc::sendmsg(w.fd, msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT)
                    }
                }
            };
            let res = if r < 0 {
                -io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
            } else {
                r as i32
            };
            if res == -libc::EAGAIN && matches!(w.what, WaitFor::Send { .. }) {
                // woken without room after all (another writer): wait again
                self.pending_recv.insert(i, w);
                i += 1;
                continue;
            }
            self.done.push_back((w.user_data, res));
        }
        Ok(())
    }
}
