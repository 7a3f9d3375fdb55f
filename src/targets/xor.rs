//! `xor <dev> <offset> <keyhex>`: a toy dm-crypt, for tests of owned buffers.
//! Byte `i` of sector `s` (relative to the target) is stored XORed with
//! `key[i % key.len()] ^ s.to_le_bytes()[i % 8]`. Writes are transformed into a
//! buffer of the target's own on the way down and reads back into the request's
//! data once they are done ([`MapCtx::remap_owned`]), so a request mapped again
//! after a requeue is never transformed twice. No discards or zeroing: the
//! stored bytes of a zeroed range would not read back as zeroes.

use crate::mapper::TargetError;
use crate::io::{errno, LeafKind, Op, SECTOR};
use crate::mapper::{arg_dev, arg_u64, Bio, DevRef, Limits, MapCtx, MapErr, Resolver, Target, TargetType};
use std::sync::Arc;

/// The `xor` target type.
pub const TYPE: TargetType = TargetType {
    name: "xor",
    version: [1, 0, 0],
    new: |args, len, r| Ok(Box::new(Xor::new(args, len, r)?)),
    sync: None,
};

pub struct Xor {
    dev: DevRef,
    offset: u64,
    key: Arc<[u8]>,
}

impl Xor {
    pub fn new(args: &[String], len: u64, r: &dyn Resolver) -> Result<Xor, TargetError> {
        if args.len() != 3 {
            return Err(format!(
                "xor takes 3 arguments (<dev> <offset> <keyhex>), got {}",
                args.len()
            ).into());
        }
        let offset = arg_u64(args, 1, "offset")?;
        let key = parse_key(&args[2])?;
        let dev = arg_dev(args, 0, offset, len, r)?;
        Ok(Xor {
            dev,
            offset,
            key: key.into(),
        })
    }
}

/// 1 to 64 bytes in hex.
fn parse_key(hex: &str) -> Result<Vec<u8>, TargetError> {
    let bad = || format!("invalid key '{hex}': 2 to 128 hex digits");
    if hex.is_empty() || !hex.len().is_multiple_of(2) || hex.len() > 128 {
        return Err(bad().into());
    }
    hex::decode(hex).map_err(|_| TargetError::from(bad()))
}

/// XOR `data` (sectors from `sector` on) with the key stream; `from` and `to` may
/// be the same bytes' source and destination.
fn apply(key: &[u8], sector: u64, from: &[u8], to: &mut [u8]) {
    for (j, (t, f)) in to.iter_mut().zip(from).enumerate() {
        let s = sector + (j as u64) / SECTOR;
        let i = j % SECTOR as usize;
        *t = f ^ key[i % key.len()] ^ s.to_le_bytes()[i % 8];
    }
}

impl Target for Xor {
    fn type_name(&self) -> &'static str {
        TYPE.name
    }
    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let down = bio.shifted(self.offset);
        match bio.op {
            Op::Write => {
                let key = self.key.clone();
                ctx.remap_owned(
                    &self.dev,
                    down,
                    |own, client| apply(&key, bio.sector, client, own),
                    None,
                )
            }
            Op::Read => {
                let key = self.key.clone();
                ctx.remap_owned(
                    &self.dev,
                    down,
                    |_, _| {},
                    Some(Box::new(move |ok, own, client| {
                        if ok {
                            apply(&key, bio.sector, own, client);
                        }
                        0
                    })),
                )
            }
            Op::Flush => ctx.remap(&self.dev, down, 0),
            Op::Discard | Op::WriteZeroes => {
                ctx.complete(bio, LeafKind::Fail(errno::EOPNOTSUPP));
                Ok(())
            }
        }
    }
    fn table_params(&self) -> String {
        let key: String = self.key.iter().map(|b| format!("{b:02x}")).collect();
        format!("{} {} {key}", self.dev.table_name(), self.offset)
    }
    fn devices(&self) -> Vec<&DevRef> {
        vec![&self.dev]
    }
    fn flush_bypasses_map(&self) -> bool {
        true
    }
    fn limits(&self) -> Limits {
        Limits {
            discard: false,
            write_zeroes: false,
            ..Limits::stacked(&self.devices())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_parses_and_xor_undoes_itself() {
        assert_eq!(parse_key("0aff").as_deref(), Ok(&[0x0a, 0xff][..]));
        assert!(parse_key("0").is_err() && parse_key("zz").is_err() && parse_key("").is_err());
        let key = [1u8, 2, 3];
        let data: Vec<u8> = (0..1024u32).map(|i| i as u8).collect();
        let mut enc = vec![0; 1024];
        apply(&key, 7, &data, &mut enc);
        assert_ne!(enc, data);
        assert_eq!(enc[512], data[512] ^ 1 ^ 8);
        let mut dec = vec![0; 1024];
        apply(&key, 7, &enc, &mut dec);
        assert_eq!(dec, data);
    }
}
