//! The cdp journal's layout (docs/design/cdp.md): a superblock written once,
//! then two areas used in turn. An area begins with a checkpoint (the whole
//! index as of one commit) and goes on with batches (what each later commit
//! added), each sealed with a CRC32C; the area whose checkpoint is valid and
//! newest is the live one, and its batches are read up to the first that is
//! not whole. Little-endian throughout.

use crate::mapper::TargetError;
use crate::pdata::{le32, le64, put32, put64};

/// Bytes of the superblock (the first block of the journal device).
pub const SUPER_LEN: u64 = 4096;
/// Everything in an area starts at a multiple of this.
pub const UNIT: u64 = 512;
const SUPER_MAGIC: u64 = u64::from_le_bytes(*b"dmkitCDP");
const CKPT_MAGIC: u64 = u64::from_le_bytes(*b"cdpCKPT1");
const BATCH_MAGIC: u64 = u64::from_le_bytes(*b"cdpBATCH");
pub const VERSION: u32 = 1;
/// Bytes of a checkpoint's or a batch's header.
pub const HEAD_LEN: usize = 56;
/// The longest label a mark may carry.
pub const MAX_LABEL: usize = 64;
/// Bytes a version takes in a checkpoint or a batch, at most.
pub const VERSION_LEN: u64 = 25;
/// Bytes a point takes, at most (a marked one with the longest label).
pub const POINT_LEN: u64 = 25 + 1 + MAX_LABEL as u64;

/// The geometry, fixed when the journal is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Super {
    pub block_sectors: u32,
    pub data_blocks: u64,
    pub dev_blocks: u64,
    /// Bytes of each of the two areas.
    pub area_len: u64,
    /// Drawn when the journal is made: tells this journal's restart logs
    /// from those of an earlier journal on the same file.
    pub nonce: u64,
}

impl Super {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; SUPER_LEN as usize];
        put64(&mut b, 0, SUPER_MAGIC);
        put32(&mut b, 8, VERSION);
        put32(&mut b, 12, self.block_sectors);
        put64(&mut b, 16, self.data_blocks);
        put64(&mut b, 24, self.dev_blocks);
        put64(&mut b, 32, self.area_len);
        put64(&mut b, 40, self.nonce);
        let c = crc32c::crc32c(&b[..48]);
        put32(&mut b, 48, c);
        b
    }

    /// `None` when the block is all zeroes (a journal never used).
    pub fn decode(b: &[u8]) -> Result<Option<Super>, TargetError> {
        if b.len() < 52 {
            return Err("superblock: shorter than 52 bytes".into());
        }
        if b.iter().all(|&x| x == 0) {
            return Ok(None);
        }
        if le64(b, 0) != SUPER_MAGIC {
            return Err("the first 4 KiB are neither zeroes nor a cdp superblock (magic 'dmkitCDP'): not a cdp journal, left as it is".into());
        }
        if le32(b, 48) != crc32c::crc32c(&b[..48]) {
            return Err("superblock: checksum mismatch".into());
        }
        let v = le32(b, 8);
        if v != VERSION {
            return Err(format!("superblock: version {v}, this dmkit reads version {VERSION}").into());
        }
        Ok(Some(Super {
            block_sectors: le32(b, 12),
            data_blocks: le64(b, 16),
            dev_blocks: le64(b, 24),
            area_len: le64(b, 32),
            nonce: le64(b, 40),
        }))
    }

    /// Where area `i` (0 or 1) starts, in bytes of the journal device.
    pub fn area_start(&self, i: usize) -> u64 {
        SUPER_LEN + i as u64 * self.area_len
    }
}

/// A checkpoint's or a batch's header: which area generation it belongs to,
/// its sequence in the area (0 for the checkpoint), the last point it commits
/// and the client's flushes counted then, and the length and checksum of the
/// body after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Head {
    pub checkpoint: bool,
    pub gen: u64,
    pub seq: u64,
    pub committed: u64,
    pub flushes: u64,
    pub body_len: u64,
}

impl Head {
    pub fn encode(&self, body: &[u8]) -> [u8; HEAD_LEN] {
        let mut b = [0u8; HEAD_LEN];
        put64(&mut b, 0, if self.checkpoint { CKPT_MAGIC } else { BATCH_MAGIC });
        put64(&mut b, 8, self.gen);
        put64(&mut b, 16, self.seq);
        put64(&mut b, 24, self.committed);
        put64(&mut b, 32, self.flushes);
        put64(&mut b, 40, self.body_len);
        put32(&mut b, 48, crc32c::crc32c(body));
        let c = crc32c::crc32c(&b[..52]);
        put32(&mut b, 52, c);
        b
    }

    /// The header at the start of `b`, if it is one (of the kind asked for);
    /// the body's checksum is [`Head::body_ok`]'s to check.
    pub fn decode(b: &[u8], checkpoint: bool) -> Option<(Head, u32)> {
        if b.len() < HEAD_LEN {
            return None;
        }
        let magic = if checkpoint { CKPT_MAGIC } else { BATCH_MAGIC };
        if le64(b, 0) != magic || le32(b, 52) != crc32c::crc32c(&b[..52]) {
            return None;
        }
        Some((
            Head {
                checkpoint,
                gen: le64(b, 8),
                seq: le64(b, 16),
                committed: le64(b, 24),
                flushes: le64(b, 32),
                body_len: le64(b, 40),
            },
            le32(b, 48),
        ))
    }

    pub fn body_ok(crc: u32, body: &[u8]) -> bool {
        crc32c::crc32c(body) == crc
    }
}

/// `len` rounded up to a whole [`UNIT`].
pub fn padded(len: u64) -> u64 {
    len.div_ceil(UNIT) * UNIT
}

/// One record of a batch or a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// Block `block` holds, from flush point `fp` on, data block `slot`
    /// (`slot` [`super::state::ZEROES`]: it reads as zeroes).
    Version { block: u64, fp: u64, slot: u64 },
    /// Point `n`, the client's flush number `flush` (flushes and FUA writes
    /// counted from 1), acknowledged at `time_ns` (since the Unix epoch), and
    /// the label a `mark` gave it.
    Point {
        n: u64,
        flush: u64,
        time_ns: u64,
        label: Option<String>,
    },
    /// Point `n` is no longer kept.
    Drop { n: u64 },
}

const T_VERSION: u8 = 1;
const T_POINT: u8 = 2;
const T_DROP: u8 = 3;

impl Record {
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Record::Version { block, fp, slot } => {
                out.push(T_VERSION);
                for v in [block, fp, slot] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
            Record::Point { n, flush, time_ns, label } => {
                out.push(T_POINT);
                out.extend_from_slice(&n.to_le_bytes());
                out.extend_from_slice(&flush.to_le_bytes());
                out.extend_from_slice(&time_ns.to_le_bytes());
                let l = label.as_deref().unwrap_or("").as_bytes();
                let l = &l[..l.len().min(MAX_LABEL)];
                out.push(l.len() as u8);
                out.extend_from_slice(l);
            }
            Record::Drop { n } => {
                out.push(T_DROP);
                out.extend_from_slice(&n.to_le_bytes());
            }
        }
    }

    /// Every record of `body`, or what could not be read and at which byte.
    pub fn decode_all(body: &[u8]) -> Result<Vec<Record>, TargetError> {
        let mut r = Rd { b: body, at: 0 };
        let mut out = Vec::new();
        while r.at < body.len() {
            let start = r.at;
            let t = r.u8("record type")?;
            out.push(match t {
                T_VERSION => Record::Version {
                    block: r.u64("block")?,
                    fp: r.u64("flush point")?,
                    slot: r.u64("data block")?,
                },
                T_POINT => {
                    let n = r.u64("point")?;
                    let flush = r.u64("flush number")?;
                    let time_ns = r.u64("point time")?;
                    let len = usize::from(r.u8("label length")?);
                    if len > MAX_LABEL {
                        return Err(format!("byte {start}: label of {len} bytes (at most {MAX_LABEL})").into());
                    }
                    let l = r.take(len, "label")?;
                    let label = (len > 0).then(|| String::from_utf8_lossy(l).into_owned());
                    Record::Point { n, flush, time_ns, label }
                }
                T_DROP => Record::Drop { n: r.u64("dropped point")? },
                // zero padding ends a body
                0 if body[start..].iter().all(|&x| x == 0) => break,
                t => return Err(format!("byte {start}: unknown record type {t}").into()),
            });
        }
        Ok(out)
    }
}

/// A bounded reader that names the field it could not read.
struct Rd<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Rd<'a> {
    fn take(&mut self, n: usize, field: &str) -> Result<&'a [u8], TargetError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        match end {
            Some(e) => {
                let s = &self.b[self.at..e];
                self.at = e;
                Ok(s)
            }
            None => Err(format!("byte {}: {field} runs past the end ({} bytes)", self.at, self.b.len()).into()),
        }
    }

    fn u8(&mut self, field: &str) -> Result<u8, TargetError> {
        Ok(self.take(1, field)?[0])
    }

    fn u64(&mut self, field: &str) -> Result<u64, TargetError> {
        Ok(le64(self.take(8, field)?, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_lies_are_named() {
        let recs = vec![
            Record::Version { block: 3, fp: 7, slot: 9 },
            Record::Point {
                n: 7,
                flush: 6,
                time_ns: 12,
                label: Some("before-upgrade".into()),
            },
            Record::Point {
                n: 8,
                flush: 7,
                time_ns: 13,
                label: None,
            },
            Record::Drop { n: 2 },
        ];
        let mut b = Vec::new();
        for r in &recs {
            r.encode(&mut b);
        }
        let mut padded_body = b.clone();
        padded_body.resize(padded(b.len() as u64) as usize, 0);
        assert_eq!(Record::decode_all(&padded_body).unwrap(), recs);
        let cut = &b[..b.len() - 3];
        assert!(Record::decode_all(cut).unwrap_err().what().contains("dropped point runs past the end"));
        let mut bad = b.clone();
        bad[0] = 77;
        assert_eq!(Record::decode_all(&bad).unwrap_err(), "byte 0: unknown record type 77".into());
    }

    #[test]
    fn heads_and_supers_check_their_seals() {
        let h = Head {
            checkpoint: false,
            gen: 2,
            seq: 5,
            committed: 40,
            flushes: 39,
            body_len: 100,
        };
        let body = vec![1u8; 100];
        let e = h.encode(&body);
        let (d, crc) = Head::decode(&e, false).unwrap();
        assert_eq!(d, h);
        assert!(Head::body_ok(crc, &body));
        assert!(!Head::body_ok(crc, &[2u8; 100]));
        assert!(Head::decode(&e, true).is_none());
        let mut torn = e;
        torn[20] ^= 1;
        assert!(Head::decode(&torn, false).is_none());
        let s = Super {
            block_sectors: 8,
            data_blocks: 100,
            dev_blocks: 80,
            area_len: 1 << 20,
            nonce: 5,
        };
        assert_eq!(Super::decode(&s.encode()).unwrap(), Some(s));
        assert_eq!(Super::decode(&[0u8; 4096]).unwrap(), None);
        assert!(Super::decode(&[1u8; 4096]).unwrap_err().what().contains("not a cdp journal"));
    }
}
