//! Damaged dm-era metadata: a small valid image (eras archived into the
//! writeset tree, a current writeset, the era array digested over two of its
//! blocks, a metadata snapshot held) with byte patches (4 bytes of offset, 1
//! byte of value, repeated) applied, then opened, marked and committed, dumped
//! (plain or logical, the first input byte's bit 1 picking which), listed by
//! `era_invalidate` and checked. Unless the first input byte is odd, every
//! patched block is re-sealed (its checksum recomputed with the salt of what the
//! block held), so the patches reach the structure parsers: metadata that lies
//! with a valid checksum. Nothing may panic or abort.
#![no_main]
#[path = "../common.rs"]
mod common;
use dmkit::era::metadata::EraMetadata;
use dmkit::pdata::{BlockKind, MemDev};
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

const KINDS: [BlockKind; 5] = [
    BlockKind::EraSuperblock,
    BlockKind::BtreeNode,
    BlockKind::Bitmap,
    BlockKind::Index,
    BlockKind::Array,
];

/// Era blocks of the image: two blocks of the era array (1,018 entries each),
/// few enough that an input's dump is cheap.
const BLOCKS: u64 = 1100;

/// The era image, and what each of its blocks holds (None: free).
fn base() -> &'static (Vec<u8>, Vec<Option<BlockKind>>) {
    static B: OnceLock<(Vec<u8>, Vec<Option<BlockKind>>)> = OnceLock::new();
    B.get_or_init(|| {
        let dev = MemDev::new(64);
        let mut md = EraMetadata::format(Box::new(dev.clone()), 128).expect("format");
        md.resize(BLOCKS).expect("resize");
        for era in 0..4u64 {
            md.rollover().expect("rollover");
            for b in (era * 7..BLOCKS).step_by(13 + era as usize) {
                md.mark(b).expect("mark");
            }
            md.commit().expect("commit");
        }
        md.rollover().expect("rollover");
        md.digest_all().expect("digest");
        for b in (0..BLOCKS).step_by(31) {
            md.mark(b).expect("mark");
        }
        md.take_snap().expect("metadata snap");
        md.commit().expect("commit");
        assert_eq!(
            dmkit::era::tools::check(Box::new(dev.clone()), false, false),
            Ok(vec![]),
            "the base image is valid metadata"
        );
        let img = dev.image();
        let kinds = common::block_kinds(&img, &KINDS);
        (img, kinds)
    })
}

fuzz_target!(|data: &[u8]| {
    let (img0, kinds) = base();
    let img = common::patched(img0, kinds, data);
    let dev = || Box::new(MemDev::from_image(img.clone()));
    if let Ok(mut md) = EraMetadata::open(dev()) {
        let n = md.nr_blocks();
        for b in (0..n.min(BLOCKS + 1000)).step_by(97) {
            let _ = md.marked(b);
            let _ = md.mark(b);
        }
        // a bounded number of digest steps, as the target's worker takes them
        // (a whole digest of a lying writeset is work in proportion to its bits)
        for _ in 0..8 {
            if !matches!(md.digest_step(), Ok(true)) {
                break;
            }
        }
        let _ = md.rollover().and_then(|_| md.commit());
    }
    let mut sink = std::io::sink();
    let logical = data.first().is_some_and(|b| b & 2 != 0);
    let _ = dmkit::era::tools::dump(dev(), logical, &mut sink);
    let _ = dmkit::era::tools::invalidate(dev(), 1, false);
    let _ = dmkit::era::tools::invalidate(dev(), 0, true);
    let _ = dmkit::era::tools::check(dev(), false, false);
});
