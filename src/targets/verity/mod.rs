//! `verity`: dm-verity, read-only block integrity checked against a hash tree,
//! with the kernel's table line, status and on-disk format, so a data and hash
//! device pair made by `veritysetup format` opens in dmkit with the same table
//! the kernel takes.
//!
//! Table: `<version> <data_dev> <hash_dev> <data_block_size> <hash_block_size>
//! <num_data_blocks> <hash_start_block> <algorithm> <digest> <salt>
//! [<#opt_params> <opt_params>]`.
//!
//! - Version 1 hashes `salt || block` and stores each digest in a slot of
//!   the digest size rounded up to a power of two; version 0 (the original
//!   Chrome OS format) hashes `block || salt` and packs the digests.
//! - Algorithms: `sha256`, `sha224`, `sha384`, `sha512` (RustCrypto's `sha2`)
//!   and `sha1` (RustCrypto's `sha1`).
//! - The tree's levels lie on the hash device from `hash_start_block` on, the
//!   top level first; a hash block holds `2^k` digests, `2^k` the largest power
//!   of two with `2^k * digest_size <= hash_block_size`, the rest zeroes.
//! - Options: `ignore_corruption` (a mismatch is logged and counted, the data
//!   served), `restart_on_corruption` and `panic_on_corruption` (userspace
//!   cannot restart or panic the machine: the read fails with EIO, as without
//!   them, and the log says which the table asked for), `restart_on_error` and
//!   `panic_on_error` (likewise: an I/O error fails the read), `ignore_zero_blocks`
//!   (a block whose expected digest is the zero block's reads as zeroes unread),
//!   `check_at_most_once` (a bitmap of verified blocks), `try_verify_in_tasklet`
//!   (accepted and printed back; dmkit verifies where the read completes).
//!   Forward error correction (`use_fec_from_device`, `fec_roots`, `fec_blocks`,
//!   `fec_start`): a block failing its hash is rebuilt from the FEC device's
//!   Reed-Solomon codewords ([`fec`]). Root hash signatures
//!   (`root_hash_sig_key_desc`, a kernel keyring) are refused with one line.
//!
//! The device must be read-only (`dmkit create --readonly`), as the kernel's
//! table must be; writes and discards fail with EIO. A read is remapped to
//! the data device into a buffer of the target's own
//! ([`MapCtx::remap_owned`]); once it completed, each data block is hashed and
//! checked against its digest, which comes from the level-0 hash block, itself
//! checked up the tree to the root digest. Hash blocks are read synchronously
//! from the hash device in that end-of-I/O hook (so the hash device must be a
//! file or block device, not another dmkit device, whose I/O would wait on an
//! engine), and the verified ones are kept in a cache bounded to
//! [`CACHE_BYTES`]: a warm read costs the data block's hash. A mismatch fails
//! the read with EIO (never wrong data) and the status says `C`.
//!
//! A cold sequential read is bound by sha256 over every data byte (RustCrypto's
//! `sha2`, with SHA-NI where the CPU has it: as fast as OpenSSL's SHA-256 here,
//! `examples/verity_hash_speed.rs`). A request's consecutive data blocks take
//! their digests from the level-0 hash block the previous one found, without
//! walking the tree or taking the cache's lock again. A request's blocks are
//! checked on the thread its read completed on: splitting a long request
//! between threads (as the kernel's workqueues spread bios) was measured
//! slower on the 2 shared cores here, the request's thread waiting for a core
//! the client held.

mod fec;
mod rs;
pub mod superblock;

use crate::mapper::TargetError;
use crate::io::{errno, LeafKind, Op, SECTOR};
use crate::mapper::{arg_dev, Bio, DevRef, Limits, MapCtx, MapErr, Resolver, Target, TargetType};
use sha1::Sha1;
use sha2::{Digest, Sha224, Sha256, Sha384, Sha512};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The `verity` target type (Linux 6.12's dm-verity version).
pub const TYPE: TargetType = TargetType {
    name: "verity",
    version: [1, 10, 0],
    new: |args, len, r| Ok(Box::new(Verity::new(args, len, r)?)),
    sync: None,
};

/// Bytes of verified hash blocks kept in memory per target (one block if a
/// hash block is larger).
pub const CACHE_BYTES: usize = 16 << 20;

/// The kernel's limit on tree levels.
const MAX_LEVELS: usize = 63;

/// Corruptions logged before the log goes quiet (the kernel's limit).
const MAX_CORRUPTED_ERRS: u32 = 100;

/// The largest digest (sha512).
const MAX_DIGEST: usize = 64;

/// The largest data block (the kernel's PAGE_SIZE limit).
const MAX_DATA_BLOCK: u32 = 4096;

/// Optional parameters: the most the kernel counts.
const MAX_OPT_ARGS: usize = 15;

/// A hash function, already fed the salt for version 1.
#[derive(Clone)]
enum Alg {
    Sha1(Sha1),
    Sha224(Sha224),
    Sha256(Sha256),
    Sha384(Sha384),
    Sha512(Sha512),
}

impl Alg {
    fn new(name: &str) -> Option<Alg> {
        Some(match name {
            "sha1" => Alg::Sha1(Sha1::new()),
            "sha224" => Alg::Sha224(Sha224::new()),
            "sha256" => Alg::Sha256(Sha256::new()),
            "sha384" => Alg::Sha384(Sha384::new()),
            "sha512" => Alg::Sha512(Sha512::new()),
            _ => return None,
        })
    }

    fn size(&self) -> usize {
        match self {
            Alg::Sha1(_) => 20,
            Alg::Sha224(_) => 28,
            Alg::Sha256(_) => 32,
            Alg::Sha384(_) => 48,
            Alg::Sha512(_) => 64,
        }
    }

    fn update(&mut self, b: &[u8]) {
        match self {
            Alg::Sha1(h) => h.update(b),
            Alg::Sha224(h) => h.update(b),
            Alg::Sha256(h) => h.update(b),
            Alg::Sha384(h) => h.update(b),
            Alg::Sha512(h) => h.update(b),
        }
    }

    /// The digest into the first `size()` bytes of `out`.
    fn finish(self, out: &mut [u8; MAX_DIGEST]) {
        match self {
            Alg::Sha1(h) => out[..20].copy_from_slice(&h.finalize()),
            Alg::Sha224(h) => out[..28].copy_from_slice(&h.finalize()),
            Alg::Sha256(h) => out[..32].copy_from_slice(&h.finalize()),
            Alg::Sha384(h) => out[..48].copy_from_slice(&h.finalize()),
            Alg::Sha512(h) => out[..64].copy_from_slice(&h.finalize()),
        }
    }
}

/// What a corruption does (the kernel's verity mode).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Eio,
    Logging,
    Restart,
    Panic,
}

/// The optional parameters, as the kernel keeps and prints them.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Opts {
    mode: Mode,
    /// On I/O errors: Eio, Restart or Panic.
    error_mode: Mode,
    ignore_zero_blocks: bool,
    check_at_most_once: bool,
    try_verify_in_tasklet: bool,
    fec: fec::Args,
}

/// Parse `<#opt_params> <opt_params>` (verity_parse_opt_args).
fn parse_opts(args: &[String]) -> Result<Opts, TargetError> {
    let mut o = Opts {
        mode: Mode::Eio,
        error_mode: Mode::Eio,
        ignore_zero_blocks: false,
        check_at_most_once: false,
        try_verify_in_tasklet: false,
        fec: fec::Args::default(),
    };
    let Some(count) = args.first() else { return Ok(o) };
    let n = match count.parse::<usize>() {
        Ok(n) if n <= MAX_OPT_ARGS => n,
        _ => return Err(format!("Invalid number of feature args '{count}' (0 to {MAX_OPT_ARGS})").into()),
    };
    let opts = &args[1..];
    if n > opts.len() {
        return Err(format!("Insufficient arguments: {n} feature arguments announced, {} given", opts.len()).into());
    }
    let conflict = |a: &str| format!("Conflicting error handling parameters ('{a}')");
    let mut i = 0;
    while i < n {
        let a = &opts[i];
        i += 1;
        if o.fec.parse(a, opts[..n].get(i))? {
            i += 1;
            continue;
        }
        match a.to_ascii_lowercase().as_str() {
            m @ ("ignore_corruption" | "restart_on_corruption" | "panic_on_corruption") => {
                if o.mode != Mode::Eio {
                    return Err(conflict(a).into());
                }
                o.mode = match m {
                    "ignore_corruption" => Mode::Logging,
                    "restart_on_corruption" => Mode::Restart,
                    _ => Mode::Panic,
                };
            }
            m @ ("restart_on_error" | "panic_on_error") => {
                if o.error_mode != Mode::Eio {
                    return Err(conflict(a).into());
                }
                o.error_mode = if m == "restart_on_error" { Mode::Restart } else { Mode::Panic };
            }
            "ignore_zero_blocks" => o.ignore_zero_blocks = true,
            "check_at_most_once" => o.check_at_most_once = true,
            "try_verify_in_tasklet" => o.try_verify_in_tasklet = true,
            "root_hash_sig_key_desc" => {
                return Err("root hash signatures (root_hash_sig_key_desc) are checked against a kernel \
                            keyring, which dmkit cannot read: open the device without the signature"
                    .into())
            }
            _ => return Err(format!("Unrecognized verity feature request '{a}'").into()),
        }
    }
    Ok(o)
}

impl Opts {
    /// The options as verity_status prints them (with their count first), or
    /// ""; `fec_dev` names the FEC device.
    fn table(&self, fec_dev: &str) -> String {
        let mut v: Vec<&str> = Vec::new();
        match self.mode {
            Mode::Eio => {}
            Mode::Logging => v.push("ignore_corruption"),
            Mode::Restart => v.push("restart_on_corruption"),
            Mode::Panic => v.push("panic_on_corruption"),
        }
        match self.error_mode {
            Mode::Restart => v.push("restart_on_error"),
            Mode::Panic => v.push("panic_on_error"),
            Mode::Eio | Mode::Logging => {}
        }
        for (on, s) in [
            (self.ignore_zero_blocks, "ignore_zero_blocks"),
            (self.check_at_most_once, "check_at_most_once"),
            (self.try_verify_in_tasklet, "try_verify_in_tasklet"),
        ] {
            if on {
                v.push(s);
            }
        }
        let fec = self.fec.table(fec_dev);
        let n = v.len() + if self.fec.enabled() { 8 } else { 0 };
        if n == 0 {
            String::new()
        } else if v.is_empty() {
            format!(" {n}{fec}")
        } else {
            format!(" {n} {}{fec}", v.join(" "))
        }
    }
}

/// Where the tree lies: computed from the table as verity_ctr does.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Geometry {
    version: u32,
    data_bits: u32,
    hash_bits: u32,
    data_blocks: u64,
    hash_start: u64,
    digest_size: usize,
    /// log2 of the digests in a hash block.
    per_block_bits: u32,
    /// The first hash block of each level, level 0 (the data's digests) first.
    level_block: Vec<u64>,
    /// One past the last hash block.
    hash_blocks: u64,
}

impl Geometry {
    fn new(
        version: u32,
        data_bits: u32,
        hash_bits: u32,
        data_blocks: u64,
        hash_start: u64,
        digest_size: usize,
    ) -> Result<Geometry, TargetError> {
        // floor(log2(hash_block_size / digest_size)); Digest size too big was checked
        let per_block_bits = ((1u64 << hash_bits) / digest_size as u64).ilog2();
        let mut levels = 0usize;
        if data_blocks > 0 {
            while (per_block_bits as usize) * levels < 64 && (data_blocks - 1) >> (per_block_bits as usize * levels) != 0 {
                levels += 1;
            }
        }
        if levels > MAX_LEVELS {
            return Err(format!("Too many tree levels ({levels}, at most {MAX_LEVELS})").into());
        }
        let mut level_block = vec![0u64; levels];
        let mut pos = hash_start;
        for i in (0..levels).rev() {
            level_block[i] = pos;
            let shift = (i as u32 + 1) * per_block_bits;
            // blocks of level i: ceil(data_blocks / 2^shift)
            let s = if shift >= 64 {
                1
            } else {
                data_blocks.div_ceil(1u64 << shift)
            };
            pos = pos
                .checked_add(s)
                .ok_or_else(|| format!("Hash device offset overflow (level {i} at hash block {pos})"))?;
        }
        Ok(Geometry {
            version,
            data_bits,
            hash_bits,
            data_blocks,
            hash_start,
            digest_size,
            per_block_bits,
            level_block,
            hash_blocks: pos,
        })
    }

    fn levels(&self) -> usize {
        self.level_block.len()
    }

    /// The hash block holding `block`'s digest at `level`, and the digest's
    /// byte offset in it (verity_hash_at_level).
    fn at_level(&self, block: u64, level: usize) -> (u64, usize) {
        let position = block.checked_shr(level as u32 * self.per_block_bits).unwrap_or(0);
        let hash_block = self.level_block[level] + (position >> self.per_block_bits);
        let idx = (position & ((1u64 << self.per_block_bits) - 1)) as usize;
        let offset = if self.version == 0 {
            idx * self.digest_size
        } else {
            idx << (self.hash_bits - self.per_block_bits)
        };
        (hash_block, offset)
    }
}

/// Verified hash blocks, oldest evicted first.
struct Cache {
    blocks: HashMap<u64, Arc<[u8]>>,
    order: VecDeque<u64>,
    cap: usize,
}

impl Cache {
    fn get(&self, b: u64) -> Option<Arc<[u8]>> {
        self.blocks.get(&b).cloned()
    }

    fn insert(&mut self, b: u64, data: Arc<[u8]>) {
        if self.blocks.insert(b, data).is_none() {
            self.order.push_back(b);
        }
        while self.order.len() > self.cap {
            if let Some(old) = self.order.pop_front() {
                self.blocks.remove(&old);
            }
        }
    }
}

/// A verified level-0 hash block and its number, kept while a request's
/// data blocks are checked ([`Core::want_digest`]).
type Last = Option<(u64, Arc<[u8]>)>;

/// Which kind of block failed its check.
#[derive(Clone, Copy)]
enum Kind {
    Data,
    Metadata,
}

/// The state every read shares.
struct Core {
    geo: Geometry,
    /// Fed the salt already for version 1.
    alg: Alg,
    salt: Vec<u8>,
    root: [u8; MAX_DIGEST],
    zero_digest: Option<[u8; MAX_DIGEST]>,
    opts: Opts,
    hash: Arc<crate::io::BackingFile>,
    hash_name: String,
    data_name: String,
    cache: Mutex<Cache>,
    /// check_at_most_once: a bit per data block of the target, set once verified.
    verified: Vec<AtomicU64>,
    hash_failed: AtomicBool,
    corrupted_errs: AtomicU32,
    fec: Option<fec::Fec>,
}

impl Core {
    /// The digest of `data` (salted as the version says).
    fn digest(&self, data: &[u8], out: &mut [u8; MAX_DIGEST]) {
        let mut h = self.alg.clone();
        h.update(data);
        if self.geo.version == 0 {
            h.update(&self.salt);
        }
        h.finish(out);
    }

    /// Note a corruption (verity_handle_err): true if the read must fail.
    fn corrupted(&self, kind: Kind, block: u64) -> bool {
        self.hash_failed.store(true, Ordering::SeqCst);
        let n = self.corrupted_errs.fetch_add(1, Ordering::SeqCst);
        let what = match kind {
            Kind::Data => "data",
            Kind::Metadata => "metadata",
        };
        if n < MAX_CORRUPTED_ERRS {
            tracing::error!("verity {}: {what} block {block} is corrupted", self.data_name);
            if n + 1 == MAX_CORRUPTED_ERRS {
                tracing::error!("verity {}: reached maximum errors", self.data_name);
            }
        } else {
            self.corrupted_errs.store(MAX_CORRUPTED_ERRS, Ordering::SeqCst);
        }
        match self.opts.mode {
            Mode::Logging => false,
            Mode::Eio => true,
            Mode::Restart | Mode::Panic => {
                if n < MAX_CORRUPTED_ERRS {
                    tracing::error!(
                        "verity {}: the table asks to {} on corruption, which dmkit cannot do: the read fails",
                        self.data_name,
                        if self.opts.mode == Mode::Restart { "restart" } else { "panic" }
                    );
                }
                true
            }
        }
    }

    /// Rebuild data or hash block `block`, which failed its hash, from the
    /// FEC data: the block if it then matches `want` (verity_fec_decode).
    fn fec_correct(&self, kind: Kind, block: u64, want: &[u8; MAX_DIGEST]) -> Option<Vec<u8>> {
        let fec = self.fec.as_ref()?;
        let idx = match kind {
            Kind::Data => block,
            Kind::Metadata => fec.hash_index(block),
        };
        let mut out = vec![0u8; 1 << self.geo.data_bits];
        let ds = self.geo.digest_size;
        let why = match fec.correct(idx, &mut out) {
            Ok(n) => {
                let mut real = [0u8; MAX_DIGEST];
                self.digest(&out, &mut real);
                if real[..ds] == want[..ds] {
                    tracing::warn!("verity {}: FEC {idx}: corrected {n} errors", self.data_name);
                    // the 6.12 kernel's status says C once a block needed
                    // correcting (seen in the guest: tests/verity_oracle.rs)
                    self.hash_failed.store(true, Ordering::SeqCst);
                    return Some(out);
                }
                "the corrected block fails its hash".to_string()
            }
            Err(e) => e.to_string(),
        };
        tracing::error!("verity {}: FEC {idx}: failed to correct: {why}", self.data_name);
        None
    }

    /// Read hash block `b` (not verified).
    fn read_hash_block(&self, b: u64) -> Result<Vec<u8>, i32> {
        let size = 1usize << self.geo.hash_bits;
        let mut buf = vec![0u8; size];
        let off = b.checked_mul(size as u64).ok_or(errno::EIO)?;
        if let Err(e) = self.hash.read_at(&mut buf, off) {
            tracing::error!(
                "verity {}: reading hash block {b} of {}: {e}",
                self.data_name,
                self.hash_name
            );
            return Err(errno::EIO);
        }
        Ok(buf)
    }

    /// The expected digest of data block `block` into `want`, checking the
    /// hash blocks on the way down from the root (verity_hash_for_block).
    /// `last` is the level-0 hash block the request's previous data block
    /// found (verified): a sequential read takes the next digests from it
    /// without walking the tree or taking the cache's lock again.
    fn want_digest(&self, block: u64, want: &mut [u8; MAX_DIGEST], last: &mut Last) -> Result<(), i32> {
        let ds = self.geo.digest_size;
        let levels = self.geo.levels();
        if levels > 0 {
            let (hb, off) = self.geo.at_level(block, 0);
            if let Some((b, d)) = last.as_ref().filter(|(b, _)| *b == hb) {
                let slot = d.get(off..off + ds).ok_or_else(|| {
                    tracing::error!("verity {}: hash block {b} is shorter than its digest {off}", self.data_name);
                    errno::EIO
                })?;
                want[..ds].copy_from_slice(slot);
                return Ok(());
            }
        }
        *want = self.root;
        for level in (0..levels).rev() {
            let (hb, off) = self.geo.at_level(block, level);
            let cached = self.cache.lock().map_err(|_| errno::EIO)?.get(hb);
            let (data, verified) = match cached {
                Some(d) => (d, true),
                None => {
                    let raw = self.read_hash_block(hb)?;
                    let mut real = [0u8; MAX_DIGEST];
                    self.digest(&raw, &mut real);
                    let (d, keep) = if real[..ds] == want[..ds] {
                        (raw, true)
                    } else {
                        match self.fec_correct(Kind::Metadata, hb, want) {
                            Some(fixed) => (fixed, true),
                            None if self.corrupted(Kind::Metadata, hb) => return Err(errno::EIO),
                            // ignore_corruption: used as read, not kept
                            None => (raw, false),
                        }
                    };
                    let d: Arc<[u8]> = d.into();
                    if keep {
                        self.cache.lock().map_err(|_| errno::EIO)?.insert(hb, d.clone());
                    }
                    (d, keep)
                }
            };
            let slot = data.get(off..off + ds).ok_or(errno::EIO)?;
            want[..ds].copy_from_slice(slot);
            if level == 0 && verified {
                *last = Some((hb, data));
            }
        }
        Ok(())
    }

    /// Check a request's data blocks, from data block `first`, as read into
    /// `own`, serving them into `client`; 0 or the errno that fails the read.
    fn verify_request(&self, first: u64, own: &[u8], client: &mut [u8]) -> i32 {
        let bs = 1usize << self.geo.data_bits;
        let mut last = None;
        for (i, (o, c)) in own.chunks_exact(bs).zip(client.chunks_exact_mut(bs)).enumerate() {
            if let Err(e) = self.verify(first + i as u64, o, c, &mut last) {
                return e;
            }
        }
        0
    }

    fn is_verified(&self, block: u64) -> bool {
        let i = (block / 64) as usize;
        self.verified
            .get(i)
            .is_some_and(|w| w.load(Ordering::Relaxed) & (1 << (block % 64)) != 0)
    }

    fn set_verified(&self, block: u64) {
        if let Some(w) = self.verified.get((block / 64) as usize) {
            w.fetch_or(1 << (block % 64), Ordering::Relaxed);
        }
    }

    /// Check data block `block` as read into `own`; the data served goes to
    /// `out` (zeroes for an expected zero block). Err(errno) fails the read.
    fn verify(&self, block: u64, own: &[u8], out: &mut [u8], last: &mut Last) -> Result<(), i32> {
        if self.is_verified(block) {
            out.copy_from_slice(own);
            return Ok(());
        }
        let ds = self.geo.digest_size;
        let mut want = [0u8; MAX_DIGEST];
        self.want_digest(block, &mut want, last)?;
        if let Some(z) = &self.zero_digest {
            if z[..ds] == want[..ds] {
                out.fill(0);
                return Ok(());
            }
        }
        let mut real = [0u8; MAX_DIGEST];
        self.digest(own, &mut real);
        if real[..ds] != want[..ds] {
            if let Some(fixed) = self.fec_correct(Kind::Data, block, &want) {
                out.copy_from_slice(&fixed);
                return Ok(());
            }
            if self.corrupted(Kind::Data, block) {
                return Err(errno::EIO);
            }
        } else if self.opts.check_at_most_once {
            self.set_verified(block);
        }
        out.copy_from_slice(own);
        Ok(())
    }
}

pub struct Verity {
    core: Arc<Core>,
    data: DevRef,
    hash_dev: DevRef,
    fec_dev: Option<DevRef>,
    alg_name: String,
}

/// Parse a block size field: a power of two from the device's logical block
/// size to `max`.
fn block_size(v: &str, lbs: u32, max: u32, what: &str) -> Result<u32, TargetError> {
    match v.parse::<u32>() {
        Ok(n) if n.is_power_of_two() && n >= lbs.max(512) && n <= max => Ok(n),
        _ => Err(format!(
            "Invalid {what} device block size '{v}' (a power of two from {} to {max})",
            lbs.max(512)
        ).into()),
    }
}

/// A device the target reads synchronously (hash, data for FEC, FEC): a file
/// or block device, not a dmkit device.
fn file_of(d: &DevRef, what: &str, name: &str) -> Result<Arc<crate::io::BackingFile>, TargetError> {
    match d {
        DevRef::File(f) => Ok(f.clone()),
        DevRef::Dm(_) => Err(format!(
            "{what} device '{name}' is a dmkit device: dmkit reads it synchronously, \
             so it must be a file or block device"
        ).into()),
    }
}

/// The table's root digest (`ds` bytes of algorithm `args[7]`, in hex) and
/// salt (hex, or `-` for none).
fn root_and_salt(args: &[String], ds: usize) -> Result<(Vec<u8>, Vec<u8>), TargetError> {
    let root = hex::decode(&args[8]).ok().filter(|d| d.len() == ds).ok_or_else(|| {
        format!(
            "Invalid root digest '{}' ({} hex digits for {})",
            args[8],
            ds * 2,
            args[7]
        )
    })?;
    let salt = if args[9] == "-" {
        Vec::new()
    } else {
        hex::decode(&args[9]).ok().ok_or_else(|| format!("Invalid salt '{}' (hex digits in pairs, or -)", args[9]))?
    };
    Ok((root, salt))
}

/// With `check_at_most_once`, a bit for each of the target's `blocks`, set once
/// the block has verified; else none.
fn verified_bits(at_most_once: bool, data_blocks: u64, blocks: u64) -> Result<Vec<AtomicU64>, TargetError> {
    if !at_most_once {
        return Ok(Vec::new());
    }
    if data_blocks > i32::MAX as u64 {
        return Err("device too large to use check_at_most_once".into());
    }
    Ok((0..blocks.div_ceil(64)).map(|_| AtomicU64::new(0)).collect())
}

/// A count of blocks of 2^`bits` bytes whose sectors fit in 64 bits.
fn parse_blocks(s: &str, bits: u32, what: &str) -> Result<u64, TargetError> {
    s.parse::<u64>()
        .ok()
        .filter(|n| n.checked_shl(bits - 9).is_some_and(|v| v >> (bits - 9) == *n))
        .ok_or_else(|| TargetError::from(format!("Invalid {what} '{s}'")))
}

/// The FEC device the options name (`use_fec_from_device`) and its decoder
/// over the data device (`data`: it and its name) and the hash device.
fn open_fec(
    r: &dyn Resolver,
    args: &fec::Args,
    (data, data_name): (&DevRef, &str),
    hash: &Arc<crate::io::BackingFile>,
    geo: &Geometry,
    hash_dev_blocks: u64,
) -> Result<(Option<fec::Fec>, Option<DevRef>), TargetError> {
    let Some(name) = args.dev.clone() else {
        if *args != fec::Args::default() {
            return Err("FEC feature arguments (fec_roots, fec_blocks, fec_start) without use_fec_from_device".into());
        }
        return Ok((None, None));
    };
    let dev = r
        .open(&name)
        .map_err(|e| format!("FEC device lookup failed: device '{name}': {e}"))?;
    let f = fec::Fec::new(
        args.clone(),
        fec::Setup {
            dev: file_of(&dev, "FEC", &name)?,
            data: file_of(data, "Data", data_name)?,
            hash: hash.clone(),
            data_bits: geo.data_bits,
            hash_bits: geo.hash_bits,
            data_blocks: geo.data_blocks,
            hash_start: geo.hash_start,
            tree_end: geo.hash_blocks,
            hash_dev_blocks,
            fec_dev_bytes: dev.size_sectors().saturating_mul(SECTOR),
            name: &name,
        },
    )?;
    Ok((Some(f), Some(dev)))
}

impl Verity {
    pub fn new(args: &[String], len: u64, r: &dyn Resolver) -> Result<Verity, TargetError> {
        if !r.read_only() {
            return Err("Device must be readonly (create it with --readonly, load it with --readonly)".into());
        }
        if args.len() < 10 {
            return Err(format!(
                "Not enough arguments: verity takes <version> <data_dev> <hash_dev> <data_block_size> \
                 <hash_block_size> <num_data_blocks> <hash_start_block> <algorithm> <digest> <salt> \
                 [<#opt_params> <opt_params>], got {}",
                args.len()
            ).into());
        }
        let opts = parse_opts(&args[10..])?;
        let version = match args[0].parse::<u32>() {
            Ok(v @ (0 | 1)) => v,
            _ => return Err(format!("Invalid version '{}' (0 or 1)", args[0]).into()),
        };
        let data = arg_dev(args, 1, 0, len, r).map_err(|e| format!("Data device lookup failed: {e}"))?;
        let hash_dev = r
            .open(&args[2])
            .map_err(|e| format!("Hash device lookup failed: device '{}': {e}", args[2]))?;
        let hash = file_of(&hash_dev, "Hash", &args[2])?;
        let dbs = block_size(&args[3], data.logical_block_size(), MAX_DATA_BLOCK, "data")?;
        let hbs = block_size(&args[4], hash_dev.logical_block_size(), i32::MAX as u32, "hash")?;
        let (data_bits, hash_bits) = (dbs.trailing_zeros(), hbs.trailing_zeros());
        let data_blocks = parse_blocks(&args[5], data_bits, "data blocks")?;
        if len > data_blocks << (data_bits - 9) {
            return Err(format!(
                "Data device is too small: the target's {len} sectors exceed {data_blocks} data blocks of {dbs} bytes"
            ).into());
        }
        let hash_start = parse_blocks(&args[6], hash_bits, "hash start")?;
        let mut alg = Alg::new(&args[7]).ok_or_else(|| {
            format!(
                "Cannot initialize hash function '{}': dmkit supports sha256, sha1, sha224, sha384, sha512",
                args[7]
            )
        })?;
        let ds = alg.size();
        if (hbs as usize) < ds * 2 {
            return Err(format!(
                "Digest size too big: {} digests are {ds} bytes, a {hbs}-byte hash block holds fewer than two",
                args[7]
            ).into());
        }
        let (root, salt) = root_and_salt(args, ds)?;
        let geo = Geometry::new(version, data_bits, hash_bits, data_blocks, hash_start, ds)?;
        let hash_dev_blocks = hash_dev.size_sectors() >> (hash_bits - 9);
        if hash_dev_blocks < geo.hash_blocks {
            return Err(format!(
                "Hash device is too small: the tree ends at hash block {} of {hbs} bytes, the device holds {hash_dev_blocks}",
                geo.hash_blocks
            ).into());
        }
        let (fec, fec_dev) = open_fec(r, &opts.fec, (&data, &args[1]), &hash, &geo, hash_dev_blocks)?;
        if version == 1 {
            alg.update(&salt);
        }
        let mut root_d = [0u8; MAX_DIGEST];
        root_d[..ds].copy_from_slice(&root);
        // blocks the target can read: bounded by the data device (arg_dev checked len)
        let target_blocks = len.div_ceil(u64::from(dbs) / SECTOR).min(data_blocks);
        let verified = verified_bits(opts.check_at_most_once, data_blocks, target_blocks)?;
        let mut core = Core {
            geo,
            alg,
            salt,
            root: root_d,
            zero_digest: None,
            opts,
            hash,
            hash_name: args[2].clone(),
            data_name: args[1].clone(),
            cache: Mutex::new(Cache {
                blocks: HashMap::new(),
                order: VecDeque::new(),
                // one block at least (a hash block larger than the cache)
                cap: (CACHE_BYTES >> hash_bits).max(1),
            }),
            verified,
            hash_failed: AtomicBool::new(false),
            corrupted_errs: AtomicU32::new(0),
            fec,
        };
        if core.opts.ignore_zero_blocks {
            let mut z = [0u8; MAX_DIGEST];
            core.digest(&[0u8; MAX_DATA_BLOCK as usize][..dbs as usize], &mut z);
            core.zero_digest = Some(z);
        }
        Ok(Verity {
            core: Arc::new(core),
            data,
            hash_dev,
            fec_dev,
            alg_name: args[7].clone(),
        })
    }
}

impl Target for Verity {
    fn type_name(&self) -> &'static str {
        TYPE.name
    }

    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let geo = &self.core.geo;
        let spb = 1u64 << (geo.data_bits - 9);
        match bio.op {
            Op::Flush => return ctx.remap(&self.data, Bio { sector: 0, ..bio }, 0),
            Op::Read => {}
            Op::Write | Op::Discard | Op::WriteZeroes => {
                ctx.complete(bio, LeafKind::Fail(errno::EIO));
                return Ok(());
            }
        }
        let aligned = bio.sector.is_multiple_of(spb) && bio.nr_sectors.is_multiple_of(spb);
        let in_range = (bio.sector + bio.nr_sectors) / spb <= geo.data_blocks;
        if !aligned || !in_range {
            tracing::error!(
                "verity {}: {} I/O at sector {} (+{})",
                self.core.data_name,
                if aligned { "out of range" } else { "unaligned" },
                bio.sector,
                bio.nr_sectors
            );
            ctx.complete(bio, LeafKind::Fail(errno::EIO));
            return Ok(());
        }
        let core = self.core.clone();
        ctx.remap_owned(
            &self.data,
            bio,
            |_, _| {},
            Some(Box::new(move |ok, own, client| {
                if !ok {
                    if core.opts.error_mode != Mode::Eio {
                        tracing::error!(
                            "verity {}: read error at sector {}: the table asks to {} on errors, which dmkit \
                             cannot do: the read fails",
                            core.data_name,
                            bio.sector,
                            if core.opts.error_mode == Mode::Restart { "restart" } else { "panic" }
                        );
                    }
                    return 0;
                }
                if own.len() != client.len() {
                    return errno::EIO;
                }
                core.verify_request(bio.sector / spb, own, client)
            })),
        )
    }

    fn table_params(&self) -> String {
        let g = &self.core.geo;
        let salt = if self.core.salt.is_empty() {
            "-".to_string()
        } else {
            hex::encode(&self.core.salt)
        };
        format!(
            "{} {} {} {} {} {} {} {} {} {salt}{}",
            g.version,
            self.data.table_name(),
            self.hash_dev.table_name(),
            1u32 << g.data_bits,
            1u32 << g.hash_bits,
            g.data_blocks,
            g.hash_start,
            self.alg_name,
            hex::encode(&self.core.root[..g.digest_size]),
            self.core.opts.table(&self.fec_dev.as_ref().map_or(String::new(), |d| d.table_name()))
        )
    }

    fn status_params(&self) -> String {
        if self.core.hash_failed.load(Ordering::SeqCst) {
            "C".into()
        } else {
            "V".into()
        }
    }

    fn devices(&self) -> Vec<&DevRef> {
        vec![&self.data]
    }

    fn held_devices(&self) -> Vec<&DevRef> {
        let mut v = vec![&self.data, &self.hash_dev];
        v.extend(&self.fec_dev);
        v
    }

    fn flush_bypasses_map(&self) -> bool {
        true
    }

    fn logical_block_size(&self) -> u32 {
        1 << self.core.geo.data_bits
    }

    fn limits(&self) -> Limits {
        let below = Limits::stacked(&self.devices());
        Limits {
            discard: false,
            write_zeroes: false,
            read_only: true,
            io_min: below.io_min.max(1 << self.core.geo.data_bits),
            ..below
        }
    }

    fn postsuspend(&self) {
        // the kernel drops its buffers at suspend: a hash device changed while
        // suspended is read again
        if let Ok(mut c) = self.core.cache.lock() {
            c.blocks.clear();
            c.order.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_and_offsets_are_the_kernels() {
        // 1024 blocks, sha256 in 4096-byte hash blocks: 128 digests a block,
        // two levels: 1 top block, then 8 level-0 blocks, from hash block 1
        let g = Geometry::new(1, 12, 12, 1024, 1, 32).expect("geometry");
        assert_eq!(g.per_block_bits, 7);
        assert_eq!(g.level_block, vec![2, 1]);
        assert_eq!(g.hash_blocks, 10);
        assert_eq!(g.at_level(0, 0), (2, 0));
        assert_eq!(g.at_level(129, 0), (3, 32));
        assert_eq!(g.at_level(129, 1), (1, 32));
        // sha224 in version 1 takes 32-byte slots; version 0 packs 28 bytes
        let g1 = Geometry::new(1, 12, 12, 1024, 0, 28).expect("geometry");
        assert_eq!(g1.at_level(3, 0).1, 96);
        let g0 = Geometry::new(0, 12, 12, 1024, 0, 28).expect("geometry");
        assert_eq!(g0.at_level(3, 0).1, 84);
        // one block: no tree, the root is the block's digest
        assert_eq!(Geometry::new(1, 12, 12, 1, 0, 32).expect("geometry").levels(), 0);
        // 128 blocks fit one hash block: one level
        assert_eq!(Geometry::new(1, 12, 12, 128, 0, 32).expect("geometry").levels(), 1);
        assert_eq!(Geometry::new(1, 12, 12, 129, 0, 32).expect("geometry").levels(), 2);
        // the largest count still fits 64 bits of tree
        let big = Geometry::new(1, 12, 9, u64::MAX >> 3, 0, 64).expect("geometry");
        assert!(big.levels() <= MAX_LEVELS);
        assert!(Geometry::new(1, 12, 12, u64::MAX >> 3, u64::MAX - 1, 32).is_err(), "offset overflow");
    }

    #[test]
    fn options_parse_and_print_as_the_kernels() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let o = parse_opts(&s(&["3", "check_at_most_once", "ignore_corruption", "ignore_zero_blocks"])).expect("opts");
        assert_eq!(o.table(""), " 3 ignore_corruption ignore_zero_blocks check_at_most_once");
        let o = parse_opts(&s(&["2", "restart_on_error", "PANIC_ON_CORRUPTION"])).expect("opts");
        assert_eq!(o.table(""), " 2 panic_on_corruption restart_on_error");
        assert_eq!(parse_opts(&[]).expect("none").table(""), "");
        assert!(parse_opts(&s(&["2", "ignore_corruption", "restart_on_corruption"]))
            .unwrap_err()
            .what().contains("Conflicting"));
        assert_eq!(
            parse_opts(&s(&["2", "fec_roots", "99"])).unwrap_err(),
            "Invalid fec_roots '99' (2 to 24)".into()
        );
        assert_eq!(
            parse_opts(&s(&["1", "fec_start"])).unwrap_err(),
            "FEC feature arguments: fec_start without its value".into()
        );
        let o = parse_opts(&s(&[
            "9",
            "use_fec_from_device",
            "f.img",
            "fec_roots",
            "2",
            "ignore_zero_blocks",
            "fec_blocks",
            "1033",
            "fec_start",
            "0",
        ]))
        .expect("fec opts");
        assert_eq!(
            o.table("7:2"),
            " 9 ignore_zero_blocks use_fec_from_device 7:2 fec_blocks 1033 fec_start 0 fec_roots 2"
        );
        assert!(parse_opts(&s(&["1", "bogus"])).unwrap_err().what().contains("Unrecognized"));
        assert!(parse_opts(&s(&["3", "bogus"])).unwrap_err().what().contains("Insufficient"));
        assert!(parse_opts(&s(&["x"])).unwrap_err().what().contains("Invalid number"));
    }
}
