//! dm-verity's forward error correction: `use_fec_from_device <dev> fec_roots
//! <n> fec_blocks <n> fec_start <n>`, with the kernel's layout (what
//! `veritysetup format --fec-device` writes).
//!
//! FEC covers `fec_blocks` blocks: the data blocks, then the hash device's
//! blocks from the tree's first (blocks past the hash device's tree read as
//! zeroes). With `rsn = 255 - roots` and `rounds = ceil(fec_blocks / rsn)`,
//! codeword `k` (`0 <= k < rounds * block_size`) takes as its message the
//! bytes at offsets `k + i * rounds * block_size` of that space, `i < rsn`
//! (so one byte of each of `rsn` blocks `rounds` apart: a block's bytes lie
//! in different codewords), and its `roots` parity bytes are at byte `k *
//! roots` of the FEC device from block `fec_start`. A block that fails its
//! hash, or whose read failed, is rebuilt from its codewords and hashed again.
//! A block of the codewords that cannot be read is an erasure (its symbols
//! known to be lost, as the kernel's fec_read_bufs marks them): up to `roots`
//! of them are recovered, where unknown wrong symbols stop at roots/2.

use crate::mapper::TargetError;
use super::rs;
use crate::io::BackingFile;
use std::sync::Arc;

/// The kernel's bounds on fec_roots (RS(255, 231) to RS(255, 253)).
const MIN_ROOTS: u32 = 2;
const MAX_ROOTS: u32 = 24;

/// The FEC options as parsed (verity_parse_fec_opt_args).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Args {
    pub dev: Option<String>,
    pub roots: u32,
    pub blocks: u64,
    pub start: u64,
}

impl Args {
    /// Take option `key` with its value; false if `key` is not a FEC option.
    pub fn parse(&mut self, key: &str, value: Option<&String>) -> Result<bool, TargetError> {
        let key = key.to_ascii_lowercase();
        if !matches!(key.as_str(), "use_fec_from_device" | "fec_roots" | "fec_blocks" | "fec_start") {
            return Ok(false);
        }
        let v = value.ok_or_else(|| format!("FEC feature arguments: {key} without its value"))?;
        let num = || v.parse::<u64>().map_err(|_| format!("Invalid {key} '{v}'"));
        match key.as_str() {
            "use_fec_from_device" => self.dev = Some(v.clone()),
            "fec_roots" => {
                self.roots = num()?
                    .try_into()
                    .ok()
                    .filter(|r| (MIN_ROOTS..=MAX_ROOTS).contains(r))
                    .ok_or_else(|| format!("Invalid fec_roots '{v}' ({MIN_ROOTS} to {MAX_ROOTS})"))?
            }
            "fec_blocks" => self.blocks = num()?,
            _ => self.start = num()?,
        }
        Ok(true)
    }

    pub fn enabled(&self) -> bool {
        self.dev.is_some()
    }

    /// The options as the kernel's table prints them (after the others, in
    /// this order), or "".
    pub fn table(&self, dev_name: &str) -> String {
        if self.enabled() {
            format!(
                " use_fec_from_device {dev_name} fec_blocks {} fec_start {} fec_roots {}",
                self.blocks, self.start, self.roots
            )
        } else {
            String::new()
        }
    }
}

/// Where FEC reads, checked against the devices (verity_fec_ctr).
pub struct Fec {
    pub args: Args,
    dev: Arc<BackingFile>,
    data: Arc<BackingFile>,
    hash: Arc<BackingFile>,
    block_bits: u32,
    data_blocks: u64,
    /// Blocks of the hash device FEC covers, from `hash_start`.
    hash_blocks: u64,
    hash_start: u64,
    rsn: u64,
    rounds: u64,
}

/// The devices and geometry FEC needs.
pub struct Setup<'a> {
    pub dev: Arc<BackingFile>,
    pub data: Arc<BackingFile>,
    pub hash: Arc<BackingFile>,
    pub data_bits: u32,
    pub hash_bits: u32,
    pub data_blocks: u64,
    pub hash_start: u64,
    /// One past the tree's last hash block.
    pub tree_end: u64,
    pub hash_dev_blocks: u64,
    pub fec_dev_bytes: u64,
    pub name: &'a str,
}

impl Fec {
    pub fn new(args: Args, s: Setup<'_>) -> Result<Fec, TargetError> {
        if s.data_bits != s.hash_bits {
            return Err("Block sizes must match to use FEC".into());
        }
        if args.roots == 0 {
            return Err("Missing fec_roots".into());
        }
        if args.blocks == 0 {
            return Err("Missing fec_blocks".into());
        }
        let bits = s.data_bits;
        let fits = |n: u64| n.checked_shl(bits).is_some_and(|b| b >> bits == n);
        if !fits(args.blocks) {
            return Err(format!("Invalid fec_blocks '{}'", args.blocks).into());
        }
        if !fits(args.start) {
            return Err(format!("Invalid fec_start '{}'", args.start).into());
        }
        let rsn = u64::from(255 - args.roots);
        let rounds = args.blocks.div_ceil(rsn);
        let tree = s.tree_end - s.hash_start;
        if args.blocks < s.data_blocks.saturating_add(tree) {
            return Err(format!(
                "Invalid fec_blocks '{}' (fewer than the {} data blocks and {tree} hash blocks)",
                args.blocks, s.data_blocks
            ).into());
        }
        let hash_blocks = args.blocks - s.data_blocks;
        if s.hash_dev_blocks < hash_blocks.saturating_add(s.hash_start) {
            return Err(format!(
                "Hash device is too small for fec_blocks ({} blocks from block {}, the device holds {})",
                hash_blocks, s.hash_start, s.hash_dev_blocks
            ).into());
        }
        // parity: rounds * block_size codewords of `roots` bytes
        let need = rounds
            .checked_mul(u64::from(args.roots))
            .and_then(|b| b.checked_add(args.start))
            .and_then(|b| b.checked_shl(bits).filter(|v| v >> bits == b));
        match need {
            Some(n) if n <= s.fec_dev_bytes => {}
            _ => {
                return Err(format!(
                    "FEC device {} is too small: {} bytes, fec_start {} and {rounds} rounds of {} parity blocks \
                     need more",
                    s.name, s.fec_dev_bytes, args.start, args.roots
                ).into())
            }
        }
        Ok(Fec {
            args,
            dev: s.dev,
            data: s.data,
            hash: s.hash,
            block_bits: bits,
            data_blocks: s.data_blocks,
            hash_blocks,
            hash_start: s.hash_start,
            rsn,
            rounds,
        })
    }

    /// FEC's index of hash block `hb`.
    pub fn hash_index(&self, hb: u64) -> u64 {
        self.data_blocks + (hb - self.hash_start)
    }

    /// Block `idx` of the covered space into `buf`.
    fn read_block(&self, idx: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let bs = buf.len() as u64;
        if idx < self.data_blocks {
            return self.data.read_exact_at(buf, idx * bs);
        }
        let h = idx - self.data_blocks;
        if h >= self.hash_blocks {
            buf.fill(0);
            return Ok(());
        }
        self.hash.read_exact_at(buf, (h + self.hash_start) * bs)
    }

    /// Rebuild block `idx` of the covered space (a data block's index, or
    /// [`Fec::hash_index`]) into `out` from its codewords: Err names why not.
    pub fn correct(&self, idx: u64, out: &mut [u8]) -> Result<usize, TargetError> {
        let bs = 1u64 << self.block_bits;
        let span = self.rounds; // blocks between a codeword's symbols
        // the target is symbol `res` of the codewords of round block `rsb`
        let (res, rsb) = (idx / span, idx % span);
        if res >= self.rsn {
            return Err(format!("block {idx} is beyond what FEC covers").into());
        }
        let roots = self.args.roots as usize;
        let n = self.rsn as usize;
        // the rsn blocks of these codewords, one after another; those that
        // cannot be read are erasures (zeroes), at most `roots`
        let mut blocks = vec![0u8; n << self.block_bits];
        let mut eras = Vec::new();
        for (i, b) in blocks.chunks_exact_mut(bs as usize).enumerate() {
            let at = rsb + i as u64 * span;
            if let Err(e) = self.read_block(at, b) {
                if eras.len() == roots {
                    return Err(format!(
                        "reading block {at} for FEC: {e} (more unreadable blocks than the {roots} roots recover)"
                    ).into());
                }
                tracing::warn!("verity FEC: block {at} cannot be read ({e}): an erasure in its codewords");
                b.fill(0);
                eras.push(i);
            }
        }
        let mut par = vec![0u8; roots << self.block_bits];
        let off = (self.args.start << self.block_bits) + rsb * bs * roots as u64;
        self.dev
            .read_exact_at(&mut par, off)
            .map_err(|e| format!("reading {} parity bytes at byte {off} of the FEC device: {e}", par.len()))?;
        let mut fixed = 0;
        let mut cw = [0u8; rs::N];
        for (j, o) in out.iter_mut().enumerate() {
            for (i, c) in cw[..n].iter_mut().enumerate() {
                *c = blocks[(i << self.block_bits) + j];
            }
            cw[n..].copy_from_slice(&par[j * roots..(j + 1) * roots]);
            fixed += rs::decode(&mut cw, roots, &eras).ok_or_else(|| {
                format!("byte {j}: too many errors (with {} unreadable blocks)", eras.len())
            })?;
            *o = cw[res as usize];
        }
        Ok(fixed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 506 data blocks of 512 bytes, two roots: two rounds, so a codeword
    /// group is every other block. Its parity is built here as veritysetup
    /// lays it out; the data file then loses its tail, so its last blocks
    /// fail to read (past the end of the file).
    #[test]
    fn unreadable_blocks_are_erasures_up_to_the_roots() {
        let (bits, roots, blocks) = (9u32, 2u32, 506u64);
        let bs = 1usize << bits;
        let dir = std::env::temp_dir().join(format!("dmkit-fec-eras-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let data = crate::rng::pattern(42, blocks as usize * bs);
        let rsn = 255 - roots as usize;
        let rounds = (blocks as usize).div_ceil(rsn);
        let mut parity = vec![0u8; rounds * bs * roots as usize];
        for rsb in 0..rounds {
            for j in 0..bs {
                let msg: Vec<u8> = (0..rsn)
                    .map(|i| data.get((rsb + i * rounds) * bs + j).copied().unwrap_or(0))
                    .collect();
                let at = (rsb * bs + j) * roots as usize;
                rs::encode(&msg, &mut parity[at..at + roots as usize]);
            }
        }
        let open = |name: &str, bytes: &[u8]| {
            let p = dir.join(name);
            std::fs::write(&p, bytes).unwrap();
            Arc::new(BackingFile::open(&p, true, false).unwrap())
        };
        let fec = |data_bytes: &[u8]| {
            let args = Args {
                dev: Some("fec".into()),
                roots,
                blocks,
                start: 0,
            };
            Fec::new(
                args,
                Setup {
                    dev: open("fec.img", &parity),
                    data: open("data.img", data_bytes),
                    hash: open("hash.img", &[]),
                    data_bits: bits,
                    hash_bits: bits,
                    data_blocks: blocks,
                    hash_start: 0,
                    tree_end: 0,
                    hash_dev_blocks: 0,
                    fec_dev_bytes: parity.len() as u64,
                    name: "fec.img",
                },
            )
            .unwrap()
        };
        let block = |b: usize| &data[b * bs..(b + 1) * bs];
        let mut out = vec![0u8; bs];
        // blocks 502 and 504 unreadable: two erasures in group 0 (more than
        // the one wrong symbol two roots correct), both rebuilt
        let f = fec(&data[..502 * bs]);
        for b in [502, 504, 500] {
            f.correct(b as u64, &mut out).unwrap();
            assert!(out == block(b), "block {b}");
        }
        // group 1 (odd blocks) lost 503 and 505 alike
        f.correct(505, &mut out).unwrap();
        assert!(out == block(505));
        // three in one group: beyond two roots
        let f = fec(&data[..500 * bs]);
        let e = f.correct(504, &mut out).unwrap_err();
        assert!(e.what().contains("more unreadable blocks than the 2 roots"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
