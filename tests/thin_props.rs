//! Property tests (proptest): random operation sequences against a simple model
//! (a map per device), with commits, aborts and reopens at random points. A
//! failure is shrunk to a short sequence, and proptest saves its seed in
//! tests/thin_props.proptest-regressions to replay first next time.

use crate::thin_util;
use dmkit::pdata::MemDev;
use dmkit::thin::{FormatOptions, ThinPoolMetadata};
use proptest::prelude::*;
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

/// One operation of a sequence. Devices are picked by index into the devices that
/// exist when the operation runs, so any sequence is valid and shrinks cleanly.
#[derive(Clone, Debug)]
enum Step {
    /// Create a thin; `reuse` picks the lowest free id (a deleted or aborted one).
    Create {
        reuse: bool,
    },
    Snap {
        of: usize,
        reuse: bool,
    },
    Delete(usize),
    Insert(usize, u64),
    Remove(usize, u64),
    Lookup(usize, u64),
    Commit,
    Abort,
    /// Commit, drop, and open the image again.
    Reopen,
}

const SPAN: u64 = 3000;

fn step_strategy() -> impl Strategy<Value = Step> {
    let dev = 0usize..64;
    let vb = 0..SPAN;
    prop_oneof![
        8 => any::<bool>().prop_map(|reuse| Step::Create { reuse }),
        12 => (dev.clone(), any::<bool>()).prop_map(|(of, reuse)| Step::Snap { of, reuse }),
        6 => dev.clone().prop_map(Step::Delete),
        674 => (dev.clone(), vb.clone()).prop_map(|(d, v)| Step::Insert(d, v)),
        250 => (dev.clone(), vb.clone()).prop_map(|(d, v)| Step::Remove(d, v)),
        50 => (dev, vb).prop_map(|(d, v)| Step::Lookup(d, v)),
        15 => Just(Step::Commit),
        3 => Just(Step::Abort),
        3 => Just(Step::Reopen),
    ]
}

/// A metadata pool under a sequence of steps, beside its model.
struct Run {
    dev: MemDev,
    md: ThinPoolMetadata,
    model: Model,
    committed: Model,
    next_dev: u64,
}

impl Run {
    fn new_id(&mut self, reuse: bool) -> u64 {
        let id = if reuse {
            (0..self.next_dev)
                .find(|d| !self.model.contains_key(d))
                .unwrap_or(self.next_dev)
        } else {
            self.next_dev
        };
        self.next_dev = self.next_dev.max(id + 1);
        id
    }

    fn pick(&self, i: usize) -> Option<u64> {
        let n = self.model.len();
        (n > 0).then(|| *self.model.keys().nth(i % n).expect("index below len"))
    }

    fn apply(&mut self, s: &Step, at: usize) {
        match *s {
            Step::Create { reuse } => {
                let id = self.new_id(reuse);
                self.md.create_thin(id).unwrap();
                self.model.insert(id, Default::default());
            }
            Step::Snap { of, reuse } => {
                let Some(origin) = self.pick(of) else { return };
                let id = self.new_id(reuse);
                self.md.create_snap(id, origin).unwrap();
                let c = self.model[&origin].clone();
                self.model.insert(id, c);
            }
            Step::Delete(i) => {
                let Some(d) = self.pick(i).filter(|_| self.model.len() > 1) else {
                    return;
                };
                self.md.delete(d).unwrap();
                self.model.remove(&d);
            }
            Step::Insert(i, vb) => {
                let Some(d) = self.pick(i) else { return };
                let Ok(b) = self.md.alloc_data_block() else { return };
                self.md.insert(d, vb, b).unwrap();
                let t = self.md.time();
                self.model.get_mut(&d).unwrap().insert(vb, (b, t));
            }
            Step::Remove(i, vb) => {
                let Some(d) = self.pick(i) else { return };
                let was = self.md.remove(d, vb).unwrap();
                assert_eq!(was, self.model.get_mut(&d).unwrap().remove(&vb).is_some());
            }
            Step::Lookup(i, vb) => {
                let Some(d) = self.pick(i) else { return };
                let got = self.md.lookup(d, vb).unwrap().map(|m| (m.data_block, m.time));
                assert_eq!(
                    got,
                    self.model[&d].get(&vb).copied(),
                    "op {at}: dev {d} vblock {vb}"
                );
            }
            Step::Commit => {
                self.md.commit().unwrap();
                self.committed = self.model.clone();
            }
            Step::Abort => {
                self.md.abort().unwrap();
                self.model = self.committed.clone();
                self.next_dev = self.model.keys().last().map_or(0, |d| d + 1).max(self.next_dev);
            }
            Step::Reopen => {
                self.md.commit().unwrap();
                self.committed = self.model.clone();
                self.dev = MemDev::from_image(self.dev.image());
                self.md = ThinPoolMetadata::open(Box::new(self.dev.clone()), 64).unwrap();
                assert_eq!(model_of_api(&mut self.md), self.model, "op {at}: reopen");
            }
        }
    }
}

fn run_steps(cache: usize, steps: &[Step], probes: &[(usize, u64)]) {
    let dev = MemDev::new(16384);
    let md = mem_pool(&dev, 50_000, cache);
    let mut r = Run {
        dev,
        md,
        model: Model::new(),
        committed: Model::new(),
        next_dev: 0,
    };
    r.apply(&Step::Create { reuse: false }, 0);
    for (i, s) in steps.iter().enumerate() {
        r.apply(s, i);
        // a lookup after every op: through the lookup cache, which must stay exact
        let (pi, vb) = probes[i % probes.len()];
        r.apply(&Step::Lookup(pi, vb), i);
    }
    r.md.commit().unwrap();
    finish(steps.len(), r.md, r.dev, r.model)
}

proptest! {
    // 12 sequences of up to 6000 steps (PROPTEST_CASES changes the count); a failing
    // one is shrunk to a short sequence and saved for replay by proptest.
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]
    #[test]
    fn random_ops_match_model(
        cache in 16usize..216,
        steps in prop::collection::vec(step_strategy(), 1..6000),
        probes in prop::collection::vec((0usize..64, 0..SPAN), 1..64),
    ) {
        run_steps(cache, &steps, &probes);
    }
}

fn finish(i: usize, mut md: ThinPoolMetadata, dev: MemDev, model: Model) {
    assert_eq!(model_of_api(&mut md), model, "after op {i}");
    for (d, m) in &model {
        assert_eq!(md.mapped_blocks(*d).unwrap(), m.len() as u64, "dev {d}");
    }
    md.commit().unwrap();
    drop(md);
    let s = Scratch::new("prop");
    let p = s.path("meta");
    std::fs::write(&p, dev.image()).unwrap();
    let r = dmkit::thin::check::check(Box::new(dmkit::pdata::FileDev::open(&p, false).unwrap()), false);
    assert!(r.ok(), "dmkit check: {:?} {:?}", r.errors, r.leaks);
    assert_thin_check_clean(&p);
    assert_eq!(model_of_xml(&our_dump(&p, false)), model);
}
