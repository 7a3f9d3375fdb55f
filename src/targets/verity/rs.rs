//! Reed-Solomon RS(255, 255 - roots) over GF(2^8), as dm-verity's FEC uses
//! it: field polynomial 0x11d, first consecutive root 0, primitive element
//! 1 (the generator's roots are α^0 .. α^(roots-1)); a codeword is the
//! message (its first byte the highest power) followed by the parity.
//!
//! Written here rather than taken from a crate: the Reed-Solomon crates
//! either decode erasures only (reed-solomon-erasure, reed-solomon-novelpoly:
//! a different, Vandermonde construction), fix other field or root choices
//! (fec: CCSDS with fcr 112 and prim 11; reed-solomon-32: GF(2^5)), or are
//! unmaintained since 2017 (reed-solomon 0.2). This is errors-and-erasures
//! decoding (Berlekamp-Massey started from the erasures' locator, Chien
//! search, Forney): with f symbols known to be lost (erasures: their blocks
//! could not be read) and e wrong ones, it corrects them while 2e + f <=
//! roots, so up to `roots` erasures instead of roots/2 errors; a wrong
//! correction cannot get through, as the block is hashed again afterwards.

/// The codeword length.
pub const N: usize = 255;

use crate::gf256::{inv, mul, pow2 as pow_a};

/// Evaluate `p` (coefficient i of x^i) at `x`.
fn eval(p: &[u8], x: u8) -> u8 {
    p.iter().rev().fold(0, |acc, &c| mul(acc, x) ^ c)
}

/// The parity of `msg` (255 - roots bytes) into `par` (roots bytes): the
/// decoder's tests build codewords with it (veritysetup builds the FEC data).
#[cfg(test)]
pub fn encode(msg: &[u8], par: &mut [u8]) {
    let roots = par.len();
    // generator: Π (x - α^i), i < roots; g[i] the coefficient of x^i
    let mut g = vec![0u8; roots + 1];
    g[0] = 1;
    for i in 0..roots {
        let r = pow_a(i);
        for j in (0..=i + 1).rev() {
            let lower = if j > 0 { g[j - 1] } else { 0 };
            g[j] = lower ^ mul(g[j], r);
        }
    }
    // remainder of msg(x) * x^roots by g, by long division
    par.fill(0);
    for &m in msg {
        let f = m ^ par[0];
        par.copy_within(1.., 0);
        par[roots - 1] = 0;
        for j in 0..roots {
            par[j] ^= mul(f, g[roots - 1 - j]);
        }
    }
}

/// Correct `cw` (255 bytes: message then `roots` parity bytes) in place,
/// `eras` the indices of symbols known to be lost (each once): the number of
/// symbols corrected (erasures included), or None if the errors are beyond
/// the code.
pub fn decode(cw: &mut [u8; N], roots: usize, eras: &[usize]) -> Option<usize> {
    if eras.len() > roots {
        return None;
    }
    // syndromes S_j = cw(α^j); cw[i] is the coefficient of x^(254 - i)
    let mut s = [0u8; 32];
    let s = &mut s[..roots];
    for (j, sj) in s.iter_mut().enumerate() {
        let x = pow_a(j);
        *sj = cw.iter().fold(0, |acc, &c| mul(acc, x) ^ c);
    }
    if s.iter().all(|&v| v == 0) {
        return Some(0);
    }
    // the erasures' locator Γ = Π (1 + X x), X = α^p for index 254 - p
    let f = eras.len();
    let mut lambda = [0u8; 33];
    lambda[0] = 1;
    for (k, &i) in eras.iter().enumerate() {
        let x = pow_a(N.checked_sub(i + 1)?);
        for j in (1..=k + 1).rev() {
            lambda[j] ^= mul(x, lambda[j - 1]);
        }
    }
    // Berlekamp-Massey from Γ: the locator Λ of errors and erasures
    let mut b = lambda;
    let mut l = f;
    for r in f + 1..=roots {
        let d = (0..r).fold(0, |acc, i| acc ^ mul(lambda[i], s[r - 1 - i]));
        // b <- x * b (shifted below, after its use)
        let mut xb = [0u8; 33];
        xb[1..].copy_from_slice(&b[..32]);
        if d == 0 {
            b = xb;
            continue;
        }
        let mut t = lambda;
        for i in 0..33 {
            t[i] ^= mul(d, xb[i]);
        }
        if 2 * l < r + f {
            l = r + f - l;
            let di = inv(d);
            for i in 0..33 {
                b[i] = mul(lambda[i], di);
            }
        } else {
            b = xb;
        }
        lambda = t;
    }
    let deg = (0..33).rev().find(|&i| lambda[i] != 0).unwrap_or(0);
    // e errors and f erasures: 2e + f = 2 deg - f must not pass the roots
    if deg == 0 || deg != l || 2 * deg > roots + f {
        return None;
    }
    // Ω = S Λ mod x^roots
    let mut omega = [0u8; 32];
    for i in 0..roots {
        for j in 0..=i.min(deg) {
            omega[i] ^= mul(lambda[j], s[i - j]);
        }
    }
    // Λ' (characteristic 2: the odd terms, one power down)
    let mut dl = [0u8; 32];
    for i in (1..=deg).step_by(2) {
        dl[i - 1] = lambda[i];
    }
    // Chien search: a root α^-p of Λ is an error at power p, index 254 - p
    let mut found = 0;
    for p in 0..N {
        let xinv = pow_a(255 - p);
        if eval(&lambda[..=deg], xinv) != 0 {
            continue;
        }
        let den = eval(&dl[..deg], xinv);
        if den == 0 {
            return None;
        }
        // Forney with fcr 0: e = X * Ω(X^-1) / Λ'(X^-1)
        let e = mul(mul(pow_a(p), eval(&omega[..roots], xinv)), inv(den));
        cw[N - 1 - p] ^= e;
        found += 1;
    }
    (found == deg).then_some(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn codeword(roots: usize, seed: u64) -> [u8; N] {
        let msg = crate::rng::pattern(seed, N - roots);
        let mut cw = [0u8; N];
        cw[..N - roots].copy_from_slice(&msg);
        let (m, p) = cw.split_at_mut(N - roots);
        encode(m, p);
        cw
    }

    #[test]
    fn corrects_up_to_half_the_roots() {
        for roots in [2usize, 4, 7, 24] {
            let good = codeword(roots, roots as u64);
            let mut clean = good;
            assert_eq!(decode(&mut clean, roots, &[]), Some(0));
            for errs in 1..=roots / 2 {
                let mut bad = good;
                for k in 0..errs {
                    bad[(k * 37 + 5) % N] ^= 0x5a + k as u8;
                }
                assert_eq!(decode(&mut bad, roots, &[]), Some(errs), "roots {roots}, {errs} errors");
                assert!(bad == good, "roots {roots}, {errs} errors");
            }
        }
    }

    #[test]
    fn beyond_the_code_is_refused_or_caught_by_the_syndromes() {
        let good = codeword(2, 9);
        let mut bad = good;
        bad[3] ^= 1;
        bad[200] ^= 7;
        // two errors with two roots: refused, or "corrected" to another
        // codeword (the block's hash catches that)
        let r = decode(&mut bad, 2, &[]);
        assert!(r.is_none() || bad != good);
        // three erasures with two roots: refused
        let mut bad = good;
        assert_eq!(decode(&mut bad, 2, &[1, 2, 3]), None);
    }

    /// Erasures (known positions) count one root each, errors two: every mix
    /// with 2e + f <= roots comes back whole, up to `roots` erasures, where
    /// errors alone stop at roots/2.
    #[test]
    fn corrects_erasures_and_errors_while_2e_plus_f_fit_the_roots() {
        for roots in [2usize, 3, 4, 7, 24] {
            let good = codeword(roots, 77 + roots as u64);
            for f in 0..=roots {
                for e in 0..=(roots - f) / 2 {
                    let mut bad = good;
                    let eras: Vec<usize> = (0..f).map(|k| (k * 41 + 3) % N).collect();
                    for &i in &eras {
                        bad[i] ^= 0xa5; // lost: any value
                    }
                    for k in 0..e {
                        bad[(k * 53 + 100) % N] ^= 0x11 + k as u8;
                    }
                    let r = decode(&mut bad, roots, &eras);
                    assert_eq!(r, Some(e + f), "roots {roots}, {f} erasures, {e} errors");
                    assert!(bad == good, "roots {roots}, {f} erasures, {e} errors");
                }
            }
        }
        // an erasure whose symbol happens to be right is still found, unchanged
        let good = codeword(4, 5);
        let mut same = good;
        assert_eq!(decode(&mut same, 4, &[10, 20, 30]), Some(0), "no syndrome: nothing to do");
        let mut bad = good;
        bad[20] ^= 9;
        assert!(decode(&mut bad, 4, &[10, 20, 30]).is_some());
        assert!(bad == good);
    }
}
