//! dm-io: synchronous I/O to any [`Dest`] (a backing file or a dmkit device, whose
//! table maps it) from a thread that is not a request engine's: the copy engine's
//! workers, a snapshot merge, an exception store's commits.
//!
//! I/O to a dmkit device runs through a request engine of the calling thread's own
//! (one per thread, for every device it reaches; one more for each request started
//! while another is being mapped), so it passes the device's targets, waits while
//! the device is suspended, and counts in its drains like any request. It blocks
//! the calling thread as a file's I/O does: a target calls it from its map only for
//! what it would read from a file there (metadata on another dmkit device, as LVM
//! puts a thin pool's on `_tmeta`), never for I/O that could wait on that thread.

use super::engine::{Dest, Engine};
use super::Device;
use crate::io::{errno, Op, SECTOR};
use std::cell::RefCell;
use std::io;
use std::sync::Arc;
use std::time::Duration;

/// Largest single request sent to a device; longer transfers go in pieces.
const MAX_REQUEST: usize = 1 << 20;

/// A request that has waited this long is logged, with what it waits for (and
/// again after as long again).
const LONG_WAIT: Duration = Duration::from_secs(30);

thread_local! {
    static ENGINES: RefCell<Vec<Engine>> = const { RefCell::new(Vec::new()) };
}

/// Read `buf.len()` bytes at `sector` of `dest`.
pub fn read(dest: &Dest, sector: u64, buf: &mut [u8]) -> io::Result<()> {
    match dest {
        Dest::File(f) => f.read_at(buf, sector * SECTOR),
        Dest::Dm(d) => {
            for (i, piece) in buf.chunks_mut(MAX_REQUEST).enumerate() {
                let s = sector + (i * MAX_REQUEST) as u64 / SECTOR;
                request(d, Op::Read, s, Data::In(piece), false)?;
            }
            Ok(())
        }
    }
}

/// Write `buf` at `sector` of `dest`; `fua`: durable before returning.
pub fn write(dest: &Dest, sector: u64, buf: &[u8], fua: bool) -> io::Result<()> {
    match dest {
        Dest::File(f) => f.write_at(buf, sector * SECTOR, fua),
        Dest::Dm(d) => {
            for (i, piece) in buf.chunks(MAX_REQUEST).enumerate() {
                let s = sector + (i * MAX_REQUEST) as u64 / SECTOR;
                request(d, Op::Write, s, Data::Out(piece), fua)?;
            }
            Ok(())
        }
    }
}

/// [`read`], but a file's data through O_DIRECT where it is aligned
/// (`BackingFile::read_direct_at`): data read beside the engine's direct I/O.
pub fn read_data(dest: &Dest, sector: u64, buf: &mut [u8]) -> io::Result<()> {
    match dest {
        Dest::File(f) => f.read_direct_at(buf, sector * SECTOR),
        Dest::Dm(_) => read(dest, sector, buf),
    }
}

/// [`write`], but a file's data through O_DIRECT where it is aligned.
pub fn write_data(dest: &Dest, sector: u64, buf: &[u8], fua: bool) -> io::Result<()> {
    match dest {
        Dest::File(f) => f.write_direct_at(buf, sector * SECTOR, fua),
        Dest::Dm(_) => write(dest, sector, buf, fua),
    }
}

/// Make everything written to `dest` durable (an empty REQ_PREFLUSH).
pub fn flush(dest: &Dest) -> io::Result<()> {
    match dest {
        Dest::File(f) => f.sync(),
        Dest::Dm(d) => request(d, Op::Flush, 0, Data::None, false),
    }
}

/// Discard `sectors` at `sector` of `dest` (punch a hole in a file).
pub fn discard(dest: &Dest, sector: u64, sectors: u64) -> io::Result<()> {
    match dest {
        Dest::File(f) => f.discard_at(sector * SECTOR, sectors * SECTOR),
        Dest::Dm(d) => {
            let mut done = 0;
            while done < sectors {
                let n = (sectors - done).min(MAX_REQUEST as u64 / SECTOR);
                request(d, Op::Discard, sector + done, Data::Discard(n), false)?;
                done += n;
            }
            Ok(())
        }
    }
}

/// Drop this thread's engines (and their rings).
pub fn release_thread_engine() {
    for mut e in ENGINES.with(|e| std::mem::take(&mut *e.borrow_mut())) {
        e.shut_down();
    }
}

/// Size of `dest` in sectors now.
pub fn size_sectors(dest: &Dest) -> u64 {
    match dest {
        Dest::File(f) => f.size().map_or(0, |b| b / SECTOR),
        Dest::Dm(d) => d.size_sectors(),
    }
}

enum Data<'a> {
    None,
    /// A range without data (discard): its length in sectors.
    Discard(u64),
    In(&'a mut [u8]),
    Out(&'a [u8]),
}

fn request(dev: &Arc<Device>, op: Op, sector: u64, data: Data, fua: bool) -> io::Result<()> {
    // The thread's engines: the top one for this request. A request can start
    // another while it is being mapped (a thin pool whose metadata is on another
    // dmkit device reads it from inside its map), so a nested one takes an
    // engine of its own, made the first time and kept.
    let mut eng = match ENGINES.with(|e| e.borrow_mut().pop()) {
        Some(e) => e,
        None => Engine::new(1)?,
    };
    let r = run(&mut eng, dev, op, sector, data, fua);
    match r {
        // the ring failed: this engine is gone
        Err(Failed::Ring(e)) => {
            eng.shut_down();
            Err(e)
        }
        Err(Failed::Io(e)) => {
            ENGINES.with(|e| e.borrow_mut().push(eng));
            Err(e)
        }
        Ok(()) => {
            ENGINES.with(|e| e.borrow_mut().push(eng));
            Ok(())
        }
    }
}

enum Failed {
    Ring(io::Error),
    Io(io::Error),
}

fn run(
    eng: &mut Engine,
    dev: &Arc<Device>,
    op: Op,
    sector: u64,
    mut data: Data,
    fua: bool,
) -> Result<(), Failed> {
    let r = eng
        .alloc()
        .ok_or_else(|| Failed::Io(io::Error::from_raw_os_error(errno::EIO)))?;
    let len = match &data {
        Data::None | Data::Discard(_) => 0,
        Data::In(b) => b.len(),
        Data::Out(b) => b.len(),
    };
    let q = eng.request_mut(r);
    q.op = op;
    q.sector = sector;
    q.nr_sectors = match &data {
        Data::Discard(n) => *n,
        _ => len as u64 / SECTOR,
    };
    q.fua = fua;
    q.punch = false;
    q.fast_zero = false;
    q.buf.ensure(len.max(1));
    if let Data::Out(b) = &data {
        q.buf.as_mut_slice()[..len].copy_from_slice(b);
    }
    eng.start(r, dev);
    let started = std::time::Instant::now();
    let mut next_report = LONG_WAIT;
    let res = loop {
        if let Some(done) = eng.pop_done() {
            if done != r {
                // one request at a time on this engine: nothing else can finish
                tracing::error!("dm-io: request {done} finished while {r} was under way");
                continue;
            }
            break eng.request(r).error;
        }
        eng.turn(Some(Duration::from_millis(100))).map_err(Failed::Ring)?;
        if started.elapsed() > next_report {
            // waiting on a suspended device is normal; anything else here is a
            // request that something lost
            tracing::warn!(
                "dm-io: a request to {} has waited {} s: {}; this process's threads: {}",
                dev.name(),
                started.elapsed().as_secs(),
                eng.describe(r),
                crate::io::describe_threads(false)
            );
            next_report += LONG_WAIT;
        }
    };
    if let Data::In(b) = &mut data {
        b.copy_from_slice(&eng.request(r).buf.as_slice()[..len]);
    }
    eng.free(r);
    // the slot would keep `dev` alive past its removal
    eng.forget_devices();
    if res != 0 {
        return Err(Failed::Io(io::Error::from_raw_os_error(res)));
    }
    Ok(())
}

/// Copy `(source sector, destination sector, sectors)` regions from `src` to
/// `dst` as one job when both are files (the copier gathers the regions that
/// follow each other on `dst` into larger writes, several at once), else one
/// region after another. Returns when all of it is written (not durable).
pub fn copy_regions(
    copier: &crate::copier::Copier,
    src: &Dest,
    dst: &Dest,
    regions: &[(u64, u64, u64)],
) -> io::Result<()> {
    if let (Dest::File(s), Dest::File(d)) = (src, dst) {
        let bytes: Vec<(u64, u64, u64)> = regions
            .iter()
            .map(|&(a, b, n)| (a * SECTOR, b * SECTOR, n * SECTOR))
            .collect();
        return copier.copy_regions(s, d, &bytes, false);
    }
    for &(a, b, n) in regions {
        copy(copier, src, a, dst, b, n, false)?;
    }
    Ok(())
}

/// Copy `sectors` from `src` at `src_sector` to `dst` at `dst_sector`: through the
/// copy engine between files, in 1 MiB pieces through dm-io otherwise; with `fua`
/// every write to `dst` carries FUA.
pub fn copy(
    copier: &crate::copier::Copier,
    src: &Dest,
    src_sector: u64,
    dst: &Dest,
    dst_sector: u64,
    sectors: u64,
    fua: bool,
) -> io::Result<()> {
    if let (Dest::File(s), Dest::File(d)) = (src, dst) {
        if fua {
            let regions = [(src_sector * SECTOR, dst_sector * SECTOR, sectors * SECTOR)];
            return copier.copy_regions(s, d, &regions, true);
        }
        return copier.copy(
            s,
            src_sector * SECTOR,
            &[(d, dst_sector * SECTOR)],
            sectors * SECTOR,
        );
    }
    let mut buf = vec![0u8; MAX_REQUEST.min((sectors * SECTOR) as usize)];
    let mut done = 0u64;
    while done < sectors {
        let n = (sectors - done).min(MAX_REQUEST as u64 / SECTOR);
        let b = &mut buf[..(n * SECTOR) as usize];
        read(src, src_sector + done, b)?;
        write(dst, dst_sector + done, b, fua)?;
        done += n;
    }
    Ok(())
}

/// Zero `sectors` at `sector` of `dest`: through the copy engine on a file, as
/// writes of zeroes through dm-io on a device.
pub fn zero(copier: &crate::copier::Copier, dest: &Dest, sector: u64, sectors: u64) -> io::Result<()> {
    if let Dest::File(f) = dest {
        return copier.zero(&[(f, sector * SECTOR)], sectors * SECTOR);
    }
    let zeros = vec![0u8; MAX_REQUEST.min((sectors * SECTOR) as usize)];
    let mut done = 0u64;
    while done < sectors {
        let n = (sectors - done).min(MAX_REQUEST as u64 / SECTOR);
        write(dest, sector + done, &zeros[..(n * SECTOR) as usize], false)?;
        done += n;
    }
    Ok(())
}

/// The simulated disk a file `dest` lies on under `dmkit sim` (a dmkit
/// device: none; its own files answer for themselves).
pub fn sim_of(dest: &Dest) -> Option<std::sync::Arc<crate::io::sim::SimDisk>> {
    match dest {
        Dest::File(f) => f.sim().cloned(),
        Dest::Dm(_) => None,
    }
}

/// What tells two of a table's devices apart: a file's (device, inode), or a
/// dmkit device's number.
pub fn identity(dest: &Dest) -> (u64, u64) {
    match dest {
        Dest::File(f) => f.identity,
        Dest::Dm(d) => (u64::MAX, u64::from(d.minor)),
    }
}

/// How messages name `dest`: a file's path, a dmkit device's name.
pub fn describe(dest: &Dest) -> String {
    match dest {
        Dest::File(f) => f.path.display().to_string(),
        Dest::Dm(d) => d.name(),
    }
}

/// Persistent-data metadata on `dest`: a file opened for metadata I/O, or a
/// dmkit device (LVM's `_tmeta`, `_cmeta`), read and written through its table
/// with dm-io. The device's I/O blocks the calling thread, as a file's does.
pub fn metadata_dev(dest: &Dest) -> io::Result<Box<dyn crate::pdata::dev::MetadataDev>> {
    match dest {
        Dest::File(f) => crate::pdata::dev::open_backing(f),
        Dest::Dm(d) => Ok(Box::new(DmMetadata(d.clone()))),
    }
}

struct DmMetadata(Arc<Device>);

impl crate::pdata::dev::MetadataDev for DmMetadata {
    fn nr_blocks(&self) -> u64 {
        self.0.size_sectors() * SECTOR / crate::pdata::BLOCK_SIZE as u64
    }
    fn read_block(&mut self, block: u64, buf: &mut crate::pdata::Block) -> io::Result<()> {
        self.read_blocks(block, buf)
    }
    fn write_block(&mut self, block: u64, buf: &crate::pdata::Block) -> io::Result<()> {
        write(&Dest::Dm(self.0.clone()), block * 8, buf, false)
    }
    fn flush(&mut self) -> io::Result<()> {
        flush(&Dest::Dm(self.0.clone()))
    }
    fn try_clone(&self) -> Option<Box<dyn crate::pdata::dev::MetadataDev>> {
        Some(Box::new(DmMetadata(self.0.clone())))
    }
    fn read_blocks(&mut self, block: u64, buf: &mut [u8]) -> io::Result<()> {
        read(&Dest::Dm(self.0.clone()), block * 8, buf)
    }
}
