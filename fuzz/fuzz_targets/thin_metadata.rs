//! Damaged thin-pool metadata: a small valid pool image with byte patches
//! (4 bytes of offset, 1 byte of value, repeated) applied, then opened, looked
//! up and checked. Nothing may panic; the checker must not call it clean if
//! opening it failed.
#![no_main]
use dmkit::pdata::MemDev;
use dmkit::thin::{FormatOptions, ThinPoolMetadata};
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

fn base() -> &'static Vec<u8> {
    static B: OnceLock<Vec<u8>> = OnceLock::new();
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
        md.commit().expect("commit");
        dev.image()
    })
}

fuzz_target!(|data: &[u8]| {
    let mut img = base().clone();
    for p in data.chunks_exact(5) {
        let off = u32::from_le_bytes([p[0], p[1], p[2], p[3]]) as usize % img.len();
        img[off] = p[4];
    }
    let opened = ThinPoolMetadata::open(Box::new(MemDev::from_image(img.clone())), 16);
    if let Ok(mut md) = opened {
        for dev in md.devices() {
            for vb in (0..5000u64).step_by(97) {
                let _ = md.lookup(dev, vb);
            }
        }
    }
    let _ = dmkit::thin::check::check(Box::new(MemDev::from_image(img)), false);
});
