//! `delay <dev> <off> <ms> [<wdev> <woff> <wms> [<fdev> <foff> <fms>]]`: holds reads,
//! writes and flushes for a while before passing them on.

//!
//! A held bio is a piece the target takes ([`Pending`]) and a timer thread sends on
//! when it is due; presuspend sends everything on at once (the kernel's
//! flush_delayed_bios), so a suspend never waits out a delay.

use crate::mapper::TargetError;
use crate::io::Op;
use crate::mapper::engine::{Dest, Pending};
use crate::mapper::{
    arg_dev, arg_u64, dev_extents, Bio, DevRef, MapCtx, MapErr, Resolver, Target, TargetType,
};
use crate::sync::Unpoison;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

struct Class {
    dev: DevRef,
    offset: u64,
    delay_ms: u32,
}

pub struct Delay {
    /// 1 to 3 device triples as given in the table.
    classes: Vec<Class>,
    timer: Arc<Timer>,
}

/// A held piece: when it is due, what counts it, and where it goes.
struct Held {
    due: Instant,
    pending: Pending,
    dest: Dest,
    bio: Bio,
}

/// The bios a delay target holds, in arrival order per class (each class has one
/// delay, so arrival order is due order), and the thread that sends them on.
struct Timer {
    queues: Mutex<[VecDeque<Held>; 3]>,
    cv: Condvar,
    /// Bios held right now, per read / write / flush (status shows these).
    held: [AtomicU64; 3],
    /// Set from presuspend to resume: held bios are released and no more are held.
    released: AtomicBool,
    stop: AtomicBool,
}

impl Timer {
    fn run(&self) {
        let mut q = self.queues.lock().unpoisoned();
        loop {
            if self.stop.load(Ordering::SeqCst) {
                break;
            }
            let now = Instant::now();
            let release = self.released.load(Ordering::SeqCst);
            let mut due = Vec::new();
            let mut next: Option<Instant> = None;
            for (k, cq) in q.iter_mut().enumerate() {
                while cq.front().is_some_and(|h| release || h.due <= now) {
                    if let Some(h) = cq.pop_front() {
                        self.held[k].fetch_sub(1, Ordering::Relaxed);
                        due.push(h);
                    }
                }
                if let Some(h) = cq.front() {
                    next = Some(next.map_or(h.due, |n: Instant| n.min(h.due)));
                }
            }
            if !due.is_empty() {
                drop(q);
                for h in due {
                    h.pending.remap(h.dest, h.bio, None);
                }
                q = self.queues.lock().unpoisoned();
                continue;
            }
            let wait = next.map_or(Duration::from_secs(3600), |n| n.saturating_duration_since(now));
            q = self.cv.wait_timeout(q, wait).unpoisoned().0;
        }
        // the target is gone: whatever is still held goes on now
        for cq in q.iter_mut() {
            for h in cq.drain(..) {
                h.pending.remap(h.dest, h.bio, None);
            }
        }
    }
}

impl Delay {
    pub fn new(args: &[String], len: u64, r: &dyn Resolver) -> Result<Delay, TargetError> {
        if !matches!(args.len(), 3 | 6 | 9) {
            return Err(format!(
                "delay takes 3, 6 or 9 arguments (<dev> <offset> <delay_ms> per class), got {}",
                args.len()
            ).into());
        }
        let mut classes = Vec::new();
        for c in 0..args.len() / 3 {
            let offset = arg_u64(args, 3 * c + 1, "offset")?;
            let ms = arg_u64(args, 3 * c + 2, "delay")?;
            if ms > u32::MAX as u64 {
                return Err(format!("invalid delay '{ms}'").into());
            }
            let dev = arg_dev(args, 3 * c, offset, len, r)?;
            classes.push(Class {
                dev,
                offset,
                delay_ms: ms as u32,
            });
        }
        let timer = Arc::new(Timer {
            queues: Mutex::new(Default::default()),
            cv: Condvar::new(),
            held: Default::default(),
            released: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        });
        let t = timer.clone();
        std::thread::Builder::new()
            .name("delay-timer".into())
            .spawn(move || t.run())
            .map_err(|e| format!("starting the delay timer: {e}"))?;
        Ok(Delay { classes, timer })
    }

    /// The counter index (0 read, 1 write/discard, 2 flush) and the triple that applies:
    /// with 3 arguments one triple serves all, with 6 writes and flushes share the second.
    fn class_of(&self, op: Op) -> (usize, &Class) {
        let kind = match op {
            Op::Read => 0,
            Op::Write | Op::Discard | Op::WriteZeroes => 1,
            Op::Flush => 2,
        };
        (kind, &self.classes[kind.min(self.classes.len() - 1)])
    }
}

/// The `delay` target type.
pub const TYPE: TargetType = TargetType {
    name: "delay",
    version: [1, 4, 0],
    new: |args, len, r| Ok(Box::new(Delay::new(args, len, r)?)),
    sync: None,
};

impl Target for Delay {
    fn type_name(&self) -> &'static str {
        TYPE.name
    }
    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let (kind, c) = self.class_of(bio.op);
        let remapped = bio.shifted(c.offset);
        if c.delay_ms == 0 || self.timer.released.load(Ordering::SeqCst) {
            return ctx.remap(&c.dev, remapped, 0);
        }
        let held = Held {
            due: Instant::now() + Duration::from_millis(u64::from(c.delay_ms)),
            pending: ctx.submit(bio),
            dest: c.dev.dest(),
            bio: remapped,
        };
        let mut q = self.timer.queues.lock().unpoisoned();
        self.timer.held[kind].fetch_add(1, Ordering::Relaxed);
        let first = q[kind].is_empty();
        q[kind].push_back(held);
        drop(q);
        if first {
            self.timer.cv.notify_one();
        }
        Ok(())
    }
    fn table_params(&self) -> String {
        let v: Vec<String> = self
            .classes
            .iter()
            .map(|c| format!("{} {} {}", c.dev.table_name(), c.offset, c.delay_ms))
            .collect();
        v.join(" ")
    }
    fn status_params(&self) -> String {
        let h: Vec<u64> = self
            .timer
            .held
            .iter()
            .map(|h| h.load(Ordering::Relaxed))
            .collect();
        format!("{} {} {}", h[0], h[1], h[2])
    }
    fn devices(&self) -> Vec<&DevRef> {
        self.classes.iter().map(|c| &c.dev).collect()
    }
    fn extents(&self, sector: u64, nr: u64, out: &mut Vec<(u64, u32)>) -> Result<(), TargetError> {
        let c = &self.classes[0];
        dev_extents(&c.dev, c.offset + sector, nr, out)
    }
    fn presuspend(&self) {
        let _q = self.timer.queues.lock().unpoisoned();
        self.timer.released.store(true, Ordering::SeqCst);
        self.timer.cv.notify_one();
    }
    fn resume(&self) {
        self.timer.released.store(false, Ordering::SeqCst);
    }
}

impl Drop for Delay {
    fn drop(&mut self) {
        let _q = self.timer.queues.lock().unpoisoned();
        self.timer.stop.store(true, Ordering::SeqCst);
        self.timer.cv.notify_one();
    }
}
