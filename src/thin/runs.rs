//! Finding the leaf runs devices share, for thin_dump's `<def>`/`<ref>` form.
//!
//! Each device is a sequence of bottom-level leaf blocks. Snapshots share leaves,
//! usually in long runs. The sequences are cut into atomic runs: a run starts where
//! a leaf begins a sequence, follows different predecessors in different sequences,
//! or follows a leaf that ends a run; it ends where a leaf ends a sequence, has
//! more than one successor, or is followed by a run's start. A run is shared when
//! its first leaf is reached more than once (as the start of a sequence or from
//! different places); shared runs are printed once as a `<def>` named after their
//! first leaf and referred to by `<ref>`. thin-provisioning-tools 1.x cuts the same
//! runs, so dmkit's dumps of shared pools compare equal to its.

use std::collections::{BTreeSet, HashMap};

/// Per leaf: the leaves that follow it somewhere, and the one that first preceded it.
#[derive(Default)]
struct Leaf {
    next: BTreeSet<u64>,
    first_prev: Option<u64>,
    head: bool,
    tail: bool,
    shared: bool,
}

#[derive(Default)]
pub struct Gatherer {
    leaves: HashMap<u64, Leaf>,
    prev: Option<u64>,
}

impl Gatherer {
    pub fn new() -> Gatherer {
        Gatherer::default()
    }

    /// Start a new sequence (a device, or a break in one).
    pub fn new_seq(&mut self) {
        if let Some(p) = self.prev.take() {
            self.leaves.entry(p).or_default().tail = true;
        }
    }

    fn mark_head(&mut self, b: u64) {
        let l = self.leaves.entry(b).or_default();
        if l.head {
            l.shared = true;
        }
        l.head = true;
    }

    /// The next leaf of the current sequence.
    pub fn next(&mut self, b: u64) {
        match self.prev {
            Some(p) => {
                let pl = self.leaves.entry(p).or_default();
                if !pl.next.insert(b) {
                    // the same step taken again: b is reached more than once
                    self.leaves.entry(b).or_default().shared = true;
                }
                let l = self.leaves.entry(b).or_default();
                match l.first_prev {
                    Some(fp) if fp != p => self.mark_head(b),
                    Some(_) => {}
                    None => l.first_prev = Some(p),
                }
            }
            None => self.mark_head(b),
        }
        self.leaves.entry(b).or_default();
        self.prev = Some(b);
    }

    /// The atomic runs, ascending by first leaf, each with whether it is shared.
    pub fn gather(mut self) -> Vec<(Vec<u64>, bool)> {
        self.new_seq();
        let heads: BTreeSet<u64> = self
            .leaves
            .iter()
            .filter(|(_, l)| l.head)
            .map(|(b, _)| *b)
            .collect();
        // a leaf ends a run if it branches, ends nowhere, or leads into a head
        let mut tails = Vec::new();
        for (b, l) in &self.leaves {
            let into_head = l.next.first().is_some_and(|n| heads.contains(n));
            if l.next.len() != 1 || into_head {
                tails.push(*b);
            }
        }
        for t in tails {
            if let Some(l) = self.leaves.get_mut(&t) {
                l.tail = true;
            }
        }
        // whatever follows a tail starts a run
        let follow: Vec<u64> = self
            .leaves
            .values()
            .filter(|l| l.tail)
            .flat_map(|l| l.next.iter().copied())
            .collect();
        for n in follow {
            self.mark_head(n);
        }
        let mut heads: Vec<u64> = self
            .leaves
            .iter()
            .filter(|(_, l)| l.head)
            .map(|(b, _)| *b)
            .collect();
        heads.sort_unstable();
        let mut out = Vec::with_capacity(heads.len());
        for h in heads {
            let mut run = vec![h];
            let mut b = h;
            while let Some(l) = self.leaves.get(&b) {
                if l.tail {
                    break;
                }
                match l.next.first() {
                    Some(&n) if run.len() <= self.leaves.len() => {
                        run.push(n);
                        b = n;
                    }
                    _ => break,
                }
            }
            let shared = self.leaves.get(&h).is_some_and(|l| l.shared);
            out.push((run, shared));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gather(seqs: &[&[u64]]) -> Vec<(Vec<u64>, bool)> {
        let mut g = Gatherer::new();
        for s in seqs {
            g.new_seq();
            for &b in *s {
                g.next(b);
            }
        }
        g.gather()
    }

    /// The cuts thin-provisioning-tools 1.x makes for the same sequences.
    #[test]
    fn runs_are_cut_as_the_reference_cuts_them() {
        assert_eq!(gather(&[]), vec![]);
        assert_eq!(gather(&[&[1]]), vec![(vec![1], false)]);
        assert_eq!(gather(&[&[1, 2, 3]]), vec![(vec![1, 2, 3], false)]);
        assert_eq!(
            gather(&[&[1, 2], &[1, 2, 3]]),
            vec![(vec![1, 2], true), (vec![3], false)]
        );
        assert_eq!(
            gather(&[&[2, 3], &[1, 2, 3]]),
            vec![(vec![1], false), (vec![2, 3], true)]
        );
        assert_eq!(
            gather(&[&[1, 2, 3, 4], &[2, 3, 4, 5]]),
            vec![(vec![1], false), (vec![2, 3, 4], true), (vec![5], false)]
        );
        assert_eq!(
            gather(&[&[2, 3, 4, 5], &[1, 2, 3, 4]]),
            vec![(vec![1], false), (vec![2, 3, 4], true), (vec![5], false)]
        );
        assert_eq!(
            gather(&[&[1, 2, 3, 4], &[2, 3, 4, 5, 6], &[3, 4], &[5, 6]]),
            vec![
                (vec![1], false),
                (vec![2], true),
                (vec![3, 4], true),
                (vec![5, 6], true)
            ]
        );
        assert_eq!(
            gather(&[&[2, 3, 4, 5], &[2, 3, 4, 6], &[1, 3, 4, 5]]),
            vec![
                (vec![1], false),
                (vec![2], true),
                (vec![3, 4], true),
                (vec![5], true),
                (vec![6], false)
            ]
        );
        assert_eq!(
            gather(&[&[1, 2], &[2, 1]]),
            vec![(vec![1], true), (vec![2], true)]
        );
    }
}
