//! `flakey <dev> <offset> <up> <down> [<n> <features>...]`: linear while up; while
//! down, errors, dropped writes or corruption as the features say.

use crate::mapper::TargetError;
use crate::io::{errno, LeafKind};
use crate::mapper::{arg_dev, arg_u64, Bio, DevRef, MapCtx, MapErr, Resolver, Target, TargetType};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dir {
    Read,
    Write,
}

#[derive(Clone, Copy, Debug)]
struct CorruptByte {
    nth: u64,
    dir: Dir,
    value: u8,
    flags: u64,
}

pub struct Flakey {
    dev: DevRef,
    offset: u64,
    up: u64,
    down: u64,
    start: Instant,
    error_reads: bool,
    drop_writes: bool,
    error_writes: bool,
    corrupt: Option<CorruptByte>,
    random_read: Option<u64>,
    random_write: Option<u64>,
    rng: AtomicU64,
}

impl Flakey {
    pub fn new(args: &[String], len: u64, r: &dyn Resolver) -> Result<Flakey, TargetError> {
        if args.len() < 4 {
            return Err(format!(
                "flakey takes at least 4 arguments (<dev> <offset> <up> <down>), got {}",
                args.len()
            ).into());
        }
        let offset = arg_u64(args, 1, "offset")?;
        let up = arg_u64(args, 2, "up interval")?;
        let down = arg_u64(args, 3, "down interval")?;
        if up.checked_add(down).is_none_or(|t| t == 0 || t > u32::MAX as u64) {
            return Err("up and down intervals must add up to more than 0 seconds".into());
        }
        let mut f = Flakey {
            dev: arg_dev(args, 0, offset, len, r)?,
            offset,
            up,
            down,
            start: Instant::now(),
            error_reads: false,
            drop_writes: false,
            error_writes: false,
            corrupt: None,
            random_read: None,
            random_write: None,
            rng: AtomicU64::new(0x9E37_79B9_7F4A_7C15),
        };
        f.parse_features(&args[4..])?;
        Ok(f)
    }

    fn parse_features(&mut self, feat: &[String]) -> Result<(), TargetError> {
        if feat.is_empty() {
            self.error_reads = true;
            self.error_writes = true;
            return Ok(());
        }
        let n = arg_u64(feat, 0, "feature count")? as usize;
        if n > 11 || n != feat.len() - 1 {
            return Err(format!(
                "feature count {n} does not match the {} feature words given (at most 11)",
                feat.len() - 1
            ).into());
        }
        let mut i = 1;
        while i < feat.len() {
            let w = feat[i].as_str();
            let dup = || format!("feature {w} given twice");
            match w {
                "error_reads" => {
                    if self.error_reads {
                        return Err(dup().into());
                    }
                    self.error_reads = true;
                }
                "drop_writes" | "error_writes" => {
                    if self.drop_writes || self.error_writes {
                        return Err(if (w == "drop_writes") == self.drop_writes {
                            dup().into()
                        } else {
                            "drop_writes and error_writes are mutually exclusive".into()
                        });
                    }
                    if w == "drop_writes" {
                        self.drop_writes = true;
                    } else {
                        self.error_writes = true;
                    }
                }
                "corrupt_bio_byte" => {
                    if self.corrupt.is_some() {
                        return Err(dup().into());
                    }
                    if i + 4 >= feat.len() {
                        return Err("corrupt_bio_byte takes 4 arguments: <Nth> <r|w> <value> <flags>".into());
                    }
                    let nth = arg_u64(feat, i + 1, "corrupt_bio_byte Nth")?;
                    if nth == 0 {
                        return Err("corrupt_bio_byte: Nth byte must be at least 1".into());
                    }
                    let dir = match feat[i + 2].as_str() {
                        "r" => Dir::Read,
                        "w" => Dir::Write,
                        o => return Err(format!("corrupt_bio_byte: direction '{o}' is not r or w").into()),
                    };
                    let value = arg_u64(feat, i + 3, "corrupt_bio_byte value")?;
                    if value > 255 {
                        return Err(format!("corrupt_bio_byte: value {value} is more than 255").into());
                    }
                    let flags = arg_u64(feat, i + 4, "corrupt_bio_byte flags")?;
                    self.corrupt = Some(CorruptByte {
                        nth,
                        dir,
                        value: value as u8,
                        flags,
                    });
                    i += 4;
                }
                "random_read_corrupt" | "random_write_corrupt" => {
                    let p = arg_u64(feat, i + 1, w)?;
                    if p > 1_000_000_000 {
                        return Err(format!("{w}: probability {p} is more than 1000000000").into());
                    }
                    let slot = if w == "random_read_corrupt" {
                        &mut self.random_read
                    } else {
                        &mut self.random_write
                    };
                    if slot.is_some() {
                        return Err(dup().into());
                    }
                    *slot = Some(p);
                    i += 1;
                }
                other => return Err(format!("unknown flakey feature '{other}'").into()),
            }
            i += 1;
        }
        let w_corrupt = self.corrupt.is_some_and(|c| c.dir == Dir::Write) || self.random_write.is_some();
        let r_corrupt = self.corrupt.is_some_and(|c| c.dir == Dir::Read) || self.random_read.is_some();
        if w_corrupt && (self.drop_writes || self.error_writes) {
            return Err("write corruption is incompatible with drop_writes and error_writes".into());
        }
        if r_corrupt && self.error_reads {
            return Err("read corruption is incompatible with error_reads".into());
        }
        Ok(())
    }

    fn is_down(&self) -> bool {
        let secs = self.start.elapsed().as_secs();
        secs % (self.up + self.down) >= self.up
    }

    fn random(&self) -> u64 {
        let mut x = self.rng.load(Ordering::Relaxed);
        crate::rng::step(&mut x);
        self.rng.store(x, Ordering::Relaxed);
        x
    }

    /// The byte of `bio` to corrupt, and its new value, if any.
    fn corruption(&self, bio: &Bio, dir: Dir) -> Option<(u64, u8)> {
        if let Some(c) = self.corrupt {
            if c.dir == dir && bio_flags(bio) & c.flags == c.flags && c.nth <= bio.bytes() {
                return Some((c.nth - 1, c.value));
            }
        }
        let p = if dir == Dir::Read {
            self.random_read
        } else {
            self.random_write
        };
        match p {
            Some(p) if bio.bytes() > 0 && self.random() % 1_000_000_000 < p => {
                Some((self.random() % bio.bytes(), self.random() as u8))
            }
            _ => None,
        }
    }
}

/// The kernel's bi_opf (6.1 numbering) of a bio from dmkit's export, which
/// `corrupt_bio_byte`'s flags mask must all match: a write is an O_DIRECT write,
/// REQ_OP_WRITE | REQ_SYNC | REQ_IDLE (0x8801), plus REQ_FUA (0x28801) with FUA; a
/// read carries none.
fn bio_flags(bio: &Bio) -> u64 {
    const REQ_OP_WRITE: u64 = 1;
    const REQ_SYNC: u64 = 1 << 11;
    const REQ_IDLE: u64 = 1 << 15;
    const REQ_FUA: u64 = 1 << 17;
    match (bio.op.is_write(), bio.fua) {
        (false, _) => 0,
        (true, false) => REQ_OP_WRITE | REQ_SYNC | REQ_IDLE,
        (true, true) => REQ_OP_WRITE | REQ_SYNC | REQ_IDLE | REQ_FUA,
    }
}

/// The `flakey` target type.
pub const TYPE: TargetType = TargetType {
    name: "flakey",
    version: [1, 5, 0],
    new: |args, len, r| Ok(Box::new(Flakey::new(args, len, r)?)),
    sync: None,
};

impl Target for Flakey {
    fn type_name(&self) -> &'static str {
        TYPE.name
    }
    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let remapped = bio.shifted(self.offset);
        if !self.is_down() {
            return ctx.remap(&self.dev, remapped, 0);
        }
        let dir = if bio.op.is_write() { Dir::Write } else { Dir::Read };
        match dir {
            Dir::Read if self.error_reads => {
                ctx.complete(bio, LeafKind::Fail(errno::EIO));
                return Ok(());
            }
            Dir::Write if self.error_writes => {
                ctx.complete(bio, LeafKind::Fail(errno::EIO));
                return Ok(());
            }
            Dir::Write if self.drop_writes => {
                ctx.complete(bio, LeafKind::Drop);
                return Ok(());
            }
            _ => {}
        }
        let corrupt = if bio.op.has_data() {
            self.corruption(&bio, dir)
        } else {
            None
        };
        let Some((index, value)) = corrupt else {
            return ctx.remap(&self.dev, remapped, 0);
        };
        if dir == Dir::Write {
            // The data goes down corrupted (the kernel corrupts the bio's pages in map).
            if let Some(b) = ctx.data_of(&bio).get_mut(index as usize) {
                *b = value;
            }
            return ctx.remap(&self.dev, remapped, 0);
        }
        // A read is corrupted when it completes, in the leaf holding that byte.
        let mark = ctx.mark();
        ctx.remap(&self.dev, remapped, 0)?;
        ctx.wrap_hook_at(mark, bio.buf_off + index as usize, move |ok, data, at| {
            if let Some(b) = data.get_mut(at).filter(|_| ok) {
                *b = value;
            }
        });
        Ok(())
    }
    fn table_params(&self) -> String {
        let mut words: Vec<String> = Vec::new();
        if self.error_reads {
            words.push("error_reads".into());
        }
        if self.drop_writes {
            words.push("drop_writes".into());
        }
        if self.error_writes {
            words.push("error_writes".into());
        }
        if let Some(c) = self.corrupt {
            let d = if c.dir == Dir::Read { "r" } else { "w" };
            words.push(format!("corrupt_bio_byte {} {d} {} {}", c.nth, c.value, c.flags));
        }
        if let Some(p) = self.random_read {
            words.push(format!("random_read_corrupt {p}"));
        }
        if let Some(p) = self.random_write {
            words.push(format!("random_write_corrupt {p}"));
        }
        let count: usize = words.iter().map(|w| w.split(' ').count()).sum();
        let mut s = format!(
            "{} {} {} {} {count}",
            self.dev.table_name(),
            self.offset,
            self.up,
            self.down
        );
        for w in words {
            s.push(' ');
            s.push_str(&w);
        }
        s
    }
    fn devices(&self) -> Vec<&DevRef> {
        vec![&self.dev]
    }
}
