//! Damaged thin-pool metadata: a small valid pool image with byte patches
//! (4 bytes of offset, 1 byte of value, repeated) applied, then opened, looked
//! up and checked. Unless the first input byte is odd, every patched block is
//! re-sealed afterwards (its checksum recomputed with the salt of what the block
//! held, a btree node's for a block that was free), so the patches reach the
//! structure parsers instead of stopping at "bad checksum": this is metadata that
//! lies with a valid checksum. Nothing may panic or abort, and the checker must
//! not call clean what cannot be opened.
#![no_main]
use dmkit::pdata::checksum::block_csum;
use dmkit::pdata::{BlockKind, MemDev, BLOCK_SIZE};
use dmkit::thin::{FormatOptions, ThinPoolMetadata};
use libfuzzer_sys::fuzz_target;
use std::collections::BTreeSet;
use std::sync::OnceLock;

/// The pool image, and what each of its blocks holds (None: free).
fn base() -> &'static (Vec<u8>, Vec<Option<BlockKind>>) {
    static B: OnceLock<(Vec<u8>, Vec<Option<BlockKind>>)> = OnceLock::new();
    B.get_or_init(|| {
        let dev = MemDev::new(256);
        let opts = FormatOptions {
            data_block_size: 128,
            nr_data_blocks: 4096,
            cache_blocks: 64,
        };
        let mut md = ThinPoolMetadata::format(Box::new(dev.clone()), opts).expect("format");
        md.create_thin(0).expect("thin");
        for vb in 0..600u64 {
            let b = md.alloc_data_block().expect("alloc");
            md.insert(0, vb * 7, b).expect("insert");
        }
        md.create_snap(1, 0).expect("snap");
        md.reserve_metadata_snap().expect("metadata snap");
        md.commit().expect("commit");
        let img = dev.image();
        let kinds = img
            .chunks_exact(BLOCK_SIZE)
            .map(|b| {
                let stored = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                [BlockKind::Superblock, BlockKind::BtreeNode, BlockKind::Bitmap, BlockKind::Index]
                    .into_iter()
                    .find(|k| block_csum(b, k.salt()) == stored)
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
            // the self block number stays as patched, lies included
            let c = block_csum(block, kind.salt());
            block[0..4].copy_from_slice(&c.to_le_bytes());
        }
    }
    let opened = ThinPoolMetadata::open(Box::new(MemDev::from_image(img.clone())), 16);
    let open_failed = opened.is_err();
    if let Ok(mut md) = opened {
        for dev in md.devices() {
            for vb in (0..5000u64).step_by(97) {
                let _ = md.lookup(dev, vb);
            }
        }
    }
    let report = dmkit::thin::check::check(Box::new(MemDev::from_image(img)), false);
    assert!(
        !(open_failed && report.ok()),
        "the checker calls clean metadata that cannot be opened"
    );
});
