//! Where md puts an array's sectors on its legs, for each raid level dm-raid
//! builds (docs/design/dm-raid-levels.md has the rules, from md's raid0.c,
//! raid5.c and raid10.c): striping (raid0), copies (raid10 near, far,
//! offset), and data with rotating parity (raid4/5/6, every md algorithm).

use crate::mapper::TargetError;

/// md's raid5/6 algorithms (`layout` in the superblock).
pub mod algo {
    pub const LEFT_ASYMMETRIC: u32 = 0;
    pub const RIGHT_ASYMMETRIC: u32 = 1;
    pub const LEFT_SYMMETRIC: u32 = 2;
    pub const RIGHT_SYMMETRIC: u32 = 3;
    pub const PARITY_0: u32 = 4;
    pub const PARITY_N: u32 = 5;
    pub const ROTATING_ZERO_RESTART: u32 = 8;
    pub const ROTATING_N_RESTART: u32 = 9;
    pub const ROTATING_N_CONTINUE: u32 = 10;
    pub const LEFT_ASYMMETRIC_6: u32 = 16;
    pub const RIGHT_ASYMMETRIC_6: u32 = 17;
    pub const LEFT_SYMMETRIC_6: u32 = 18;
    pub const RIGHT_SYMMETRIC_6: u32 = 19;
    pub const PARITY_0_6: u32 = 20;
}

/// md's raid10 layout bits.
pub const RAID10_OFFSET: u32 = 1 << 16;
pub const RAID10_USE_FAR_SETS: u32 = 1 << 18;

/// A raid level with its md number, layout and parities.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Raid0,
    Raid1,
    /// md's raid10 `layout`: near copies (bits 0–7), far copies (8–15),
    /// offset (bit 16), far sets (bit 18).
    Raid10(u32),
    /// raid4/5/6: md level (4, 5, 6), algorithm, parities (1 or 2).
    Parity { level: u32, algo: u32, parities: u32 },
}

/// A dm-raid raid type name's level (docs/design/dm-raid-levels.md §1.1):
/// `raid4` is md's raid5 with P on the first leg; the `raid10_*` names all
/// start near (only `raid10_format` changes that).
pub fn parse_type(name: &str) -> Option<Level> {
    use algo::*;
    let p = |level, algo, parities| Some(Level::Parity { level, algo, parities });
    match name {
        "raid0" => Some(Level::Raid0),
        "raid1" => Some(Level::Raid1),
        "raid10" | "raid10_near" | "raid10_far" | "raid10_offset" => Some(Level::Raid10(2 | (1 << 8))),
        "raid4" => p(5, PARITY_0, 1),
        "raid5_n" => p(5, PARITY_N, 1),
        "raid5_la" => p(5, LEFT_ASYMMETRIC, 1),
        "raid5_ra" => p(5, RIGHT_ASYMMETRIC, 1),
        "raid5_ls" => p(5, LEFT_SYMMETRIC, 1),
        "raid5_rs" => p(5, RIGHT_SYMMETRIC, 1),
        "raid6_zr" => p(6, ROTATING_ZERO_RESTART, 2),
        "raid6_nr" => p(6, ROTATING_N_RESTART, 2),
        "raid6_nc" => p(6, ROTATING_N_CONTINUE, 2),
        "raid6_n_6" => p(6, PARITY_N, 2),
        "raid6_la_6" => p(6, LEFT_ASYMMETRIC_6, 2),
        "raid6_ra_6" => p(6, RIGHT_ASYMMETRIC_6, 2),
        "raid6_ls_6" => p(6, LEFT_SYMMETRIC_6, 2),
        "raid6_rs_6" => p(6, RIGHT_SYMMETRIC_6, 2),
        _ => None,
    }
}

/// The name the status line gives a level (the kernel's lookup by md level
/// and layout, from the end of its table).
pub fn status_name(level: Level) -> &'static str {
    use algo::*;
    match level {
        Level::Raid0 => "raid0",
        Level::Raid1 => "raid1",
        Level::Raid10(l) if l & RAID10_OFFSET != 0 => "raid10_offset",
        Level::Raid10(l) if l & 0xff > 1 => "raid10",
        Level::Raid10(_) => "raid10_far",
        Level::Parity { level: 5, algo, .. } => match algo {
            PARITY_0 => "raid4",
            PARITY_N => "raid5_n",
            LEFT_ASYMMETRIC => "raid5_la",
            RIGHT_ASYMMETRIC => "raid5_ra",
            LEFT_SYMMETRIC => "raid5_ls",
            _ => "raid5_rs",
        },
        Level::Parity { algo, .. } => match algo {
            ROTATING_ZERO_RESTART => "raid6_zr",
            ROTATING_N_RESTART => "raid6_nr",
            ROTATING_N_CONTINUE => "raid6_nc",
            PARITY_N => "raid6_n_6",
            LEFT_ASYMMETRIC_6 => "raid6_la_6",
            RIGHT_ASYMMETRIC_6 => "raid6_ra_6",
            LEFT_SYMMETRIC_6 => "raid6_ls_6",
            _ => "raid6_rs_6",
        },
    }
}

impl Level {
    /// md's level number.
    pub fn md_level(self) -> u32 {
        match self {
            Level::Raid0 => 0,
            Level::Raid1 => 1,
            Level::Raid10(_) => 10,
            Level::Parity { level, .. } => level,
        }
    }

    /// md's layout number.
    pub fn md_layout(self) -> u32 {
        match self {
            Level::Raid0 | Level::Raid1 => 0,
            Level::Raid10(l) => l,
            Level::Parity { algo, .. } => algo,
        }
    }

    /// How many legs may fail: parities, copies less one, none for raid0.
    pub fn parities(self) -> u32 {
        match self {
            Level::Parity { parities, .. } => parities,
            _ => 0,
        }
    }
}

/// One stripe row of a raid4/5/6 array: which leg holds P, Q, and each data
/// block in order, with each data block's Q coefficient index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    pub p: usize,
    pub q: Option<usize>,
    /// Leg of data block i (i = the block's index in the stripe).
    pub data: Vec<usize>,
    /// Q coefficient index of data block i.
    pub coef: Vec<usize>,
}

/// Where stripe `stripe` of an `n`-leg array with `algo` and `parities` puts
/// its blocks (md's raid5_compute_sector and set_syndrome_sources).
// Long: one arm per md layout algorithm (raid4/5/6, left/right, symmetric or
// not, parity first or last, the raid6 rotations), read beside md's
// raid5_compute_sector, which has the same cases.
pub fn row(n: usize, algo: u32, parities: u32, stripe: u64) -> Row {
    use algo::*;
    let data_disks = n - parities as usize;
    let s = (stripe % n as u64) as usize;
    // each data block's leg, as md turns dd_idx into a leg
    let mut legs: Vec<usize> = (0..data_disks).collect();
    let (p, q);
    let mut ddf = false;
    if parities == 1 {
        match algo {
            LEFT_ASYMMETRIC | RIGHT_ASYMMETRIC => {
                p = if algo == LEFT_ASYMMETRIC { data_disks - s } else { s };
                for d in legs.iter_mut() {
                    if *d >= p {
                        *d += 1;
                    }
                }
            }
            LEFT_SYMMETRIC | RIGHT_SYMMETRIC => {
                p = if algo == LEFT_SYMMETRIC { data_disks - s } else { s };
                for d in legs.iter_mut() {
                    *d = (p + 1 + *d) % n;
                }
            }
            PARITY_0 => {
                p = 0;
                for d in legs.iter_mut() {
                    *d += 1;
                }
            }
            _ => p = data_disks,
        }
        q = None;
    } else {
        let asym = |p: usize, legs: &mut Vec<usize>| -> usize {
            // Q after P, or on leg 0 when P is last; data around them
            if p == n - 1 {
                for d in legs.iter_mut() {
                    *d += 1;
                }
                0
            } else {
                for d in legs.iter_mut() {
                    if *d >= p {
                        *d += 2;
                    }
                }
                p + 1
            }
        };
        match algo {
            LEFT_ASYMMETRIC => {
                p = n - 1 - s;
                q = Some(asym(p, &mut legs));
            }
            RIGHT_ASYMMETRIC => {
                p = s;
                q = Some(asym(p, &mut legs));
            }
            LEFT_SYMMETRIC | RIGHT_SYMMETRIC => {
                p = if algo == LEFT_SYMMETRIC { n - 1 - s } else { s };
                q = Some((p + 1) % n);
                for d in legs.iter_mut() {
                    *d = (p + 2 + *d) % n;
                }
            }
            PARITY_0 => {
                p = 0;
                q = Some(1);
                for d in legs.iter_mut() {
                    *d += 2;
                }
            }
            ROTATING_ZERO_RESTART => {
                p = s;
                q = Some(asym(p, &mut legs));
                ddf = true;
            }
            ROTATING_N_RESTART => {
                p = n - 1 - ((stripe + 1) % n as u64) as usize;
                q = Some(asym(p, &mut legs));
                ddf = true;
            }
            ROTATING_N_CONTINUE => {
                p = n - 1 - s;
                q = Some((p + n - 1) % n);
                for d in legs.iter_mut() {
                    *d = (p + 1 + *d) % n;
                }
                ddf = true;
            }
            LEFT_ASYMMETRIC_6 | RIGHT_ASYMMETRIC_6 | LEFT_SYMMETRIC_6 | RIGHT_SYMMETRIC_6 | PARITY_0_6 => {
                // raid5's layout on the first n-1 legs, Q on the last
                let r5 = row(n - 1, algo - 16, 1, stripe);
                p = r5.p;
                q = Some(n - 1);
                legs = r5.data;
            }
            _ => {
                p = data_disks;
                q = Some(data_disks + 1);
            }
        }
    }
    // Q coefficients: md walks the legs from the one after Q (from leg 0 for
    // the ddf layouts, where P and Q take a slot each), numbering data blocks
    let coef = match q {
        None => (0..data_disks).collect(),
        Some(qd) => {
            let d0 = if ddf || qd == n - 1 { 0 } else { qd + 1 };
            let mut slot_of_leg = vec![0usize; n];
            let mut count = 0;
            for k in 0..n {
                let leg = (d0 + k) % n;
                slot_of_leg[leg] = count;
                if ddf || (leg != p && leg != qd) {
                    count += 1;
                }
            }
            legs.iter().map(|&l| slot_of_leg[l]).collect()
        }
    };
    Row { p, q, data: legs, coef }
}

/// Where an array's chunks lie on its legs (md's geometry for raid0, raid10
/// and raid4/5/6; raid1 has none: every leg holds every sector).
#[derive(Clone, Debug)]
pub struct Geometry {
    pub level: Level,
    pub legs: usize,
    /// Chunk in sectors (a power of two; 0 for raid1).
    pub chunk: u64,
    /// Sectors of each leg the array uses.
    pub dev_sectors: u64,
    /// raid10: near and far copies, offset layout, far set size, and the
    /// distance between far copies on a leg (md's geo.stride), in sectors.
    near: usize,
    far: usize,
    offset: bool,
    far_set: usize,
    stride: u64,
}

impl Geometry {
    /// The geometry of an array of `len` sectors on `legs` legs, or why the
    /// kernel would refuse it.
    pub fn new(level: Level, legs: usize, chunk: u64, len: u64) -> Result<Geometry, TargetError> {
        let mut g = Geometry {
            level,
            legs,
            chunk,
            dev_sectors: len,
            near: 1,
            far: 1,
            offset: false,
            far_set: legs,
            stride: 0,
        };
        match level {
            Level::Raid1 => {}
            Level::Raid0 => {
                if !len.is_multiple_of(legs as u64) {
                    return Err("Target length not divisible by number of data devices".into());
                }
                g.dev_sectors = len / legs as u64;
                g.aligned(len, legs as u64)?;
            }
            Level::Parity { parities, .. } => {
                let data = (legs - parities as usize) as u64;
                if !len.is_multiple_of(data) {
                    return Err("Target length not divisible by number of data devices".into());
                }
                g.dev_sectors = len / data;
                g.aligned(len, data)?;
            }
            Level::Raid10(layout) => {
                g.near = (layout & 0xff) as usize;
                g.far = ((layout >> 8) & 0xff) as usize;
                g.offset = layout & RAID10_OFFSET != 0;
                let copies = g.near * g.far;
                g.far_set = match layout >> 17 {
                    0 => legs,
                    2 => copies,
                    _ => return Err(format!("raid10 layout {layout:#x} is not one dmkit builds").into()),
                };
                if copies < 2 || copies > legs {
                    return Err("Not enough devices to satisfy specification".into());
                }
                let total = len * copies as u64;
                if !total.is_multiple_of(legs as u64) {
                    return Err("Target length not divisible by number of data devices".into());
                }
                // md's calc_sectors: whole chunks per leg, rounded up to a
                // multiple of the far copies
                let per_leg = total / legs as u64;
                let chunks = per_leg / chunk / g.far as u64;
                let array_chunks = chunks * legs as u64 / g.near as u64;
                let used = (array_chunks * copies as u64).div_ceil(legs as u64);
                g.dev_sectors = used * chunk;
                g.stride = if g.offset { chunk } else { used / g.far as u64 * chunk };
                if array_chunks * chunk < len {
                    return Err(format!(
                        "Target length {len} is more than the raid10 layout holds ({} sectors: each leg's share in whole chunks of {chunk}, times the legs, over the copies)",
                        array_chunks * chunk
                    ).into());
                }
            }
        }
        Ok(g)
    }

    /// md rounds each leg down to whole chunks and the array with it: a table
    /// longer than that would address sectors md does not have.
    fn aligned(&self, len: u64, data: u64) -> Result<(), TargetError> {
        if !self.dev_sectors.is_multiple_of(self.chunk) {
            return Err(format!(
                "Target length {len} is not a multiple of the chunk ({}) times the data legs ({data}): md would make the array shorter than the table, which dmkit does not do",
                self.chunk
            ).into());
        }
        Ok(())
    }

    /// raid0: the leg and leg sector of array sector `s`.
    pub fn striped(&self, s: u64) -> (usize, u64) {
        let (chunk, off) = (s / self.chunk, s % self.chunk);
        let n = self.legs as u64;
        ((chunk % n) as usize, chunk / n * self.chunk + off)
    }

    /// raid10: every copy of array sector `s` (md's __raid10_find_phys), in
    /// md's order: (leg, leg sector).
    pub fn copies(&self, s: u64) -> Vec<(usize, u64)> {
        let n = self.legs;
        let chunk = s / self.chunk * self.near as u64;
        let mut sector = s % self.chunk;
        let mut dev = (chunk % n as u64) as usize;
        let mut stripe = chunk / n as u64;
        if self.offset {
            stripe *= self.far as u64;
        }
        sector += stripe * self.chunk;
        let last_set_start = (n / self.far_set - 1) * self.far_set;
        let last_set_size = self.far_set + n % self.far_set;
        let mut out = Vec::with_capacity(self.near * self.far);
        for _ in 0..self.near {
            let (mut d, mut at) = (dev, sector);
            out.push((d, at));
            for _ in 1..self.far {
                let set = d / self.far_set;
                d += self.near;
                if !n.is_multiple_of(self.far_set) && d > last_set_start {
                    d = (d - last_set_start) % last_set_size + last_set_start;
                } else {
                    d = d % self.far_set + self.far_set * set;
                }
                at += self.stride;
                out.push((d, at));
            }
            dev += 1;
            if dev >= n {
                dev = 0;
                sector += self.chunk;
            }
        }
        out
    }

    /// raid4/5/6: the stripe row of array sector `s`, the index of its data
    /// block there, and its leg sector.
    pub fn parity_block(&self, s: u64) -> (Row, usize, u64) {
        let Level::Parity { algo, parities, .. } = self.level else {
            return (row(self.legs, 0, 1, 0), 0, s);
        };
        let data = (self.legs - parities as usize) as u64;
        let (chunk, off) = (s / self.chunk, s % self.chunk);
        let stripe = chunk / data;
        let r = row(self.legs, algo, parities, stripe);
        (r, (chunk % data) as usize, stripe * self.chunk + off)
    }

    /// raid4/5/6: the row at leg sector `dev_sector`.
    pub fn row_at(&self, dev_sector: u64) -> Row {
        let Level::Parity { algo, parities, .. } = self.level else {
            return row(self.legs, 0, 1, 0);
        };
        row(self.legs, algo, parities, dev_sector / self.chunk)
    }

    /// A row of data across the legs, in array sectors: the chunk times the
    /// legs that hold data (all of them but raid4/5/6's parities; raid10's
    /// copies count, as dm-raid's io_hints count them).
    pub fn row_sectors(&self) -> u64 {
        self.chunk * (self.legs - self.level.parities() as usize) as u64
    }

    /// raid10: the copies a chunk has (near times far).
    pub fn copies_count(&self) -> usize {
        self.near * self.far
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raid10_copies_lie_where_md_puts_them() {
        // 4 legs, chunk 8, 2 copies, 4096 array sectors (2048 per leg)
        let near = Geometry::new(Level::Raid10(2 | (1 << 8)), 4, 8, 4096).expect("near");
        assert_eq!(near.copies(0), vec![(0, 0), (1, 0)]);
        assert_eq!(near.copies(8 + 3), vec![(2, 3), (3, 3)]);
        assert_eq!(near.copies(16), vec![(0, 8), (1, 8)]);
        let far = Geometry::new(Level::Raid10((2 << 8) | 1 | RAID10_USE_FAR_SETS), 4, 8, 4096).expect("far");
        assert_eq!(far.dev_sectors, 2048);
        assert_eq!(far.copies(0), vec![(0, 0), (1, 1024)]);
        assert_eq!(far.copies(8 * 3), vec![(3, 0), (2, 1024)]);
        assert_eq!(far.copies(8 * 4), vec![(0, 8), (1, 1032)]);
        let off = Geometry::new(Level::Raid10((2 << 8) | 1 | RAID10_OFFSET | RAID10_USE_FAR_SETS), 4, 8, 4096)
            .expect("offset");
        assert_eq!(off.copies(0), vec![(0, 0), (1, 8)]);
        assert_eq!(off.copies(8 * 4), vec![(0, 16), (1, 24)]);
    }

    #[test]
    fn raid5_layouts_put_parity_where_md_does() {
        // 4 legs: stripe 0 and 1 of each algorithm (md's raid5_compute_sector)
        let la0 = row(4, algo::LEFT_ASYMMETRIC, 1, 0);
        assert_eq!((la0.p, la0.data.clone()), (3, vec![0, 1, 2]));
        let la1 = row(4, algo::LEFT_ASYMMETRIC, 1, 1);
        assert_eq!((la1.p, la1.data.clone()), (2, vec![0, 1, 3]));
        let ls1 = row(4, algo::LEFT_SYMMETRIC, 1, 1);
        assert_eq!((ls1.p, ls1.data.clone()), (2, vec![3, 0, 1]));
        let rs1 = row(4, algo::RIGHT_SYMMETRIC, 1, 1);
        assert_eq!((rs1.p, rs1.data.clone()), (1, vec![2, 3, 0]));
        let ra0 = row(4, algo::RIGHT_ASYMMETRIC, 1, 0);
        assert_eq!((ra0.p, ra0.data.clone()), (0, vec![1, 2, 3]));
        let n = row(4, algo::PARITY_N, 1, 7);
        assert_eq!((n.p, n.data.clone()), (3, vec![0, 1, 2]));
    }

    #[test]
    fn raid6_layouts_and_q_coefficients_as_md_numbers_them() {
        // zr: P rotates right from 0, Q after it; ddf numbering: slot = leg
        let z0 = row(5, algo::ROTATING_ZERO_RESTART, 2, 0);
        assert_eq!((z0.p, z0.q, z0.data.clone(), z0.coef.clone()), (0, Some(1), vec![2, 3, 4], vec![2, 3, 4]));
        let z4 = row(5, algo::ROTATING_ZERO_RESTART, 2, 4);
        assert_eq!((z4.p, z4.q, z4.data.clone(), z4.coef.clone()), (4, Some(0), vec![1, 2, 3], vec![1, 2, 3]));
        // nr: the first stripe is D D D P Q
        let n0 = row(5, algo::ROTATING_N_RESTART, 2, 0);
        assert_eq!((n0.p, n0.q, n0.data.clone()), (3, Some(4), vec![0, 1, 2]));
        // ls_6: raid5 ls on 4 legs, Q last; md numbering from after Q: leg 0 first
        let l1 = row(5, algo::LEFT_SYMMETRIC_6, 2, 1);
        assert_eq!((l1.p, l1.q, l1.data.clone(), l1.coef.clone()), (2, Some(4), vec![3, 0, 1], vec![2, 0, 1]));
    }
}
