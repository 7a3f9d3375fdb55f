//! A dmkit device as a virtio-blk device: the vhost-user backend QEMU, Cloud
//! Hypervisor and crosvm connect a guest's disk to. rust-vmm's crates speak the
//! protocol and map the guest's memory; this file answers the device's config
//! space and serves its queues.
//!
//! Each worker thread (one per core, the queues spread over them) serves its
//! queues in batches: every request the guest made available is parsed and
//! handed to the thread's request engine at once, and when the batch is done the
//! requests go back to the guest **in the order the guest made them available**.
//! That order is what makes a reconnect safe without the inflight region: when
//! the backend dies, QEMU restarts the queue at the used index (the requests the
//! guest has not had back), so every request after it must not have been
//! completed, and every one before it must have been. A write done twice (done,
//! not yet reported, then resubmitted to the next daemon) writes the same bytes.
//!
//! Data is copied between the guest's buffers and the request's own (one copy,
//! as the NBD export's socket read): the engine's requests own aligned buffers.

use crate::io::{AlignedBuf, Op, SECTOR};
use crate::mapper::engine::Engine;
use crate::mapper::Device;
use crate::sync::Unpoison;
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_bindings::virtio_blk as vb;
use virtio_queue::{QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier};

pub type Mem = GuestMemoryAtomic<GuestMemoryMmap>;

/// The queues a device offers (the frontend uses as many as it asks for, QEMU
/// one per vCPU by default).
pub const MAX_QUEUES: usize = 16;
/// The largest queue a frontend may set up.
pub const MAX_QUEUE_SIZE: usize = 1024;
/// The most data one request may carry; larger ones fail (IOERR). A Linux guest
/// sends at most `max_sectors_kb` (1280 KiB by default).
const MAX_DATA: usize = 32 << 20;
/// The most bytes one batch carries: the requests past it wait in the ring for
/// the next batch (a guest cannot make a queue's thread hold more).
const BATCH_BYTES: u64 = 64 << 20;
/// The most descriptors one request may have (the `seg_max` offered, the header
/// and the status): a longer chain is failed unread.
const MAX_CHAIN: usize = MAX_QUEUE_SIZE;
/// The most descriptors one batch holds before it stops taking requests.
const BATCH_SEGS: usize = 8 * MAX_QUEUE_SIZE;
/// A request buffer larger than this is freed when its request ends, so a queue
/// that once saw large requests does not keep their memory.
const KEEP_BUF: usize = 128 << 10;
/// virtio-blk's request header (struct virtio_blk_outhdr): type, ioprio, sector.
const HEADER: usize = 16;
/// A discard or write-zeroes segment (struct virtio_blk_discard_write_zeroes):
/// sector, num_sectors, flags.
const SEGMENT: usize = 16;

/// The device's config space (struct virtio_blk_config), its fields in order as
/// (offset, width); [`put`] writes them little-endian.
mod cfg {
    pub const CAPACITY: (usize, usize) = (0, 8);
    pub const SEG_MAX: (usize, usize) = (12, 4);
    pub const BLK_SIZE: (usize, usize) = (20, 4);
    pub const PHYSICAL_BLOCK_EXP: (usize, usize) = (24, 1);
    pub const MIN_IO_SIZE: (usize, usize) = (26, 2);
    pub const OPT_IO_SIZE: (usize, usize) = (28, 4);
    pub const WRITEBACK: (usize, usize) = (32, 1);
    pub const NUM_QUEUES: (usize, usize) = (34, 2);
    pub const MAX_DISCARD_SECTORS: (usize, usize) = (36, 4);
    pub const MAX_DISCARD_SEG: (usize, usize) = (40, 4);
    pub const DISCARD_SECTOR_ALIGNMENT: (usize, usize) = (44, 4);
    pub const MAX_WRITE_ZEROES_SECTORS: (usize, usize) = (48, 4);
    pub const MAX_WRITE_ZEROES_SEG: (usize, usize) = (52, 4);
    pub const WRITE_ZEROES_MAY_UNMAP: (usize, usize) = (56, 1);
    /// The struct's size up to the secure-erase fields (not offered).
    pub const SIZE: usize = 60;
}

fn put(buf: &mut [u8], (off, width): (usize, usize), v: u64) {
    buf[off..off + width].copy_from_slice(&v.to_le_bytes()[..width]);
}

/// The virtio-blk device one connection sees.
#[derive(Clone)]
pub struct BlkBackend(Arc<Inner>);

struct Inner {
    dev: Arc<Device>,
    /// The guest's memory, from its last memory table.
    mem: Mutex<Option<Mem>>,
    /// The guest turned the write cache off (CONFIG_WCE): every write is FUA.
    writethrough: AtomicBool,
    features: u64,
    threads: usize,
    exits: Vec<(EventConsumer, EventNotifier)>,
    /// A worker is serving the queue (its batch taken, not all given back).
    busy: [AtomicBool; MAX_QUEUES],
    /// The connection is about to be cut: take no more requests.
    quiescing: AtomicBool,
}

/// How long a stop waits for the batches in hand to be given back.
const IDLE_WITHIN: Duration = Duration::from_secs(60);

/// Wait (at most [`IDLE_WITHIN`]) until no worker serves any of the queues
/// `busy` flags; whether they all went idle.
fn idle_within(busy: &[AtomicBool]) -> bool {
    let t0 = std::time::Instant::now();
    while busy.iter().any(|b| b.load(Ordering::SeqCst)) {
        if t0.elapsed() > IDLE_WITHIN {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

fn bit(b: u32) -> u64 {
    1 << b
}

impl BlkBackend {
    pub fn new(dev: Arc<Device>) -> std::io::Result<BlkBackend> {
        let limits = dev.limits();
        let mut features = bit(vb::VIRTIO_BLK_F_SEG_MAX)
            | bit(vb::VIRTIO_BLK_F_BLK_SIZE)
            | bit(vb::VIRTIO_BLK_F_TOPOLOGY)
            | bit(vb::VIRTIO_BLK_F_FLUSH)
            | bit(vb::VIRTIO_BLK_F_CONFIG_WCE)
            | bit(vb::VIRTIO_BLK_F_MQ)
            | bit(virtio_bindings::virtio_config::VIRTIO_F_VERSION_1)
            | bit(virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC)
            | bit(virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX)
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        if limits.discard {
            features |= bit(vb::VIRTIO_BLK_F_DISCARD);
        }
        if limits.write_zeroes {
            features |= bit(vb::VIRTIO_BLK_F_WRITE_ZEROES);
        }
        if limits.read_only || dev.read_only() {
            features |= bit(vb::VIRTIO_BLK_F_RO);
        }
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(MAX_QUEUES));
        let exits = (0..threads)
            .map(|_| new_event_consumer_and_notifier(EventFlag::NONBLOCK))
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(BlkBackend(Arc::new(Inner {
            dev,
            mem: Mutex::new(None),
            writethrough: AtomicBool::new(false),
            features,
            threads,
            exits,
            busy: std::array::from_fn(|_| AtomicBool::new(false)),
            quiescing: AtomicBool::new(false),
        })))
    }

    /// The config space as the guest reads it.
    fn config(&self) -> [u8; cfg::SIZE] {
        let dev = &self.0.dev;
        let limits = dev.limits();
        let lbs = u64::from(dev.logical_block_size().max(512));
        let mut c = [0u8; cfg::SIZE];
        put(&mut c, cfg::CAPACITY, dev.size_sectors());
        put(&mut c, cfg::SEG_MAX, (MAX_QUEUE_SIZE - 2) as u64);
        put(&mut c, cfg::BLK_SIZE, lbs);
        put(&mut c, cfg::PHYSICAL_BLOCK_EXP, 0);
        let blocks = |bytes: u64, max: u64| (bytes / lbs).min(max);
        put(
            &mut c,
            cfg::MIN_IO_SIZE,
            blocks(limits.io_min, u64::from(u16::MAX)),
        );
        put(
            &mut c,
            cfg::OPT_IO_SIZE,
            blocks(limits.io_opt, u64::from(u32::MAX)),
        );
        put(
            &mut c,
            cfg::WRITEBACK,
            u64::from(!self.0.writethrough.load(Ordering::Relaxed)),
        );
        put(&mut c, cfg::NUM_QUEUES, MAX_QUEUES as u64);
        let gran = (limits.io_min.max(lbs) / SECTOR).min(u64::from(u32::MAX));
        // discards and zeroing carry no data: up to 4 GiB in one request
        let max_sectors = u64::from(u32::MAX >> 9);
        if limits.discard {
            put(&mut c, cfg::MAX_DISCARD_SECTORS, max_sectors);
            put(&mut c, cfg::MAX_DISCARD_SEG, 1);
            put(&mut c, cfg::DISCARD_SECTOR_ALIGNMENT, gran);
        }
        if limits.write_zeroes {
            put(&mut c, cfg::MAX_WRITE_ZEROES_SECTORS, max_sectors);
            put(&mut c, cfg::MAX_WRITE_ZEROES_SEG, 1);
            put(&mut c, cfg::WRITE_ZEROES_MAY_UNMAP, u64::from(limits.discard));
        }
        c
    }

    /// Before the connection is cut from this side (a forced detach): the
    /// queues take no more requests, and the batches in hand are given back
    /// first. A frontend restarts a broken ring at its used index, so nothing
    /// may be given back after the cut. False if a batch did not end in 60 s.
    pub fn quiesce(&self) -> bool {
        self.0.quiescing.store(true, Ordering::SeqCst);
        idle_within(&self.0.busy)
    }

    fn memory(&self) -> Option<Mem> {
        self.0.mem.lock().unpoisoned().clone()
    }
}

impl VhostUserBackend for BlkBackend {
    type Bitmap = ();
    type Vring = VringRwLock;

    fn num_queues(&self) -> usize {
        MAX_QUEUES
    }

    fn max_queue_size(&self) -> usize {
        MAX_QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        self.0.features
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
    }

    fn set_event_idx(&self, _enabled: bool) {}

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let c = self.config();
        let (off, size) = (offset as usize, size as usize);
        // what lies past the struct reads as zero (bounded by the message's size)
        let mut out = vec![0u8; size.min(256)];
        if off < c.len() {
            let n = (c.len() - off).min(out.len());
            out[..n].copy_from_slice(&c[off..off + n]);
        }
        out
    }

    fn set_config(&self, offset: u32, buf: &[u8]) -> std::io::Result<()> {
        // the only field a driver writes: the cache mode (CONFIG_WCE)
        if offset as usize == cfg::WRITEBACK.0 && buf.len() == 1 {
            self.0.writethrough.store(buf[0] == 0, Ordering::Relaxed);
            return Ok(());
        }
        Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "config write of {} bytes at offset {offset}: only the writeback byte is writable",
                buf.len()
            ),
        ))
    }

    fn update_memory(&self, mem: Mem) -> std::io::Result<()> {
        *self.0.mem.lock().unpoisoned() = Some(mem);
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        let t = self.0.threads;
        (0..t)
            .map(|i| {
                (0..MAX_QUEUES)
                    .filter(|q| q % t == i)
                    .fold(0u64, |m, q| m | 1 << q)
            })
            .collect()
    }

    fn exit_event(&self, thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        let (c, n) = self.0.exits.get(thread_index)?;
        Some((c.try_clone().ok()?, n.try_clone().ok()?))
    }

    /// The frontend stops the queue (GET_VRING_BASE, after marking it not
    /// ready): the batch being served is finished and given back first, so the
    /// ring's base the frontend is told covers exactly what it had back.
    fn stop_vring(&self, queue_index: u32) -> std::io::Result<()> {
        let q = queue_index as usize;
        match self.0.busy.get(q..=q) {
            Some(busy) if !idle_within(busy) => Err(std::io::Error::other(format!(
                "queue {queue_index}: its requests did not finish in {} s",
                IDLE_WITHIN.as_secs()
            ))),
            _ => Ok(()),
        }
    }

    /// A queue was kicked. Errors are logged, not returned: an error ends the
    /// crate's worker thread, and with it every queue the thread serves.
    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[VringRwLock],
        thread_id: usize,
    ) -> std::io::Result<()> {
        let (Some(vring), Some(mem), true) = (
            vrings.get(usize::from(device_event)),
            self.memory(),
            evset == EventSet::IN,
        ) else {
            let name = self.0.dev.name();
            tracing::warn!(
                "{name}: vhost-user event {device_event} ({evset:?}) on thread {thread_id} ignored"
            );
            return Ok(());
        };
        // the queue's number: thread t serves queues t, t + threads, ...
        let q = thread_id + usize::from(device_event) * self.0.threads;
        let Some(busy) = self.0.busy.get(q) else {
            return Ok(());
        };
        busy.store(true, Ordering::SeqCst);
        if self.0.quiescing.load(Ordering::SeqCst) {
            busy.store(false, Ordering::SeqCst);
            return Ok(());
        }
        let r = serve_queue(self, vring, &mem);
        busy.store(false, Ordering::SeqCst);
        if let Err(e) = r {
            tracing::warn!("{}: vhost-user queue {q}: {e}", self.0.dev.name());
        }
        Ok(())
    }
}

/// Serve `vring` as a kick does, on this thread's worker (made at the thread's
/// first kick). Public for the fuzz target: a hostile guest's rings and
/// requests in guest memory it wrote.
pub fn serve_queue(b: &BlkBackend, vring: &VringRwLock, mem: &Mem) -> std::io::Result<()> {
    WORKER.with(|w| {
        let mut w = w.borrow_mut();
        if w.is_none() {
            // a panic on this thread is logged under the device's name
            crate::panics::set_device(&b.0.dev.name());
            *w = Some(Worker::new()?);
        }
        match w.as_mut() {
            Some(w) => w.serve(b, vring, mem),
            None => Ok(()),
        }
    })
}

thread_local! {
    /// The thread's request engine and batch (the crate's worker threads live as
    /// long as the connection; the engine goes with the thread).
    static WORKER: RefCell<Option<Worker>> = const { RefCell::new(None) };
}

impl Job {
    /// A request that cannot be read (nothing is written to the guest).
    fn failed(head: u16) -> Job {
        Job {
            head,
            status_at: None,
            status: vb::VIRTIO_BLK_S_IOERR as u8,
            used: 0,
            slot: None,
            out: (0, 0),
        }
    }
}

/// What a request asks, parsed from its descriptor chain.
struct Job {
    head: u16,
    /// Where the status byte goes (None: the chain has no writable byte, so
    /// nothing can be said; it is returned with nothing written).
    status_at: Option<GuestAddress>,
    status: u8,
    /// Bytes written into the guest's buffers (data and status).
    used: u32,
    /// The engine slot doing its I/O.
    slot: Option<usize>,
    /// A read: its data goes to these writable segments (in `Worker::segs`).
    out: (usize, usize),
}

struct Worker {
    engine: Engine,
    jobs: Vec<Job>,
    /// The job of each engine slot.
    job_of: Vec<usize>,
    /// Every descriptor of the batch: (guest address, length, writable).
    segs: Vec<(u64, u32, bool)>,
}

impl Worker {
    fn new() -> std::io::Result<Worker> {
        let mut engine = Engine::new(128)?;
        engine.allow_growth(MAX_QUEUE_SIZE);
        engine.offload_hooks(true);
        Ok(Worker {
            engine,
            jobs: Vec::with_capacity(128),
            job_of: vec![0; MAX_QUEUE_SIZE],
            segs: Vec::with_capacity(512),
        })
    }

    /// Serve the queue until the guest has nothing more in it.
    fn serve(&mut self, b: &BlkBackend, vring: &VringRwLock, mem: &Mem) -> std::io::Result<()> {
        // rounds in a row that found the ring holding more but took nothing: a
        // request that came as notifications went back on is taken on the next
        // round; a second such round means the guest's ring lies (an available
        // index past the queue's size), and spinning on it would wedge the thread
        let mut idle = 0;
        loop {
            if !vring.get_ref().get_queue().ready() || b.0.quiescing.load(Ordering::SeqCst) {
                return Ok(()); // stopped by the frontend, or the connection is being cut
            }
            vring.disable_notification().map_err(std::io::Error::other)?;
            let took = self.batch(b, vring, mem)?;
            // notifications back on; a request that came meanwhile is served now
            let more = vring.enable_notification().map_err(std::io::Error::other)?;
            idle = if took { 0 } else { idle + 1 };
            if !more || idle > 1 {
                return Ok(());
            }
        }
    }

    /// Take what the queue holds (as many as the engine has slots for), do it,
    /// and give it back in order. Whether anything was taken.
    fn batch(&mut self, b: &BlkBackend, vring: &VringRwLock, mem: &Mem) -> std::io::Result<bool> {
        let guard = mem.memory();
        self.jobs.clear();
        self.segs.clear();
        {
            let mut state = vring.get_mut();
            let queue = state.get_queue_mut();
            let mut bytes = 0u64;
            while self.engine.can_alloc() && self.segs.len() < BATCH_SEGS {
                let Some(chain) = queue.pop_descriptor_chain(guard.clone()) else {
                    break;
                };
                let head = chain.head_index();
                let start = self.segs.len();
                let mut too_long = false;
                for (i, d) in chain.enumerate() {
                    if i == MAX_CHAIN {
                        too_long = true;
                        break;
                    }
                    self.segs.push((d.addr().0, d.len(), d.is_write_only()));
                }
                let len: u64 = self.segs[start..].iter().map(|s| u64::from(s.1)).sum();
                if !self.jobs.is_empty() && bytes + len > BATCH_BYTES {
                    // for the next batch
                    self.segs.truncate(start);
                    queue.go_to_previous_position();
                    break;
                }
                bytes += len;
                let end = self.segs.len();
                let job = if too_long {
                    Job::failed(head)
                } else {
                    self.start(b, &guard, head, start, end)
                };
                self.jobs.push(job);
            }
        }
        if self.jobs.is_empty() {
            return Ok(false);
        }
        self.wait(&guard);
        for j in &self.jobs {
            if let Some(at) = j.status_at {
                // the guest gave this address: a failure here is its own
                let _ = guard.write_obj(j.status, at);
            }
            vring.add_used(j.head, j.used).map_err(std::io::Error::other)?;
        }
        if vring.needs_notification().map_err(std::io::Error::other)? {
            vring.signal_used_queue()?;
        }
        Ok(true)
    }

    /// Parse one request and start its I/O (or answer it at once).
    fn start(&mut self, b: &BlkBackend, mem: &GuestMemoryMmap, head: u16, start: usize, end: usize) -> Job {
        let segs = &self.segs[start..end];
        // the device-readable part comes first, the writable after it
        let first_w = segs.iter().position(|s| s.2).unwrap_or(segs.len());
        let (rd, wr) = segs.split_at(first_w);
        let mut job = Job {
            out: (start + first_w, end),
            ..Job::failed(head)
        };
        if wr.iter().any(|s| !s.2) {
            return job; // a readable descriptor after a writable one: malformed
        }
        let Some(&(last, last_len, _)) = wr.iter().rev().find(|s| s.1 > 0) else {
            return job;
        };
        // an address past the end of the address space is the guest's error: the
        // write of the status there fails, and nothing else is touched
        job.status_at = Some(GuestAddress(last.wrapping_add(u64::from(last_len) - 1)));
        job.used = 1;
        let rd_len: u64 = rd.iter().map(|s| u64::from(s.1)).sum();
        let wr_len: u64 = wr.iter().map(|s| u64::from(s.1)).sum::<u64>() - 1;
        let mut hdr = [0u8; HEADER];
        if rd_len < HEADER as u64 || gather(mem, rd, 0, &mut hdr).is_err() {
            return job;
        }
        let kind = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
        let sector = u64::from_le_bytes([
            hdr[8], hdr[9], hdr[10], hdr[11], hdr[12], hdr[13], hdr[14], hdr[15],
        ]);
        let dev = &b.0.dev;
        let size = dev.size_sectors();
        let ro = b.0.features & bit(vb::VIRTIO_BLK_F_RO) != 0;
        let in_range = |sector: u64, bytes: u64| {
            bytes.is_multiple_of(SECTOR) && sector.checked_add(bytes / SECTOR).is_some_and(|e| e <= size)
        };
        let (op, sector, bytes, punch) = match kind {
            vb::VIRTIO_BLK_T_IN => (Op::Read, sector, wr_len, false),
            vb::VIRTIO_BLK_T_OUT if ro => return job,
            vb::VIRTIO_BLK_T_OUT => (Op::Write, sector, rd_len - HEADER as u64, false),
            vb::VIRTIO_BLK_T_FLUSH => (Op::Flush, 0, 0, false),
            vb::VIRTIO_BLK_T_GET_ID => {
                answer_id(
                    &mut job,
                    &dev.uuid().unwrap_or_else(|| dev.name()),
                    mem,
                    wr,
                    wr_len,
                );
                return job;
            }
            vb::VIRTIO_BLK_T_DISCARD | vb::VIRTIO_BLK_T_WRITE_ZEROES => {
                match zeroing_segment(b, kind, mem, rd, rd_len) {
                    Ok(what) => what,
                    Err(status) => {
                        job.status = status;
                        return job;
                    }
                }
            }
            _ => {
                job.status = vb::VIRTIO_BLK_S_UNSUPP as u8;
                return job;
            }
        };
        if op != Op::Flush && (!in_range(sector, bytes) || (op.has_data() && bytes > MAX_DATA as u64)) {
            return job;
        }
        if bytes == 0 && op != Op::Flush {
            job.status = vb::VIRTIO_BLK_S_OK as u8;
            return job;
        }
        let Some(slot) = self.engine.alloc() else {
            return job;
        };
        let q = self.engine.request_mut(slot);
        if op.has_data() {
            q.buf.ensure(bytes as usize);
        }
        if op == Op::Write && gather(mem, rd, HEADER, &mut q.buf.as_mut_slice()[..bytes as usize]).is_err() {
            self.engine.free(slot);
            return job;
        }
        q.op = op;
        q.sector = sector;
        q.nr_sectors = bytes / SECTOR;
        q.fua = op == Op::Write && b.0.writethrough.load(Ordering::Relaxed);
        q.punch = punch;
        q.fast_zero = false;
        self.job_of[slot] = self.jobs.len();
        job.slot = Some(slot);
        if op == Op::Read {
            job.used = bytes as u32 + 1;
        }
        self.engine.start(slot, dev);
        job
    }

    /// Wait for the batch's I/O; reads' data goes to the guest as each ends.
    fn wait(&mut self, mem: &GuestMemoryMmap) {
        let mut left = self.jobs.iter().filter(|j| j.slot.is_some()).count();
        while left > 0 {
            while let Some(slot) = self.engine.pop_done() {
                let j = &mut self.jobs[self.job_of[slot]];
                let q = self.engine.request_mut(slot);
                j.status = match q.error {
                    0 => vb::VIRTIO_BLK_S_OK as u8,
                    libc::EOPNOTSUPP => vb::VIRTIO_BLK_S_UNSUPP as u8,
                    _ => vb::VIRTIO_BLK_S_IOERR as u8,
                };
                if q.error == 0 && q.op == Op::Read {
                    let bytes = (q.nr_sectors * SECTOR) as usize;
                    let out = &self.segs[j.out.0..j.out.1];
                    if scatter(mem, out, &q.buf.as_slice()[..bytes]).is_err() {
                        j.status = vb::VIRTIO_BLK_S_IOERR as u8;
                    }
                }
                if q.error != 0 {
                    j.used = 1;
                }
                if q.buf.capacity() > KEEP_BUF {
                    q.buf = AlignedBuf::default();
                }
                j.slot = None;
                self.engine.free(slot);
                left -= 1;
            }
            if left > 0 && self.engine.turn(Some(Duration::from_millis(100))).is_err() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

/// Read `out.len()` bytes at `offset` of the stream the segments make.
fn gather(
    mem: &GuestMemoryMmap,
    segs: &[(u64, u32, bool)],
    mut offset: usize,
    out: &mut [u8],
) -> Result<(), ()> {
    let mut done = 0;
    for &(addr, len, _) in segs {
        let len = len as usize;
        if offset >= len {
            offset -= len;
            continue;
        }
        let n = (len - offset).min(out.len() - done);
        let at = addr.checked_add(offset as u64).ok_or(())?;
        mem.read_slice(&mut out[done..done + n], GuestAddress(at))
            .map_err(|_| ())?;
        done += n;
        offset = 0;
        if done == out.len() {
            return Ok(());
        }
    }
    if done == out.len() {
        Ok(())
    } else {
        Err(())
    }
}

/// Write `data` at the start of the stream the segments make.
/// GET_ID: `id` (the device's uuid or name) cut to virtio-blk's 20 bytes,
/// into the request's writable part `wr` of `wr_len` bytes.
fn answer_id(job: &mut Job, id: &str, mem: &GuestMemoryMmap, wr: &[(u64, u32, bool)], wr_len: u64) {
    let mut bytes = [0u8; vb::VIRTIO_BLK_ID_BYTES as usize];
    let n = id.len().min(bytes.len());
    bytes[..n].copy_from_slice(&id.as_bytes()[..n]);
    let n = (wr_len as usize).min(bytes.len());
    if scatter(mem, wr, &bytes[..n]).is_ok() {
        job.status = vb::VIRTIO_BLK_S_OK as u8;
        job.used = n as u32 + 1;
    }
}

/// A DISCARD or WRITE_ZEROES request's one segment (as the config space
/// says), from the readable part `rd` of `rd_len` bytes: (op, sector, bytes,
/// unmap), or the status to answer (UNSUPP for what is not offered, IOERR for
/// a malformed request).
fn zeroing_segment(
    b: &BlkBackend,
    kind: u32,
    mem: &GuestMemoryMmap,
    rd: &[(u64, u32, bool)],
    rd_len: u64,
) -> Result<(Op, u64, u64, bool), u8> {
    let (op, offered) = if kind == vb::VIRTIO_BLK_T_DISCARD {
        (Op::Discard, vb::VIRTIO_BLK_F_DISCARD)
    } else {
        (Op::WriteZeroes, vb::VIRTIO_BLK_F_WRITE_ZEROES)
    };
    let unsupp = vb::VIRTIO_BLK_S_UNSUPP as u8;
    if b.0.features & bit(offered) == 0 || b.0.features & bit(vb::VIRTIO_BLK_F_RO) != 0 {
        return Err(unsupp);
    }
    let mut seg = [0u8; SEGMENT];
    if rd_len != (HEADER + SEGMENT) as u64 || gather(mem, rd, HEADER, &mut seg).is_err() {
        return Err(vb::VIRTIO_BLK_S_IOERR as u8);
    }
    let s = u64::from_le_bytes([seg[0], seg[1], seg[2], seg[3], seg[4], seg[5], seg[6], seg[7]]);
    let n = u32::from_le_bytes([seg[8], seg[9], seg[10], seg[11]]);
    let flags = u32::from_le_bytes([seg[12], seg[13], seg[14], seg[15]]);
    let unmap = flags & vb::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0;
    if flags & !vb::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0 || (op == Op::Discard && unmap) {
        return Err(unsupp);
    }
    Ok((op, s, u64::from(n) * SECTOR, unmap))
}

fn scatter(mem: &GuestMemoryMmap, segs: &[(u64, u32, bool)], data: &[u8]) -> Result<(), ()> {
    let mut done = 0;
    for &(addr, len, _) in segs {
        if done == data.len() {
            break;
        }
        let n = (len as usize).min(data.len() - done);
        mem.write_slice(&data[done..done + n], GuestAddress(addr))
            .map_err(|_| ())?;
        done += n;
    }
    if done == data.len() {
        Ok(())
    } else {
        Err(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The config space's fields sit where struct virtio_blk_config has them
    /// (include/uapi/linux/virtio_blk.h).
    #[test]
    fn config_fields_at_the_kernels_offsets() {
        let offsets = [
            (cfg::CAPACITY, 0),
            (cfg::SEG_MAX, 12),
            (cfg::BLK_SIZE, 20),
            (cfg::WRITEBACK, 32),
            (cfg::NUM_QUEUES, 34),
            (cfg::MAX_DISCARD_SECTORS, 36),
            (cfg::MAX_WRITE_ZEROES_SEG, 52),
            (cfg::WRITE_ZEROES_MAY_UNMAP, 56),
        ];
        for ((off, _), want) in offsets {
            assert_eq!(off, want);
        }
        let c = std::mem::size_of::<vb::virtio_blk_config>();
        assert!(c >= cfg::SIZE, "{c}");
    }

    #[test]
    fn a_stream_split_over_segments_is_read_and_written_whole() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 16)]).expect("memory");
        mem.write_slice(&[1, 2, 3], GuestAddress(100)).expect("write");
        mem.write_slice(&[4, 5], GuestAddress(200)).expect("write");
        let segs = [(100, 3, false), (200, 2, false)];
        let mut out = [0u8; 4];
        gather(&mem, &segs, 1, &mut out).expect("gather");
        assert_eq!(out, [2, 3, 4, 5]);
        assert!(gather(&mem, &segs, 2, &mut out).is_err(), "past the stream's end");
        scatter(&mem, &[(300, 1, true), (400, 8, true)], &[9, 8, 7]).expect("scatter");
        let mut b = [0u8; 2];
        mem.read_slice(&mut b, GuestAddress(400)).expect("read");
        assert_eq!(b, [8, 7]);
        assert!(
            gather(&mem, &[(1 << 20, 4, false)], 0, &mut out).is_err(),
            "outside the guest's memory"
        );
    }
}
