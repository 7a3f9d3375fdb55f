//! `zero`: reads return zeroes, writes and discards are dropped.

use crate::mapper::TargetError;
use crate::io::{LeafKind, Op, SECTOR};
use crate::mapper::{Bio, Limits, MapCtx, MapErr, Target, TargetType};

pub struct Zero;

impl Zero {
    pub fn new(args: &[String]) -> Result<Zero, TargetError> {
        if !args.is_empty() {
            return Err("zero: No arguments required".into());
        }
        Ok(Zero)
    }
}

/// The `zero` target type.
pub const TYPE: TargetType = TargetType {
    name: "zero",
    version: [1, 2, 0],
    new: |args, _, _| Ok(Box::new(Zero::new(args)?)),
    sync: None,
};

impl Target for Zero {
    fn type_name(&self) -> &'static str {
        TYPE.name
    }
    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        match bio.op {
            Op::Read => ctx.complete(bio, LeafKind::ZeroFill),
            // num_flush_bios = 0: nothing to flush. Writes are dropped; zeroing a
            // device that reads as zeroes is already done.
            Op::Flush | Op::Write | Op::Discard | Op::WriteZeroes => ctx.complete(bio, LeafKind::Drop),
        }
        Ok(())
    }
    fn table_params(&self) -> String {
        String::new()
    }
    /// Discards and zeroing are no-ops on a device that reads as zeroes (the
    /// kernel's zero target takes discards since 1.2).
    fn limits(&self) -> Limits {
        Limits {
            discard: true,
            write_zeroes: true,
            ..Limits::NONE
        }
    }
    fn extents(&self, _sector: u64, nr: u64, out: &mut Vec<(u64, u32)>) -> Result<(), TargetError> {
        out.push((nr * SECTOR, 3));
        Ok(())
    }
}
