//! `thin_metadata_size`: the metadata a pool needs for a data size, block size
//! and number of thin devices, by 1.x's estimate: one superblock, a root per
//! device, and the bottom-level leaves at half occupancy.

use super::thin::MetadataSizeArgs;
use super::Outcome;
use dmkit::pdata::space_map::MAX_METADATA_BLOCKS;
use dmkit::pdata::BLOCK_SIZE;

/// A unit as 1.x names it: (letter, name, short name, bytes). The names are 1.x's
/// words, its "terabyte" for TiB included, so output compares equal.
const UNITS: &[(&str, &str, &str, u64)] = &[
    ("b", "byte", "b", 1),
    ("s", "sector", "s", 512),
    ("k", "kibibyte", "KiB", 1 << 10),
    ("m", "mebibyte", "MiB", 1 << 20),
    ("g", "gibibyte", "GiB", 1 << 30),
    ("t", "terabyte", "TiB", 1 << 40),
    ("p", "pebibyte", "PiB", 1 << 50),
    ("e", "exbibyte", "EiB", 1 << 60),
    ("K", "kilobyte", "kB", 1_000),
    ("M", "megabyte", "MB", 1_000_000),
    ("G", "gigabyte", "GB", 1_000_000_000),
    ("T", "terabyte", "TB", 1_000_000_000_000),
    ("P", "petabyte", "PB", 1_000_000_000_000_000),
    ("E", "exabyte", "EB", 1_000_000_000_000_000_000),
];

/// Look a unit up by letter, short name or long name ("tebibyte" for TiB).
fn unit(s: &str) -> Option<&'static (&'static str, &'static str, &'static str, u64)> {
    UNITS
        .iter()
        .find(|u| u.0 == s || u.2 == s || u.1 == s || (s == "tebibyte" && u.0 == "t"))
}

/// The index in [`UNITS`] of a unit named on the command line.
pub fn unit_index(s: &str) -> Result<usize, String> {
    let u = unit(s).ok_or("Invalid unit specifier")?;
    Ok(UNITS.iter().position(|x| std::ptr::eq(x, u)).unwrap_or(1))
}

/// `N[unit]` in bytes; a bare number is sectors.
pub fn storage_size(s: &str) -> Result<u64, String> {
    let pos = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let n: u64 = s[..pos].parse().map_err(|e| format!("{e}"))?;
    let bytes = if pos == s.len() {
        512
    } else {
        unit(&s[pos..]).ok_or("Invalid unit specifier")?.3
    };
    n.checked_mul(bytes)
        .ok_or_else(|| "value out of bounds".to_string())
}

/// Mapping entries per bottom-level leaf at half occupancy: a node holds
/// (4096 - 32) / 16 entries rounded down to a multiple of 3, i.e. 252.
const ENTRIES_PER_LEAF: u64 = ((BLOCK_SIZE as u64 - 32) / 16 / 3 * 3) / 2;

/// Estimated metadata bytes for `nr_blocks` data blocks and `max_thins` devices.
pub fn estimate(nr_blocks: u64, max_thins: u64) -> u64 {
    let leaves = nr_blocks.div_ceil(ENTRIES_PER_LEAF);
    let blocks = (1 + leaves).saturating_add(max_thins).min(MAX_METADATA_BLOCKS);
    blocks * BLOCK_SIZE as u64
}

pub fn run(a: MetadataSizeArgs) -> Outcome {
    let (block, pool) = (a.block_size.unwrap_or_default(), a.pool_size.unwrap_or_default());
    if block == 0 || !block.is_multiple_of(64 << 10) {
        return Err("block size must be a multiple of 64 KiB".into());
    }
    if block > 1 << 30 {
        return Err("maximum block size is 1 GiB".into());
    }
    if pool < block {
        return Err("pool size must be larger than block size".into());
    }
    let bytes = estimate(pool / block, a.max_thins.unwrap_or_default());
    print(bytes as f64, a.unit, a.numeric_only.as_ref());
    Ok(())
}

/// Print a size of `bytes` in unit `unit` (an index in [`UNITS`]) as 1.x does:
/// two decimals unless whole, then the unit's name (plural), its letter
/// (`-n=short`) or nothing (`-n`).
pub fn print(bytes: f64, unit: usize, numeric_only: Option<&Option<String>>) {
    let u = &UNITS[unit.min(UNITS.len() - 1)];
    let size = bytes / u.3 as f64;
    let mut out = if size < 1.0 || size.trunc() == size {
        format!("{size}")
    } else {
        format!("{size:.2}")
    };
    match numeric_only {
        None => {
            out.push(' ');
            out.push_str(u.1);
            out.push('s');
        }
        Some(None) => {}
        Some(Some(o)) if o == "short" => out.push_str(u.0),
        Some(Some(_)) => {
            out.push_str(u.1);
            out.push('s');
        }
    }
    println!("{out}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimate_matches_the_formula() {
        // 1 TiB of 64 KiB blocks: 2^24 blocks / 126 per leaf, + superblock + 1000 roots
        let leaves = (1u64 << 24).div_ceil(126);
        assert_eq!(estimate(1 << 24, 1000), (1 + leaves + 1000) * 4096);
        assert_eq!(storage_size("64k"), Ok(65536));
        assert_eq!(storage_size("128"), Ok(65536));
        assert!(storage_size("1x").is_err());
    }
}
