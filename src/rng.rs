//! The one small pseudo-random generator: xorshift64 (Marsaglia's 13/7/17
//! shifts). Fault injection (flakey), the simulator's orders and patterns, and
//! the tests' workloads draw from it, so a seed replays the same run. Nothing
//! secret comes from it.

/// One step of xorshift64 on state `x` (never 0 once seeded): the new state,
/// which is also the output.
pub fn step(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// A generator: its state, seeded by [`XorShift::seeded`] (any seed) or set
/// directly (any state but 0).
#[derive(Clone, Debug)]
pub struct XorShift(pub u64);

impl XorShift {
    /// A generator from any seed, 0 included: the seed spread over the state.
    pub fn seeded(seed: u64) -> XorShift {
        XorShift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        step(&mut self.0)
    }

    /// A number below `n` (0 for `n` = 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// `len` bytes from `seed`: one byte per step (test data that no two seeds
/// share).
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut g = XorShift::seeded(seed);
    (0..len).map(|_| g.next_u64() as u8).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sequence_is_xorshift64() {
        let mut g = XorShift(1);
        // Marsaglia's xorshift64 (13, 7, 17) from state 1
        assert_eq!(g.next_u64(), 0x4082_2041);
        assert_eq!(g.next_u64(), 0x1000_4106_0c01_1441);
        assert_eq!(pattern(3, 4), pattern(3, 4));
        assert_ne!(pattern(3, 4), pattern(4, 4));
        assert_eq!(XorShift::seeded(0).below(0), 0);
    }
}
