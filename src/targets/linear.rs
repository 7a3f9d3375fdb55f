//! `linear <dev> <offset>`: a contiguous range of another device.

use crate::mapper::TargetError;
use crate::mapper::{
    arg_dev, arg_u64, dev_extents, Bio, DevRef, MapCtx, MapErr, Resolver, TagProfile, Target, TargetType,
};

pub struct Linear {
    dev: DevRef,
    offset: u64,
}

impl Linear {
    pub fn new(args: &[String], len: u64, r: &dyn Resolver) -> Result<Linear, TargetError> {
        if args.len() != 2 {
            return Err(format!(
                "linear takes 2 arguments (<dev> <offset>), got {}",
                args.len()
            ).into());
        }
        let offset = arg_u64(args, 1, "offset")?;
        let dev = arg_dev(args, 0, offset, len, r)?;
        Ok(Linear { dev, offset })
    }
}

/// The `linear` target type.
pub const TYPE: TargetType = TargetType {
    name: "linear",
    version: [1, 4, 0],
    new: |args, len, r| Ok(Box::new(Linear::new(args, len, r)?)),
    sync: None,
};

impl Target for Linear {
    fn type_name(&self) -> &'static str {
        TYPE.name
    }
    #[inline]
    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        ctx.remap(&self.dev, bio.shifted(self.offset), 0)
    }
    fn table_params(&self) -> String {
        format!("{} {}", self.dev.table_name(), self.offset)
    }
    fn devices(&self) -> Vec<&DevRef> {
        vec![&self.dev]
    }
    fn flush_bypasses_map(&self) -> bool {
        true
    }
    fn extents(&self, sector: u64, nr: u64, out: &mut Vec<(u64, u32)>) -> Result<(), TargetError> {
        dev_extents(&self.dev, self.offset + sector, nr, out)
    }
    /// A bio passes whole, its tags with it.
    fn tag_profile(&self) -> Option<TagProfile> {
        self.dev.tag_profile()
    }
}
