//! A flipped bit in any metadata block is reported with its block number by
//! `dmkit thin check`; opening and reading never panic and never return
//! wrong mappings.

use crate::thin_util;
use dmkit::pdata::{FileDev, MemDev};
use dmkit::thin::{FormatOptions, ThinPoolMetadata};
use thin_util::*;

#[test]
fn bit_flip_in_every_live_block_is_caught() {
    let dev = MemDev::new(2048);
    let mut md = ThinPoolMetadata::format(
        Box::new(dev.clone()),
        FormatOptions {
            data_block_size: 128,
            nr_data_blocks: 70_000,
            cache_blocks: 256,
        },
    )
    .unwrap();
    let mut model = Model::new();
    let mut rng = Rng::new(5);
    for d in 0..3u64 {
        md.create_thin(d).unwrap();
        let e = model.entry(d).or_default();
        for _ in 0..4000 {
            let vb = rng.below(20_000);
            let b = md.alloc_data_block().unwrap();
            md.insert(d, vb, b).unwrap();
            e.insert(vb, (b, 0));
        }
    }
    md.create_snap(7, 1).unwrap();
    model.insert(7, model[&1].clone());
    md.reserve_metadata_snap().unwrap();
    md.commit().unwrap();
    let live: Vec<u64> = (0..md.nr_metadata_blocks())
        .filter(|&b| md.metadata_block_ref_count(b) > 0)
        .collect();
    drop(md);
    let image = dev.image();
    assert!(live.len() > 50, "{} live blocks", live.len());
    let s = Scratch::new("corrupt");
    let p = s.path("meta");
    for &b in &live {
        let mut bad = image.clone();
        let bit = rng.below(4096 * 8) as usize;
        bad[b as usize * 4096 + bit / 8] ^= 1 << (bit % 8);

        // the checker names the block
        std::fs::write(&p, &bad).unwrap();
        let r = dmkit::thin::check::check(Box::new(FileDev::open(&p, false).unwrap()), false);
        // the superblock is block 0, named as such
        let needle = if b == 0 {
            "superblock".to_string()
        } else {
            format!("block {b}")
        };
        assert!(
            r.errors
                .iter()
                .any(|e| e.contains(&needle) || e.contains(&format!("block ({b})"))),
            "flip of bit {bit} in live block {b} not reported by block number: {:?}",
            r.errors
        );

        // the API either refuses, or every mapping it returns is right
        if let Ok(mut md) = ThinPoolMetadata::open(Box::new(MemDev::from_image(bad.clone())), 64) {
            for (dev, m) in &model {
                for (&vb, &(b2, t)) in m.iter().step_by(97) {
                    match md.lookup(*dev, vb) {
                        Ok(Some(got)) => assert_eq!((got.data_block, got.time), (b2, t)),
                        Ok(None) => panic!("block {b} flip: mapping {dev}/{vb} silently lost"),
                        Err(e) => assert!(e.to_string().contains("block"), "{e}"),
                    }
                }
            }
        }
    }
    // and the real thin_check agrees on a sample
    for &b in live.iter().step_by(live.len() / 8) {
        let mut bad = image.clone();
        bad[b as usize * 4096 + 2000] ^= 0x40;
        std::fs::write(&p, &bad).unwrap();
        {
            let (ok, _, _) = thin_check(&p, &[]);
            assert!(!ok, "thin_check missed a flip in block {b}");
        }
    }
}
