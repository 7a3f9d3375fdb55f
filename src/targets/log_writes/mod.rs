//! `log-writes <dev> <log_dev>`: the kernel's dm-log-writes. Every write, discard
//! and flush to `dev` is also recorded on `log_dev`, in the kernel's format
//! ([`format`]) and by its ordering rules, so a log can be replayed to any
//! entry, flush or mark (`dmkit replay`, [`replay`]):
//!
//! - a write is recorded with its data once it has completed, but only when a
//!   later flush arrives: the flush, when it is issued, takes every write that
//!   has completed by then, and when it completes records them, then itself;
//!   writes completing after it was issued wait for the next flush;
//! - a FUA write is recorded as soon as it completes, and the super is written
//!   again after it (and after a mark) with the number of entries so far;
//! - discards are recorded like writes, without data, and reads pass through;
//! - `message mark NAME` records a mark; when the table goes, the writes no
//!   flush took are recorded, then the mark `dm-log-writes-end`.
//!
//! As in the kernel, the log starts again at its first entry each time a table
//! is made, the log device is never flushed (the log is whole once the table
//! has gone), and a log device that fills up stops the logging (status:
//! `logging_disabled`), not the writes. Deliberately unlike the kernel: a write
//! that failed is not recorded (the kernel records it, so a replay would write
//! data that never reached the device), and sectors are the target's own (the
//! kernel's are the mapped device's, the same for a table of one target).

pub mod format;
pub mod replay;

use crate::mapper::TargetError;
use crate::io::{EndIo, LeafKind, Op, SECTOR};
use crate::mapper::devio;
use crate::mapper::engine::Dest;
use crate::mapper::{arg_dev, Bio, DevRef, Limits, MapCtx, MapErr, Resolver, Target, TargetType};
use crate::sync::Unpoison;
use format::{Entry, Super, DISCARD, END_MARK, FLUSH, FUA, MARK};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// The `log-writes` target type.
pub const TYPE: TargetType = TargetType {
    name: "log-writes",
    version: [1, 1, 0],
    new: |args, len, r| Ok(Box::new(LogWrites::new(args, len, r)?)),
    sync: None,
};

/// What one entry records: flags, where (in blocks of `sectorsize`), and a
/// write's entry block and data (the block left for the logger to fill, so the
/// entry and its data go to the log in one write, copied once) or a mark's text.
struct Block {
    flags: u64,
    sector: u64,
    nr: u64,
    data: Vec<u8>,
}

/// The bytes the logger gathers into one write of the log, about.
const BATCH: usize = 1 << 20;

/// The data of completed writes a device holds for its log (not yet taken by
/// a flush, or not yet written to the log), at most: a client that never
/// flushes, or writes faster than the log device takes them, would otherwise
/// hold the daemon's memory without bound (the kernel's holds its pages so).
/// Past it, logging stops as when the log device is full.
const MAX_HELD: usize = 1 << 30;

#[derive(Default)]
struct State {
    /// Completed writes and discards no flush has taken yet.
    unflushed: Vec<Block>,
    /// The data bytes of `unflushed` and `logging`.
    held: usize,
    /// What the logger writes next, in order.
    logging: VecDeque<Block>,
    /// Where the next entry goes, in 512-byte sectors of the log device.
    next_sector: u64,
    /// The log device's size in 512-byte sectors.
    end_sector: u64,
    logged: u64,
    enabled: bool,
    stop: bool,
    /// The logger waits for work (a notify is a system call: only then).
    idle: bool,
}

struct Inner {
    st: Mutex<State>,
    /// `st.enabled`, read without the lock on the I/O path.
    on: AtomicBool,
    wake: Condvar,
    log: Dest,
    sectorsize: u32,
}

impl Inner {
    /// A write or discard completed: recorded now (FUA) or by the next flush.
    fn completed(&self, b: Block) {
        let mut st = self.st.lock().unpoisoned();
        if !st.enabled {
            return;
        }
        st.held += b.data.len();
        if st.held > MAX_HELD {
            tracing::error!(
                "log-writes: more than {MAX_HELD} bytes of writes wait for a flush or for the log device: logging stops"
            );
            st.enabled = false;
            self.on.store(false, Ordering::Relaxed);
            st.unflushed = Vec::new();
            st.logging.clear();
            st.held = 0;
            return;
        }
        if b.flags & FUA != 0 {
            st.logging.push_back(b);
            self.wake_logger(&mut st);
        } else {
            st.unflushed.push(b);
        }
    }

    /// Work was queued: wake the logger if it waits.
    fn wake_logger(&self, st: &mut State) {
        if st.idle {
            st.idle = false;
            self.wake.notify_one();
        }
    }

    /// The logger thread: writes entries in order until told to stop with
    /// nothing left. What is queued goes in one write of consecutive entries
    /// (at most [`BATCH`] bytes: a system call costs more than the copy), then
    /// the super if an entry of it was a FUA write or a mark: the super is
    /// written after the entries it counts, as the kernel's.
    fn logger(&self) {
        let ss = u64::from(self.sectorsize);
        let mut out: Vec<u8> = Vec::new();
        let mut batch: Vec<Block> = Vec::new();
        loop {
            let mut st = self.st.lock().unpoisoned();
            while st.logging.is_empty() {
                if st.stop {
                    return;
                }
                st.idle = true;
                st = self.wake.wait(st).unpoisoned();
                st.idle = false;
            }
            // taken under the lock with their places; copied out of it
            let (first, mut super_after, mut bytes) = (st.next_sector, false, 0usize);
            while let Some(b) = st.logging.pop_front() {
                st.held = st.held.saturating_sub(b.data.len());
                if !st.enabled {
                    continue;
                }
                if b.flags & DISCARD == 0 {
                    st.next_sector += b.nr * ss / SECTOR;
                }
                st.next_sector += ss / SECTOR;
                if st.next_sector >= st.end_sector {
                    tracing::error!("log-writes: the log device is full: logging stops");
                    st.enabled = false;
                    self.on.store(false, Ordering::Relaxed);
                    continue;
                }
                st.logged += 1;
                super_after |= b.flags & (FUA | MARK) != 0;
                bytes += b.data.len().max(ss as usize);
                batch.push(b);
                if bytes >= BATCH {
                    break;
                }
            }
            let logged = st.logged;
            drop(st);
            if batch.is_empty() {
                continue;
            }
            out.clear();
            for mut b in batch.drain(..) {
                self.encode(&mut b, &mut out);
            }
            let r = devio::write(&self.log, first, &out, false).and_then(|()| {
                if super_after {
                    self.write_super(logged)
                } else {
                    Ok(())
                }
            });
            if let Err(e) = r {
                tracing::error!("log-writes: writing the log failed: {e}: logging stops");
                self.st.lock().unpoisoned().enabled = false;
                self.on.store(false, Ordering::Relaxed);
            }
            if out.capacity() > 2 * BATCH {
                out = Vec::new();
            }
        }
    }

    /// Entry `b`'s block (a write's data after it) appended to `out`.
    fn encode(&self, b: &mut Block, out: &mut Vec<u8>) {
        let ss = self.sectorsize;
        let mark = b.flags & MARK != 0;
        let e = Entry {
            sector: b.sector,
            nr_sectors: b.nr,
            flags: b.flags,
            // a mark's text length; a write's data is not counted here
            data_len: if mark { b.data.len() as u64 } else { 0 },
        };
        let head = e.encode(if mark { &b.data } else { &[] }, ss);
        if !mark && b.nr > 0 && b.data.len() == ss as usize * (1 + b.nr as usize) {
            // a write: its entry block goes in the room left before its data
            b.data[..ss as usize].copy_from_slice(&head);
            out.extend_from_slice(&b.data);
        } else {
            out.extend_from_slice(&head);
        }
    }

    fn write_super(&self, nr_entries: u64) -> std::io::Result<()> {
        let s = Super {
            nr_entries,
            sectorsize: self.sectorsize,
        };
        devio::write(&self.log, 0, &s.encode(), false)
    }

    /// Queue a mark (its text cut to what an entry block holds).
    fn mark(&self, text: &str) {
        let room = self.sectorsize as usize - format::ENTRY_LEN - 1;
        let mut data = text.as_bytes().to_vec();
        data.truncate(room);
        let mut st = self.st.lock().unpoisoned();
        st.logging.push_back(Block {
            flags: MARK,
            sector: 0,
            nr: 0,
            data,
        });
        self.wake_logger(&mut st);
    }
}

pub struct LogWrites {
    dev: DevRef,
    log: DevRef,
    inner: Arc<Inner>,
    /// Discards reach `dev` (else they are recorded and completed at once).
    dev_discards: bool,
    logger: Option<std::thread::JoinHandle<()>>,
}

impl LogWrites {
    pub fn new(args: &[String], len: u64, r: &dyn Resolver) -> Result<LogWrites, TargetError> {
        if args.len() != 2 {
            return Err(format!(
                "Invalid argument count: log-writes takes 2 arguments (<dev_path> <log_dev_path>), got {}",
                args.len()
            ).into());
        }
        let dev = arg_dev(args, 0, 0, len, r)?;
        let log = r
            .open(&args[1])
            .map_err(|e| format!("Log device lookup failed: '{}': {e}", args[1]))?;
        let sectorsize = dev.logical_block_size().max(512);
        let end_sector = log.size_sectors();
        if end_sector < 2 * u64::from(sectorsize) / SECTOR {
            return Err(format!(
                "log device '{}' holds {} sectors: not even a super and one entry of {sectorsize} bytes",
                args[1], end_sector
            ).into());
        }
        let inner = Arc::new(Inner {
            st: Mutex::new(State {
                next_sector: u64::from(sectorsize) / SECTOR,
                end_sector,
                enabled: true,
                ..State::default()
            }),
            on: AtomicBool::new(true),
            wake: Condvar::new(),
            log: log.dest(),
            sectorsize,
        });
        let i = inner.clone();
        let logger = std::thread::Builder::new()
            .name("log-writes".into())
            .spawn(move || {
                i.logger();
                devio::release_thread_engine();
            })
            .map_err(|e| format!("Couldn't start the logging thread: {e}"))?;
        Ok(LogWrites {
            dev_discards: dev.limits().discard,
            dev,
            log,
            inner,
            logger: Some(logger),
        })
    }

    fn enabled(&self) -> bool {
        self.inner.on.load(Ordering::Relaxed)
    }

    /// Record `b` once the I/O `bio` on the device has completed well.
    fn remap_recorded(&self, bio: Bio, b: Block, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let (inner, slot) = (self.inner.clone(), Mutex::new(Some(b)));
        let hook: EndIo = Arc::new(move |ok, _: &mut [u8]| {
            if let Some(b) = slot.lock().unpoisoned().take().filter(|_| ok) {
                inner.completed(b);
            }
            0
        });
        ctx.remap_noting(&self.dev, bio, 0, hook)
    }
}

impl Drop for LogWrites {
    fn drop(&mut self) {
        // what no flush took, then the end mark: the kernel's destructor
        {
            let mut st = self.inner.st.lock().unpoisoned();
            let left = std::mem::take(&mut st.unflushed);
            st.logging.extend(left);
        }
        self.inner.mark(END_MARK);
        self.inner.st.lock().unpoisoned().stop = true;
        self.inner.wake.notify_all();
        if let Some(t) = self.logger.take() {
            let _ = t.join();
        }
    }
}

impl Target for LogWrites {
    fn type_name(&self) -> &'static str {
        TYPE.name
    }

    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let per_block = u64::from(self.inner.sectorsize) / SECTOR;
        let block = |flags, data| Block {
            flags,
            sector: bio.sector / per_block,
            nr: bio.nr_sectors / per_block,
            data,
        };
        match bio.op {
            Op::Read => ctx.remap(&self.dev, bio, 0),
            _ if !self.enabled() => ctx.remap(&self.dev, bio, 0),
            Op::Write | Op::WriteZeroes if bio.nr_sectors == 0 => ctx.remap(&self.dev, bio, 0),
            Op::Write | Op::WriteZeroes => {
                // copied now (the request's buffer is the client's until the log
                // has it), after room for the entry's block; write-zeroes is
                // recorded as the write of zeroes it is
                let ss = self.inner.sectorsize as usize;
                let mut data = vec![0u8; ss + bio.bytes() as usize];
                if bio.op == Op::Write {
                    let src = ctx.data_of(&bio);
                    if src.len() != data.len() - ss {
                        // the engine bounds every piece by its request: not reached
                        return Err(MapErr::Errno(crate::io::errno::EIO));
                    }
                    data[ss..].copy_from_slice(src);
                }
                let flags = if bio.fua { FUA } else { 0 };
                self.remap_recorded(bio, block(flags, data), ctx)
            }
            Op::Discard if self.dev_discards => self.remap_recorded(bio, block(DISCARD, Vec::new()), ctx),
            Op::Discard => {
                // the device cannot discard: recorded and completed at once
                self.inner.completed(block(DISCARD, Vec::new()));
                ctx.complete(bio, LeafKind::Drop);
                Ok(())
            }
            Op::Flush => {
                // the flush takes what has completed so far
                let taken = std::mem::take(&mut self.inner.st.lock().unpoisoned().unflushed);
                let (inner, slot) = (self.inner.clone(), Mutex::new(Some(taken)));
                let hook: EndIo = Arc::new(move |ok, _: &mut [u8]| {
                    let Some(taken) = slot.lock().unpoisoned().take() else {
                        return 0;
                    };
                    let mut st = inner.st.lock().unpoisoned();
                    if ok {
                        st.logging.extend(taken);
                        st.logging.push_back(Block {
                            flags: FLUSH,
                            sector: 0,
                            nr: 0,
                            data: Vec::new(),
                        });
                        inner.wake_logger(&mut st);
                    } else if st.enabled {
                        // not flushed after all: back before what completed since
                        let later = std::mem::replace(&mut st.unflushed, taken);
                        st.unflushed.extend(later);
                    }
                    0
                });
                ctx.remap_noting(&self.dev, bio, 0, hook)
            }
        }
    }

    fn table_params(&self) -> String {
        format!("{} {}", self.dev.table_name(), self.log.table_name())
    }

    /// `<logged entries> <highest sector of the log in use>`, and
    /// `logging_disabled` once logging has stopped.
    fn status_params(&self) -> String {
        let st = self.inner.st.lock().unpoisoned();
        let mut s = format!("{} {}", st.logged, st.next_sector - 1);
        if !st.enabled {
            s.push_str(" logging_disabled");
        }
        s
    }

    fn message(&self, words: &[String]) -> Result<String, TargetError> {
        if words.len() != 2 {
            return Err(format!(
                "Invalid log-writes message arguments, expect 2 arguments, got {}",
                words.len()
            ).into());
        }
        if !words[0].eq_ignore_ascii_case("mark") {
            return Err(format!(
                "Unrecognised log writes target message received: {}",
                crate::table::bounded(&words[0])
            ).into());
        }
        self.inner.mark(&words[1]);
        Ok(String::new())
    }

    fn devices(&self) -> Vec<&DevRef> {
        vec![&self.dev]
    }

    fn held_devices(&self) -> Vec<&DevRef> {
        vec![&self.dev, &self.log]
    }

    fn logical_block_size(&self) -> u32 {
        self.inner.sectorsize
    }

    fn limits(&self) -> Limits {
        Limits {
            // recorded even where the device cannot discard, as the kernel's
            discard: true,
            // the kernel's target takes no write-zeroes: the zero pages come as writes
            write_zeroes: false,
            ..Limits::stacked(&self.devices())
        }
    }
}
