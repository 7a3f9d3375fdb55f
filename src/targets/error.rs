//! `error [<dev> <offset>]`: every read, write and discard fails; flushes succeed.

use super::{Bio, DevRef, MapCtx, MapErr, Resolver, Target};
use crate::io::{errno, LeafKind, Op};

pub struct Error {
    /// The optional device only lends its limits; I/O never reaches it.
    dev: Option<(DevRef, u64)>,
}

impl Error {
    pub fn new(args: &[String], r: &dyn Resolver) -> Result<Error, String> {
        match args.len() {
            0 => Ok(Error { dev: None }),
            2 => {
                let off = super::arg_u64(args, 1, "offset")?;
                let dev = r
                    .open(&args[0])
                    .map_err(|e| format!("device '{}': {e}", args[0]))?;
                Ok(Error {
                    dev: Some((dev, off)),
                })
            }
            n => Err(format!("error takes 0 or 2 arguments, got {n}")),
        }
    }
}

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
    fn devices(&self) -> Vec<&DevRef> {
        self.dev.iter().map(|(d, _)| d).collect()
    }
}
