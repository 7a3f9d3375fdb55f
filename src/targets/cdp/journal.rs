//! The journal device: made when blank, replayed when opened, appended to at
//! each commit, and its two areas swapped when the live one is full
//! ([`super::format`] has the layout).

use crate::mapper::TargetError;
use super::format::{padded, Head, Record, Super, HEAD_LEN, POINT_LEN, SUPER_LEN, UNIT, VERSION_LEN};
use super::state::{Index, Point, Version};
use crate::mapper::devio;
use crate::mapper::engine::Dest;

/// Where the next commit goes.
#[derive(Clone, Copy, Debug)]
pub struct Pos {
    pub area: usize,
    pub gen: u64,
    pub seq: u64,
    /// Byte offset on the journal device.
    pub off: u64,
}

/// The most a checkpoint can take for this geometry: every point, and every
/// version (at most two per data block, a data version and the zeroes that
/// replaced it, and one per device block).
pub fn max_checkpoint(data_blocks: u64, dev_blocks: u64, max_points: u64) -> u64 {
    padded(HEAD_LEN as u64 + POINT_LEN * max_points + VERSION_LEN * (2 * data_blocks + dev_blocks))
}

/// The journal bytes a geometry needs: the superblock and two areas, each room
/// for two of the largest checkpoints (a checkpoint is written when the area
/// is full, so batches get at least its room again).
pub fn needed(data_blocks: u64, dev_blocks: u64, max_points: u64) -> u64 {
    SUPER_LEN + 2 * 2 * max_checkpoint(data_blocks, dev_blocks, max_points)
}

/// A journal opened: its geometry, the index it holds (its free data blocks
/// not yet counted: [`Index::rebuild_free`] once what a restart log adds is
/// in), the last committed point and where the next commit goes.
pub struct Opened {
    pub sup: Super,
    pub index: Index,
    pub committed: u64,
    /// The client's flushes counted at that point.
    pub flushes: u64,
    pub pos: Pos,
    pub made: bool,
}

/// Read-ahead for the replay.
const CHUNK: u64 = 1 << 20;

/// Reads `buf.len()` bytes of the journal at a byte offset (a multiple of 512).
pub type ReadAt<'a> = &'a mut dyn FnMut(u64, &mut [u8]) -> std::io::Result<()>;

struct Reader<'a> {
    read: ReadAt<'a>,
    size: u64,
    start: u64,
    buf: Vec<u8>,
}

impl Reader<'_> {
    /// `len` bytes at `off` (both multiples of [`UNIT`]).
    fn bytes(&mut self, off: u64, len: u64) -> Result<&[u8], TargetError> {
        let have = off >= self.start && off + len <= self.start + self.buf.len() as u64;
        if !have {
            let n = padded(len.max(CHUNK));
            self.buf.resize(n as usize, 0);
            self.start = off;
            let n = n.min(self.size.saturating_sub(off));
            self.buf.truncate(n as usize);
            (self.read)(off, &mut self.buf).map_err(|e| format!("reading the journal at byte {off}: {e}"))?;
            if (self.buf.len() as u64) < len {
                return Err(format!("the journal ends before byte {}", off + len).into());
            }
        }
        let at = (off - self.start) as usize;
        Ok(&self.buf[at..at + len as usize])
    }
}

/// Apply one checkpoint's or batch's records to `ix`.
fn apply(ix: &mut Index, recs: Vec<Record>, committed: u64, where_: &str) -> Result<(), TargetError> {
    let dev_blocks = ix.cur.len() as u64;
    let mut scratch = Vec::new();
    for r in recs {
        match r {
            Record::Version { block, fp, slot } => {
                let older = block < dev_blocks && fp < ix.cur[block as usize].fp;
                if block >= dev_blocks || !ix.slot_ok(slot) || fp > committed || fp == 0 || older {
                    return Err(format!(
                        "{where_}: version of block {block} at point {fp} in data block {slot} lies outside the device ({dev_blocks} blocks), the data device or the points committed ({committed}), or before the block's last version"
                    ).into());
                }
                ix.install(block, Version { fp, slot }, committed, committed);
            }
            Record::Point { n, flush, time_ns, label } => {
                if n > committed {
                    return Err(format!("{where_}: point {n} after the last committed ({committed})").into());
                }
                ix.points.insert(n, Point { flush, time_ns, label });
            }
            Record::Drop { n } => ix.drop_point(n, &mut scratch),
        }
    }
    Ok(())
}

/// Read one sealed piece (checkpoint or batch) at `off` of the area that ends at
/// `end`: its header and records, or `None` where none is whole.
fn piece(
    rd: &mut Reader,
    off: u64,
    end: u64,
    checkpoint: bool,
) -> Result<Option<(Head, Vec<Record>, u64)>, TargetError> {
    if off + UNIT > end {
        return Ok(None);
    }
    let Some((h, crc)) = Head::decode(rd.bytes(off, UNIT)?, checkpoint) else {
        return Ok(None);
    };
    if h.body_len > end - off - HEAD_LEN as u64 {
        return Ok(None);
    }
    let total = padded(HEAD_LEN as u64 + h.body_len);
    let all = rd.bytes(off, total)?;
    let body = &all[HEAD_LEN..HEAD_LEN + h.body_len as usize];
    if !Head::body_ok(crc, body) {
        return Ok(None);
    }
    let recs = Record::decode_all(body).map_err(|e| format!("journal byte {off}: a sealed record list that does not parse: {e}"))?;
    Ok(Some((h, recs, total)))
}

/// Open the journal on `dest` for a device of `dev_blocks` blocks of
/// `block_sectors` over `data_blocks` data blocks: made when its first 4 KiB are
/// zero, else replayed (its geometry must be the table's).
pub fn open(dest: &Dest, block_sectors: u32, data_blocks: u64, dev_blocks: u64) -> Result<Opened, TargetError> {
    let mut first = vec![0u8; SUPER_LEN as usize];
    devio::read(dest, 0, &mut first).map_err(|e| format!("reading the journal's superblock: {e}"))?;
    let size = devio::size_sectors(dest) * 512;
    let sup = match Super::decode(&first)? {
        None => return make(dest, block_sectors, data_blocks, dev_blocks, size),
        Some(s) => s,
    };
    if sup.block_sectors != block_sectors || sup.dev_blocks != dev_blocks {
        return Err(format!(
            "the journal was made for {} blocks of {} sectors, the table asks {dev_blocks} of {block_sectors}",
            sup.dev_blocks, sup.block_sectors
        ).into());
    }
    if sup.data_blocks > data_blocks {
        return Err(format!(
            "the journal was made for {} data blocks, the data device holds {data_blocks}",
            sup.data_blocks
        ).into());
    }
    replay(&mut |off, buf| devio::read(dest, off / 512, buf), size, sup)
}

/// The index a journal of `size` bytes with superblock `sup` holds, read
/// through `read`: the newest whole checkpoint and the whole batches after it.
pub fn replay(read: ReadAt, size: u64, sup: Super) -> Result<Opened, TargetError> {
    let fits = sup
        .area_len
        .checked_mul(2)
        .and_then(|a| a.checked_add(SUPER_LEN))
        .is_some_and(|end| end <= size);
    if sup.area_len < UNIT || !sup.area_len.is_multiple_of(UNIT) || !fits {
        return Err(format!("the journal's areas ({} bytes each) do not fit its {size} bytes", sup.area_len).into());
    }
    let dev_blocks = sup.dev_blocks;
    let mut rd = Reader {
        read,
        size,
        start: 0,
        buf: Vec::new(),
    };
    // the newer of the two areas whose checkpoint is whole
    let mut best: Option<(usize, Head, Vec<Record>, u64)> = None;
    for area in 0..2 {
        let start = sup.area_start(area);
        if let Some((h, recs, len)) = piece(&mut rd, start, start + sup.area_len, true)? {
            if best.as_ref().is_none_or(|b| h.gen > b.1.gen) {
                best = Some((area, h, recs, len));
            }
        }
    }
    let Some((area, head, recs, len)) = best else {
        return Err("neither journal area holds a whole checkpoint".into());
    };
    let mut ix = Index::new(dev_blocks as usize, sup.data_blocks);
    let mut committed = head.committed;
    let mut flushes = head.flushes;
    apply(&mut ix, recs, committed, "checkpoint")?;
    let end = sup.area_start(area) + sup.area_len;
    let mut off = sup.area_start(area) + len;
    let mut seq = 1;
    while let Some((h, recs, len)) = piece(&mut rd, off, end, false)? {
        if h.gen != head.gen || h.seq != seq || h.committed < committed {
            break;
        }
        committed = h.committed;
        flushes = h.flushes;
        apply(&mut ix, recs, committed, &format!("batch {seq} at journal byte {off}"))?;
        off += len;
        seq += 1;
    }
    Ok(Opened {
        sup,
        index: ix,
        committed,
        flushes,
        pos: Pos {
            area,
            gen: head.gen,
            seq,
            off,
        },
        made: false,
    })
}

fn make(dest: &Dest, block_sectors: u32, data_blocks: u64, dev_blocks: u64, size: u64) -> Result<Opened, TargetError> {
    let area_len = (size.saturating_sub(SUPER_LEN) / 2) / UNIT * UNIT;
    let mut n = [0u8; 8];
    // a trial's: from its seed; else the clock and the process
    let nonce = if crate::sync::sched::seeded_bytes(&mut n) {
        u64::from_le_bytes(n)
    } else {
        crate::sync::wall_ns() ^ (u64::from(std::process::id()) << 40)
    };
    let sup = Super {
        block_sectors,
        data_blocks,
        dev_blocks,
        area_len,
        nonce,
    };
    let ix = Index::new(dev_blocks as usize, data_blocks);
    let mut pos = Pos {
        area: 1,
        gen: 0,
        seq: 0,
        off: 0,
    };
    // the empty checkpoint first, the superblock after it: a journal with a
    // superblock always has a checkpoint
    let (off, ck) = checkpoint(&ix, (0, 0), &mut pos, &sup);
    devio::write(dest, off / 512, &ck, false)
        .and_then(|()| devio::write(dest, 0, &sup.encode(), false))
        .and_then(|()| devio::flush(dest))
        .map_err(|e| format!("making the journal: {e}"))?;
    Ok(Opened {
        sup,
        index: ix,
        committed: 0,
        flushes: 0,
        pos,
        made: true,
    })
}

/// A checkpoint of `ix` as of point `committed` (the client's flushes counted
/// then: `flushes`), for the other area, and where it goes: `pos` moves
/// there, past it (its next batch is sequence 1).
pub fn checkpoint(ix: &Index, (committed, flushes): (u64, u64), pos: &mut Pos, sup: &Super) -> (u64, Vec<u8>) {
    let mut body = Vec::new();
    for (&n, p) in &ix.points {
        Record::Point {
            n,
            flush: p.flush,
            time_ns: p.time_ns,
            label: p.label.clone(),
        }
        .encode(&mut body);
    }
    ix.journaled_versions(committed, |block, v| {
        Record::Version {
            block,
            fp: v.fp,
            slot: v.slot,
        }
        .encode(&mut body)
    });
    pos.area = 1 - pos.area;
    pos.gen += 1;
    pos.seq = 1;
    let out = sealed(
        Head {
            checkpoint: true,
            gen: pos.gen,
            seq: 0,
            committed,
            flushes,
            body_len: body.len() as u64,
        },
        &body,
    );
    let off = sup.area_start(pos.area);
    pos.off = off + out.len() as u64;
    (off, out)
}

/// A batch of `records` and where it goes (`pos`, which moves past it), or
/// `None` if it does not fit in the area.
pub fn batch(records: &[u8], (committed, flushes): (u64, u64), pos: &mut Pos, sup: &Super) -> Option<(u64, Vec<u8>)> {
    let total = padded(HEAD_LEN as u64 + records.len() as u64);
    if pos.off + total > sup.area_start(pos.area) + sup.area_len {
        return None;
    }
    let out = sealed(
        Head {
            checkpoint: false,
            gen: pos.gen,
            seq: pos.seq,
            committed,
            flushes,
            body_len: records.len() as u64,
        },
        records,
    );
    let off = pos.off;
    pos.seq += 1;
    pos.off += out.len() as u64;
    Some((off, out))
}

fn sealed(h: Head, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(padded(HEAD_LEN as u64 + body.len() as u64) as usize);
    out.extend_from_slice(&h.encode(body));
    out.extend_from_slice(body);
    out.resize(padded(out.len() as u64) as usize, 0);
    out
}
