//! Crash consistency: a power loss at any point between or during commits
//! (unflushed writes dropped, the last one torn) leaves the last committed
//! transaction intact and the metadata clean for thin_check.

use crate::thin_util;
use dmkit::pdata::{FileDev, MemDev};
use dmkit::thin::{FormatOptions, ThinPoolMetadata};
use thin_util::*;

fn verify(image: Vec<u8>, ok_models: &[&Model], what: &str) {
    let mut md = ThinPoolMetadata::open(Box::new(MemDev::from_image(image.clone())), 256)
        .unwrap_or_else(|e| panic!("{what}: open after crash: {e}"));
    let got = model_of_api(&mut md);
    assert!(
        ok_models.iter().any(|m| **m == got),
        "{what}: state after crash is not a committed one"
    );
    drop(md);
    let s = Scratch::new("crash");
    let p = s.path("meta");
    std::fs::write(&p, &image).unwrap();
    let r = dmkit::thin::check::check(Box::new(FileDev::open(&p, false).unwrap()), false);
    assert!(r.ok(), "{what}: dmkit check: {:?}", r.errors);
    assert_thin_check_clean(&p);
}

fn workload(md: &mut ThinPoolMetadata, model: &mut Model, rng: &mut Rng, n: usize) {
    for _ in 0..n {
        let dev = rng.below(3);
        let vb = rng.below(100_000);
        if rng.below(4) == 0 {
            md.remove(dev, vb).unwrap();
            model.get_mut(&dev).unwrap().remove(&vb);
        } else {
            let b = md.alloc_data_block().unwrap();
            md.insert(dev, vb, b).unwrap();
            model.get_mut(&dev).unwrap().insert(vb, (b, md.time()));
        }
    }
}

fn setup(seed: u64) -> (MemDev, ThinPoolMetadata, Model, Rng) {
    let dev = MemDev::new(8192);
    let mut md = ThinPoolMetadata::format(
        Box::new(dev.clone()),
        FormatOptions {
            data_block_size: 128,
            nr_data_blocks: 200_000,
            cache_blocks: 16, // small: dirty blocks get evicted (written) mid-transaction
        },
    )
    .unwrap();
    let mut model = Model::new();
    md.create_thin(0).unwrap();
    md.create_thin(1).unwrap();
    md.create_snap(2, 0).unwrap();
    for d in 0..3 {
        model.insert(d, Default::default());
    }
    let mut rng = Rng::new(seed);
    workload(&mut md, &mut model, &mut rng, 10_000);
    md.commit().unwrap();
    (dev, md, model, rng)
}

#[test]
fn crash_between_commits_keeps_last_commit() {
    let (dev, mut md, mut model, mut rng) = setup(1);
    for round in 0..8 {
        let committed = model.clone();
        workload(&mut md, &mut model, &mut rng, 1500);
        if round % 3 == 1 {
            md.create_snap(10 + round, 1).unwrap();
            model.insert(10 + round, model[&1].clone());
        }
        let pending = dev.pending_writes();
        assert!(pending > 0, "small cache should have written dirty blocks");
        for keep in [0, pending / 3, pending / 2, pending.saturating_sub(1), pending] {
            for tear in [false, true] {
                verify(
                    dev.crash_image(keep, tear),
                    &[&committed],
                    &format!("round {round} keep {keep}/{pending} tear {tear}"),
                );
            }
        }
        md.commit().unwrap();
    }
}

#[test]
fn crash_during_commit_is_atomic() {
    for cut in [1u64, 5, 20, 60, 150, 400] {
        let (dev, mut md, mut model, mut rng) = setup(cut);
        let committed = model.clone();
        workload(&mut md, &mut model, &mut rng, 2000);
        dev.fail_after_writes(Some(cut));
        let res = md.commit();
        let pending = dev.pending_writes();
        for keep in [0, pending / 2, pending] {
            for tear in [false, true] {
                verify(
                    dev.crash_image(keep, tear),
                    &[&committed, &model],
                    &format!("cut {cut} keep {keep}/{pending} tear {tear} commit {res:?}"),
                );
            }
        }
    }
}
