//! `crypt`: dm-crypt, with the kernel's table line, messages and on-disk
//! result, so a device encrypted by the kernel's dm-crypt (or by cryptsetup,
//! which drives it) reads back through dmkit and the other way round.
//!
//! Table: `<cipher> <key> <iv_offset> <device> <offset> [<#opt_params> <opt_params>]`.
//!
//! - Ciphers: `aes-xts-*` (two AES-128, -192 or -256 keys: a 256-, 384- or
//!   512-bit key), `aes-cbc-*` (AES-128/192/256), `cipher_null-ecb` (key `-`),
//!   in the legacy spelling or the crypto API one (`capi:xts(aes)-plain64`,
//!   `capi:cbc(aes)-essiv:sha256`, `capi:ecb(cipher_null)`).
//! - IV modes: `plain` (the sector number's low 32 bits, little-endian),
//!   `plain64` (64 bits little-endian), `plain64be` (64 bits big-endian in the
//!   IV's last 8 bytes), `essiv:sha256` (the `plain64` IV encrypted with AES-256
//!   keyed by sha256 of the whole volume key), `null` (zero), `random` (kept in
//!   the sector's integrity tag). The sector number
//!   is the target's sector plus `iv_offset`, in 512-byte units; with
//!   `iv_large_sectors`, in units of `sector_size`.
//! - Options: `sector_size:<512..4096>` (the unit encrypted with one IV; I/O
//!   must be aligned to it, and it is the device's logical block size),
//!   `iv_large_sectors`, `allow_discards` (discards pass to the device;
//!   without it they fail), and the kernel's workqueue options
//!   (`same_cpu_crypt`, `high_priority`, `submit_from_crypt_cpus`,
//!   `no_read_workqueue`, `no_write_workqueue`), accepted and printed back.
//!   `integrity:<bytes>:<aead|none>` with `capi:authenc(hmac(sha256),...)`
//!   ciphers or `random` IVs: the tags live on the integrity device below
//!   ([`aead`]).
//! - Keys are given in hex. A key in a kernel keyring (`:<size>:logon:<desc>`)
//!   is refused: userspace cannot read it (cryptsetup `--disable-keyring` puts
//!   the key in the table instead).
//! - Messages `key wipe` and `key set <hex>`, only while suspended; a device
//!   whose key was wiped does not resume until a key is set (the kernel's
//!   "aborting resume - crypt key is not set").
//!
//! Writes are encrypted into a buffer of the target's own
//! ([`MapCtx::remap_owned`]); reads are decrypted into the request's data once
//! the device's read completed, so a requeued request is never transformed
//! twice. Write-zeroes fails (EOPNOTSUPP): zeroed sectors would not decrypt to
//! zeroes, and a range can be too large to encrypt zeroes for.
//!
//! The key and the `aes` crate's key schedules live in one page-aligned
//! allocation of their own, locked in memory (`mlock`: never swapped out) and
//! zeroed when dropped (the `aes` crate's `zeroize` feature wipes its key
//! schedules; the raw key is wiped with `zeroize`). Neither is ever logged.
//! Short-lived copies made while a key is parsed and expanded on the stack are
//! not locked.
//!
//! The exception, chosen for speed: XTS (any of its keys) runs on OpenSSL's
//! AES ([`OsslXts`]): OpenSSL's own `aes-128-xts` / `aes-256-xts` for sectors
//! of 2 KiB and more, and XTS over OpenSSL's `aes-*-ecb` for smaller ones,
//! many sectors a call (OpenSSL 3.0's per-sector IV set-up costs as much as
//! a 512-byte sector's cipher); OpenSSL's assembly is what the goal
//! is measured against, and the `aes` crate called a batch at a time reached
//! 0.64× of it. OpenSSL
//! expands the key into its cipher contexts, which it allocates in its own
//! heap (`OPENSSL_zalloc`, not the secure heap: `CRYPTO_secure_malloc_init`
//! would not cover them) and wipes when they are freed (`OPENSSL_clear_free`
//! in the provider's `freectx`). So those key schedules are wiped on `key
//! wipe`, `key set`, remove and exit (the contexts are freed with the
//! [`Keys`] that own them; the tweaks computed beside them are wiped with
//! them), and they are locked because the first such key
//! locks all of the daemon's memory (`mlockall`, each page when first touched,
//! as dmeventd and multipathd lock theirs; [`memory_locked`]). Where that is
//! not allowed (an unprivileged daemon's locked-memory limit), XTS stays with
//! the `aes` crate, whose schedules are in locked pages.
//! CBC and LUKS keyslots stay with the `aes` crate, locked.
//!
//! [`luks`] reads LUKS1 and LUKS2 headers and gives the table line that opens
//! a volume (`dmkit luks table`), unlocking its keyslots with these ciphers;
//! the key material it handles lives in [`LockedBytes`], locked and wiped as
//! the keys here are.
//!
//! Crates: `aes` (RustCrypto's AES, using AES-NI when the CPU has it; its
//! many-block calls pipeline eight blocks at once), `cbc` (RustCrypto's CBC
//! mode, borrowing the expanded key so no sector re-expands it), `sha2` (the
//! ESSIV salt), `zeroize` (wiping key bytes so the compiler cannot elide it).
//! `openssl` (and `openssl-sys`, to set a context's IV per sector without the
//! crate's per-call IV-length query) for the XTS above. The `aes` crate's XTS
//! is the few lines of `xts_sector` over its many-block calls: the
//! `xts-mode` crate encrypts one block at a time (200 MiB/s through NBD here
//! against 4 times that), so it serves as the reference the unit tests check
//! both XTS paths against, beside the IEEE 1619 vectors.

use crate::mapper::TargetError;
use crate::io::{errno, LeafKind, Op, SECTOR};
use crate::mapper::{arg_dev, Bio, DevRef, Limits, MapCtx, MapErr, Resolver, TagProfile, Target, TargetType};
use aes::cipher::array::Array;
use aes::cipher::consts::U16;
use aes::cipher::{BlockCipherDecrypt, BlockCipherEncrypt, BlockModeDecrypt, BlockModeEncrypt, BlockSizeUser};
use aes::cipher::typenum::Unsigned;
use aes::cipher::{BlockCipherDecBackend, BlockCipherDecClosure, BlockCipherEncBackend, BlockCipherEncClosure};
use aes::cipher::{InnerIvInit, KeyInit};
use aes::{Aes128, Aes192, Aes256};
use arc_swap::ArcSwapOption;
use sha2::{Digest, Sha256};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use zeroize::{Zeroize, Zeroizing};

mod aead;
pub mod luks;

/// The `crypt` target type (Linux 6.12's dm-crypt version).
pub const TYPE: TargetType = TargetType {
    name: "crypt",
    version: [1, 28, 0],
    new: |args, len, r| Ok(Box::new(Crypt::new(args, len, r)?)),
    sync: None,
};

/// The longest key any supported cipher takes (XTS with two AES-256 keys).
const MAX_CIPHER_KEY: usize = 64;
/// The longest key a table gives: a cipher's, and an HMAC-SHA-256 key after
/// it (dm-crypt's AEAD).
const MAX_KEY: usize = MAX_CIPHER_KEY + 32;

/// Why a key in a kernel keyring is refused (the kernel would read the keyring).
const KEYRING: &str = "the key is a kernel keyring reference, which userspace cannot read: \
                       open the device with cryptsetup --disable-keyring so the key is passed in the table";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Chain {
    Xts,
    Cbc,
    /// Only with cipher_null: no IV.
    NullEcb,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum IvMode {
    Plain,
    Plain64,
    Plain64Be,
    Essiv,
    Null,
    /// Random bytes for each sector written, kept in its integrity tag.
    Random,
}

/// A parsed cipher specification.
#[derive(Debug, PartialEq, Eq)]
struct Spec {
    chain: Chain,
    /// None for ciphers without an IV (cipher_null).
    iv: Option<IvMode>,
    /// `capi:authenc(<mac>,<cipher>)`: the MAC of the AEAD.
    auth: Option<aead::Auth>,
}

/// A cipher spelling's chain mode, IV mode, IV options and MAC.
type CipherParts<'a> = (Chain, Option<&'a str>, Option<&'a str>, Option<aead::Auth>);

/// The parts of a crypto API spelling, `capi:<api>-<ivmode>[:<ivopts>]`
/// (`rest` after `capi:`, `s` the whole for errors): chain, IV mode, IV
/// options, and the MAC of an `authenc(...)` API.
fn parse_capi<'a>(s: &str, rest: &'a str) -> Result<CipherParts<'a>, TargetError> {
    // capi:<api>-<ivmode>:<ivopts>; the options may hold '-' (a hash name)
    let (rest, ivopts) = match rest.rsplit_once(':') {
        Some((r, o)) => (r, Some(o)),
        None => (rest, None),
    };
    let (api, ivmode) = match rest.rsplit_once('-') {
        Some((a, m)) => (a, Some(m)),
        None => (rest, None),
    };
    let (auth, api) = match aead::split_authenc(api) {
        Some(Ok((a, c))) => (Some(a), c),
        Some(Err(e)) => return Err(e.into()),
        None => (None, api),
    };
    let chain = match api {
        "xts(aes)" => Chain::Xts,
        "cbc(aes)" => Chain::Cbc,
        "ecb(cipher_null)" => Chain::NullEcb,
        _ => return Err(unsupported_cipher(s).into()),
    };
    Ok((chain, ivmode, ivopts, auth))
}

/// Parse `<cipher>` as the kernel does (crypt_ctr_cipher_old / _new), for the
/// ciphers dmkit implements.
fn parse_cipher(s: &str) -> Result<Spec, TargetError> {
    let (chain, ivmode, ivopts, auth) = if let Some(rest) = s.strip_prefix("capi:") {
        parse_capi(s, rest)?
    } else {
        if s.contains('(') {
            return Err(format!("Bad cipher specification '{s}'").into());
        }
        // cipher[:keycount]-chainmode-ivmode[:ivopts]
        let mut parts = s.splitn(2, '-');
        let first = parts.next().unwrap_or_default();
        let tail = parts.next();
        let (cipher, keycount) = match first.split_once(':') {
            Some((c, k)) => (c, Some(k)),
            None => (first, None),
        };
        if let Some(k) = keycount {
            match k.parse::<u32>() {
                Ok(1) => {}
                Ok(n) if n.is_power_of_two() => {
                    return Err(format!(
                        "Bad cipher key count specification '{s}': dmkit supports one key ({n} given)"
                    ).into())
                }
                _ => return Err(format!("Bad cipher key count specification '{s}'").into()),
            }
        }
        let (mut chainmode, mut ivmode, mut ivopts) = (None, None, None);
        if let Some(t) = tail {
            let mut p = t.splitn(2, '-');
            chainmode = p.next();
            if let Some(rest) = p.next() {
                match rest.split_once(':') {
                    Some((m, o)) => (ivmode, ivopts) = (Some(m), Some(o)),
                    None => ivmode = Some(rest),
                }
            }
        }
        // the original format: a cipher name alone (or "-plain") is cbc-plain
        if chainmode.is_none() || (chainmode == Some("plain") && ivmode.is_none()) {
            (chainmode, ivmode) = (Some("cbc"), Some("plain"));
        }
        if chainmode != Some("ecb") && ivmode.is_none() {
            return Err(format!("IV mechanism required in '{s}'").into());
        }
        let chain = match (cipher, chainmode) {
            ("aes", Some("xts")) => Chain::Xts,
            ("aes", Some("cbc")) => Chain::Cbc,
            ("cipher_null", Some("ecb")) => Chain::NullEcb,
            _ => return Err(unsupported_cipher(s).into()),
        };
        (chain, ivmode, ivopts, None)
    };
    if chain == Chain::NullEcb {
        // no IV: the kernel warns and ignores an IV mode
        return Ok(Spec { chain, iv: None, auth });
    }
    let iv = match ivmode {
        Some("plain") => IvMode::Plain,
        Some("plain64") => IvMode::Plain64,
        Some("plain64be") => IvMode::Plain64Be,
        Some("null") => IvMode::Null,
        Some("random") => IvMode::Random,
        Some("essiv") => match ivopts {
            None | Some("") => return Err(format!("Digest algorithm missing for ESSIV mode in '{s}'").into()),
            Some("sha256") => IvMode::Essiv,
            Some(h) => {
                return Err(format!(
                    "Error allocating crypto tfm: ESSIV with digest '{h}' is not supported by dmkit (sha256)"
                ).into())
            }
        },
        Some(m @ ("benbi" | "lmk" | "tcw" | "eboiv" | "elephant")) => {
            return Err(format!(
                "IV mode '{m}' is not supported by dmkit (plain, plain64, plain64be, essiv:sha256, null, random)"
            ).into())
        }
        Some(m) => return Err(format!("Invalid IV mode '{m}'").into()),
        None => return Err(format!("IV mechanism required in '{s}'").into()),
    };
    Ok(Spec {
        chain,
        iv: Some(iv),
        auth,
    })
}

fn unsupported_cipher(s: &str) -> String {
    format!(
        "Error allocating crypto tfm: cipher '{s}' is not supported by dmkit \
         (aes-xts-<iv>, aes-cbc-<iv>, cipher_null-ecb, their capi: forms, \
         capi:authenc(hmac(sha256),<cipher>)-<iv>)"
    )
}

/// Decode a hex key into `out`; its length in bytes. `-` is the empty key.
fn decode_key(hex: &str, out: &mut [u8; MAX_KEY]) -> Result<usize, TargetError> {
    if hex.starts_with(':') {
        return Err(KEYRING.into());
    }
    if hex == "-" {
        return Ok(0);
    }
    if !hex.len().is_multiple_of(2) {
        return Err(format!("odd number of hex digits in the key ({})", hex.len()).into());
    }
    let n = hex.len() / 2;
    if n > MAX_KEY {
        return Err(format!("key of {} bits is longer than any cipher takes ({} bits)", n * 8, MAX_KEY * 8).into());
    }
    hex::decode_to_slice(hex, &mut out[..n]).map_err(|e| match e {
        hex::FromHexError::InvalidHexCharacter { index, .. } => format!("the key is not hex (at digit {index})"),
        _ => "the key is not hex".to_string(),
    })?;
    Ok(n)
}

/// The ciphers keyed for one chain mode.
enum Engine {
    Null,
    Xts128(Xts<Aes128>),
    Xts192(Xts<Aes192>),
    Xts256(Xts<Aes256>),
    Cbc128(Aes128),
    Cbc192(Aes192),
    Cbc256(Aes256),
}

trait Block16: BlockCipherEncrypt + BlockCipherDecrypt + BlockSizeUser<BlockSize = U16> + KeyInit {}
impl<C: BlockCipherEncrypt + BlockCipherDecrypt + BlockSizeUser<BlockSize = U16> + KeyInit> Block16 for C {}

fn new_cipher<C: Block16>(key: &[u8]) -> Result<C, TargetError> {
    C::new_from_slice(key).map_err(|_| TargetError::from(format!("AES takes a 128-, 192- or 256-bit key, not {} bits", key.len() * 8)))
}

/// XTS's two ciphers: the first encrypts the data, the second the tweak.
struct Xts<C>(C, C);

fn xts<C: Block16>(key: &[u8]) -> Result<Xts<C>, TargetError> {
    let (a, b) = key.split_at(key.len() / 2);
    Ok(Xts(new_cipher(a)?, new_cipher(b)?))
}

/// One sector in place with XTS (IEEE 1619, no ciphertext stealing: a sector
/// is whole 16-byte blocks), `iv` as the tweak: T = E_k2(iv), block j is
/// E_k1(P ^ T·x^j) ^ T·x^j in GF(2^128). The work runs inside the cipher's
/// backend (`XtsRun`), a batch of blocks at a time: the tweaks and the XORs are
/// compiled there with the instructions the backend was chosen for (VAES and
/// AVX-512 where the CPU has them), and the batch stays in registers and L1.
fn xts_sector<C: Block16>(x: &Xts<C>, enc: bool, sector: &mut [u8], iv: [u8; 16]) {
    let (blocks, _) = Array::<u8, U16>::slice_as_chunks_mut(sector);
    let mut t = Array(iv);
    x.1.encrypt_block(&mut t);
    let run = XtsRun {
        blocks,
        t: u128::from_le_bytes(t.0),
    };
    if enc {
        x.0.encrypt_with_backend(run)
    } else {
        x.0.decrypt_with_backend(run)
    }
}

/// A sector's blocks and its first tweak, for the cipher's backend.
struct XtsRun<'a> {
    blocks: &'a mut [Array<u8, U16>],
    t: u128,
}

impl BlockSizeUser for XtsRun<'_> {
    type BlockSize = U16;
}

/// The blocks a batch at most holds (the widest backend's parallel blocks).
const XTS_BATCH: usize = 64;

impl XtsRun<'_> {
    /// The XTS steps around `cipher`, a batch of `par` blocks at a time (the
    /// backend's parallel width, at most `XTS_BATCH`).
    #[inline(always)]
    fn go(self, par: usize, mut cipher: impl FnMut(&mut [Array<u8, U16>])) {
        let par = par.clamp(1, XTS_BATCH);
        let mut tweaks = [0u128; XTS_BATCH];
        let mut t = self.t;
        for batch in self.blocks.chunks_mut(par) {
            // T·x^j: the first eight one step apart, then each from the one
            // eight before (eight independent chains, not one serial one)
            for tw in tweaks.iter_mut().take(8) {
                *tw = t;
                t = mul_x(t);
            }
            for j in 8..batch.len() {
                tweaks[j] = mul_x8(tweaks[j - 8]);
            }
            t = mul_x(tweaks[batch.len() - 1]);
            for (b, tw) in batch.iter_mut().zip(&tweaks) {
                b.0 = (u128::from_le_bytes(b.0) ^ tw).to_le_bytes();
            }
            cipher(batch);
            for (b, tw) in batch.iter_mut().zip(&tweaks) {
                b.0 = (u128::from_le_bytes(b.0) ^ tw).to_le_bytes();
            }
        }
    }
}

impl BlockCipherEncClosure for XtsRun<'_> {
    #[inline(always)]
    fn call<B: BlockCipherEncBackend<BlockSize = U16>>(self, backend: &B) {
        self.go(B::ParBlocksSize::USIZE, |batch| {
            let (par, tail) = Array::<Array<u8, U16>, B::ParBlocksSize>::slice_as_chunks_mut(batch);
            for p in par {
                backend.encrypt_par_blocks(p.into());
            }
            backend.encrypt_tail_blocks(tail.into());
        })
    }
}

impl BlockCipherDecClosure for XtsRun<'_> {
    #[inline(always)]
    fn call<B: BlockCipherDecBackend<BlockSize = U16>>(self, backend: &B) {
        self.go(B::ParBlocksSize::USIZE, |batch| {
            let (par, tail) = Array::<Array<u8, U16>, B::ParBlocksSize>::slice_as_chunks_mut(batch);
            for p in par {
                backend.decrypt_par_blocks(p.into());
            }
            backend.decrypt_tail_blocks(tail.into());
        })
    }
}

/// `t`·x in GF(2^128) as XTS defines it: shift left, reduce by
/// x^128 = x^7 + x^2 + x + 1.
#[inline]
fn mul_x(t: u128) -> u128 {
    (t << 1) ^ ((t >> 127) * 0x87)
}

/// `t`·x^8: the byte shifted out, multiplied (carry-less) by 0x87, folds back.
#[inline]
fn mul_x8(t: u128) -> u128 {
    let h = t >> 120;
    (t << 8) ^ h ^ (h << 1) ^ (h << 2) ^ (h << 7)
}

/// One sector in place with CBC from `iv` (a sector is whole 16-byte blocks).
fn cbc_sector<C: Block16>(c: &C, enc: bool, sector: &mut [u8], iv: [u8; 16]) {
    let (blocks, _) = Array::<u8, U16>::slice_as_chunks_mut(sector);
    let iv = Array(iv);
    if enc {
        cbc::Encryptor::<&C>::inner_iv_init(c, &iv).encrypt_blocks(blocks)
    } else {
        cbc::Decryptor::<&C>::inner_iv_init(c, &iv).decrypt_blocks(blocks)
    }
}

impl Engine {
    fn new(chain: Chain, key: &[u8]) -> Result<Engine, TargetError> {
        let bits = key.len() * 8;
        Ok(match (chain, key.len()) {
            (Chain::NullEcb, 0) => Engine::Null,
            (Chain::NullEcb, _) => return Err(format!("cipher_null takes no key ('-'), got {bits} bits").into()),
            (Chain::Xts, 32) => Engine::Xts128(xts(key)?),
            (Chain::Xts, 48) => Engine::Xts192(xts(key)?),
            (Chain::Xts, 64) => Engine::Xts256(xts(key)?),
            (Chain::Xts, _) => {
                return Err(format!(
                    "aes-xts takes a 256-, 384- or 512-bit key (two AES keys), got {bits} bits"
                ).into())
            }
            (Chain::Cbc, 16) => Engine::Cbc128(new_cipher(key)?),
            (Chain::Cbc, 24) => Engine::Cbc192(new_cipher(key)?),
            (Chain::Cbc, 32) => Engine::Cbc256(new_cipher(key)?),
            (Chain::Cbc, _) => return Err(format!("aes-cbc takes a 128-, 192- or 256-bit key, got {bits} bits").into()),
        })
    }

    fn sector(&self, enc: bool, s: &mut [u8], iv: [u8; 16]) {
        match self {
            Engine::Null => {}
            Engine::Xts128(x) => xts_sector(x, enc, s, iv),
            Engine::Xts192(x) => xts_sector(x, enc, s, iv),
            Engine::Xts256(x) => xts_sector(x, enc, s, iv),
            Engine::Cbc128(c) => cbc_sector(c, enc, s, iv),
            Engine::Cbc192(c) => cbc_sector(c, enc, s, iv),
            Engine::Cbc256(c) => cbc_sector(c, enc, s, iv),
        }
    }
}

/// The most XTS context sets a key keeps for reuse: one per thread
/// transforming at once (the reactors and I/O workers are fewer); a set given
/// back beyond it is freed.
const XTS_POOL: usize = 64;

/// The most bytes of data one pass of XTS over ECB takes ([`XtsCtx::over_ecb`]):
/// the pass's tweaks (as many bytes again) and its data stay in the L1 cache
/// between the XORs and the cipher.
const XTS_PASS: usize = 8 << 10;

/// Sectors of at least this many bytes go through OpenSSL's own XTS, one call
/// a sector; smaller ones through XTS over OpenSSL's ECB, many sectors a call.
const XTS_WHOLE: usize = 2048;

/// XTS with OpenSSL's AES, keyed, in two ways chosen by the sector size
/// (`bench/crypt.py` and `examples/crypt_speed.rs` measure both):
/// - OpenSSL's own `aes-128-xts` / `aes-256-xts` (its assembly interleaves the
///   tweaks with the AES rounds), the IV set per sector by `EVP_CipherInit_ex`.
///   In OpenSSL 3.0 that set-up asks the provider for the IV length by a
///   parameter lookup each time, which at 512-byte sectors cost as much as
///   the cipher (0.48× of `openssl speed`, which sets its IV once); at 4 KiB
///   it is a small part.
/// - XTS over OpenSSL's ECB (eight blocks interleaved with AES-NI): each
///   sector's first tweak is its IV under the second key (one ECB call for a
///   pass's sectors), the others doublings in GF(2^128), and the data is
///   XORed with them before and after one ECB call under the first key for
///   the whole pass. No per-sector set-up; the doublings and XORs are ours.
///   It also takes the keys OpenSSL's XTS does not (AES-192, equal halves).
///
/// A set of contexts serves one thread at a time: taken from `pool` for a
/// request, given back.
struct OsslXts {
    ecb: &'static openssl::cipher::CipherRef,
    /// OpenSSL's XTS for this key, if it takes it.
    xts: Option<&'static openssl::cipher::CipherRef>,
    pool: std::sync::Mutex<Vec<XtsCtx>>,
}

/// Lock all of the daemon's memory, now and to come, each page when first
/// touched (`mlockall` with MCL_ONFAULT), once: as dmeventd and multipathd lock
/// theirs, and so OpenSSL's key schedules are never swapped. False where the
/// limit on locked memory does not allow it (an unprivileged daemon).
fn memory_locked() -> bool {
    static LOCKED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *LOCKED.get_or_init(|| {
        use rustix::mm::MlockAllFlags as F;
        match rustix::mm::mlockall(F::CURRENT | F::FUTURE | F::ONFAULT) {
            Ok(()) => {
                tracing::info!("crypt: the daemon's memory is locked (OpenSSL's XTS holds key schedules)");
                true
            }
            Err(e) => {
                tracing::info!("crypt: cannot lock the daemon's memory ({e}): XTS runs in the aes crate");
                false
            }
        }
    })
}

/// The contexts of one thread's use of an [`OsslXts`] key.
struct XtsCtx {
    /// AES-ECB under XTS's first key, both ways, and under its second key
    /// (the tweaks); padding off.
    enc: openssl::cipher_ctx::CipherCtx,
    dec: openssl::cipher_ctx::CipherCtx,
    tweak: openssl::cipher_ctx::CipherCtx,
    /// OpenSSL's XTS both ways, where it takes the key.
    xts: Option<(openssl::cipher_ctx::CipherCtx, openssl::cipher_ctx::CipherCtx)>,
    /// A pass's tweaks, one a block, and each sector's first (derived from
    /// the key: wiped when freed).
    tweaks: Zeroizing<Vec<u128>>,
    firsts: Zeroizing<Vec<[u8; 16]>>,
}

impl OsslXts {
    /// For any XTS key (two AES-128, -192 or -256 keys), where all of the
    /// daemon's memory is locked: OpenSSL keeps its key schedules in its own
    /// heap. Otherwise the `aes` crate, whose schedules are in locked pages.
    fn new(chain: Chain, key: &[u8]) -> Option<OsslXts> {
        use openssl::cipher::Cipher;
        let (ecb, xts) = match (chain, key.len()) {
            (Chain::Xts, 32) => (Cipher::aes_128_ecb(), Some(Cipher::aes_128_xts())),
            (Chain::Xts, 48) => (Cipher::aes_192_ecb(), None),
            (Chain::Xts, 64) => (Cipher::aes_256_ecb(), Some(Cipher::aes_256_xts())),
            _ => return None,
        };
        // OpenSSL's XTS refuses equal halves to encrypt (the kernel, outside
        // FIPS mode, does not); no early exit: how much of the halves agree
        // is not told by the time
        let (a, b) = key.split_at(key.len() / 2);
        let differ = a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) != 0;
        if !memory_locked() {
            return None;
        }
        Some(OsslXts {
            ecb,
            xts: xts.filter(|_| differ),
            pool: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// A keyed set, from the pool or new; None if OpenSSL fails.
    fn take(&self, key: &[u8]) -> Option<XtsCtx> {
        if let Some(c) = self.pool.lock().ok().and_then(|mut p| p.pop()) {
            return Some(c);
        }
        let keyed = |cipher: &openssl::cipher::CipherRef, key: &[u8], enc: bool| {
            let mut c = openssl::cipher_ctx::CipherCtx::new().ok()?;
            let r = if enc {
                c.encrypt_init(Some(cipher), Some(key), None)
            } else {
                c.decrypt_init(Some(cipher), Some(key), None)
            };
            r.ok()?;
            c.set_padding(false);
            Some(c)
        };
        let (k1, k2) = key.split_at(key.len() / 2);
        let xts = match self.xts {
            Some(x) => Some((keyed(x, key, true)?, keyed(x, key, false)?)),
            None => None,
        };
        Some(XtsCtx {
            enc: keyed(self.ecb, k1, true)?,
            dec: keyed(self.ecb, k1, false)?,
            tweak: keyed(self.ecb, k2, true)?,
            xts,
            // at their largest once (a pass of 16-byte sectors), never grown:
            // a grown vector would leave its old copy of tweaks unwiped
            tweaks: Zeroizing::new(vec![0; XTS_PASS / 16]),
            firsts: Zeroizing::new(vec![[0; 16]; XTS_PASS / 16]),
        })
    }

    fn give_back(&self, c: XtsCtx) {
        if let Ok(mut p) = self.pool.lock() {
            if p.len() < XTS_POOL {
                p.push(c);
            }
        }
    }
}

/// `dst` from `src` (as long) or in place through a keyed context, its IV
/// first set to `iv` if given; false if OpenSSL refused (it checks its
/// arguments before it writes: `dst` is then untouched).
fn evp(c: &mut openssl::cipher_ctx::CipherCtx, iv: Option<&[u8; 16]>, src: Option<&[u8]>, dst: &mut [u8]) -> bool {
    let Ok(len) = std::ffi::c_int::try_from(dst.len()) else {
        return false;
    };
    if src.is_some_and(|s| s.len() != dst.len()) {
        return false;
    }
    let src = src.map_or(dst.as_ptr(), <[u8]>::as_ptr);
    let ctx = foreign_types::ForeignTypeRef::as_ptr(&**c);
    let mut out = 0;
    // SAFETY: `ctx` is a live context (keyed, its cipher set, padding off),
    // borrowed mutably here so no other thread uses it; `iv` is the 16 bytes
    // XTS's IV takes (the direction, -1, is kept); `dst` is `len` bytes,
    // written: ECB of whole blocks (the callers' units) and XTS (block size
    // 1) write exactly `len` (counted into `out`); `src` is `len` bytes too,
    // another buffer (checked above) or `dst` itself, which OpenSSL's update
    // allows.
    let ok = unsafe {
        iv.is_none_or(|iv| {
            openssl_sys::EVP_CipherInit_ex(
                ctx,
                std::ptr::null(),
                std::ptr::null_mut(),
                std::ptr::null(),
                iv.as_ptr(),
                -1,
            ) == 1
        }) && openssl_sys::EVP_CipherUpdate(ctx, dst.as_mut_ptr(), &mut out, src, len) == 1
    } && out == len;
    if !ok {
        // the reasons queued on this thread: not kept for another call
        drop(openssl::error::ErrorStack::get());
    }
    ok
}

/// `data` XOR the tweaks, block by block.
fn xor_tweaks(data: &mut [u8], tweaks: &[u128]) {
    for (d, t) in data.as_chunks_mut::<16>().0.iter_mut().zip(tweaks) {
        *d = (u128::from_le_bytes(*d) ^ t).to_le_bytes();
    }
}

impl XtsCtx {
    /// Encrypt (`enc`) or decrypt into `data`, from `from` (as long) or in
    /// place, in sectors of `unit` bytes, the one at index i with IV `iv(i)`.
    /// Returns the bytes done: all whole sectors, or fewer if OpenSSL refused
    /// (the sectors from there on are left as they were, for the `aes` crate).
    fn run(&mut self, enc: bool, from: Option<&[u8]>, data: &mut [u8], unit: usize, iv: impl Fn(usize) -> [u8; 16]) -> usize {
        if unit == 0 || !unit.is_multiple_of(16) || from.is_some_and(|f| f.len() < data.len()) {
            return 0;
        }
        let whole = data.len() / unit * unit;
        match &mut self.xts {
            Some((e, d)) if unit >= XTS_WHOLE => {
                let c = if enc { e } else { d };
                for (i, s) in data[..whole].chunks_exact_mut(unit).enumerate() {
                    if !evp(c, Some(&iv(i)), from.map(|f| &f[i * unit..(i + 1) * unit]), s) {
                        return i * unit;
                    }
                }
                whole
            }
            _ if unit <= XTS_PASS => self.over_ecb(enc, from, &mut data[..whole], unit, iv),
            _ => 0,
        }
    }

    /// [`XtsCtx::run`] over ECB, for whole sectors of at most [`XTS_PASS`].
    fn over_ecb(&mut self, enc: bool, from: Option<&[u8]>, data: &mut [u8], unit: usize, iv: impl Fn(usize) -> [u8; 16]) -> usize {
        let (per, blocks) = (XTS_PASS / unit, unit / 16);
        let mut done = 0;
        for (k, pass) in data.chunks_mut(per * unit).enumerate() {
            let sectors = pass.len() / unit;
            // each sector's first tweak: its IV under the second key
            let first = &mut self.firsts[..sectors];
            for (i, t) in first.iter_mut().enumerate() {
                *t = iv(k * per + i);
            }
            if !evp(&mut self.tweak, None, None, first.as_flattened_mut()) {
                return done;
            }
            // block j of a sector has the tweak T·x^j, T its first; the data
            // is XORed with it as it is made
            let src = from.map(|f| &f[done..done + pass.len()]);
            let (d, _) = pass.as_chunks_mut::<16>();
            for (s, (t0, tw)) in first.iter().zip(self.tweaks.chunks_exact_mut(blocks)).enumerate() {
                let mut t = u128::from_le_bytes(*t0);
                let d = &mut d[s * blocks..(s + 1) * blocks];
                match src {
                    Some(f) => {
                        let (f, _) = f[s * unit..(s + 1) * unit].as_chunks::<16>();
                        for ((w, d), f) in tw.iter_mut().zip(d).zip(f) {
                            *w = t;
                            *d = (u128::from_le_bytes(*f) ^ t).to_le_bytes();
                            t = mul_x(t);
                        }
                    }
                    None => {
                        for (w, d) in tw.iter_mut().zip(d) {
                            *w = t;
                            *d = (u128::from_le_bytes(*d) ^ t).to_le_bytes();
                            t = mul_x(t);
                        }
                    }
                }
            }
            let tweaks = &self.tweaks[..sectors * blocks];
            if !evp(if enc { &mut self.enc } else { &mut self.dec }, None, None, pass) {
                match src {
                    Some(s) => pass.copy_from_slice(s),
                    None => xor_tweaks(pass, tweaks),
                }
                return done;
            }
            xor_tweaks(pass, tweaks);
            done += pass.len();
        }
        done
    }
}

/// The volume key and everything keyed by it.
struct Keys {
    /// The table's key: the cipher's, then the MAC's.
    key: [u8; MAX_KEY],
    len: usize,
    /// Bytes of it that are the cipher's.
    enc_len: usize,
    /// The AEAD's MAC, keyed with the rest.
    mac: Option<aead::MacKey>,
    engine: Engine,
    /// XTS over OpenSSL's AES for the data path ([`Keys::run`]).
    ossl: Option<OsslXts>,
    iv: Option<IvMode>,
    /// ESSIV's cipher, keyed with sha256 of the volume key.
    essiv: Option<Aes256>,
}

impl Drop for Keys {
    fn drop(&mut self) {
        self.key.zeroize();
    }
}

impl Keys {
    fn new(spec: &Spec, whole: &[u8]) -> Result<Keys, TargetError> {
        let mut k = [0u8; MAX_KEY];
        k.get_mut(..whole.len()).ok_or("key too long")?.copy_from_slice(whole);
        let (key, mac) = match spec.auth {
            Some(a) => {
                let at = whole.len().checked_sub(a.key_len()).ok_or_else(|| {
                    format!("the key is shorter than the MAC's key ({} bits)", a.key_len() * 8)
                })?;
                let (key, m) = whole.split_at(at);
                (key, Some(aead::MacKey::new(a, m)?))
            }
            None => (whole, None),
        };
        let essiv = match spec.iv {
            Some(IvMode::Essiv) => {
                let mut salt: Zeroizing<[u8; 32]> = Zeroizing::new(Sha256::digest(key).into());
                let c = new_cipher::<Aes256>(&salt[..])?;
                salt.zeroize();
                Some(c)
            }
            _ => None,
        };
        Ok(Keys {
            key: k,
            len: whole.len(),
            enc_len: key.len(),
            mac,
            engine: Engine::new(spec.chain, key)?,
            ossl: OsslXts::new(spec.chain, key),
            iv: spec.iv,
            essiv,
        })
    }

    /// Encrypt (`enc`) or decrypt into `data`, from `from` (as long) or in
    /// place, in sectors of `unit` bytes, the one at index i with the IV
    /// numbered `n(i)`: with XTS on OpenSSL's AES where the daemon's memory is
    /// locked (one context set for the whole call; from `from` straight into
    /// `data`, no copy first), else (or from where OpenSSL failed) with the
    /// `aes` crate in place.
    fn run(&self, enc: bool, from: Option<&[u8]>, data: &mut [u8], unit: usize, n: impl Fn(usize) -> u64) {
        self.run_ivs(enc, from, data, unit, |i| self.iv(n(i)))
    }

    /// As [`run`](Self::run), the sector at index i with IV `iv(i)`.
    fn run_ivs(&self, enc: bool, from: Option<&[u8]>, data: &mut [u8], unit: usize, iv: impl Fn(usize) -> [u8; 16]) {
        let mut done = 0;
        if let Some(o) = &self.ossl {
            if let Some(mut c) = o.take(&self.key[..self.enc_len]) {
                done = c.run(enc, from, data, unit, &iv);
                o.give_back(c);
            }
        }
        if unit == 0 {
            return;
        }
        // what OpenSSL did not do (none of it, for keys or sectors it does not take)
        for (i, s) in data.chunks_exact_mut(unit).enumerate().skip(done / unit) {
            if let Some(f) = from.and_then(|f| f.get(i * unit..(i + 1) * unit)) {
                s.copy_from_slice(f);
            }
            self.engine.sector(enc, s, iv(i));
        }
    }

    /// The IV of the sector numbered `n` (in IV units).
    fn iv(&self, n: u64) -> [u8; 16] {
        let mut iv = [0u8; 16];
        match self.iv {
            // a random IV comes from the sector's tag, not from here
            None | Some(IvMode::Null) | Some(IvMode::Random) => {}
            Some(IvMode::Plain) => iv[..4].copy_from_slice(&(n as u32).to_le_bytes()),
            Some(IvMode::Plain64) => iv[..8].copy_from_slice(&n.to_le_bytes()),
            Some(IvMode::Plain64Be) => iv[8..].copy_from_slice(&n.to_be_bytes()),
            Some(IvMode::Essiv) => {
                iv[..8].copy_from_slice(&n.to_le_bytes());
                if let Some(c) = &self.essiv {
                    let mut b = Array(iv);
                    c.encrypt_block(&mut b);
                    iv = b.0;
                }
            }
        }
        iv
    }
}

/// A cipher as the target keys it, for `examples/crypt_speed.rs`, which
/// times it against `openssl speed` (bench/crypt.py). Its keys are not in
/// locked memory.
pub struct SectorCipher(Keys);

impl SectorCipher {
    /// `cipher` in the table's spelling, `key` its bytes.
    pub fn new(cipher: &str, key: &[u8]) -> Result<SectorCipher, TargetError> {
        Ok(SectorCipher(Keys::new(&parse_cipher(cipher)?, key)?))
    }

    /// Encrypt (or decrypt) `buf` in place as the target does, in sectors of
    /// `sector_size` bytes numbered from `first`.
    pub fn apply(&self, enc: bool, sector_size: usize, first: u64, buf: &mut [u8]) -> Result<(), TargetError> {
        if sector_size == 0 || !buf.len().is_multiple_of(sector_size) {
            return Err(format!("{} bytes are not whole {sector_size}-byte sectors", buf.len()).into());
        }
        self.0.run(enc, None, buf, sector_size, |i| first + i as u64);
        Ok(())
    }
}

/// A value in pages of its own, locked in memory while it lives, zeroed (by
/// its own drop) before they are unlocked.
#[repr(align(4096))]
struct Page<T>(Option<T>);

struct Locked<T> {
    page: Box<Page<T>>,
}

impl<T> Locked<T> {
    fn new() -> Result<Locked<T>, TargetError> {
        let mut page = Box::new(Page(None));
        let ptr = (&mut *page as *mut Page<T>).cast::<std::ffi::c_void>();
        // SAFETY: the range is exactly the box's allocation (page-aligned, a
        // whole number of pages, owned by nothing else), which lives until
        // `drop` unlocks it.
        unsafe { rustix::mm::mlock(ptr, std::mem::size_of::<Page<T>>()) }
            .map_err(|e| format!("cannot lock the key in memory (mlock: {e}; see RLIMIT_MEMLOCK)"))?;
        Ok(Locked { page })
    }
}

impl<T> Drop for Locked<T> {
    fn drop(&mut self) {
        self.page.0 = None;
        let ptr = (&mut *self.page as *mut Page<T>).cast::<std::ffi::c_void>();
        // SAFETY: the range `new` locked; the value in it is dropped (zeroed).
        let _ = unsafe { rustix::mm::munlock(ptr, std::mem::size_of::<Page<T>>()) };
    }
}

/// Bytes whose number is known only at run time (a LUKS keyslot's split key,
/// a derived key, a volume key), in pages of their own: locked in memory while
/// they live, zeroed before they are unlocked. The pages are the page-aligned
/// part of a buffer one page longer than they need, so no other value shares
/// them (an munlock of a shared page would unlock its neighbour too).
pub struct LockedBytes {
    buf: Vec<u8>,
    start: usize,
    len: usize,
}

const PAGE: usize = 4096;

impl LockedBytes {
    /// `len` zero bytes, locked.
    pub fn new(len: usize) -> Result<LockedBytes, TargetError> {
        let span = len.div_ceil(PAGE).max(1) * PAGE;
        let mut buf = vec![0u8; span + PAGE];
        let start = buf.as_ptr().align_offset(PAGE).min(PAGE);
        let ptr = buf[start..].as_mut_ptr().cast::<std::ffi::c_void>();
        // SAFETY: `span` bytes from `ptr` lie inside `buf` (start < PAGE and
        // buf holds span + PAGE bytes), whose allocation never moves or grows
        // and lives until `drop` unlocks it.
        unsafe { rustix::mm::mlock(ptr, span) }
            .map_err(|e| format!("cannot lock {len} bytes of key material in memory (mlock: {e}; see RLIMIT_MEMLOCK)"))?;
        Ok(LockedBytes { buf, start, len })
    }

    /// A locked copy of `b`.
    pub fn from_slice(b: &[u8]) -> Result<LockedBytes, TargetError> {
        let mut l = LockedBytes::new(b.len())?;
        l.as_mut_slice().copy_from_slice(b);
        Ok(l)
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.buf[self.start..self.start + self.len]
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for LockedBytes {
    fn drop(&mut self) {
        self.buf.as_mut_slice().zeroize();
        let span = self.len.div_ceil(PAGE).max(1) * PAGE;
        let ptr = self.buf[self.start..].as_mut_ptr().cast::<std::ffi::c_void>();
        // SAFETY: the range `new` locked, zeroed above.
        let _ = unsafe { rustix::mm::munlock(ptr, span) };
    }
}

/// Keys in locked memory.
struct Secret(Locked<Keys>);

impl Secret {
    fn new(spec: &Spec, key: &[u8]) -> Result<Secret, TargetError> {
        let mut l = Locked::new()?;
        l.page.0 = Some(Keys::new(spec, key)?);
        Ok(Secret(l))
    }

    fn keys(&self) -> Option<&Keys> {
        self.0.page.0.as_ref()
    }
}

/// The optional parameters, as the kernel keeps and prints them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Opts {
    allow_discards: bool,
    same_cpu_crypt: bool,
    high_priority: bool,
    submit_from_crypt_cpus: bool,
    no_read_workqueue: bool,
    no_write_workqueue: bool,
    /// `integrity:<bytes>:<aead|none>`: tags on the device below.
    integrity: Option<aead::Integrity>,
    /// Bytes encrypted with one IV (512..4096).
    sector_size: u32,
    iv_large_sectors: bool,
}

/// Parse `<#opt_params> <opt_params>` (crypt_ctr_optional), `len` the target's length.
fn parse_opts(args: &[String], len: u64) -> Result<Opts, TargetError> {
    let mut o = Opts {
        sector_size: 512,
        ..Opts::default()
    };
    let Some(count) = args.first() else { return Ok(o) };
    let n = match count.parse::<usize>() {
        Ok(n) if n <= 9 => n,
        _ => return Err(format!("Invalid number of feature args '{count}' (0 to 9)").into()),
    };
    let opts = &args[1..];
    if n > opts.len() {
        return Err(format!("Not enough feature arguments: {n} announced, {} given", opts.len()).into());
    }
    if opts.len() > n {
        return Err(format!("unexpected argument '{}' after {n} feature arguments", opts[n]).into());
    }
    for a in opts {
        let l = a.to_ascii_lowercase();
        match l.as_str() {
            "allow_discards" => o.allow_discards = true,
            "same_cpu_crypt" => o.same_cpu_crypt = true,
            "high_priority" => o.high_priority = true,
            "submit_from_crypt_cpus" => o.submit_from_crypt_cpus = true,
            "no_read_workqueue" => o.no_read_workqueue = true,
            "no_write_workqueue" => o.no_write_workqueue = true,
            "iv_large_sectors" => o.iv_large_sectors = true,
            _ => {
                if let Some(v) = a.strip_prefix("sector_size:") {
                    let s = v.parse::<u32>().map_err(|_| format!("Invalid feature arguments '{a}'"))?;
                    if !(512..=4096).contains(&s) || !s.is_power_of_two() {
                        return Err(format!(
                            "Invalid feature value for sector_size '{v}' (a power of 2 from 512 to 4096)"
                        ).into());
                    }
                    if !len.is_multiple_of(u64::from(s) / SECTOR) {
                        return Err(format!(
                            "Device size is not multiple of sector_size feature ({len} sectors, sector_size {s})"
                        ).into());
                    }
                    o.sector_size = s;
                } else if let Some(v) = l.strip_prefix("integrity:") {
                    o.integrity = Some(aead::Integrity::parse(v)?);
                } else if l.starts_with("integrity_key_size:") {
                    return Err(format!(
                        "'{a}': a MAC key of another size than its digest is not supported by dmkit"
                    ).into());
                } else {
                    return Err(format!(
                        "Invalid feature arguments '{a}' (allow_discards, same_cpu_crypt, high_priority, \
                         submit_from_crypt_cpus, no_read_workqueue, no_write_workqueue, \
                         integrity:<bytes>:<aead|none>, sector_size:<bytes>, iv_large_sectors)"
                    ).into());
                }
            }
        }
    }
    Ok(o)
}

impl Opts {
    /// The options as crypt_status prints them (with their count first), or "".
    fn table(&self) -> String {
        let mut v: Vec<String> = [
            (self.allow_discards, "allow_discards"),
            (self.same_cpu_crypt, "same_cpu_crypt"),
            (self.high_priority, "high_priority"),
            (self.submit_from_crypt_cpus, "submit_from_crypt_cpus"),
            (self.no_read_workqueue, "no_read_workqueue"),
            (self.no_write_workqueue, "no_write_workqueue"),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, s)| s.to_string())
        .collect();
        if let Some(i) = self.integrity {
            v.push(i.word());
        }
        if self.sector_size != 512 {
            v.push(format!("sector_size:{}", self.sector_size));
        }
        if self.iv_large_sectors {
            v.push("iv_large_sectors".into());
        }
        if v.is_empty() {
            String::new()
        } else {
            format!(" {} {}", v.len(), v.join(" "))
        }
    }
}

/// How sectors map to IVs: the unit, and where the numbering starts.
#[derive(Clone, Copy, Debug)]
struct Layout {
    /// 512-byte sectors per encryption sector.
    spc: u64,
    iv_offset: u64,
    large: bool,
}

impl Layout {
    /// Encrypt (`enc`) or decrypt into `data`, from `from` (as long) or in
    /// place: whole encryption sectors from target sector `sector` on.
    fn apply(&self, keys: &Keys, enc: bool, sector: u64, from: Option<&[u8]>, data: &mut [u8]) {
        keys.run(enc, from, data, self.unit(), |i| self.iv_number(sector, i));
    }

    fn unit(&self) -> usize {
        (self.spc * SECTOR) as usize
    }

    /// The IV number of the encryption sector at index `i` from target
    /// sector `sector`.
    fn iv_number(&self, sector: u64, i: usize) -> u64 {
        let n = sector + self.iv_offset + i as u64 * self.spc;
        if self.large {
            n / self.spc
        } else {
            n
        }
    }

    /// The IV of sector `i` from `sector`: kept (`kept`: a buffer holding
    /// each sector's 16 bytes at `i * stride + at`), else generated.
    fn iv_of(&self, keys: &Keys, sector: u64, i: usize, kept: Option<(&[u8], usize, usize)>) -> [u8; 16] {
        let mut iv = [0u8; 16];
        match kept.and_then(|(k, stride, at)| k.get(i * stride + at..i * stride + at + 16)) {
            Some(k) => iv.copy_from_slice(k),
            None => iv = keys.iv(self.iv_number(sector, i)),
        }
        iv
    }

    /// Encrypt `client` into `own` from target sector `sector`, and write
    /// each sector's tag into `tags` (see [`aead`]); `random` holds the
    /// random IVs where the tag keeps them (16 bytes a sector).
    fn seal(
        &self,
        keys: &Keys,
        tl: &aead::TagLayout,
        sector: u64,
        (client, own): (&[u8], &mut [u8]),
        tags: &mut [u8],
        random: &[u8],
    ) {
        let kept = tl.iv_kept.then_some((random, 16, 0));
        keys.run_ivs(true, Some(client), own, self.unit(), |i| self.iv_of(keys, sector, i, kept));
        for (i, (ct, tag)) in own.chunks_exact(self.unit()).zip(tags.chunks_exact_mut(tl.on_disk)).enumerate() {
            tag.fill(0);
            let iv = self.iv_of(keys, sector, i, kept);
            if let Some(m) = &keys.mac {
                m.tag(sector + i as u64 * self.spc, &iv, ct, &mut tag[..tl.auth]);
            }
            if tl.iv_kept {
                tag[tl.auth..tl.auth + 16].copy_from_slice(&iv);
            }
        }
    }

    /// Check each sector's MAC in `tags`, then decrypt `own` into `client`;
    /// Err with the first sector whose MAC does not match (nothing
    /// decrypted then).
    fn open(&self, keys: &Keys, tl: &aead::TagLayout, sector: u64, own: &[u8], tags: &[u8], client: &mut [u8]) -> Result<(), u64> {
        // a random IV is read where the tag keeps it, after the MAC
        let kept = tl.iv_kept.then_some((tags, tl.on_disk, tl.auth));
        if let Some(m) = &keys.mac {
            for (i, (ct, tag)) in own.chunks_exact(self.unit()).zip(tags.chunks_exact(tl.on_disk)).enumerate() {
                let s = sector + i as u64 * self.spc;
                if !m.check(s, &self.iv_of(keys, sector, i, kept), ct, &tag[..tl.auth]) {
                    return Err(s);
                }
            }
        }
        keys.run_ivs(false, Some(own), client, self.unit(), |i| self.iv_of(keys, sector, i, kept));
        Ok(())
    }
}

pub struct Crypt {
    cipher: String,
    spec: Spec,
    /// None once wiped (`key wipe`).
    keys: ArcSwapOption<Secret>,
    key_len: usize,
    layout: Layout,
    dev: DevRef,
    offset: u64,
    opts: Opts,
    /// Integrity modes: what a sector's tag holds, and the profile of the
    /// device below that stores it.
    tags: Option<aead::TagLayout>,
    /// The device's name in the log (a read whose MAC fails names it).
    dev_name: Arc<str>,
    suspended: AtomicBool,
}

/// The tags of an integrity mode: the layout, checked against the profile of
/// the device below (crypt_integrity_ctr, with its errors). None where the
/// table has no integrity mode (or one that keeps nothing: `none` without a
/// random IV, which the kernel ignores).
fn tag_setup(spec: &Spec, opts: &Opts, dev: &DevRef) -> Result<Option<aead::TagLayout>, TargetError> {
    let iv_kept = spec.iv == Some(IvMode::Random);
    let integrity = match opts.integrity {
        Some(i) if i.aead || iv_kept => i,
        _ if spec.auth.is_some() => {
            return Err("Error allocating crypto tfm: an authenc cipher needs integrity:<bytes>:aead".into())
        }
        _ if iv_kept => return Err("Integrity profile not supported.".into()),
        _ => return Ok(None),
    };
    aead::check_pairing(&integrity, spec.auth)?;
    let Some(p) = dev.tag_profile() else {
        return Err("Integrity profile not supported.".into());
    };
    if u32::from(p.tag_size) != integrity.tag_size {
        return Err("Integrity profile tag size mismatch.".into());
    }
    if p.block_size != opts.sector_size {
        return Err("Integrity profile sector size mismatch.".into());
    }
    Ok(Some(aead::TagLayout::new(&integrity, spec.auth, iv_kept)?))
}

impl Crypt {

    /// The table parameters with `key` in the key's place.
    fn params_with_key(&self, key: &str) -> String {
        format!(
            "{} {key} {} {} {}{}",
            self.cipher,
            self.layout.iv_offset,
            self.dev.table_name(),
            self.offset,
            self.opts.table()
        )
    }
    pub fn new(args: &[String], len: u64, r: &dyn Resolver) -> Result<Crypt, TargetError> {
        if args.len() < 5 {
            return Err(format!(
                "Not enough arguments: crypt takes <cipher> <key> <iv_offset> <device> <offset> \
                 [<#opt_params> <opt_params>], got {}",
                args.len()
            ).into());
        }
        let opts = parse_opts(&args[5..], len)?;
        let spec = parse_cipher(&args[0])?;
        let mut key = Zeroizing::new([0u8; MAX_KEY]);
        let n = decode_key(&args[1], &mut key).map_err(|e| format!("Error decoding and setting key: {e}"))?;
        let secret = Secret::new(&spec, &key[..n]).map_err(|e| format!("Error decoding and setting key: {e}"))?;
        drop(key);
        let spc = u64::from(opts.sector_size) / SECTOR;
        let iv_offset = args[2]
            .parse::<u64>()
            .ok()
            .filter(|v| v.is_multiple_of(spc))
            .ok_or_else(|| {
                format!(
                    "Invalid iv_offset sector '{}' (a number of 512-byte sectors, a multiple of {spc})",
                    args[2]
                )
            })?;
        let offset = args[4]
            .parse::<u64>()
            .map_err(|_| format!("Invalid device sector '{}'", args[4]))?;
        let dev = arg_dev(args, 3, offset, len, r)?;
        let tags = tag_setup(&spec, &opts, &dev)?;
        let dev_name = dev.table_name().into();
        Ok(Crypt {
            cipher: args[0].clone(),
            spec,
            keys: ArcSwapOption::new(Some(Arc::new(secret))),
            key_len: n,
            layout: Layout {
                spc,
                iv_offset,
                large: opts.iv_large_sectors,
            },
            dev,
            offset,
            opts,
            tags,
            dev_name,
            suspended: AtomicBool::new(false),
        })
    }

    fn key_message(&self, words: &[String]) -> Result<String, TargetError> {
        if !self.suspended.load(Ordering::SeqCst) {
            return Err("Invalid argument: not suspended during key manipulation".into());
        }
        match words {
            [_, set, hex] if set.eq_ignore_ascii_case("set") => {
                let mut key = Zeroizing::new([0u8; MAX_KEY]);
                let n = decode_key(hex, &mut key).map_err(|e| format!("Invalid argument: key set: {e}"))?;
                if n != self.key_len {
                    return Err(format!(
                        "Invalid argument: key set: the key size may not change ({} bits given, {} expected)",
                        n * 8,
                        self.key_len * 8
                    ).into());
                }
                let s = Secret::new(&self.spec, &key[..n]).map_err(|e| format!("Invalid argument: key set: {e}"))?;
                self.keys.store(Some(Arc::new(s)));
                Ok(String::new())
            }
            [_, wipe] if wipe.eq_ignore_ascii_case("wipe") => {
                self.keys.store(None);
                Ok(String::new())
            }
            _ => Err(unrecognised(words).into()),
        }
    }
}

impl Crypt {
    /// Map a read or write of an integrity mode: the sectors go down with
    /// their tags ([`MapCtx::remap_owned_tagged`]); a read is checked and
    /// decrypted once its data and tags are back.
    fn map_tagged(
        &self,
        bio: Bio,
        ctx: &mut MapCtx,
        keys: Arc<Secret>,
        tl: aead::TagLayout,
    ) -> Result<(), MapErr> {
        let down = bio.shifted(self.offset);
        let layout = self.layout;
        // what tag_setup found the device below to store
        let profile = TagProfile {
            tag_size: tl.on_disk as u16,
            block_size: self.opts.sector_size,
        };
        let sectors = bio.bytes() as usize / layout.unit();
        if bio.op == Op::Write {
            let mut random = Vec::new();
            if tl.iv_kept {
                random.resize(sectors * 16, 0);
                if openssl::rand::rand_bytes(&mut random).is_err() {
                    tracing::error!("crypt: no random IVs (the random source failed): the write fails");
                    return Err(MapErr::Errno(errno::EIO));
                }
            }
            return ctx.remap_owned_tagged(
                &self.dev,
                down,
                Some(profile),
                |own, tags, client| match keys.keys() {
                    Some(k) if own.len() == client.len() && tags.len() == sectors * tl.on_disk => {
                        layout.seal(k, &tl, bio.sector, (client, own), tags, &random)
                    }
                    // never the plaintext (map checked there are keys and
                    // the engine sizes the buffers)
                    _ => {
                        own.fill(0);
                        tags.fill(0);
                    }
                },
                None,
            );
        }
        let dev = self.dev_name.clone();
        ctx.remap_owned_tagged(
            &self.dev,
            down,
            Some(profile),
            |_, _, _| {},
            Some(Box::new(move |ok, own, client| {
                if !ok {
                    return 0;
                }
                let n = client.len();
                let (Some(k), true) = (keys.keys(), own.len() == n + sectors * tl.on_disk) else {
                    return errno::EIO;
                };
                let (ct, tags) = own.split_at(n);
                match layout.open(k, &tl, bio.sector, ct, tags, client) {
                    Ok(()) => 0,
                    Err(s) => {
                        tracing::error!("crypt: {dev}: INTEGRITY AEAD ERROR, sector {s}");
                        client.fill(0);
                        libc::EILSEQ
                    }
                }
            })),
        )
    }
}

fn unrecognised(words: &[String]) -> String {
    // never echo a key back
    let first: Vec<&str> = words.iter().take(2).map(String::as_str).collect();
    format!(
        "Invalid argument: unrecognised message received: '{}' (key set <hexkey>, key wipe)",
        first.join(" ")
    )
}

impl Target for Crypt {
    fn type_name(&self) -> &'static str {
        TYPE.name
    }

    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let down = bio.shifted(self.offset);
        match bio.op {
            Op::Flush => return ctx.remap(&self.dev, down, 0),
            Op::Discard if self.opts.allow_discards => return ctx.remap(&self.dev, down, 0),
            Op::Discard | Op::WriteZeroes => {
                ctx.complete(bio, LeafKind::Fail(errno::EOPNOTSUPP));
                return Ok(());
            }
            Op::Read | Op::Write => {}
        }
        let spc = self.layout.spc;
        let keys = self.keys.load_full();
        let aligned = bio.sector.is_multiple_of(spc) && bio.nr_sectors.is_multiple_of(spc);
        let Some(keys) = keys.filter(|s| aligned && s.keys().is_some()) else {
            // no key (wiped), or I/O not aligned to the encryption sector
            ctx.complete(bio, LeafKind::Fail(errno::EIO));
            return Ok(());
        };
        let layout = self.layout;
        if let Some(tl) = self.tags {
            return self.map_tagged(bio, ctx, keys, tl);
        }
        if bio.op == Op::Write {
            ctx.remap_owned(
                &self.dev,
                down,
                |own, client| match keys.keys() {
                    Some(k) if own.len() == client.len() => layout.apply(k, true, bio.sector, Some(client), own),
                    Some(k) => {
                        let n = own.len().min(client.len());
                        own[..n].copy_from_slice(&client[..n]);
                        own[n..].fill(0);
                        layout.apply(k, true, bio.sector, None, own)
                    }
                    // never the plaintext (map checked there are keys)
                    None => own.fill(0),
                },
                None,
            )
        } else {
            ctx.remap_owned(
                &self.dev,
                down,
                |_, _| {},
                Some(Box::new(move |ok, own, client| {
                    if !ok {
                        return 0;
                    }
                    let (Some(k), true) = (keys.keys(), own.len() == client.len()) else {
                        return errno::EIO;
                    };
                    layout.apply(k, false, bio.sector, Some(own), client);
                    0
                })),
            )
        }
    }

    fn table_params(&self) -> String {
        let keys = self.keys.load();
        let key: String = if self.key_len == 0 {
            "-".into()
        } else {
            match keys.as_ref().and_then(|s| s.keys()) {
                Some(k) => k.key[..k.len].iter().map(|b| format!("{b:02x}")).collect(),
                // wiped: the kernel zeroes its copy
                None => "0".repeat(self.key_len * 2),
            }
        };
        self.params_with_key(&key)
    }

    /// The key as zeros, its length kept (dmsetup's table without --showkeys).
    fn table_params_keyless(&self) -> Option<String> {
        (self.key_len > 0).then(|| self.params_with_key(&"0".repeat(self.key_len * 2)))
    }

    fn message(&self, words: &[String]) -> Result<String, TargetError> {
        match words.first() {
            Some(w) if w.eq_ignore_ascii_case("key") && words.len() >= 2 => self.key_message(words),
            _ => Err(unrecognised(words).into()),
        }
    }

    fn devices(&self) -> Vec<&DevRef> {
        vec![&self.dev]
    }

    fn flush_bypasses_map(&self) -> bool {
        true
    }

    fn logical_block_size(&self) -> u32 {
        self.opts.sector_size
    }

    fn limits(&self) -> Limits {
        let below = Limits::stacked(&self.devices());
        Limits {
            discard: self.opts.allow_discards && below.discard,
            write_zeroes: false,
            io_min: below.io_min.max(u64::from(self.opts.sector_size)),
            ..below
        }
    }

    fn postsuspend(&self) {
        self.suspended.store(true, Ordering::SeqCst);
    }

    fn preresume(&self) -> Result<(), TargetError> {
        if self.keys.load().is_none() {
            return Err("aborting resume - crypt key is not set".into());
        }
        Ok(())
    }

    fn resume(&self) {
        self.suspended.store(false, Ordering::SeqCst);
    }
}


#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        ::hex::decode(s).expect("hex")
    }

    fn keys(cipher: &str, key: &str) -> Keys {
        Keys::new(&parse_cipher(cipher).unwrap(), &hex(key)).unwrap()
    }

    /// Encrypt one data unit of `pt` with IV sector `n` on the data path
    /// (XTS over OpenSSL's AES where the key is XTS's); check it decrypts back, and
    /// that the `aes` crate's path (LUKS keyslots, keys OpenSSL refuses)
    /// agrees both ways.
    fn enc(k: &Keys, n: u64, pt: &[u8]) -> Vec<u8> {
        let mut b = pt.to_vec();
        k.run(true, None, &mut b, pt.len(), |_| n);
        let mut apart = vec![0u8; pt.len()];
        k.run(true, Some(pt), &mut apart, pt.len(), |_| n);
        assert_eq!(apart, b, "from one buffer into another as in place");
        let mut soft = pt.to_vec();
        k.engine.sector(true, &mut soft, k.iv(n));
        assert_eq!(soft, b, "the aes crate's path encrypts alike");
        let mut d = b.clone();
        k.run(false, None, &mut d, pt.len(), |_| n);
        assert_eq!(d, pt, "decrypts back");
        k.engine.sector(false, &mut soft, k.iv(n));
        assert_eq!(soft, pt, "the aes crate's path decrypts back");
        b
    }

    #[test]
    fn openssl_takes_the_xts_keys_it_can() {
        let spec = parse_cipher("aes-xts-plain64").unwrap();
        let distinct: Vec<u8> = (0..64u8).collect();
        for n in [32, 48, 64] {
            let k = Keys::new(&spec, &distinct[..n]).unwrap();
            let o = k.ossl.as_ref().expect("XTS over OpenSSL's AES");
            // OpenSSL's own XTS for large sectors: not AES-192
            assert_eq!(o.xts.is_some(), n != 48, "{n}-byte key");
            // a set is reused, not made anew, by the next request
            let c = o.take(&k.key[..k.len]).expect("keyed");
            o.give_back(c);
            assert_eq!(o.pool.lock().unwrap().len(), 1);
            k.run(true, None, &mut [0u8; 512], 512, |i| i as u64);
            assert_eq!(o.pool.lock().unwrap().len(), 1);
        }
        // equal halves: over ECB only (OpenSSL's XTS refuses them)
        assert!(Keys::new(&spec, &[7; 64]).unwrap().ossl.as_ref().is_some_and(|o| o.xts.is_none()));
        // CBC: the aes crate
        assert!(Keys::new(&parse_cipher("aes-cbc-plain64").unwrap(), &distinct[..32])
            .unwrap()
            .ossl
            .is_none());
    }

    /// Many sectors in one call, as requests come (passes of XTS over ECB
    /// with a partial last one; OpenSSL's XTS a sector at a time), equal to
    /// the `aes` crate's path sector by sector, both ways, in place and
    /// from another buffer; every key size, equal halves, every sector size.
    #[test]
    fn many_sectors_in_one_call_equal_the_aes_crate_sector_by_sector() {
        let spec = parse_cipher("aes-xts-plain64").unwrap();
        let keys: Vec<Vec<u8>> = vec![
            (1..=32u8).collect(),
            (1..=48u8).collect(),
            (1..=64u8).map(|b| b.wrapping_mul(37)).collect(),
            vec![7; 64],
        ];
        for key in &keys {
            let k = Keys::new(&spec, key).unwrap();
            assert!(k.ossl.is_some(), "the test runs where memory can be locked");
            for unit in [48usize, 512, 1024, 2048, 4096] {
                let len = (2 * XTS_PASS / unit + 3) * unit;
                let pt: Vec<u8> = (0..len).map(|i| (i * 131 + i / 7) as u8).collect();
                let first = 1000 + unit as u64;
                let mut soft = pt.clone();
                for (i, s) in soft.chunks_exact_mut(unit).enumerate() {
                    k.engine.sector(true, s, k.iv(first + i as u64));
                }
                let mut inplace = pt.clone();
                k.run(true, None, &mut inplace, unit, |i| first + i as u64);
                assert!(inplace == soft, "{}-byte key, {unit}-byte sectors: encrypts alike in place", key.len());
                let mut apart = vec![0u8; len];
                k.run(true, Some(&pt), &mut apart, unit, |i| first + i as u64);
                assert!(apart == soft, "{}-byte key, {unit}-byte sectors: from another buffer", key.len());
                let mut back = vec![0u8; len];
                k.run(false, Some(&soft), &mut back, unit, |i| first + i as u64);
                assert!(back == pt, "{}-byte key, {unit}-byte sectors: decrypts back", key.len());
                k.run(false, None, &mut inplace, unit, |i| first + i as u64);
                assert!(inplace == pt, "{}-byte key, {unit}-byte sectors: decrypts back in place", key.len());
            }
        }
    }

    #[test]
    fn ciphers_parse_as_the_kernel_reads_them() {
        use IvMode::*;
        let ok = |s: &str, chain, iv| assert_eq!(parse_cipher(s), Ok(Spec { chain, iv, auth: None }), "{s}");
        ok("aes-xts-plain64", Chain::Xts, Some(Plain64));
        ok("aes-xts-plain", Chain::Xts, Some(Plain));
        ok("aes-xts-plain64be", Chain::Xts, Some(Plain64Be));
        ok("aes-cbc-essiv:sha256", Chain::Cbc, Some(Essiv));
        ok("aes-cbc-plain64", Chain::Cbc, Some(Plain64));
        ok("aes:1-cbc-null", Chain::Cbc, Some(Null));
        ok("aes", Chain::Cbc, Some(Plain));
        ok("aes-plain", Chain::Cbc, Some(Plain));
        ok("cipher_null-ecb", Chain::NullEcb, None);
        ok("capi:xts(aes)-plain64", Chain::Xts, Some(Plain64));
        ok("capi:cbc(aes)-essiv:sha256", Chain::Cbc, Some(Essiv));
        ok("capi:ecb(cipher_null)", Chain::NullEcb, None);
        let err = |s: &str, want: &str| {
            let e = parse_cipher(s).unwrap_err();
            assert!(e.what().contains(want), "{s}: {e}");
        };
        err("twofish-xts-plain64", "Error allocating crypto tfm");
        err("aes-ctr-plain64", "Error allocating crypto tfm");
        err("aes-xts", "IV mechanism required");
        err("aes-cbc-essiv", "Digest algorithm missing for ESSIV mode");
        err("aes-cbc-essiv:sha1", "not supported");
        err("aes-xts-bogus", "Invalid IV mode");
        err("aes-cbc-lmk", "not supported by dmkit");
        err("aes:3-xts-plain64", "Bad cipher key count specification");
        err("aes:4-xts-plain64", "supports one key");
        err("xts(aes)-plain64", "Bad cipher specification");
        err("capi:gcm(aes)-random", "Error allocating crypto tfm");
    }

    #[test]
    fn keys_decode_with_their_sizes_checked() {
        let mut k = [0u8; MAX_KEY];
        assert_eq!(decode_key("0aFf", &mut k), Ok(2));
        assert_eq!(&k[..2], &[0x0a, 0xff]);
        assert_eq!(decode_key("-", &mut k), Ok(0));
        assert!(decode_key("abc", &mut k).unwrap_err().what().contains("odd number"));
        assert!(decode_key("zz", &mut k).unwrap_err().what().contains("not hex"));
        assert!(decode_key(&"00".repeat(MAX_KEY + 1), &mut k).unwrap_err().what().contains("longer"));
        assert!(decode_key(":64:logon:cryptsetup:x", &mut k).unwrap_err().what().contains("--disable-keyring"));
        let spec = |s| parse_cipher(s).unwrap();
        for (c, n) in [("aes-xts-plain64", 32), ("aes-xts-plain64", 48), ("aes-xts-plain64", 64)] {
            assert!(Keys::new(&spec(c), &vec![1; n]).is_ok(), "{c} {n}");
        }
        for n in [16, 24, 32] {
            assert!(Keys::new(&spec("aes-cbc-essiv:sha256"), &vec![1; n]).is_ok());
        }
        let e = |c, n| Keys::new(&spec(c), &vec![1; n]).err().unwrap();
        assert!(e("aes-xts-plain64", 16).what().contains("256-, 384- or 512-bit"));
        assert!(e("aes-cbc-plain64", 64).what().contains("128-, 192- or 256-bit"));
        assert!(e("cipher_null-ecb", 16).what().contains("no key"));
        assert!(e("aes-xts-plain64", 0).what().contains("got 0 bits"));
    }

    #[test]
    fn options_parse_and_print_in_the_kernels_order() {
        let a = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let o = parse_opts(
            &a(&["4", "iv_large_sectors", "SECTOR_SIZE:4096", "allow_discards", "no_read_workqueue"]),
            8,
        );
        // sector_size is matched case-sensitively, as the kernel's sscanf does
        assert!(o.unwrap_err().what().contains("Invalid feature arguments"));
        let o = parse_opts(
            &a(&["5", "iv_large_sectors", "sector_size:4096", "Allow_Discards", "no_read_workqueue", "high_priority"]),
            8,
        )
        .unwrap();
        assert_eq!(
            o.table(),
            " 5 allow_discards high_priority no_read_workqueue sector_size:4096 iv_large_sectors"
        );
        assert_eq!(parse_opts(&[], 8).unwrap().table(), "");
        let err = |v: &[&str], want: &str| {
            let e = parse_opts(&a(v), 8).unwrap_err();
            assert!(e.what().contains(want), "{v:?}: {e}");
        };
        err(&["1", "bogus"], "Invalid feature arguments");
        err(&["10"], "Invalid number of feature args");
        err(&["x"], "Invalid number of feature args");
        err(&["2", "allow_discards"], "Not enough feature arguments");
        err(&["1", "sector_size:1000"], "Invalid feature value for sector_size");
        err(&["1", "sector_size:8192"], "Invalid feature value for sector_size");
        err(&["1", "sector_size:256"], "Invalid feature value for sector_size");
        assert!(parse_opts(&a(&["1", "sector_size:4096"]), 12)
            .unwrap_err()
            .what().contains("Device size is not multiple"));
        err(&["1", "integrity:0:aead"], "Invalid integrity arguments");
        err(&["1", "integrity:32:gcm"], "Unknown integrity profile");
        err(&["1", "integrity_key_size:16"], "not supported");
        let o = parse_opts(&a(&["3", "sector_size:4096", "integrity:48:aead", "allow_discards"]), 8).unwrap();
        assert_eq!(o.table(), " 3 allow_discards integrity:48:aead sector_size:4096", "crypt_status's order");
    }

    /// IEEE 1619-2007 XTS-AES vectors 2 and 3 (256-bit keys, 32-byte data
    /// units) and 10 (512-bit key, 512-byte data unit, sector 0xff).
    #[test]
    fn xts_matches_ieee_1619_vectors() {
        let k = keys("aes-xts-plain64", &format!("{}{}", "11".repeat(16), "22".repeat(16)));
        assert_eq!(
            enc(&k, 0x3333333333, &[0x44; 32]),
            hex("c454185e6a16936e39334038acef838bfb186fff7480adc4289382ecd6d394f0")
        );
        let k = keys("aes-xts-plain64", &format!("fffefdfcfbfaf9f8f7f6f5f4f3f2f1f0{}", "22".repeat(16)));
        assert_eq!(
            enc(&k, 0x3333333333, &[0x44; 32]),
            hex("af85336b597afc1a900b2eb21ec949d292df4c047e0b21532186a5971a227a89")
        );
        let k = keys(
            "aes-xts-plain64",
            "27182818284590452353602874713526624977572470936999595749669676273141592653589793238462643383279502884197169399375105820974944592",
        );
        let pt: Vec<u8> = (0..512).map(|i| i as u8).collect();
        let ct = [
            "1c3b3a102f770386e4836c99e370cf9bea00803f5e482357a4ae12d414a3e63b5d31e276f8fe4a8d66b317f9ac683f44",
            "680a86ac35adfc3345befecb4bb188fd5776926c49a3095eb108fd1098baec70aaa66999a72a82f27d848b21d4a741b0",
            "c5cd4d5fff9dac89aeba122961d03a757123e9870f8acf1000020887891429ca2a3e7a7d7df7b10355165c8b9a6d0a7d",
            "e8b062c4500dc4cd120c0f7418dae3d0b5781c34803fa75421c790dfe1de1834f280d7667b327f6c8cd7557e12ac3a0f",
            "93ec05c52e0493ef31a12d3d9260f79a289d6a379bc70c50841473d1a8cc81ec583e9645e07b8d9670655ba5bbcfecc6",
            "dc3966380ad8fecb17b6ba02469a020a84e18e8f84252070c13e9f1f289be54fbc481457778f616015e1327a02b140f1",
            "505eb309326d68378f8374595c849d84f4c333ec4423885143cb47bd71c5edae9be69a2ffeceb1bec9de244fbe15992b",
            "11b77c040f12bd8f6a975a44a0f90c29a9abc3d4d893927284c58754cce294529f8614dcd2aba991925fedc4ae74ffac",
            "6e333b93eb4aff0479da9a410e4450e0dd7ae4c6e2910900575da401fc07059f645e8b7e9bfdef33943054ff84011493",
            "c27b3429eaedb4ed5376441a77ed43851ad77f16f541dfd269d50d6a5f14fb0aab1cbb4c1550be97f7ab4066193c4caa",
            "773dad38014bd2092fa755c824bb5e54c4f36ffda9fcea70b9c6e693e148c151",
        ]
        .concat();
        assert_eq!(enc(&k, 0xff, &pt), hex(&ct));
        // plain (32-bit) drops the high bits the 64-bit IV keeps
        let p32 = keys("aes-xts-plain", &format!("{}{}", "11".repeat(16), "22".repeat(16)));
        assert_eq!(enc(&p32, 0x1_0000_0001, &[0; 32]), enc(&p32, 1, &[0; 32]));
    }

    /// The data path's XTS against the xts-mode crate's (block by block), for
    /// every key size, on sectors longer than one run of tweaks.
    #[test]
    fn xts_agrees_with_the_xts_mode_crate() {
        fn check<C: Block16>(key: &[u8]) {
            let k = keys("aes-xts-plain64", &key.iter().map(|b| format!("{b:02x}")).collect::<String>());
            let (a, b) = key.split_at(key.len() / 2);
            let reference = xts_mode::Xts128::new(C::new_from_slice(a).unwrap(), C::new_from_slice(b).unwrap());
            for (n, len) in [(0u64, 512usize), (u64::MAX, 4096), (0x1234_5678_9abc, 8192)] {
                let data = crate::rng::pattern(n ^ len as u64, len);
                let mut want = data.clone();
                reference.encrypt_sector(&mut want, xts_mode::get_tweak_default(u128::from(n)));
                assert_eq!(enc(&k, n, &data), want, "{} bits, sector {n}, {len} bytes", key.len() * 8);
            }
        }
        let key: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(29).wrapping_add(3)).collect();
        check::<Aes128>(&key[..32]);
        check::<Aes192>(&key[..48]);
        check::<Aes256>(&key);
    }

    #[test]
    fn ivs_are_the_kernels() {
        let k = keys("aes-cbc-plain64", &"01".repeat(16));
        assert_eq!(k.iv(0x0102), [2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        let k = keys("aes-cbc-plain", &"01".repeat(16));
        assert_eq!(k.iv(0x1_0000_0102)[..8], [2, 1, 0, 0, 0, 0, 0, 0]);
        let k = keys("aes-cbc-plain64be", &"01".repeat(16));
        assert_eq!(k.iv(0x0102), [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2]);
        let k = keys("aes-cbc-null", &"01".repeat(16));
        assert_eq!(k.iv(77), [0; 16]);
        // essiv: the plain64 IV encrypted with AES-256 keyed by sha256(key)
        let key = hex(&"01".repeat(16));
        let k = keys("aes-cbc-essiv:sha256", &"01".repeat(16));
        let salt: [u8; 32] = Sha256::digest(&key).into();
        let mut b = Array([0u8; 16]);
        b[0] = 5;
        Aes256::new_from_slice(&salt).unwrap().encrypt_block(&mut b);
        assert_eq!(k.iv(5), b.0);
    }

    #[test]
    fn large_sectors_number_ivs_in_sector_size_units() {
        let k = keys("aes-xts-plain64", &"07".repeat(32));
        let data: Vec<u8> = (0..8192u32).map(|i| (i * 7) as u8).collect();
        // target sector 16, iv_offset 8: 4096-byte sectors numbered 3 and 4
        let large = Layout { spc: 8, iv_offset: 8, large: true };
        let mut b = data.clone();
        large.apply(&k, true, 16, None, &mut b);
        assert_eq!(b[..4096], enc(&k, 3, &data[..4096]));
        assert_eq!(b[4096..], enc(&k, 4, &data[4096..]));
        // without iv_large_sectors they are numbered in 512-byte units: 24, 32
        let small = Layout { large: false, ..large };
        let mut b = data.clone();
        small.apply(&k, true, 16, None, &mut b);
        assert_eq!(b[..4096], enc(&k, 24, &data[..4096]));
        assert_eq!(b[4096..], enc(&k, 32, &data[4096..]));
        small.apply(&k, false, 16, None, &mut b);
        assert_eq!(b, data);
    }

    #[test]
    fn keys_live_in_locked_pages_and_wipe() {
        let s = Secret::new(&parse_cipher("aes-xts-plain64").unwrap(), &[9; 64]).unwrap();
        let addr = s.keys().map(|k| k as *const Keys as usize).unwrap();
        assert_eq!(addr % 4096, 0, "page-aligned");
        assert!(std::mem::size_of::<Page<Keys>>().is_multiple_of(4096));
        assert_eq!(s.keys().map(|k| k.key[..64].to_vec()), Some(vec![9; 64]));
    }
}
