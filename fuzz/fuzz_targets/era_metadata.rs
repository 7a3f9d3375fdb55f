//! Damaged dm-era metadata: a small valid image (eras archived into the
//! writeset tree, a current writeset, the era array digested, a metadata
//! snapshot held) with byte patches (4 bytes of offset, 1 byte of value,
//! repeated) applied, then opened, marked and committed, dumped, listed by
//! `era_invalidate` and checked. Unless the first input byte is odd, every
//! patched block is re-sealed (its checksum recomputed with the salt of what the
//! block held), so the patches reach the structure parsers: metadata that lies
//! with a valid checksum. Nothing may panic or abort.
#![no_main]
use dmkit::era::metadata::EraMetadata;
use dmkit::pdata::checksum::block_csum;
use dmkit::pdata::{BlockKind, MemDev, BLOCK_SIZE};
use libfuzzer_sys::fuzz_target;
use std::collections::BTreeSet;
use std::sync::OnceLock;

const KINDS: [BlockKind; 5] = [
    BlockKind::EraSuperblock,
    BlockKind::BtreeNode,
    BlockKind::Bitmap,
    BlockKind::Index,
    BlockKind::Array,
];

/// The era image, and what each of its blocks holds (None: free).
fn base() -> &'static (Vec<u8>, Vec<Option<BlockKind>>) {
    static B: OnceLock<(Vec<u8>, Vec<Option<BlockKind>>)> = OnceLock::new();
    B.get_or_init(|| {
        let dev = MemDev::new(256);
        let mut md = EraMetadata::format(Box::new(dev.clone()), 128).expect("format");
        md.resize(5000).expect("resize");
        for era in 0..4u64 {
            md.rollover().expect("rollover");
            for b in (era * 7..5000).step_by(13 + era as usize) {
                md.mark(b).expect("mark");
            }
            md.commit().expect("commit");
        }
        md.rollover().expect("rollover");
        md.digest_all().expect("digest");
        for b in (0..5000).step_by(31) {
            md.mark(b).expect("mark");
        }
        md.take_snap().expect("metadata snap");
        md.commit().expect("commit");
        let img = dev.image();
        let kinds = img
            .chunks_exact(BLOCK_SIZE)
            .map(|b| {
                let stored = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                KINDS.into_iter().find(|k| block_csum(b, k.salt()) == stored)
            })
            .collect();
        (img, kinds)
    })
}

fuzz_target!(|data: &[u8]| {
    let (img0, kinds) = base();
    let mut img = img0.clone();
    let reseal = data.first().is_none_or(|b| b & 1 == 0);
    let mut touched = BTreeSet::new();
    for p in data.get(1..).unwrap_or(&[]).chunks_exact(5) {
        let off = u32::from_le_bytes([p[0], p[1], p[2], p[3]]) as usize % img.len();
        img[off] = p[4];
        touched.insert(off / BLOCK_SIZE);
    }
    if reseal {
        for b in touched {
            let kind = kinds[b].unwrap_or(BlockKind::BtreeNode);
            let block: &mut [u8; BLOCK_SIZE] = (&mut img[b * BLOCK_SIZE..(b + 1) * BLOCK_SIZE])
                .try_into()
                .expect("a whole block");
            let c = block_csum(block, kind.salt());
            block[0..4].copy_from_slice(&c.to_le_bytes());
        }
    }
    let dev = || Box::new(MemDev::from_image(img.clone()));
    if let Ok(mut md) = EraMetadata::open(dev()) {
        let n = md.nr_blocks();
        for b in (0..n.min(6000)).step_by(97) {
            let _ = md.marked(b);
            let _ = md.mark(b);
        }
        let _ = md.digest_all();
        let _ = md.rollover().and_then(|_| md.commit());
    }
    let mut sink = std::io::sink();
    let _ = dmkit::era::tools::dump(dev(), false, &mut sink);
    let _ = dmkit::era::tools::dump(dev(), true, &mut sink);
    let _ = dmkit::era::tools::invalidate(dev(), 1, false);
    let _ = dmkit::era::tools::invalidate(dev(), 0, true);
    let _ = dmkit::era::tools::check(dev(), false, false);
});
