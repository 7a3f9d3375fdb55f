//! `delay <dev> <off> <ms> [<wdev> <woff> <wms> [<fdev> <foff> <fms>]]`: holds reads,
//! writes and flushes for a while before passing them on.

use super::{arg_dev, arg_u64, dev_extents, Bio, DevRef, MapCtx, MapErr, Resolver, Target};
use crate::io::Op;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

struct Class {
    dev: DevRef,
    offset: u64,
    delay_ms: u32,
}

pub struct Delay {
    /// 1 to 3 device triples as given in the table.
    classes: Vec<Class>,
    /// Bios held right now, per read / write / flush (status shows these).
    held: [Arc<AtomicU64>; 3],
    /// Set from presuspend to resume: held bios are released and no more are held.
    released: Arc<AtomicBool>,
}

impl Delay {
    pub fn new(args: &[String], len: u64, r: &dyn Resolver) -> Result<Delay, String> {
        if !matches!(args.len(), 3 | 6 | 9) {
            return Err(format!(
                "delay takes 3, 6 or 9 arguments (<dev> <offset> <delay_ms> per class), got {}",
                args.len()
            ));
        }
        let mut classes = Vec::new();
        for c in 0..args.len() / 3 {
            let offset = arg_u64(args, 3 * c + 1, "offset")?;
            let ms = arg_u64(args, 3 * c + 2, "delay")?;
            if ms > u32::MAX as u64 {
                return Err(format!("invalid delay '{ms}'"));
            }
            let dev = arg_dev(args, 3 * c, offset, len, r)?;
            classes.push(Class {
                dev,
                offset,
                delay_ms: ms as u32,
            });
        }
        Ok(Delay {
            classes,
            held: Default::default(),
            released: Arc::new(AtomicBool::new(false)),
        })
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

impl Target for Delay {
    fn type_name(&self) -> &'static str {
        "delay"
    }
    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let (kind, c) = self.class_of(bio.op);
        let sector = if bio.op == Op::Flush {
            0
        } else {
            c.offset + bio.sector
        };
        let first = ctx.leaves.len();
        ctx.remap(&c.dev, Bio { sector, ..bio }, 0)?;
        if c.delay_ms > 0 && !self.released.load(Ordering::Relaxed) {
            for l in &mut ctx.leaves[first..] {
                l.delay_ms = c.delay_ms;
                l.held = Some(self.held[kind].clone());
                l.release = Some(self.released.clone());
            }
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
        let h: Vec<u64> = self.held.iter().map(|h| h.load(Ordering::Relaxed)).collect();
        format!("{} {} {}", h[0], h[1], h[2])
    }
    fn devices(&self) -> Vec<&DevRef> {
        self.classes.iter().map(|c| &c.dev).collect()
    }
    fn extents(&self, sector: u64, nr: u64, out: &mut Vec<(u64, u32)>) -> Result<(), String> {
        let c = &self.classes[0];
        dev_extents(&c.dev, c.offset + sector, nr, out)
    }
    fn presuspend(&self) {
        self.released.store(true, Ordering::SeqCst);
    }
    fn resume(&self) {
        self.released.store(false, Ordering::SeqCst);
    }
}
