//! `striped <N> <chunk> (<dev> <offset>)×N`: chunks dealt round-robin over N devices.

use crate::mapper::TargetError;
use crate::io::Op;
use crate::mapper::{
    arg_dev, arg_u64, dev_extents, Bio, DevRef, Limits, MapCtx, MapErr, Resolver, Target, TargetType,
};
use std::sync::atomic::{AtomicU32, Ordering};

struct Stripe {
    dev: DevRef,
    offset: u64,
    errors: AtomicU32,
}

pub struct Striped {
    stripes: Vec<Stripe>,
    chunk: u64,
    /// log2(chunk) when the chunk size is a power of two (shift instead of divide).
    chunk_shift: Option<u32>,
}

impl Striped {
    pub fn new(args: &[String], len: u64, r: &dyn Resolver) -> Result<Striped, TargetError> {
        let n = arg_u64(args, 0, "number of stripes")?;
        if n == 0 {
            return Err("number of stripes must be at least 1".into());
        }
        if args.len() as u64 != 2 + 2 * n {
            return Err(format!(
                "striped with {n} stripes takes {} arguments, got {}",
                2 + 2 * n,
                args.len()
            ).into());
        }
        let chunk = arg_u64(args, 1, "chunk size")?;
        if chunk == 0 {
            return Err("chunk size must be greater than 0".into());
        }
        if !len.is_multiple_of(n) {
            return Err(format!(
                "target length {len} is not divisible by the number of stripes {n}"
            ).into());
        }
        let per = len / n;
        if !per.is_multiple_of(chunk) {
            return Err(format!(
                "stripe length {per} is not divisible by the chunk size {chunk}"
            ).into());
        }
        let mut stripes = Vec::new();
        for i in 0..n as usize {
            let offset = arg_u64(args, 3 + 2 * i, "stripe offset")?;
            let dev = arg_dev(args, 2 + 2 * i, offset, per, r)?;
            stripes.push(Stripe {
                dev,
                offset,
                errors: AtomicU32::new(0),
            });
        }
        let chunk_shift = chunk.is_power_of_two().then(|| chunk.trailing_zeros());
        Ok(Striped {
            stripes,
            chunk,
            chunk_shift,
        })
    }

    /// (stripe index, sector on that stripe's device) for a relative sector.
    #[inline]
    fn locate(&self, sector: u64) -> (usize, u64) {
        let (chunk, in_chunk) = match self.chunk_shift {
            Some(s) => (sector >> s, sector & (self.chunk - 1)),
            None => (sector / self.chunk, sector % self.chunk),
        };
        let n = self.stripes.len() as u64;
        let stripe = (chunk % n) as usize;
        let row = chunk / n;
        (stripe, row * self.chunk + in_chunk + self.stripes[stripe].offset)
    }

    /// Trim a whole-range op (discard / write-zeroes) to each stripe's part, as the
    /// kernel does with one clone per stripe.
    fn map_range_per_stripe(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let n = self.stripes.len() as u64;
        let (start, end) = (bio.sector, bio.sector + bio.nr_sectors);
        for (i, s) in self.stripes.iter().enumerate() {
            let lo = stripe_boundary(start, i as u64, n, self.chunk);
            let hi = stripe_boundary(end, i as u64, n, self.chunk);
            if hi > lo {
                let b = Bio {
                    sector: s.offset + lo,
                    nr_sectors: hi - lo,
                    ..bio
                };
                ctx.remap(&s.dev, b, i as u16)?;
            }
        }
        Ok(())
    }
}

/// The first sector of stripe `i`'s device area that maps at or after relative sector
/// `sector` (the kernel's stripe_map_range_sector).
fn stripe_boundary(sector: u64, i: u64, n: u64, chunk: u64) -> u64 {
    let c = sector / chunk;
    let row = c / n;
    let s = c % n;
    if s < i {
        row * chunk
    } else if s > i {
        (row + 1) * chunk
    } else {
        row * chunk + sector % chunk
    }
}

/// The `striped` target type.
pub const TYPE: TargetType = TargetType {
    name: "striped",
    version: [1, 6, 0],
    new: |args, len, r| Ok(Box::new(Striped::new(args, len, r)?)),
    sync: None,
};

impl Target for Striped {
    fn type_name(&self) -> &'static str {
        TYPE.name
    }
    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        match bio.op {
            Op::Flush => {
                for (i, s) in self.stripes.iter().enumerate() {
                    ctx.remap(&s.dev, Bio { sector: 0, ..bio }, i as u16)?;
                }
                Ok(())
            }
            Op::Discard | Op::WriteZeroes => self.map_range_per_stripe(bio, ctx),
            Op::Read | Op::Write => {
                // The engine splits at chunk boundaries (max_io_len), so this runs
                // once; it stays a loop so a bio spanning chunks could never land
                // on the wrong stripe.
                let mut done = 0;
                while done < bio.nr_sectors {
                    let sector = bio.sector + done;
                    let in_chunk = sector % self.chunk;
                    let n = (self.chunk - in_chunk).min(bio.nr_sectors - done);
                    let (stripe, dev_sector) = self.locate(sector);
                    ctx.remap(
                        &self.stripes[stripe].dev,
                        bio.sub(done, n, dev_sector),
                        stripe as u16,
                    )?;
                    done += n;
                }
                Ok(())
            }
        }
    }
    fn max_io_len(&self) -> u64 {
        self.chunk
    }
    fn table_params(&self) -> String {
        let mut s = format!("{} {}", self.stripes.len(), self.chunk);
        for st in &self.stripes {
            s.push_str(&format!(" {} {}", st.dev.table_name(), st.offset));
        }
        s
    }
    fn status_params(&self) -> String {
        let mut s = format!("{}", self.stripes.len());
        for st in &self.stripes {
            s.push(' ');
            s.push_str(&st.dev.table_name());
        }
        s.push_str(" 1 ");
        for st in &self.stripes {
            s.push(if st.errors.load(Ordering::Relaxed) > 0 {
                'D'
            } else {
                'A'
            });
        }
        s
    }
    fn devices(&self) -> Vec<&DevRef> {
        self.stripes.iter().map(|s| &s.dev).collect()
    }
    /// A full stripe is the optimal I/O size (stripe_io_hints).
    fn limits(&self) -> Limits {
        Limits {
            io_opt: self.chunk * self.stripes.len() as u64 * crate::io::SECTOR,
            ..Limits::stacked(&self.devices())
        }
    }
    fn flush_bypasses_map(&self) -> bool {
        true
    }
    fn extents(&self, sector: u64, nr: u64, out: &mut Vec<(u64, u32)>) -> Result<(), TargetError> {
        let mut done = 0;
        while done < nr {
            let s = sector + done;
            let n = (self.chunk - s % self.chunk).min(nr - done);
            let (stripe, dev_sector) = self.locate(s);
            dev_extents(&self.stripes[stripe].dev, dev_sector, n, out)?;
            done += n;
        }
        Ok(())
    }
    fn io_error(&self, tag: u16) {
        if let Some(s) = self.stripes.get(tag as usize) {
            s.errors.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::stripe_boundary;

    #[test]
    fn stripe_boundaries_cover_range() {
        // 2 stripes, chunk 8: relative sectors 4..28 are chunk 0 (stripe 0 local 4..8),
        // chunk 1 (stripe 1 local 0..8), chunk 2 (stripe 0 local 8..16) and chunk 3 up to
        // sector 28 (stripe 1 local 8..12).
        let (n, c) = (2, 8);
        assert_eq!(
            (stripe_boundary(4, 0, n, c), stripe_boundary(28, 0, n, c)),
            (4, 16)
        );
        assert_eq!(
            (stripe_boundary(4, 1, n, c), stripe_boundary(28, 1, n, c)),
            (0, 12)
        );
    }
}
