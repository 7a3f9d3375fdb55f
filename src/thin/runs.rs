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

use crate::pdata::cache::FastMap;

const NONE: u64 = u64::MAX;

/// Per leaf: the leaves that follow it somewhere (the smallest in `next0`, any
/// others ascending in `more`: almost always there is one), and the one that
/// first preceded it.
struct Leaf {
    block: u64,
    next0: u64,
    more: Vec<u64>,
    first_prev: u32,
    head: bool,
    tail: bool,
    shared: bool,
}

impl Leaf {
    fn nr_next(&self) -> usize {
        usize::from(self.next0 != NONE) + self.more.len()
    }
    /// Add a successor; false if it was there already.
    fn add_next(&mut self, b: u64) -> bool {
        if self.next0 == NONE {
            self.next0 = b;
            return true;
        }
        if b == self.next0 {
            return false;
        }
        if b < self.next0 {
            self.more.insert(0, self.next0);
            self.next0 = b;
            return true;
        }
        match self.more.binary_search(&b) {
            Ok(_) => false,
            Err(i) => {
                self.more.insert(i, b);
                true
            }
        }
    }
}

/// The leaves, densely numbered in order of first appearance.
#[derive(Default)]
pub struct Gatherer {
    index: FastMap<u64, u32>,
    leaves: Vec<Leaf>,
    prev: Option<u32>,
}

impl Gatherer {
    pub fn new() -> Gatherer {
        Gatherer::default()
    }

    fn idx(&mut self, b: u64) -> u32 {
        let n = self.leaves.len() as u32;
        let i = *self.index.entry(b).or_insert(n);
        if i == n {
            self.leaves.push(Leaf {
                block: b,
                next0: NONE,
                more: Vec::new(),
                first_prev: u32::MAX,
                head: false,
                tail: false,
                shared: false,
            });
        }
        i
    }

    /// Start a new sequence (a device, or a break in one).
    pub fn new_seq(&mut self) {
        if let Some(p) = self.prev.take() {
            self.leaves[p as usize].tail = true;
        }
    }

    fn mark_head(&mut self, i: u32) {
        let l = &mut self.leaves[i as usize];
        l.shared |= l.head;
        l.head = true;
    }

    /// The next leaf of the current sequence.
    pub fn next(&mut self, b: u64) {
        let i = self.idx(b);
        match self.prev {
            Some(p) => {
                let again = !self.leaves[p as usize].add_next(b);
                let l = &mut self.leaves[i as usize];
                // the same step taken again: b is reached more than once
                l.shared |= again;
                if l.first_prev == u32::MAX {
                    l.first_prev = p;
                } else if l.first_prev != p {
                    l.shared |= l.head;
                    l.head = true;
                }
            }
            None => self.mark_head(i),
        }
        self.prev = Some(i);
    }

    /// The atomic runs, ascending by first leaf, each with whether it is shared.
    pub fn gather(mut self) -> Vec<(Vec<u64>, bool)> {
        self.new_seq();
        let at = |g: &Gatherer, b: u64| g.index.get(&b).map(|&i| i as usize);
        // a leaf ends a run if it branches, ends nowhere, or leads into a head
        let tails: Vec<usize> = (0..self.leaves.len())
            .filter(|&i| {
                let l = &self.leaves[i];
                let into_head = l.next0 != NONE && at(&self, l.next0).is_some_and(|n| self.leaves[n].head);
                l.nr_next() != 1 || into_head
            })
            .collect();
        for t in tails {
            self.leaves[t].tail = true;
        }
        // whatever follows a tail starts a run
        let follow: Vec<u64> = self
            .leaves
            .iter()
            .filter(|l| l.tail && l.next0 != NONE)
            .flat_map(|l| std::iter::once(l.next0).chain(l.more.iter().copied()))
            .collect();
        for n in follow {
            if let Some(i) = at(&self, n) {
                self.mark_head(i as u32);
            }
        }
        let mut heads: Vec<(u64, usize)> = (0..self.leaves.len())
            .filter(|&i| self.leaves[i].head)
            .map(|i| (self.leaves[i].block, i))
            .collect();
        heads.sort_unstable();
        let mut out = Vec::with_capacity(heads.len());
        for (h, hi) in heads {
            let mut run = vec![h];
            let mut i = hi;
            loop {
                let l = &self.leaves[i];
                if l.tail || l.next0 == NONE || run.len() > self.leaves.len() {
                    break;
                }
                match at(&self, l.next0) {
                    Some(n) => {
                        run.push(l.next0);
                        i = n;
                    }
                    None => break,
                }
            }
            out.push((run, self.leaves[hi].shared));
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
