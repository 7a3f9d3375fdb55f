//! A cdp journal that lies under valid seals: the input is laid out as a
//! journal (superblock, two areas of checkpoints and batches), and every
//! superblock, header and body checksum is computed again before the replay,
//! so the records themselves are what is fuzzed. Any input gives an index or
//! an error naming what is wrong, never a panic or an allocation sized by a
//! field beyond what the table and the devices bound.
#![no_main]
use dmkit::targets::cdp::format::{padded, Head, Super, HEAD_LEN, SUPER_LEN, UNIT};
use dmkit::targets::cdp::journal;
use libfuzzer_sys::fuzz_target;

fn le64(d: &[u8], at: usize) -> u64 {
    d.get(at..at + 8)
        .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
}

fuzz_target!(|data: &[u8]| {
    if data.len() < SUPER_LEN as usize + 2 * UNIT as usize {
        return;
    }
    let mut img = data[..data.len() / UNIT as usize * UNIT as usize].to_vec();
    let size = img.len() as u64;
    // the device's blocks are bounded by the table's length, the data blocks by
    // the data device: small ones here
    let sup = Super {
        block_sectors: 8,
        data_blocks: le64(&img, 16) % (1 << 12),
        dev_blocks: le64(&img, 24) % (1 << 10),
        area_len: (le64(&img, 32) % ((size - SUPER_LEN) / 2 / UNIT + 1)) * UNIT,
        nonce: 0,
    };
    img[..SUPER_LEN as usize].copy_from_slice(&sup.encode());
    for area in 0..2 {
        let (start, end) = (sup.area_start(area), sup.area_start(area) + sup.area_len);
        let mut off = start;
        while off + UNIT <= end && img[off as usize + 1] != 0 {
            let o = off as usize;
            let room = end - off - HEAD_LEN as u64;
            let h = Head {
                checkpoint: off == start,
                gen: le64(&img, o + 8) % 4,
                seq: le64(&img, o + 16) % 8,
                committed: le64(&img, o + 24) % 64,
                flushes: le64(&img, o + 32),
                body_len: le64(&img, o + 40) % (room + 1),
            };
            let body_at = o + HEAD_LEN;
            let sealed = h.encode(&img[body_at..body_at + h.body_len as usize]);
            img[o..body_at].copy_from_slice(&sealed);
            off += padded(HEAD_LEN as u64 + h.body_len);
        }
    }
    let read = &mut |off: u64, buf: &mut [u8]| {
        let from = (off as usize).min(img.len());
        let n = buf.len().min(img.len() - from);
        buf[..n].copy_from_slice(&img[from..from + n]);
        buf[n..].fill(0);
        Ok(())
    };
    if let Ok(mut o) = journal::replay(read, size, sup) {
        o.index.rebuild_free();
        let _ = o.index.alloc();
    }
});
