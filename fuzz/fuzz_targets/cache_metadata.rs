//! Damaged dm-cache metadata: small valid images (version 1 and 2: mappings,
//! some dirty, hints, a discard bitset) with byte patches (4 bytes of offset, 1
//! byte of value, repeated) applied, then opened, looked up, remapped, marked
//! dirty and clean, committed, dumped (plain or repairing: the first input
//! byte's bit 2 picks which), checked, repaired and written back to in-memory
//! files. The first input byte's bit 1 picks the version; unless it is odd,
//! every patched block is re-sealed (its checksum
//! recomputed with the salt of what the block held), so the patches reach the
//! structure parsers: metadata that lies with a valid checksum. Nothing may
//! panic or abort.
#![no_main]
#[path = "../common.rs"]
mod common;
use dmkit::cache::metadata::CacheMetadata;
use dmkit::pdata::{BlockKind, MemDev};
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

const KINDS: [BlockKind; 5] = [
    BlockKind::CacheSuperblock,
    BlockKind::BtreeNode,
    BlockKind::Bitmap,
    BlockKind::Index,
    BlockKind::Array,
];

type Base = (Vec<u8>, Vec<Option<BlockKind>>);

/// Cache blocks of the images: three blocks of the mapping array (509 entries
/// each), two of the hint array, few enough that an input's dump is cheap.
const BLOCKS: u64 = 1100;

/// The cache image of `version`, and what each of its blocks holds.
fn make(version: u32) -> Base {
    let dev = MemDev::new(64);
    let mut md = CacheMetadata::format(Box::new(dev.clone()), 128, version).expect("format");
    md.resize(BLOCKS).expect("resize");
    // origin blocks inside the origin the discard bitset covers (256 sectors
    // x BLOCKS: 2 x BLOCKS blocks of 128 sectors), each named once (7 is prime
    // to 2 x BLOCKS)
    for c in (0..BLOCKS).step_by(3) {
        md.insert(c, (c * 7 + 1) % (2 * BLOCKS)).expect("insert");
        if c % 9 == 0 {
            md.set_dirty(c, true).expect("dirty");
        }
    }
    md.resize_discards(256, BLOCKS).expect("discards");
    for d in (0..BLOCKS).step_by(17) {
        md.set_discard(d, true).expect("discard");
    }
    let hints: Vec<u32> = (0..BLOCKS as u32).collect();
    md.save_hints("smq", [2, 0, 0], Some(&hints)).expect("hints");
    md.commit(true).expect("commit");
    assert_eq!(
        dmkit::cache::tools::check(Box::new(dev.clone()), &Default::default()),
        Ok(vec![]),
        "the base image is valid metadata"
    );
    let img = dev.image();
    let kinds = common::block_kinds(&img, &KINDS);
    (img, kinds)
}

fn base(version: u32) -> &'static Base {
    static B: [OnceLock<Base>; 2] = [OnceLock::new(), OnceLock::new()];
    B[(version - 1) as usize].get_or_init(|| make(version))
}

fuzz_target!(|data: &[u8]| {
    let version = if data.first().is_some_and(|b| b & 2 != 0) {
        2
    } else {
        1
    };
    let (img0, kinds) = base(version);
    let img = common::patched(img0, kinds, data);
    let dev = || Box::new(MemDev::from_image(img.clone()));
    if let Ok(mut md) = CacheMetadata::open(dev()) {
        let n = md.nr_cache_blocks();
        for c in (0..n.min(BLOCKS + 1000)).step_by(97) {
            let _ = md.lookup(c);
            let _ = md.insert(c, 5000 + c);
            let _ = md.set_dirty(c, true);
            let _ = md.set_dirty(c, false);
            let _ = md.discarded(c);
        }
        let _ = md.mappings();
        let _ = md.hints();
        let _ = md.resize(n / 2);
        let _ = md.commit(false);
    }
    let mut sink = std::io::sink();
    let repairing = data.first().is_some_and(|b| b & 4 != 0);
    let _ = dmkit::cache::tools::dump(dev(), repairing, &mut sink);
    let _ = dmkit::cache::tools::check(dev(), &Default::default());
    let _ = dmkit::cache::tools::repair(dev(), Box::new(MemDev::new(64)));
});
