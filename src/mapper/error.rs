//! `error [<args>...]`: every read, write and discard fails; flushes succeed. The
//! kernel's error target ignores its arguments (so an error line can replace any
//! table line in place) and has no status function, so `table` prints none.

use super::{Bio, Limits, MapCtx, MapErr, Target, TargetType};
use crate::io::{errno, LeafKind, Op};

/// The `error` target type: built into the core, as the kernel's is.
pub const TYPE: TargetType = TargetType {
    name: "error",
    version: [1, 7, 0],
    // The kernel's error target ignores its arguments.
    new: |_, _, _| Ok(Box::new(Error)),
    sync: None,
};

pub struct Error;

impl Target for Error {
    fn type_name(&self) -> &'static str {
        TYPE.name
    }
    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        if bio.op == Op::Flush {
            ctx.complete(bio, LeafKind::Drop);
        } else {
            ctx.complete(bio, LeafKind::Fail(errno::EIO));
        }
        Ok(())
    }
    fn table_params(&self) -> String {
        String::new()
    }
    /// Discards are taken (and fail), as io_err_io_hints advertises them.
    fn limits(&self) -> Limits {
        Limits {
            discard: true,
            ..Limits::NONE
        }
    }
}
