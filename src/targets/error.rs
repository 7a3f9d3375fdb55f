//! `error [<args>...]`: every read, write and discard fails; flushes succeed. The
//! kernel's error target ignores its arguments (so an error line can replace any
//! table line in place) and has no status function, so `table` prints none.

use super::{Bio, Limits, MapCtx, MapErr, Target};
use crate::io::{errno, LeafKind, Op};

pub struct Error;

impl Target for Error {
    fn type_name(&self) -> &'static str {
        "error"
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
