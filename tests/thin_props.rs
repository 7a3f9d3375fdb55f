//! Property tests: random operation sequences against a simple model (a map
//! per device), with commits, aborts and reopens at random points. Each seed
//! is replayable: THIN_PROP_SEED=<n> cargo test --test thin_props.

mod thin_util;
use dmkit::pdata::MemDev;
use dmkit::thin::{FormatOptions, ThinPoolMetadata};
use thin_util::*;

fn mem_pool(dev: &MemDev, nr_data: u64, cache: usize) -> ThinPoolMetadata {
    ThinPoolMetadata::format(
        Box::new(dev.clone()),
        FormatOptions {
            data_block_size: 128,
            nr_data_blocks: nr_data,
            cache_blocks: cache,
        },
    )
    .expect("format")
}

/// One random op on pool and model. Returns false if the op was skipped.
fn step(md: &mut ThinPoolMetadata, model: &mut Model, rng: &mut Rng, next_dev: &mut u64) {
    let devs: Vec<u64> = model.keys().copied().collect();
    let r = rng.below(1000);
    // Half the new devices reuse a free id (a deleted one, or one an abort dropped).
    let new_id = |rng: &mut Rng, model: &Model, next_dev: &mut u64| {
        let id = match rng.below(2) {
            0 => (0..*next_dev)
                .find(|d| !model.contains_key(d))
                .unwrap_or(*next_dev),
            _ => *next_dev,
        };
        *next_dev = (*next_dev).max(id + 1);
        id
    };
    if devs.is_empty() || r < 8 {
        let id = new_id(rng, model, next_dev);
        md.create_thin(id).unwrap();
        model.insert(id, Default::default());
        return;
    }
    let dev = devs[rng.below(devs.len() as u64) as usize];
    let span = 3000;
    if r < 20 {
        let id = new_id(rng, model, next_dev);
        md.create_snap(id, dev).unwrap();
        let c = model[&dev].clone();
        model.insert(id, c);
    } else if r < 26 && devs.len() > 1 {
        md.delete(dev).unwrap();
        model.remove(&dev);
    } else if r < 700 {
        let vb = rng.below(span);
        let Ok(b) = md.alloc_data_block() else { return };
        md.insert(dev, vb, b).unwrap();
        model.get_mut(&dev).unwrap().insert(vb, (b, md.time()));
    } else if r < 950 {
        let vb = rng.below(span);
        let was = md.remove(dev, vb).unwrap();
        assert_eq!(was, model.get_mut(&dev).unwrap().remove(&vb).is_some());
    } else {
        let vb = rng.below(span);
        let got = md.lookup(dev, vb).unwrap().map(|m| (m.data_block, m.time));
        assert_eq!(got, model[&dev].get(&vb).copied(), "dev {dev} vblock {vb}");
    }
}

fn run_seed(seed: u64, ops: usize) {
    let mut dev = MemDev::new(16384);
    let mut rng = Rng::new(seed);
    // a small cache forces dirty evictions mid-transaction
    let mut md = mem_pool(&dev, 50_000, 16 + rng.below(200) as usize);
    let mut model = Model::new();
    let mut committed = Model::new();
    let mut next_dev = 0u64;
    for i in 0..ops {
        step(&mut md, &mut model, &mut rng, &mut next_dev);
        // a lookup after every op: through the lookup cache, which must stay exact
        if let Some((&dev, m)) = model.iter().nth(rng.below(model.len() as u64) as usize) {
            let vb = rng.below(3000);
            let got = md.lookup(dev, vb).unwrap().map(|m| (m.data_block, m.time));
            assert_eq!(
                got,
                m.get(&vb).copied(),
                "seed {seed} op {i}: dev {dev} vblock {vb}"
            );
        }
        match rng.below(400) {
            0..=5 => {
                md.commit().unwrap();
                committed = model.clone();
            }
            6 => {
                md.abort().unwrap();
                model = committed.clone();
                next_dev = model.keys().last().map_or(0, |d| d + 1).max(next_dev);
            }
            7 => {
                md.commit().unwrap();
                committed = model.clone();
                drop(md);
                dev = MemDev::from_image(dev.image());
                md = ThinPoolMetadata::open(Box::new(dev.clone()), 64).unwrap();
                assert_eq!(model_of_api(&mut md), model, "seed {seed} op {i} reopen");
            }
            _ => {}
        }
    }
    md.commit().unwrap();
    finish(seed, ops, md, dev, model)
}

fn finish(seed: u64, i: usize, mut md: ThinPoolMetadata, dev: MemDev, model: Model) {
    assert_eq!(model_of_api(&mut md), model, "seed {seed} op {i}");
    for (d, m) in &model {
        assert_eq!(md.mapped_blocks(*d).unwrap(), m.len() as u64, "seed {seed}");
    }
    md.commit().unwrap();
    drop(md);
    let s = Scratch::new("prop");
    let p = s.path("meta");
    std::fs::write(&p, dev.image()).unwrap();
    let r = dmkit::thin::check::check(Box::new(dmkit::pdata::FileDev::open(&p, false).unwrap()), false);
    assert!(r.ok(), "seed {seed}: dmkit check: {:?} {:?}", r.errors, r.leaks);
    assert_thin_check_clean(&p);
    assert_eq!(model_of_xml(&our_dump(&p, false)), model, "seed {seed}");
}

#[test]
fn random_ops_match_model() {
    if let Ok(s) = std::env::var("THIN_PROP_SEED") {
        run_seed(s.parse().expect("seed"), 20_000);
        return;
    }
    let n: u64 = std::env::var("THIN_PROP_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12);
    for seed in 1..=n {
        run_seed(seed, 6000);
    }
}
