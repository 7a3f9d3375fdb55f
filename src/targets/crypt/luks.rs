//! LUKS1 and LUKS2 headers: read them, unlock a keyslot with a passphrase, and
//! give the `crypt` table line that opens the data, as `cryptsetup open` loads
//! it (`dmsetup table --showkeys`), so a LUKS volume activates in dmkit
//! without the kernel or cryptsetup.
//!
//! What is read (from the LUKS1 and LUKS2 on-disk format specifications):
//! - LUKS1: the 592-byte header at byte 0 (big-endian): magic `LUKS\xba\xbe`,
//!   version 1, cipher name and mode, hash spec, payload offset (sectors), key
//!   bytes, the volume key's PBKDF2 digest (20 bytes) with its salt and
//!   iterations, uuid, and 8 keyslots (active flag, iterations, salt, key
//!   material offset in sectors, stripes).
//! - LUKS2: two 4096-byte binary headers (magic `LUKS\xba\xbe`, then
//!   `SKUL\xba\xbe` at the primary's header size), each followed by its JSON
//!   area and carrying a sha256 over both (with the checksum field zeroed). The
//!   primary is used; if its checksum fails, the secondary, found at the
//!   offsets LUKS2 allows for it. The JSON names keyslots (kdf, AF, area),
//!   digests and segments.
//!
//! Unlocking a keyslot: the passphrase through the keyslot's KDF (PBKDF2 or
//! Argon2i/Argon2id) keys the keyslot's own cipher, which decrypts the key
//! material (512-byte sectors, IVs numbered from 0 at the area's start) with
//! the crypt target's own ciphers; the anti-forensic merge (XOR of the stripes
//! with the hash's diffusion between them) gives a candidate volume key, which
//! unlocks if its PBKDF2 digest is the header's.
//!
//! Everything a header says that sizes memory or work is bounded before it is
//! used, and a field beyond its bound is an error naming it: the JSON area (at
//! most LUKS2's largest header, 4 MiB), key sizes (at most the 64 bytes of the
//! widest cipher the crypt target has), stripes (at most LUKS's 4000), the
//! keyslot area (at most LUKS2's 128 MiB; only the split key's sectors are
//! read), Argon2 memory (at most 4 GiB, cryptsetup's own limit), and KDF and
//! digest iterations.
//!
//! Key material (derived keys, the split key, the volume key) lives in locked,
//! wiped memory ([`LockedBytes`], the crypt target's `Secret` for the keyslot
//! cipher) and is never part of an error or a log line.
//!
//! Crates: `serde_json` (the LUKS2 JSON area, parsed into values whose fields
//! are looked up one by one, so an error names the field that is wrong);
//! `pbkdf2` with `sha1`/`sha2` (RustCrypto's PBKDF2-HMAC, the KDF of LUKS1 and
//! of LUKS2's pbkdf2 keyslots and digests); `argon2` (RustCrypto's Argon2,
//! the RFC 9106 function LUKS2 keyslots use by default); `base64ct`
//! (RustCrypto's constant-time base64 for the JSON's salts and digests).

use super::{parse_cipher, LockedBytes, Opts, Secret, MAX_KEY};
use base64ct::{Base64, Encoding};
use serde_json::Value;
use sha2::Digest;
use std::fmt;
use std::io::{BufRead, Read, Seek};
use std::os::unix::fs::FileExt;
use std::path::Path;
use zeroize::Zeroizing;

/// LUKS's anti-forensic stripes (cryptsetup writes no other number).
const MAX_STRIPES: u32 = 4000;
/// LUKS2's largest header (binary header and JSON area).
const MAX_HDR_SIZE: u64 = 0x40_0000;
/// LUKS2's largest keyslots area.
const MAX_AREA: u64 = 0x800_0000;
/// The largest Argon2 memory accepted, in KiB (4 GiB, cryptsetup's limit).
const MAX_ARGON2_KIB: u64 = 4 << 20;
/// The most Argon2 passes accepted.
const MAX_ARGON2_TIME: u64 = 1 << 20;
/// The most PBKDF2 iterations accepted (minutes of work already).
const MAX_PBKDF2_ITERATIONS: u64 = 1 << 30;
/// The most Argon2 lanes (the Argon2 function's own limit).
const MAX_ARGON2_CPUS: u64 = (1 << 24) - 1;
/// The longest passphrase or key file read (cryptsetup's default, 8 MiB).
pub const MAX_PASSPHRASE: usize = 8 << 20;
/// Where a LUKS2 secondary header may be (one of the header sizes LUKS2 allows).
const HDR2_OFFSETS: [u64; 9] = [
    0x4000, 0x8000, 0x1_0000, 0x2_0000, 0x4_0000, 0x8_0000, 0x10_0000, 0x20_0000, 0x40_0000,
];
const MAGIC1: &[u8; 6] = b"LUKS\xba\xbe";
const MAGIC2: &[u8; 6] = b"SKUL\xba\xbe";
const LUKS1_HDR: usize = 592;
const LUKS2_BIN: usize = 4096;
/// LUKS1's keyslot flag for an active slot.
const LUKS1_ACTIVE: u32 = 0x00AC_71F3;
const LUKS1_DIGEST: usize = 20;

/// Why a header gave no table.
#[derive(Debug)]
pub enum Error {
    /// The header, or the device: unreadable, malformed, or a field out of bounds.
    Header(String),
    /// No keyslot opens with this passphrase (cryptsetup's exit code 2).
    Passphrase(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Header(s) | Error::Passphrase(s) => f.write_str(s),
        }
    }
}

impl std::error::Error for Error {}

/// A field the header parser refuses: the header is malformed.
impl From<String> for Error {
    fn from(s: String) -> Error {
        Error::Header(s)
    }
}

impl Error {
    /// The exit code cryptsetup's `open` has for it.
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::Header(_) => 1,
            Error::Passphrase(_) => 2,
        }
    }
}

type Result<T> = std::result::Result<T, Error>;

fn bad(s: impl fmt::Display) -> Error {
    Error::Header(s.to_string())
}

/// The hashes LUKS names for PBKDF2, the AF diffusion and digests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hash {
    Sha1,
    Sha224,
    Sha256,
    Sha384,
    Sha512,
}

/// Run `$body` with `$d` the digest type of `$h`.
macro_rules! with_hash {
    ($h:expr, $d:ident => $body:expr) => {
        match $h {
            Hash::Sha1 => {
                type $d = sha1::Sha1;
                $body
            }
            Hash::Sha224 => {
                type $d = sha2::Sha224;
                $body
            }
            Hash::Sha256 => {
                type $d = sha2::Sha256;
                $body
            }
            Hash::Sha384 => {
                type $d = sha2::Sha384;
                $body
            }
            Hash::Sha512 => {
                type $d = sha2::Sha512;
                $body
            }
        }
    };
}

impl Hash {
    fn parse(s: &str, field: &str) -> Result<Hash> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "sha1" => Hash::Sha1,
            "sha224" => Hash::Sha224,
            "sha256" => Hash::Sha256,
            "sha384" => Hash::Sha384,
            "sha512" => Hash::Sha512,
            _ => {
                return Err(bad(format!(
                    "{field}: hash '{s}' is not supported by dmkit (sha1, sha224, sha256, sha384, sha512)"
                )))
            }
        })
    }

    fn name(self) -> &'static str {
        match self {
            Hash::Sha1 => "sha1",
            Hash::Sha224 => "sha224",
            Hash::Sha256 => "sha256",
            Hash::Sha384 => "sha384",
            Hash::Sha512 => "sha512",
        }
    }

    /// PBKDF2-HMAC with this hash into `out`.
    fn pbkdf2(self, pw: &[u8], salt: &[u8], rounds: u32, out: &mut [u8]) {
        with_hash!(self, D => pbkdf2::pbkdf2_hmac::<D>(pw, salt, rounds, out))
    }

    /// The AF diffusion of `block` in place: each hash-sized piece `i` (and
    /// the shorter last one) becomes H(be32(i) || piece), cut to its length.
    fn diffuse(self, block: &mut [u8]) {
        with_hash!(self, D => {
            for (i, piece) in block.chunks_mut(<D as Digest>::output_size()).enumerate() {
                let mut h = D::new();
                h.update((i as u32).to_be_bytes());
                h.update(&*piece);
                let mut out = h.finalize();
                piece.copy_from_slice(&out[..piece.len()]);
                zeroize::Zeroize::zeroize(&mut out[..]);
            }
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Argon2Type {
    I,
    Id,
}

#[derive(Debug)]
enum Kdf {
    Pbkdf2 {
        hash: Hash,
        iterations: u32,
        salt: Vec<u8>,
    },
    Argon2 {
        kind: Argon2Type,
        time: u32,
        memory_kib: u32,
        cpus: u32,
        salt: Vec<u8>,
    },
}

impl Kdf {
    /// The key derived from `pw` into `out`.
    fn derive(&self, pw: &[u8], out: &mut [u8], field: &str) -> Result<()> {
        match self {
            Kdf::Pbkdf2 { hash, iterations, salt } => {
                hash.pbkdf2(pw, salt, *iterations, out);
                Ok(())
            }
            Kdf::Argon2 {
                kind,
                time,
                memory_kib,
                cpus,
                salt,
            } => {
                let alg = match kind {
                    Argon2Type::I => argon2::Algorithm::Argon2i,
                    Argon2Type::Id => argon2::Algorithm::Argon2id,
                };
                let params = argon2::Params::new(*memory_kib, *time, *cpus, Some(out.len()))
                    .map_err(|e| bad(format!("{field}: Argon2 parameters refused: {e}")))?;
                argon2::Argon2::new(alg, argon2::Version::V0x13, params)
                    .hash_password_into(pw, salt, out)
                    .map_err(|e| bad(format!("{field}: Argon2 failed: {e}")))
            }
        }
    }

    fn describe(&self) -> String {
        match self {
            Kdf::Pbkdf2 { hash, iterations, .. } => format!("pbkdf2 {} {iterations} iterations", hash.name()),
            Kdf::Argon2 {
                kind,
                time,
                memory_kib,
                cpus,
                ..
            } => format!(
                "{} time {time} memory {memory_kib} KiB cpus {cpus}",
                match kind {
                    Argon2Type::I => "argon2i",
                    Argon2Type::Id => "argon2id",
                }
            ),
        }
    }
}

/// A keyslot, as both versions have it.
#[derive(Debug)]
struct Keyslot {
    id: u32,
    /// The volume key's bytes.
    key_size: usize,
    /// 0 ignore (tried only when named), 1 normal, 2 high (tried first).
    priority: u8,
    kdf: Kdf,
    af_hash: Hash,
    stripes: u32,
    /// The key material's place, in bytes from the header's start.
    area_offset: u64,
    area_size: u64,
    area_cipher: String,
    area_key_size: usize,
}

/// The volume key's digest.
#[derive(Debug)]
struct VkDigest {
    keyslots: Vec<u32>,
    segments: Vec<u32>,
    hash: Hash,
    iterations: u32,
    salt: Vec<u8>,
    digest: Vec<u8>,
}

/// The data segment.
#[derive(Debug)]
struct Segment {
    id: u32,
    /// Bytes from the device's start.
    offset: u64,
    /// Bytes; None: to the device's end.
    size: Option<u64>,
    iv_tweak: u64,
    cipher: String,
    sector_size: u32,
}

/// A LUKS header, read and checked.
#[derive(Debug)]
pub struct Header {
    version: u16,
    uuid: String,
    label: String,
    /// Which LUKS2 binary header was used ("primary", or why the secondary).
    copy: String,
    keyslots: Vec<Keyslot>,
    digests: Vec<VkDigest>,
    segment: Segment,
    /// LUKS2's persistent activation flags, as the crypt target's options.
    flags: Opts,
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

/// A NUL-terminated string field.
fn cstr(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

fn read_exact(f: &std::fs::File, path: &Path, at: u64, buf: &mut [u8], what: &str) -> Result<()> {
    f.read_exact_at(buf, at).map_err(|e| {
        let why = if e.kind() == std::io::ErrorKind::UnexpectedEof {
            format!("the device ends before byte {}", at.saturating_add(buf.len() as u64))
        } else {
            e.to_string()
        };
        bad(format!("{}: reading {what} ({} bytes at byte {at}): {why}", path.display(), buf.len()))
    })
}

/// Read the LUKS header of `path` (a file or a block device).
pub fn read_header(path: &Path) -> Result<Header> {
    let f = std::fs::File::open(path).map_err(|e| bad(format!("{}: {e}", path.display())))?;
    let mut bin = [0u8; LUKS2_BIN];
    read_exact(&f, path, 0, &mut bin[..LUKS1_HDR], "the LUKS header")?;
    if &bin[..6] != MAGIC1 {
        // a LUKS2 device whose primary header is gone still has its secondary
        if let Some(h) = luks2_secondary(&f, path, "the primary header has no LUKS magic".into())? {
            return Ok(h);
        }
        return Err(bad(format!("{}: not a LUKS device (no LUKS magic at byte 0)", path.display())));
    }
    match be16(&bin, 6) {
        1 => luks1(&bin[..LUKS1_HDR], path),
        2 => match luks2_copy(&f, path, 0, MAGIC1) {
            Ok((bin, json)) => luks2_parse(path, "primary", &bin, &json),
            Err(primary) => match luks2_secondary(&f, path, primary.to_string())? {
                Some(h) => Ok(h),
                None => Err(primary),
            },
        },
        v => Err(bad(format!("{}: LUKS version {v} is not supported (1 or 2)", path.display()))),
    }
}

fn luks1(h: &[u8], path: &Path) -> Result<Header> {
    let p = path.display();
    let field = |name: &str| format!("{p}: LUKS1 header: {name}");
    let cipher = format!("{}-{}", cstr(&h[8..40]), cstr(&h[40..72]));
    parse_cipher(&cipher).map_err(|e| bad(format!("{}: {e}", field("cipher-name, cipher-mode"))))?;
    let hash = Hash::parse(&cstr(&h[72..104]), &field("hash-spec"))?;
    let payload = u64::from(be32(h, 104));
    let key_bytes = be32(h, 108) as usize;
    if key_bytes == 0 || key_bytes > MAX_KEY {
        return Err(bad(format!(
            "{}: {key_bytes} bytes (1 to {MAX_KEY}, what the ciphers dmkit has take)",
            field("key-bytes")
        )));
    }
    let iterations = bounded_iterations(u64::from(be32(h, 164)), &field("mk-digest-iter"))?;
    let mut digest = VkDigest {
        keyslots: Vec::new(),
        segments: vec![0],
        hash,
        iterations,
        salt: h[132..164].to_vec(),
        digest: h[112..112 + LUKS1_DIGEST].to_vec(),
    };
    let mut keyslots = Vec::new();
    for i in 0..8u32 {
        let k = &h[208 + 48 * i as usize..208 + 48 * (i as usize + 1)];
        if be32(k, 0) != LUKS1_ACTIVE {
            continue;
        }
        let f = |name: &str| field(&format!("key-slot-{i} {name}"));
        let stripes = bounded_stripes(u64::from(be32(k, 44)), &f("stripes"))?;
        let iterations = bounded_iterations(u64::from(be32(k, 4)), &f("iterations"))?;
        let offset = u64::from(be32(k, 40)) * 512;
        keyslots.push(Keyslot {
            id: i,
            key_size: key_bytes,
            priority: 1,
            kdf: Kdf::Pbkdf2 {
                hash,
                iterations,
                salt: k[8..40].to_vec(),
            },
            af_hash: hash,
            stripes,
            area_offset: offset,
            area_size: (key_bytes as u64 * u64::from(stripes)).div_ceil(512) * 512,
            area_cipher: cipher.clone(),
            area_key_size: key_bytes,
        });
    }
    digest.keyslots = keyslots.iter().map(|k| k.id).collect();
    Ok(Header {
        version: 1,
        uuid: cstr(&h[168..208]),
        label: String::new(),
        copy: "primary".into(),
        keyslots,
        digests: vec![digest],
        segment: Segment {
            id: 0,
            offset: payload * 512,
            size: None,
            iv_tweak: 0,
            cipher,
            sector_size: 512,
        },
        flags: Opts {
            sector_size: 512,
            ..Opts::default()
        },
    })
}

fn bounded_iterations(n: u64, field: &str) -> Result<u32> {
    if n == 0 || n > MAX_PBKDF2_ITERATIONS {
        return Err(bad(format!(
            "{field}: {n} PBKDF2 iterations (1 to {MAX_PBKDF2_ITERATIONS} accepted)"
        )));
    }
    Ok(n as u32)
}

fn bounded_stripes(n: u64, field: &str) -> Result<u32> {
    if n == 0 || n > u64::from(MAX_STRIPES) {
        return Err(bad(format!("{field}: {n} stripes (1 to {MAX_STRIPES}, LUKS's number)")));
    }
    Ok(n as u32)
}

/// The secondary LUKS2 header, if one with a valid checksum is at an offset
/// LUKS2 allows (its JSON's errors are final); `why` says what was wrong with
/// the primary.
fn luks2_secondary(f: &std::fs::File, path: &Path, why: String) -> Result<Option<Header>> {
    for off in HDR2_OFFSETS {
        let mut magic = [0u8; 6];
        if f.read_exact_at(&mut magic, off).is_err() || &magic != MAGIC2 {
            continue;
        }
        if let Ok((bin, json)) = luks2_copy(f, path, off, MAGIC2) {
            let mut h = luks2_parse(path, "secondary", &bin, &json)?;
            h.copy = format!("secondary at byte {off} ({why})");
            return Ok(Some(h));
        }
    }
    Ok(None)
}

/// The LUKS2 binary header at `off` and its JSON area, once its magic,
/// sizes and checksum hold (what decides whether the secondary is used).
fn luks2_copy(f: &std::fs::File, path: &Path, off: u64, magic: &[u8; 6]) -> Result<([u8; LUKS2_BIN], Vec<u8>)> {
    let p = path.display();
    let which = if off == 0 { "primary" } else { "secondary" };
    let mut bin = [0u8; LUKS2_BIN];
    read_exact(f, path, off, &mut bin, "a LUKS2 binary header")?;
    if &bin[..6] != magic {
        return Err(bad(format!("{p}: no LUKS2 {which} header magic at byte {off}")));
    }
    if be16(&bin, 6) != 2 {
        return Err(bad(format!("{p}: LUKS2 {which} header: version {} (2)", be16(&bin, 6))));
    }
    let hdr_size = be64(&bin, 8);
    if !HDR2_OFFSETS.contains(&hdr_size) {
        return Err(bad(format!(
            "{p}: LUKS2 {which} header: hdr_size {hdr_size} is not a size LUKS2 allows (16 KiB to {} KiB, a power of 2)",
            MAX_HDR_SIZE >> 10
        )));
    }
    if be64(&bin, 256) != off {
        return Err(bad(format!(
            "{p}: LUKS2 {which} header: hdr_offset {} where it lies at byte {off}",
            be64(&bin, 256)
        )));
    }
    let alg = cstr(&bin[72..104]);
    if alg != "sha256" {
        return Err(bad(format!(
            "{p}: LUKS2 {which} header: checksum_alg '{alg}' is not supported (sha256)"
        )));
    }
    // hdr_size is one of the sizes above: at most 4 MiB
    let mut json = vec![0u8; hdr_size as usize - LUKS2_BIN];
    read_exact(f, path, off + LUKS2_BIN as u64, &mut json, "the LUKS2 JSON area")?;
    let mut h = sha2::Sha256::new();
    h.update(&bin[..448]);
    h.update([0u8; 64]);
    h.update(&bin[512..]);
    h.update(&json);
    let sum = h.finalize();
    if sum[..] != bin[448..480] {
        return Err(bad(format!("{p}: LUKS2 {which} header at byte {off}: checksum mismatch")));
    }
    Ok((bin, json))
}

/// The header a checksummed LUKS2 copy gives: its JSON's errors are final.
fn luks2_parse(path: &Path, which: &str, bin: &[u8; LUKS2_BIN], json: &[u8]) -> Result<Header> {
    let p = path.display();
    let end = json.iter().position(|&c| c == 0).unwrap_or(json.len());
    let v: Value = serde_json::from_slice(&json[..end])
        .map_err(|e| bad(format!("{p}: LUKS2 {which} header: the JSON area does not parse: {e}")))?;
    let mut hdr = luks2_json(&v).map_err(|e| bad(format!("{p}: LUKS2 header: {e}")))?;
    hdr.uuid = cstr(&bin[168..208]);
    hdr.label = cstr(&bin[24..72]);
    hdr.copy = which.into();
    Ok(hdr)
}

/// A JSON object's field, or an error naming it (`at` is where the object is).
fn get<'a>(v: &'a Value, at: &str, key: &str) -> Result<&'a Value> {
    v.get(key).ok_or_else(|| format!("{at}: no field '{key}'")).map_err(Error::from)
}

fn get_str<'a>(v: &'a Value, at: &str, key: &str) -> Result<&'a str> {
    get(v, at, key)?
        .as_str()
        .ok_or_else(|| format!("{at}.{key}: not a string")).map_err(Error::from)
}

/// A number the JSON gives as a number or (LUKS2's 64-bit values) a decimal string.
fn get_u64(v: &Value, at: &str, key: &str) -> Result<u64> {
    let f = get(v, at, key)?;
    f.as_u64()
        .or_else(|| f.as_str().and_then(|s| s.parse().ok()))
        .ok_or_else(|| format!("{at}.{key}: {f} is not a non-negative integer")).map_err(Error::from)
}

fn get_bounded(v: &Value, at: &str, key: &str, lo: u64, hi: u64, what: &str) -> Result<u64> {
    let n = get_u64(v, at, key)?;
    if n < lo || n > hi {
        return Err(format!("{at}.{key}: {n} is out of bounds ({lo} to {hi}{what})").into());
    }
    Ok(n)
}

/// Base64 of at most `max` bytes.
fn get_b64(v: &Value, at: &str, key: &str, max: usize) -> Result<Vec<u8>> {
    let s = get_str(v, at, key)?;
    let mut buf = vec![0u8; max];
    if s.len() > max.div_ceil(3) * 4 {
        return Err(format!("{at}.{key}: longer than {max} bytes").into());
    }
    let n = Base64::decode(s, &mut buf)
        .map_err(|e| format!("{at}.{key}: not base64: {e}"))?
        .len();
    buf.truncate(n);
    Ok(buf)
}

fn objects<'a>(v: &'a Value, key: &str) -> Result<Vec<(u32, &'a Value)>> {
    let o = get(v, "the JSON", key)?
        .as_object()
        .ok_or_else(|| format!("{key}: not an object"))?;
    let mut out = Vec::new();
    for (k, x) in o {
        let id = k
            .parse::<u32>()
            .ok()
            .filter(|&id| id < 32)
            .ok_or_else(|| format!("{key}: '{k}' is not an id from 0 to 31"))?;
        out.push((id, x));
    }
    out.sort_by_key(|(id, _)| *id);
    Ok(out)
}

fn ids(v: &Value, at: &str, key: &str) -> Result<Vec<u32>> {
    get(v, at, key)?
        .as_array()
        .ok_or_else(|| format!("{at}.{key}: not an array"))?
        .iter()
        .map(|x| {
            x.as_str()
                .and_then(|s| s.parse::<u32>().ok())
                .ok_or_else(|| bad(format_args!("{at}.{key}: {x} is not an id")))
        })
        .collect()
}

/// A keyslot of the LUKS2 JSON (None: a kind that holds no volume key).
fn keyslot(id: u32, k: &Value) -> Result<Option<Keyslot>> {
    let at = format!("keyslots.{id}");
    let ty = get_str(k, &at, "type")?;
    if ty != "luks2" {
        // reencryption's keyslots hold no volume key
        return Ok(None);
    }
    let key_size = get_bounded(k, &at, "key_size", 1, MAX_KEY as u64, " bytes, what the ciphers dmkit has take")?;
    let priority = match k.get("priority") {
        None => 1,
        Some(_) => get_bounded(k, &at, "priority", 0, 2, "")? as u8,
    };
    let af_at = format!("{at}.af");
    let af = get(k, &at, "af")?;
    let af_type = get_str(af, &af_at, "type")?;
    if af_type != "luks1" {
        return Err(format!("{af_at}.type: '{af_type}' is not supported (luks1)").into());
    }
    let stripes = bounded_stripes(get_u64(af, &af_at, "stripes")?, &format!("{af_at}.stripes"))
        .map_err(|e| e.to_string())?;
    let af_hash = Hash::parse(get_str(af, &af_at, "hash")?, &format!("{af_at}.hash")).map_err(|e| e.to_string())?;
    let area_at = format!("{at}.area");
    let area = get(k, &at, "area")?;
    let area_type = get_str(area, &area_at, "type")?;
    if area_type != "raw" {
        return Err(format!("{area_at}.type: '{area_type}' is not supported (raw)").into());
    }
    let area_offset = get_bounded(area, &area_at, "offset", 0, 2 * MAX_HDR_SIZE + MAX_AREA, " bytes")?;
    let area_size = get_bounded(area, &area_at, "size", 0, MAX_AREA, " bytes, LUKS2's largest keyslots area")?;
    let area_key_size = get_bounded(area, &area_at, "key_size", 1, MAX_KEY as u64, " bytes")? as usize;
    let need = key_size * u64::from(stripes);
    if area_size < need {
        return Err(format!(
            "{area_at}.size: {area_size} bytes cannot hold the {need} bytes of key material ({key_size} bytes x {stripes} stripes)"
        ).into());
    }
    let kdf_at = format!("{at}.kdf");
    let kdf = get(k, &at, "kdf")?;
    let salt = get_b64(kdf, &kdf_at, "salt", 128)?;
    let kdf = match get_str(kdf, &kdf_at, "type")? {
        "pbkdf2" => Kdf::Pbkdf2 {
            hash: Hash::parse(get_str(kdf, &kdf_at, "hash")?, &format!("{kdf_at}.hash"))
                .map_err(|e| e.to_string())?,
            iterations: get_bounded(kdf, &kdf_at, "iterations", 1, MAX_PBKDF2_ITERATIONS, "")? as u32,
            salt,
        },
        t @ ("argon2i" | "argon2id") => Kdf::Argon2 {
            kind: if t == "argon2i" { Argon2Type::I } else { Argon2Type::Id },
            time: get_bounded(kdf, &kdf_at, "time", 1, MAX_ARGON2_TIME, "")? as u32,
            memory_kib: get_bounded(kdf, &kdf_at, "memory", 8, MAX_ARGON2_KIB, " KiB: at most 4 GiB")? as u32,
            cpus: get_bounded(kdf, &kdf_at, "cpus", 1, MAX_ARGON2_CPUS, "")? as u32,
            salt,
        },
        t => return Err(format!("{kdf_at}.type: '{t}' is not supported (pbkdf2, argon2i, argon2id)").into()),
    };
    Ok(Some(Keyslot {
        id,
        key_size: key_size as usize,
        priority,
        kdf,
        af_hash,
        stripes,
        area_offset,
        area_size,
        area_cipher: get_str(area, &area_at, "encryption")?.to_string(),
        area_key_size,
    }))
}

/// The one crypt segment of the LUKS2 JSON.
fn segment(v: &Value) -> Result<Segment> {
    let segs = objects(v, "segments")?;
    let [(id, s)] = segs.as_slice() else {
        return Err(format!(
            "segments: {} segments (a reencryption in progress?); dmkit opens one crypt segment",
            segs.len()
        ).into());
    };
    let at = format!("segments.{id}");
    let ty = get_str(s, &at, "type")?;
    if ty != "crypt" {
        return Err(format!("{at}.type: '{ty}' is not supported (crypt)").into());
    }
    if s.get("integrity").is_some_and(|i| !i.is_null()) {
        return Err(format!(
            "{at}.integrity: an integrity-protected volume is two devices (dm-integrity under dm-crypt), \
             more than the one table this prints: open it with cryptsetup behind the door \
             (dmkit exec -- cryptsetup open --disable-keyring ...)"
        )
        .into());
    }
    let size = match get_str(s, &at, "size") {
        Ok("dynamic") => None,
        _ => Some(get_u64(s, &at, "size")?),
    };
    let sector_size = get_u64(s, &at, "sector_size")?;
    if !(512..=4096).contains(&sector_size) || !sector_size.is_power_of_two() {
        return Err(format!("{at}.sector_size: {sector_size} (a power of 2 from 512 to 4096)").into());
    }
    let segment = Segment {
        id: *id,
        offset: get_u64(s, &at, "offset")?,
        size,
        iv_tweak: get_u64(s, &at, "iv_tweak")?,
        cipher: get_str(s, &at, "encryption")?.to_string(),
        sector_size: sector_size as u32,
    };
    if !segment.offset.is_multiple_of(512) || segment.size.is_some_and(|n| !n.is_multiple_of(sector_size)) {
        return Err(format!("{at}: offset and size must be whole sectors").into());
    }
    // a cipher the crypt target would refuse is refused here, by its field
    parse_cipher(&segment.cipher).map_err(|e| format!("{at}.encryption: {e}"))?;
    Ok(segment)
}

/// The JSON's `config`: no mandatory requirement dmkit lacks, and its flags
/// as the crypt table's options.
fn config_flags(v: &Value, segment: &Segment) -> Result<Opts> {
    let config = v.get("config");
    if let Some(req) = config
        .and_then(|c| c.get("requirements"))
        .and_then(|r| r.get("mandatory"))
        .and_then(Value::as_array)
        .filter(|r| !r.is_empty())
    {
        let names: Vec<String> = req.iter().map(|x| x.as_str().unwrap_or("?").to_string()).collect();
        return Err(format!(
            "config.requirements.mandatory: {} (a reencryption in progress, or a feature dmkit does not have)",
            names.join(", ")
        ).into());
    }
    let mut flags = Opts {
        sector_size: segment.sector_size,
        ..Opts::default()
    };
    if let Some(list) = config.and_then(|c| c.get("flags")).and_then(Value::as_array) {
        for f in list.iter().filter_map(Value::as_str) {
            match f {
                "allow-discards" => flags.allow_discards = true,
                "same-cpu-crypt" => flags.same_cpu_crypt = true,
                "submit-from-crypt-cpus" => flags.submit_from_crypt_cpus = true,
                "no-read-workqueue" => flags.no_read_workqueue = true,
                "no-write-workqueue" => flags.no_write_workqueue = true,
                _ => {}
            }
        }
    }
    Ok(flags)
}

fn luks2_json(v: &Value) -> Result<Header> {
    let mut keyslots = Vec::new();
    for (id, k) in objects(v, "keyslots")? {
        keyslots.extend(keyslot(id, k)?);
    }
    let mut digests = Vec::new();
    for (id, d) in objects(v, "digests")? {
        let at = format!("digests.{id}");
        let ty = get_str(d, &at, "type")?;
        if ty != "pbkdf2" {
            return Err(format!("{at}.type: '{ty}' is not supported (pbkdf2)").into());
        }
        digests.push(VkDigest {
            keyslots: ids(d, &at, "keyslots")?,
            segments: ids(d, &at, "segments")?,
            hash: Hash::parse(get_str(d, &at, "hash")?, &format!("{at}.hash")).map_err(|e| e.to_string())?,
            iterations: get_bounded(d, &at, "iterations", 1, MAX_PBKDF2_ITERATIONS, "")? as u32,
            salt: get_b64(d, &at, "salt", 128)?,
            digest: get_b64(d, &at, "digest", 64)?,
        });
    }
    let segment = segment(v)?;
    let flags = config_flags(v, &segment)?;
    Ok(Header {
        version: 2,
        uuid: String::new(),
        label: String::new(),
        copy: String::new(),
        keyslots,
        digests,
        segment,
        flags,
    })
}

impl Header {
    /// A short summary of what the header says (not cryptsetup's text).
    pub fn summary(&self) -> String {
        let s = &self.segment;
        let mut out = format!("version: {}\n", self.version);
        if self.version == 2 {
            out += &format!("header: {}\n", self.copy);
        }
        out += &format!("uuid: {}\n", self.uuid);
        if !self.label.is_empty() {
            out += &format!("label: {}\n", self.label);
        }
        out += &format!("cipher: {}\n", s.cipher);
        if let Some(k) = self.keyslots.first() {
            out += &format!("volume key: {} bits\n", k.key_size * 8);
        }
        out += &format!("sector size: {}\n", s.sector_size);
        out += &format!("data offset: {} bytes ({} sectors)\n", s.offset, s.offset / 512);
        match s.size {
            None => out += "data size: to the device's end\n",
            Some(n) => out += &format!("data size: {n} bytes\n"),
        }
        if s.iv_tweak != 0 {
            out += &format!("iv tweak: {}\n", s.iv_tweak);
        }
        out += &format!("keyslots: {}\n", self.keyslots.len());
        for k in &self.keyslots {
            out += &format!(
                "  {}: {}; af luks1 {} stripes {}; area {} {} bits at byte {} ({} bytes){}\n",
                k.id,
                k.kdf.describe(),
                k.stripes,
                k.af_hash.name(),
                k.area_cipher,
                k.area_key_size * 8,
                k.area_offset,
                k.area_size,
                match k.priority {
                    0 => ", priority ignore",
                    2 => ", priority high",
                    _ => "",
                }
            );
        }
        for d in &self.digests {
            out += &format!(
                "digest: pbkdf2 {} {} iterations, keyslots {}\n",
                d.hash.name(),
                d.iterations,
                d.keyslots.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")
            );
        }
        out
    }

    /// The volume key the passphrase unlocks: from keyslot `slot`, else from
    /// the first active one that opens (high priority first, "ignore" ones
    /// skipped), and that keyslot's number.
    pub fn unlock(&self, path: &Path, pw: &[u8], slot: Option<u32>) -> Result<(LockedBytes, u32)> {
        let f = std::fs::File::open(path).map_err(|e| bad(format!("{}: {e}", path.display())))?;
        let mut order: Vec<&Keyslot> = match slot {
            Some(n) => {
                let k = self.keyslots.iter().find(|k| k.id == n).ok_or_else(|| {
                    bad(format!(
                        "{}: keyslot {n} is not active (active: {})",
                        path.display(),
                        self.keyslots.iter().map(|k| k.id.to_string()).collect::<Vec<_>>().join(" ")
                    ))
                })?;
                vec![k]
            }
            None => self.keyslots.iter().filter(|k| k.priority > 0).collect(),
        };
        order.sort_by_key(|k| std::cmp::Reverse(k.priority));
        if order.is_empty() {
            return Err(bad(format!("{}: no active keyslot", path.display())));
        }
        for k in order {
            if let Some(vk) = self.try_keyslot(&f, path, k, pw)? {
                return Ok((vk, k.id));
            }
        }
        Err(Error::Passphrase(match slot {
            Some(n) => format!("{}: keyslot {n} does not open with this passphrase", path.display()),
            None => format!("{}: no key slot matches this passphrase", path.display()),
        }))
    }

    fn try_keyslot(&self, f: &std::fs::File, path: &Path, k: &Keyslot, pw: &[u8]) -> Result<Option<LockedBytes>> {
        let at = format!("{}: keyslot {}", path.display(), k.id);
        let spec = parse_cipher(&k.area_cipher).map_err(|e| bad(format!("{at}: {e}")))?;
        let mut derived = LockedBytes::new(k.area_key_size).map_err(bad)?;
        k.kdf.derive(pw, derived.as_mut_slice(), &at)?;
        let area = Secret::new(&spec, derived.as_slice()).map_err(|e| bad(format!("{at}: {e}")))?;
        drop(derived);
        let keys = area.keys().ok_or_else(|| bad(format!("{at}: no key")))?;
        // bounded: key_size <= MAX_KEY, stripes <= MAX_STRIPES
        let split_len = k.key_size * k.stripes as usize;
        let mut split = LockedBytes::new(split_len.div_ceil(512) * 512).map_err(bad)?;
        read_exact(f, path, k.area_offset, split.as_mut_slice(), &format!("keyslot {}'s key material", k.id))?;
        for (i, s) in split.as_mut_slice().chunks_exact_mut(512).enumerate() {
            keys.engine.sector(false, s, keys.iv(i as u64));
        }
        let vk = af_merge(&split.as_slice()[..split_len], k.key_size, k.af_hash)?;
        for d in self.digests.iter().filter(|d| d.keyslots.contains(&k.id)) {
            if d.segments.contains(&self.segment.id) && digest_matches(d, vk.as_slice())? {
                return Ok(Some(vk));
            }
        }
        Ok(None)
    }

    /// The table line that opens the data of `device` (of `dev_bytes` bytes)
    /// with `vk`, as `dmsetup table --showkeys` shows it for cryptsetup's open.
    pub fn table(&self, vk: &LockedBytes, device: &str, dev_bytes: u64) -> Result<Zeroizing<String>> {
        let s = &self.segment;
        let bytes = match s.size {
            Some(n) => n,
            None => dev_bytes.checked_sub(s.offset).filter(|&n| n > 0).ok_or_else(|| {
                bad(format!(
                    "{device}: the data offset ({} bytes) is beyond the device's {dev_bytes} bytes",
                    s.offset
                ))
            })?,
        };
        if s.size.is_some_and(|n| s.offset.saturating_add(n) > dev_bytes) {
            return Err(bad(format!(
                "{device}: the data segment ({bytes} bytes at byte {}) ends beyond the device's {dev_bytes} bytes",
                s.offset
            )));
        }
        if !bytes.is_multiple_of(u64::from(s.sector_size)) {
            return Err(bad(format!(
                "{device}: the data ({bytes} bytes) is not a whole number of {}-byte sectors",
                s.sector_size
            )));
        }
        let mut line = Zeroizing::new(format!("0 {} crypt {} ", bytes / 512, s.cipher));
        let mut key = Zeroizing::new(vec![0u8; vk.len() * 2]);
        hex::encode_to_slice(vk.as_slice(), &mut key).map_err(|e| bad(format!("hex: {e}")))?;
        line.push_str(std::str::from_utf8(&key).map_err(|_| bad("hex is not UTF-8"))?);
        line.push_str(&format!(" {} {device} {}{}", s.iv_tweak, s.offset / 512, self.flags.table()));
        Ok(line)
    }
}

/// The LUKS AF merge: the stripes XORed in turn into a block diffused after
/// each but the last; the volume key, in locked memory.
fn af_merge(split: &[u8], key_size: usize, hash: Hash) -> Result<LockedBytes> {
    let mut block = LockedBytes::new(key_size).map_err(bad)?;
    let stripes: Vec<&[u8]> = split.chunks_exact(key_size).collect();
    let Some((last, rest)) = stripes.split_last() else {
        return Err(bad("no stripes"));
    };
    for s in rest {
        block.as_mut_slice().iter_mut().zip(*s).for_each(|(b, x)| *b ^= x);
        hash.diffuse(block.as_mut_slice());
    }
    block.as_mut_slice().iter_mut().zip(*last).for_each(|(b, x)| *b ^= x);
    Ok(block)
}

/// Whether `vk`'s PBKDF2 digest is `d`'s.
fn digest_matches(d: &VkDigest, vk: &[u8]) -> Result<bool> {
    if d.digest.is_empty() {
        return Ok(false);
    }
    let mut out = Zeroizing::new(vec![0u8; d.digest.len()]);
    d.hash.pbkdf2(vk, &d.salt, d.iterations, &mut out);
    Ok(out.iter().zip(&d.digest).fold(0u8, |a, (x, y)| a | (x ^ y)) == 0)
}

/// The size in bytes of the file or block device `path`.
pub fn device_bytes(path: &Path) -> Result<u64> {
    let mut f = std::fs::File::open(path).map_err(|e| bad(format!("{}: {e}", path.display())))?;
    // seeking to the end works for block devices too (their metadata says 0)
    f.seek(std::io::SeekFrom::End(0))
        .map_err(|e| bad(format!("{}: finding its size: {e}", path.display())))
}

/// A passphrase from `r`: all of it from a key file (`key_file`), else up to
/// the first newline, as cryptsetup reads one from standard input; at most
/// [`MAX_PASSPHRASE`] bytes, in locked memory.
pub fn read_passphrase(r: impl BufRead, key_file: bool) -> Result<LockedBytes> {
    let mut buf = Zeroizing::new(Vec::with_capacity(4096));
    let mut r = r.take(MAX_PASSPHRASE as u64 + 1);
    let read = if key_file {
        r.read_to_end(&mut buf)
    } else {
        // a line: a terminal's input ends there, not at end of file
        r.read_until(b'\n', &mut buf)
    };
    read.map_err(|e| format!("reading the passphrase: {e}"))?;
    if buf.len() > MAX_PASSPHRASE {
        return Err(format!("the passphrase is longer than {} MiB", MAX_PASSPHRASE >> 20).into());
    }
    let n = if key_file {
        buf.len()
    } else {
        buf.iter().position(|&c| c == b'\n').unwrap_or(buf.len())
    };
    LockedBytes::from_slice(&buf[..n]).map_err(bad)
}

/// `dmkit luks table`: the table line for `path`'s LUKS volume, unlocked by
/// `pw` (keyslot `slot` only, if given), naming the device `device`.
pub fn table(path: &Path, pw: &[u8], slot: Option<u32>, device: &str) -> Result<Zeroizing<String>> {
    let h = read_header(path)?;
    let (vk, _) = h.unlock(path, pw, slot)?;
    h.table(&vk, device, device_bytes(path)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// AF merge of a split made here by the definition: stripes 0..n-1
    /// random, the last the key XOR the diffused chain.
    #[test]
    fn af_merge_inverts_the_split() {
        for hash in [Hash::Sha1, Hash::Sha256, Hash::Sha512] {
            let key: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(7)).collect();
            let stripes = 5;
            let mut split = crate::rng::pattern(3, 64 * stripes);
            let mut d = vec![0u8; 64];
            for s in split.chunks(64).take(stripes - 1) {
                d.iter_mut().zip(s).for_each(|(a, b)| *a ^= b);
                hash.diffuse(&mut d);
            }
            let last: Vec<u8> = d.iter().zip(&key).map(|(a, b)| a ^ b).collect();
            split[64 * (stripes - 1)..].copy_from_slice(&last);
            assert_eq!(af_merge(&split, 64, hash).unwrap().as_slice(), &key[..], "{hash:?}");
        }
    }

    /// Diffusion hashes each piece with its index, the last one cut short.
    #[test]
    fn diffuse_hashes_pieces_with_their_index() {
        let mut b = [7u8; 40];
        Hash::Sha256.diffuse(&mut b);
        let mut h0 = sha2::Sha256::new();
        h0.update([0, 0, 0, 0]);
        h0.update([7u8; 32]);
        assert_eq!(b[..32], h0.finalize()[..]);
        let mut h1 = sha2::Sha256::new();
        h1.update([0, 0, 0, 1]);
        h1.update([7u8; 8]);
        assert_eq!(b[32..], h1.finalize()[..8]);
    }

    #[test]
    fn locked_bytes_are_page_aligned_and_sized() {
        let mut l = LockedBytes::new(5000).unwrap();
        assert_eq!(l.len(), 5000);
        assert_eq!(l.as_slice().as_ptr() as usize % 4096, 0);
        l.as_mut_slice()[4999] = 1;
        assert_eq!(l.as_slice()[4999], 1);
        assert!(LockedBytes::new(0).unwrap().is_empty());
    }
}
