//! Damaged thin-pool metadata: a small valid pool image with byte patches
//! (4 bytes of offset, 1 byte of value, repeated) applied, then opened, looked
//! up and checked. Unless the first input byte is odd, every patched block is
//! re-sealed afterwards (its checksum recomputed with the salt of what the block
//! held, a btree node's for a block that was free), so the patches reach the
//! structure parsers instead of stopping at "bad checksum": this is metadata that
//! lies with a valid checksum. Nothing may panic or abort, and the checker must
//! not call clean what cannot be opened.
#![no_main]
#[path = "../common.rs"]
mod common;
use dmkit::pdata::{BlockKind, MemDev};
use dmkit::thin::ThinPoolMetadata;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

/// The pool image, and what each of its blocks holds (None: free).
fn base() -> &'static (Vec<u8>, Vec<Option<BlockKind>>) {
    static B: OnceLock<(Vec<u8>, Vec<Option<BlockKind>>)> = OnceLock::new();
    B.get_or_init(|| {
        common::thin_image(4096, |md| {
            for vb in 0..600u64 {
                let b = md.alloc_data_block().expect("alloc");
                md.insert(0, vb * 7, b).expect("insert");
            }
            md.create_snap(1, 0).expect("snap");
        })
    })
}

fuzz_target!(|data: &[u8]| {
    let (img0, kinds) = base();
    let img = common::patched(img0, kinds, data);
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
