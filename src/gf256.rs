//! GF(2⁸) with the polynomial x⁸+x⁴+x³+x²+1 (0x11d) and generator 2: the
//! field of md's raid6 syndrome and of dm-verity's Reed-Solomon FEC.

struct Tables {
    exp: [u8; 512],
    log: [u8; 256],
}

const fn tables() -> Tables {
    let mut exp = [0u8; 512];
    let mut log = [0u8; 256];
    let mut x: u16 = 1;
    let mut i = 0;
    while i < 255 {
        exp[i] = x as u8;
        exp[i + 255] = x as u8;
        log[x as usize] = i as u8;
        x <<= 1;
        if x & 0x100 != 0 {
            x ^= 0x11d;
        }
        i += 1;
    }
    exp[510] = exp[0];
    exp[511] = exp[1];
    Tables { exp, log }
}

static T: Tables = tables();

/// a·b.
pub fn mul(a: u8, b: u8) -> u8 {
    if a == 0 || b == 0 {
        0
    } else {
        T.exp[T.log[a as usize] as usize + T.log[b as usize] as usize]
    }
}

/// 2ᵉ (α to the e).
pub fn pow2(e: usize) -> u8 {
    T.exp[e % 255]
}

/// a⁻¹ (0 for 0).
pub fn inv(a: u8) -> u8 {
    if a == 0 {
        0
    } else {
        T.exp[(255 - T.log[a as usize] as usize) % 255]
    }
}

/// The row of the multiplication table for `c`: `row[b] = c·b`.
pub fn mul_row(c: u8) -> [u8; 256] {
    let mut row = [0u8; 256];
    for (b, r) in row.iter_mut().enumerate() {
        *r = mul(c, b as u8);
    }
    row
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_field_is_mds_and_inverses_hold() {
        // md's generator tables: 2⁸ = 0x1d under 0x11d
        assert_eq!(pow2(8), 0x1d);
        for a in 1..=255u8 {
            assert_eq!(mul(a, inv(a)), 1, "{a}");
        }
    }
}
