//! dm-io: synchronous I/O to any [`Dest`] (a backing file or a dmkit device, whose
//! table maps it) from a thread that is not a request engine's: the copy engine's
//! workers, a snapshot merge, an exception store's commits.
//!
//! I/O to a dmkit device runs through a request engine of the calling thread's own
//! (one per thread, for every device it reaches), so it passes the device's targets,
//! waits while the device is suspended, and counts in its drains like any request.
//! Never call it from a request engine's thread: it blocks.

use super::engine::{Dest, Engine};
use super::Device;
use crate::io::{errno, Op, SECTOR};
use std::cell::RefCell;
use std::io;
use std::sync::Arc;
use std::time::Duration;

/// Largest single request sent to a device; longer transfers go in pieces.
const MAX_REQUEST: usize = 1 << 20;

thread_local! {
    static ENGINE: RefCell<Option<Engine>> = const { RefCell::new(None) };
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

/// Drop this thread's engine (and its ring).
pub fn release_thread_engine() {
    ENGINE.with(|cell| {
        if let Some(mut e) = cell.borrow_mut().take() {
            e.shut_down();
        }
    });
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

fn request(dev: &Arc<Device>, op: Op, sector: u64, mut data: Data, fua: bool) -> io::Result<()> {
    ENGINE.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(Engine::new(1)?);
        }
        let Some(eng) = slot.as_mut() else {
            return Err(io::Error::from_raw_os_error(errno::EIO));
        };
        let r = eng
            .alloc()
            .ok_or_else(|| io::Error::from_raw_os_error(errno::EIO))?;
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
        let res = loop {
            if let Some(done) = eng.pop_done() {
                debug_assert_eq!(done, r);
                break eng.request(r).error;
            }
            if let Err(e) = eng.turn(Some(Duration::from_millis(100))) {
                // the ring failed: wait for what is under way, then report
                eng.shut_down();
                *slot = None;
                return Err(e);
            }
        };
        if let Data::In(b) = &mut data {
            b.copy_from_slice(&eng.request(r).buf.as_slice()[..len]);
        }
        eng.free(r);
        // the slot would keep `dev` alive past its removal
        eng.forget_devices();
        if res != 0 {
            return Err(io::Error::from_raw_os_error(res));
        }
        Ok(())
    })
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
