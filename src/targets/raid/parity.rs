//! raid4/5/6 parity: P is the XOR of a stripe's data blocks; Q (raid6) is
//! Σ gᵏ·Dₖ in GF(2⁸) with md's polynomial x⁸+x⁴+x³+x²+1 (0x11d) and g = 2,
//! where k is each data block's coefficient index ([`super::layout`] gives it
//! per layout). Any one (raid5) or two (raid6) blocks of a stripe are rebuilt
//! from the others ([`rebuild`]).

pub use crate::gf256::pow2;
use crate::gf256::inv;

/// `dst ^= src`, a word at a time.
pub fn xor_into(dst: &mut [u8], src: &[u8]) {
    let n = dst.len().min(src.len());
    let (d, s) = (&mut dst[..n], &src[..n]);
    let mut dc = d.chunks_exact_mut(8);
    let mut sc = s.chunks_exact(8);
    for (a, b) in (&mut dc).zip(&mut sc) {
        let v = u64::from_ne_bytes([a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]])
            ^ u64::from_ne_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
        a.copy_from_slice(&v.to_ne_bytes());
    }
    for (a, b) in dc.into_remainder().iter_mut().zip(sc.remainder()) {
        *a ^= b;
    }
}

/// `dst ^= c·src` in GF(2⁸).
pub fn mul_xor_into(dst: &mut [u8], c: u8, src: &[u8]) {
    match c {
        0 => {}
        1 => xor_into(dst, src),
        _ => {
            // one row of the multiplication table, then a lookup per byte
            let row = crate::gf256::mul_row(c);
            for (a, &b) in dst.iter_mut().zip(src) {
                *a ^= row[b as usize];
            }
        }
    }
}

/// `buf = c·buf`.
pub fn scale(buf: &mut [u8], c: u8) {
    if c == 1 {
        return;
    }
    let row = crate::gf256::mul_row(c);
    for a in buf.iter_mut() {
        *a = row[*a as usize];
    }
}

/// P (and Q when `q` is given) of the data blocks `data`, whose Q coefficient
/// indices are `coef`: written over `p` and `q`.
pub fn syndromes(data: &[&[u8]], coef: &[usize], p: &mut [u8], mut q: Option<&mut [u8]>) {
    p.fill(0);
    if let Some(q) = q.as_deref_mut() {
        q.fill(0);
    }
    for (d, &k) in data.iter().zip(coef) {
        xor_into(p, d);
        if let Some(q) = q.as_deref_mut() {
            mul_xor_into(q, pow2(k), d);
        }
    }
}

/// One stripe's blocks: `data[i]` with coefficient index `coef[i]`, then P and
/// Q (raid6). `missing` names the blocks to rebuild (indices into data, or
/// `data.len()` for P and `data.len() + 1` for Q), at most as many as there
/// are parities; they are rebuilt in place from the others. False if they
/// cannot be (too many missing, or a parity needed is missing).
pub fn rebuild(data: &mut [Vec<u8>], coef: &[usize], p: &mut [u8], q: Option<&mut [u8]>, missing: &[usize]) -> bool {
    let nd = data.len();
    let lost_data: Vec<usize> = missing.iter().copied().filter(|&m| m < nd).collect();
    let lost_p = missing.contains(&nd);
    let lost_q = missing.contains(&(nd + 1));
    let has_q = q.is_some();
    let len = p.len();
    match (lost_data.as_slice(), lost_p, lost_q) {
        ([], _, _) => {
            // only parities: computed again
            let refs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
            let mut qq = vec![0u8; len];
            syndromes(&refs, coef, p, has_q.then_some(qq.as_mut_slice()));
            if let (Some(q), true) = (q, lost_q) {
                q.copy_from_slice(&qq);
            }
            true
        }
        (&[x], false, _) => {
            // from P: the XOR of the others
            let mut out = p.to_vec();
            for (i, d) in data.iter().enumerate() {
                if i != x {
                    xor_into(&mut out, d);
                }
            }
            data[x] = out;
            if let (Some(q), true) = (q, lost_q) {
                let refs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
                let mut pp = vec![0u8; len];
                syndromes(&refs, coef, &mut pp, Some(q));
            }
            true
        }
        (&[x], true, false) => {
            let Some(q) = q else { return false };
            // from Q: (Q ^ Σ gᵏDₖ, k ≠ x) · g⁻ˣ
            let mut out = q.to_vec();
            for (i, d) in data.iter().enumerate() {
                if i != x {
                    mul_xor_into(&mut out, pow2(coef[i]), d);
                }
            }
            scale(&mut out, inv(pow2(coef[x])));
            data[x] = out;
            let refs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
            syndromes(&refs, coef, p, None);
            true
        }
        (&[x, y], false, false) => {
            let Some(q) = q else { return false };
            // Pxy = Dx ^ Dy, Qxy = gˣDx ^ gʸDy: Dx = (Qxy ^ gʸPxy) / (gˣ ^ gʸ)
            let mut pxy = p.to_vec();
            let mut qxy = q.to_vec();
            for (i, d) in data.iter().enumerate() {
                if i != x && i != y {
                    xor_into(&mut pxy, d);
                    mul_xor_into(&mut qxy, pow2(coef[i]), d);
                }
            }
            let (gx, gy) = (pow2(coef[x]), pow2(coef[y]));
            mul_xor_into(&mut qxy, gy, &pxy);
            scale(&mut qxy, inv(gx ^ gy));
            xor_into(&mut pxy, &qxy);
            data[x] = qxy;
            data[y] = pxy;
            true
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_two_blocks_of_a_raid6_stripe_come_back() {
        let coef = [0usize, 1, 2, 3];
        let data: Vec<Vec<u8>> = (0..4u8)
            .map(|i| (0..64u8).map(|b| b.wrapping_mul(31).wrapping_add(i * 77)).collect())
            .collect();
        let mut p = vec![0u8; 64];
        let mut q = vec![0u8; 64];
        let refs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
        syndromes(&refs, &coef, &mut p, Some(&mut q));
        for a in 0..6 {
            for b in a..6 {
                let missing: Vec<usize> = if a == b { vec![a] } else { vec![a, b] };
                let mut d = data.clone();
                let (mut pp, mut qq) = (p.clone(), q.clone());
                for &m in &missing {
                    match m {
                        4 => pp.fill(0xee),
                        5 => qq.fill(0xee),
                        i => d[i].fill(0xee),
                    }
                }
                assert!(rebuild(&mut d, &coef, &mut pp, Some(&mut qq), &missing), "{missing:?}");
                assert_eq!(d, data, "{missing:?}");
                assert_eq!((pp.as_slice(), qq.as_slice()), (p.as_slice(), q.as_slice()), "{missing:?}");
            }
        }
    }
}
