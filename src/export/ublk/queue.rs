//! One ublk queue: a thread with its own request engine. The queue's fetch and
//! commit commands go on the engine's ring beside the backing I/O, so one wait
//! covers both: a request arrives as a fetch's completion, the engine maps and
//! issues it, and its commit (which also fetches the tag's next request) goes
//! back on the same ring. Nothing is shared with other queues but the device.
//!
//! Data moves the driver's default way: each tag has a buffer in this process,
//! named in its fetch; the driver copies a write's data into it before handing
//! the request over and a read's data out of it at the commit. The buffer is lent
//! to the engine's request for the request's life, so the engine reads and
//! writes the backing devices from it directly.

use super::sys::{self, IoCmd, IoDesc};
use crate::io::queue::Sqe;
use crate::io::{AlignedBuf, Op, SECTOR};
use crate::mapper::engine::Engine;
use crate::mapper::Device;
use crate::sync::Unpoison;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// The frontend tag of the pause signal's poll (ublk tags are below 4096).
const TAG_PAUSE: u64 = 1 << 20;

/// What the daemon tells a device's queues, and hears back.
pub struct QueueCtl {
    /// Take no new requests (the daemon is about to exit): those fetched stay
    /// with the driver, which gives them to the next daemon.
    pause: AtomicBool,
    /// Written when `pause` is set, to wake the queues.
    efd: OwnedFd,
    /// Queues that have set up (Ok) or failed to (the error), and queues paused.
    state: Mutex<(Vec<Result<(), String>>, usize)>,
    changed: Condvar,
}

impl QueueCtl {
    pub fn new() -> std::io::Result<QueueCtl> {
        Ok(QueueCtl {
            pause: AtomicBool::new(false),
            efd: rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC)?,
            state: Mutex::new((Vec::new(), 0)),
            changed: Condvar::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (Vec<Result<(), String>>, usize)> {
        self.state.lock().unpoisoned()
    }

    fn report(&self, r: Result<(), String>) {
        self.lock().0.push(r);
        self.changed.notify_all();
    }

    /// Wait until `n` queues have set up; the first error if one failed.
    pub fn wait_ready(&self, n: usize) -> Result<(), String> {
        let mut g = self.lock();
        loop {
            if let Some(Err(e)) = g.0.iter().find(|r| r.is_err()) {
                return Err(e.clone());
            }
            if g.0.len() >= n {
                return Ok(());
            }
            g = self.changed.wait(g).unpoisoned();
        }
    }

    /// Ask the queues to take no new requests and wait (at most `limit`) until
    /// the `n` queues have none in flight.
    pub fn pause(&self, n: usize, limit: Duration) -> bool {
        self.pause.store(true, Ordering::SeqCst);
        let _ = rustix::io::write(&self.efd, &1u64.to_ne_bytes());
        let g = self.lock();
        let (g, _) = self
            .changed
            .wait_timeout_while(g, limit, |s| s.1 < n)
            .unpoisoned();
        g.1 >= n
    }
}

/// One queue to serve.
pub struct QueueSpec {
    pub dev: Arc<Device>,
    /// /dev/ublkcN, shared by the device's queues.
    pub cdev: Arc<std::fs::File>,
    pub q_id: u16,
    pub depth: u16,
    pub max_io: usize,
    pub ctl: Arc<QueueCtl>,
}

/// The queue's descriptor array, mapped read-only from the driver.
struct Descs {
    ptr: *const IoDesc,
    len: usize,
}

impl Descs {
    fn map(fd: RawFd, q_id: u16, depth: u16) -> std::io::Result<Descs> {
        let page = rustix::param::page_size();
        let len = (usize::from(depth) * std::mem::size_of::<IoDesc>()).div_ceil(page) * page;
        // SAFETY: a fresh shared read-only mapping of the driver's array for this
        // queue (the offset and length the driver requires); nothing else maps
        // this address range, and it is unmapped in Drop.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd,
                sys::desc_offset(q_id),
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Descs { ptr: ptr.cast(), len })
    }

    fn get(&self, tag: usize) -> IoDesc {
        // SAFETY: `tag` is below the queue depth the mapping covers; the driver
        // writes the descriptor before completing the tag's fetch, which we have
        // reaped, and not again until we commit it.
        unsafe { std::ptr::read_volatile(self.ptr.add(tag)) }
    }
}

impl Drop for Descs {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// A request larger than this leaves its tag's buffer released to the kernel
/// afterwards: each tag's buffer is sized for the largest request (512 KiB, 64
/// MiB for a queue of 128), and a device that once saw large requests would
/// otherwise keep all of it resident; smaller requests, the common ones, cost
/// no system call.
const RELEASE_OVER: u64 = 32 << 10;

struct Queue {
    engine: Engine,
    /// The device this queue serves.
    dev: Arc<Device>,
    fd: RawFd,
    q_id: u16,
    descs: Descs,
    /// Each tag's buffer while it is not lent to a request.
    bufs: Vec<AlignedBuf>,
    /// Each tag's buffer address, as given to the driver.
    addrs: Vec<u64>,
    max_io: usize,
    /// The tag of each engine slot in use.
    tag_of: Vec<u16>,
    /// Tags with a command at the driver.
    cmds: usize,
    /// Tags whose last command the driver refused (see `refused`).
    refused: Vec<bool>,
    /// Tags whose buffer a large read filled, to be released at its next use
    /// that does not need its contents (see [`RELEASE_OVER`]).
    filled: Vec<bool>,
    /// Requests with the engine.
    in_flight: usize,
    /// Fetched while paused: left to the driver for the next daemon.
    held: usize,
    paused: bool,
    /// The pause is reported (the daemon exits next).
    reported: bool,
    ctl: Arc<QueueCtl>,
    events: Vec<crate::mapper::engine::IoEvent>,
}

/// Serve one queue until the driver aborts it (the device stops, or is deleted).
pub fn run(spec: QueueSpec) {
    let ctl = spec.ctl.clone();
    let mut q = match Queue::new(spec) {
        Ok(q) => q,
        Err(e) => return ctl.report(Err(e)),
    };
    q.serve();
}

impl Queue {
    fn new(s: QueueSpec) -> Result<Queue, String> {
        // this thread serves `s.dev`: a panic on it is logged under the device's name
        crate::panics::set_device(&s.dev.name());
        let mut engine = Engine::new(usize::from(s.depth)).map_err(|e| format!("queue {}: {e}", s.q_id))?;
        engine.offload_hooks(true);
        if !engine.uses_uring() {
            return Err(
                "ublk needs io_uring, which this system refuses (or `serve --no-io-uring` turned it off)"
                    .into(),
            );
        }
        let fd = s.cdev.as_raw_fd();
        let descs = Descs::map(fd, s.q_id, s.depth)
            .map_err(|e| format!("queue {}: mapping its descriptors: {e}", s.q_id))?;
        let mut bufs: Vec<AlignedBuf> = (0..s.depth).map(|_| AlignedBuf::new(s.max_io)).collect();
        let addrs = bufs.iter_mut().map(|b| b.as_mut_ptr() as u64).collect();
        Ok(Queue {
            engine,
            dev: s.dev.clone(),
            fd,
            q_id: s.q_id,
            descs,
            bufs,
            addrs,
            max_io: s.max_io,
            tag_of: vec![0; usize::from(s.depth)],
            cmds: 0,
            refused: vec![false; usize::from(s.depth)],
            filled: vec![false; usize::from(s.depth)],
            in_flight: 0,
            held: 0,
            paused: false,
            reported: false,
            ctl: s.ctl,
            events: Vec::with_capacity(64),
        })
    }

    fn command(&mut self, op: u32, tag: u16, result: i32) {
        let cmd = IoCmd {
            q_id: self.q_id,
            tag,
            result,
            addr: self.addrs[usize::from(tag)],
        };
        self.cmds += 1;
        // SAFETY: the command names the tag's buffer, owned by this queue (in
        // `bufs` or lent to a request whose slot is free again) and neither freed
        // nor moved until the engine is idle, which `serve` waits for.
        unsafe {
            self.engine.push_io(
                Sqe::UringCmd {
                    fd: self.fd,
                    cmd_op: op,
                    cmd: cmd.bytes(),
                },
                u64::from(tag),
            )
        };
    }

    fn serve(&mut self) {
        for tag in 0..self.tag_of.len() as u16 {
            self.command(sys::IO_FETCH_REQ, tag, 0);
        }
        self.engine.poll_in(self.ctl.efd.as_raw_fd(), TAG_PAUSE);
        // The fetches reach the driver on this submission: START_DEV waits for them.
        let setup = self.engine.turn(Some(Duration::ZERO));
        self.ctl
            .report(setup.map_err(|e| format!("queue {}: {e}", self.q_id)));
        loop {
            while let Some(slot) = self.engine.pop_done() {
                self.commit(slot);
            }
            if self.cmds == 0 && self.in_flight == 0 {
                break;
            }
            if self.engine.turn(None).is_err() {
                break;
            }
            let mut ev = std::mem::take(&mut self.events);
            self.engine.io_events(&mut ev);
            for e in &ev {
                if e.tag == TAG_PAUSE {
                    self.check_pause();
                    continue;
                }
                self.cmds -= 1;
                let tag = e.tag as u16;
                match e.res {
                    sys::IO_RES_OK if self.paused => self.held += 1,
                    sys::IO_RES_OK => {
                        self.refused[usize::from(tag)] = false;
                        self.start(tag)
                    }
                    sys::IO_RES_ABORT => {}
                    r => self.refused(tag, r),
                }
            }
            ev.clear();
            self.events = ev;
            self.check_pause();
        }
        self.engine.shut_down();
    }

    /// The driver refused the tag's command (`r`): without a command at the
    /// driver the tag would hold its request, and the filesystem above, for ever.
    /// The request is committed again as failed (EIO), which also fetches the
    /// tag's next one. Refused again, the tag cannot be served by this process:
    /// the daemon exits, and the driver's recovery hands the tag's request to
    /// `serve --restore` (unless the daemon is exiting already).
    fn refused(&mut self, tag: u16, r: i32) {
        let dev = self.dev.name();
        let t = usize::from(tag);
        if !std::mem::replace(&mut self.refused[t], true) {
            tracing::error!(
                "{dev}: ublk queue {} tag {tag}: the driver refused a command ({}); failing the tag's request with EIO",
                self.q_id,
                std::io::Error::from_raw_os_error(-r)
            );
            self.command(sys::IO_COMMIT_AND_FETCH_REQ, tag, -libc::EIO);
        } else if self.paused {
            tracing::error!(
                "{dev}: ublk queue {} tag {tag}: the driver refused a command again ({}); the daemon is exiting",
                self.q_id,
                std::io::Error::from_raw_os_error(-r)
            );
        } else {
            crate::panics::exit(&format!(
                "{dev}: ublk queue {} tag {tag}: the driver refused a command again ({}), so the tag cannot be served",
                self.q_id,
                std::io::Error::from_raw_os_error(-r)
            ));
        }
    }

    /// Once asked to pause: stop starting requests, and say so when none is left.
    fn check_pause(&mut self) {
        if !self.paused && self.ctl.pause.load(Ordering::SeqCst) {
            self.paused = true;
        }
        if self.paused && !self.reported && self.in_flight == 0 {
            self.reported = true;
            self.ctl.lock().1 += 1;
            self.ctl.changed.notify_all();
        }
    }

    /// A request arrived for `tag`: check it and hand it to the engine.
    fn start(&mut self, tag: u16) {
        let d = self.descs.get(usize::from(tag));
        let Some(slot) = self.engine.alloc() else {
            // as many slots as tags: cannot happen; fail the request, keep the tag
            return self.command(sys::IO_COMMIT_AND_FETCH_REQ, tag, -libc::EIO);
        };
        self.in_flight += 1;
        self.tag_of[slot] = tag;
        let (op, fua, nounmap) = decode_op_flags(d.op_flags);
        let bytes = u64::from(d.nr_sectors) * SECTOR;
        let size = self.dev.size_sectors();
        let end = d.start_sector.checked_add(u64::from(d.nr_sectors));
        let error = match op {
            None => libc::EOPNOTSUPP,
            Some(Op::Read | Op::Write) if bytes > self.max_io as u64 => libc::EINVAL,
            Some(Op::Flush) => 0,
            Some(_) if end.is_none_or(|e| e > size) => libc::EIO,
            _ => 0,
        };
        let q = self.engine.request_mut(slot);
        let Some(op) = op.filter(|&op| error == 0 && (op == Op::Flush || d.nr_sectors > 0)) else {
            // answered here: refused, or nothing to do
            q.op = Op::Flush;
            q.nr_sectors = 0;
            return self.engine.complete(slot, error);
        };
        if op == Op::Read && std::mem::take(&mut self.filled[usize::from(tag)]) {
            // the last read's data reached the driver at its commit
            self.bufs[usize::from(tag)].release();
        }
        let q = self.engine.request_mut(slot);
        std::mem::swap(&mut q.buf, &mut self.bufs[usize::from(tag)]);
        q.op = op;
        q.sector = if op == Op::Flush { 0 } else { d.start_sector };
        q.nr_sectors = if op == Op::Flush {
            0
        } else {
            u64::from(d.nr_sectors)
        };
        q.fua = fua;
        q.punch = !nounmap;
        q.fast_zero = false;
        self.engine.start(slot, &self.dev);
    }

    /// A request is done: give the tag its buffer back and commit the result,
    /// fetching the tag's next request.
    fn commit(&mut self, slot: usize) {
        let tag = self.tag_of[slot];
        let q = self.engine.request_mut(slot);
        if q.buf.capacity() >= self.max_io {
            std::mem::swap(&mut q.buf, &mut self.bufs[usize::from(tag)]);
        }
        let result = if q.error != 0 {
            -q.error
        } else if matches!(q.op, Op::Read | Op::Write) {
            i32::try_from(q.nr_sectors * SECTOR).unwrap_or(i32::MAX)
        } else {
            0
        };
        let large = q.nr_sectors * SECTOR > RELEASE_OVER;
        match q.op {
            // the driver copied a write's data in before the request came: it
            // needs nothing from the buffer at the commit
            Op::Write if large || std::mem::take(&mut self.filled[usize::from(tag)]) => {
                self.bufs[usize::from(tag)].release()
            }
            // the driver copies a read's data out at this commit: released later
            Op::Read if large => self.filled[usize::from(tag)] = true,
            _ => {}
        }
        self.engine.free(slot);
        self.in_flight -= 1;
        self.command(sys::IO_COMMIT_AND_FETCH_REQ, tag, result);
    }
}

/// A request's operation, FUA and NOUNMAP from its descriptor's `op_flags`: the
/// operation in bits 0-7, the flags (`sys::IO_F_*`) at their own bit positions in
/// the same word (the kernel's ublk_req_build_flags), not shifted down by 8.
fn decode_op_flags(op_flags: u32) -> (Option<Op>, bool, bool) {
    let op = match (op_flags & 0xff) as u8 {
        sys::OP_READ => Some(Op::Read),
        sys::OP_WRITE => Some(Op::Write),
        sys::OP_FLUSH => Some(Op::Flush),
        sys::OP_DISCARD => Some(Op::Discard),
        sys::OP_WRITE_ZEROES => Some(Op::WriteZeroes),
        _ => None,
    };
    (
        op,
        op_flags & sys::IO_F_FUA != 0,
        op_flags & sys::IO_F_NOUNMAP != 0,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A FUA write (ext4's journal commit block) must reach the engine as FUA: a
    /// thin commits its metadata before it completes one to a changed thin. The
    /// flags were read shifted by 8, so FUA and NOUNMAP were never seen.
    #[test]
    fn fua_and_nounmap_are_read_where_the_kernel_puts_them() {
        // values of include/uapi/linux/ublk_cmd.h
        assert_eq!(sys::IO_F_FUA, 1 << 13);
        assert_eq!(sys::IO_F_NOUNMAP, 1 << 15);
        let w = u32::from(sys::OP_WRITE);
        assert_eq!(decode_op_flags(w), (Some(Op::Write), false, false));
        assert_eq!(decode_op_flags(w | (1 << 13)), (Some(Op::Write), true, false));
        let z = u32::from(sys::OP_WRITE_ZEROES) | (1 << 15);
        assert_eq!(decode_op_flags(z), (Some(Op::WriteZeroes), false, true));
        // failfast flags (bits 8-10, set on every request) are neither
        let f = u32::from(sys::OP_FLUSH) | 0x700;
        assert_eq!(decode_op_flags(f), (Some(Op::Flush), false, false));
        assert_eq!(decode_op_flags(4).0, None); // WRITE_SAME
    }
}
