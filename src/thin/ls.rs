//! thin_ls: a pool's thin devices with their usage.

use super::dump::superblock_and_plan;
use super::ir::Plan;
use super::Result;
use crate::pdata::btree::{self, node};
use crate::pdata::space_map::SmKind;
use crate::pdata::tm::TransactionManager;
use crate::pdata::BlockKind;
use std::collections::HashMap;
use std::fmt::Write as _;

/// thin_ls's fields, in the order of [`LsField::ALL`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LsField {
    Dev,
    MappedBlocks,
    ExclusiveBlocks,
    SharedBlocks,
    HighestBlock,
    MappedSectors,
    ExclusiveSectors,
    SharedSectors,
    HighestSector,
    MappedBytes,
    ExclusiveBytes,
    SharedBytes,
    HighestByte,
    Mapped,
    Exclusive,
    Shared,
    HighestMapped,
    Transaction,
    CreateTime,
    SnapTime,
}

impl LsField {
    pub const ALL: [LsField; 20] = [
        LsField::Dev,
        LsField::MappedBlocks,
        LsField::ExclusiveBlocks,
        LsField::SharedBlocks,
        LsField::HighestBlock,
        LsField::MappedSectors,
        LsField::ExclusiveSectors,
        LsField::SharedSectors,
        LsField::HighestSector,
        LsField::MappedBytes,
        LsField::ExclusiveBytes,
        LsField::SharedBytes,
        LsField::HighestByte,
        LsField::Mapped,
        LsField::Exclusive,
        LsField::Shared,
        LsField::HighestMapped,
        LsField::Transaction,
        LsField::CreateTime,
        LsField::SnapTime,
    ];

    /// The field's name, as thin_ls's `-o` takes it and its header prints it.
    pub fn name(self) -> &'static str {
        match self {
            LsField::Dev => "DEV",
            LsField::MappedBlocks => "MAPPED_BLOCKS",
            LsField::ExclusiveBlocks => "EXCLUSIVE_BLOCKS",
            LsField::SharedBlocks => "SHARED_BLOCKS",
            LsField::HighestBlock => "HIGHEST_BLOCK",
            LsField::MappedSectors => "MAPPED_SECTORS",
            LsField::ExclusiveSectors => "EXCLUSIVE_SECTORS",
            LsField::SharedSectors => "SHARED_SECTORS",
            LsField::HighestSector => "HIGHEST_SECTOR",
            LsField::MappedBytes => "MAPPED_BYTES",
            LsField::ExclusiveBytes => "EXCLUSIVE_BYTES",
            LsField::SharedBytes => "SHARED_BYTES",
            LsField::HighestByte => "HIGHEST_BYTE",
            LsField::Mapped => "MAPPED",
            LsField::Exclusive => "EXCLUSIVE",
            LsField::Shared => "SHARED",
            LsField::HighestMapped => "HIGHEST_MAPPED",
            LsField::Transaction => "TRANSACTION",
            LsField::CreateTime => "CREATE_TIME",
            LsField::SnapTime => "SNAP_TIME",
        }
    }

    /// A field by its name.
    pub fn parse(s: &str) -> std::result::Result<LsField, String> {
        LsField::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| "Unknown field".to_string())
    }

    /// Whether the field needs the mappings counted (all but DEV and the details').
    fn counts(self) -> bool {
        !matches!(
            self,
            LsField::Dev | LsField::Transaction | LsField::CreateTime | LsField::SnapTime
        )
    }
}

/// The fields thin_ls prints without `-o`.
const DEFAULT_FIELDS: [LsField; 4] = [
    LsField::Dev,
    LsField::Mapped,
    LsField::CreateTime,
    LsField::SnapTime,
];

/// thin_ls's options.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LsOptions {
    /// The columns (`-o`); none: DEV, MAPPED, CREATE_TIME, SNAP_TIME.
    pub fields: Vec<LsField>,
    /// No header line.
    pub no_headers: bool,
    /// List the devices of the held metadata snapshot.
    pub metadata_snap: bool,
}

impl LsOptions {
    /// The columns printed.
    pub fn columns(&self) -> &[LsField] {
        if self.fields.is_empty() {
            &DEFAULT_FIELDS
        } else {
            &self.fields
        }
    }

    /// Whether the listing counts mappings (thin_ls says so first).
    pub fn counts(&self) -> bool {
        self.columns().iter().any(|f| f.counts())
    }
}

/// One device of the listing. The counts are 0 (and `highest_block` None)
/// when the fields asked for need no counting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LsRow {
    pub dev: u64,
    pub mapped: u64,
    pub exclusive: u64,
    pub shared: u64,
    /// The highest mapped thin block, if any is mapped.
    pub highest_block: Option<u64>,
    pub transaction: u64,
    pub create_time: u32,
    pub snap_time: u32,
}

/// A listing: the rows, ascending by device, and the data block size (sectors).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LsReport {
    pub data_block_size: u32,
    pub rows: Vec<LsRow>,
}

/// 1.x's short size: the largest binary unit with at most 8192 of it, truncated.
pub fn pretty_size(bytes: u128) -> String {
    const UNITS: [&str; 7] = ["b", "KiB", "MiB", "GiB", "Tib", "PiB", "EiB"];
    if bytes == 0 {
        return "0b".into();
    }
    let mut i = (((127 - bytes.leading_zeros()) / 10).saturating_sub(1) as usize).min(6);
    let mut m = bytes >> (10 * i);
    if m > 8192 && i < 6 {
        m = (m as f64 / 1024.0).round() as u128;
        i += 1;
    }
    format!("{m}{}", UNITS[i])
}

/// Per device of `plan`: mapped, shared, highest mapped block.
pub fn usage(
    tm: &mut TransactionManager,
    plan: &Plan,
    nr_data_blocks: u64,
) -> Result<Vec<(u64, u64, Option<u64>)>> {
    // each device's leaves; how many times each leaf is used
    let mut seqs: HashMap<u64, Vec<u64>> = HashMap::new();
    let mut uses: HashMap<u64, u32> = HashMap::new();
    for (_, _, root) in &plan.devices {
        if !seqs.contains_key(root) {
            let (l, _) = btree::leaves(tm, *root, 8, false)?;
            seqs.insert(*root, l);
        }
        for l in &seqs[root] {
            *uses.entry(*l).or_default() += 1;
        }
    }
    // references to each data block, counting a shared leaf once per use
    let mut refs: Vec<u8> =
        crate::pdata::bounds::zeroed_vec(0, SmKind::Data.nr_blocks_field(), nr_data_blocks)?;
    let mut leaf_values: HashMap<u64, (Vec<u64>, Option<u64>)> = HashMap::new();
    for (&l, &n) in &uses {
        let d = tm.read(l, BlockKind::BtreeNode)?;
        node::check_header(l, d, 8)?;
        let cnt = node::nr_entries(d);
        let vals: Vec<u64> = (0..cnt).map(|i| node::value_u64(d, i) >> 24).collect();
        let hi = cnt.checked_sub(1).map(|i| node::key(d, i));
        for &b in &vals {
            if let Some(c) = refs.get_mut(b as usize) {
                *c = c.saturating_add(n.min(255) as u8);
            }
        }
        leaf_values.insert(l, (vals, hi));
    }
    let per_leaf: HashMap<u64, (u64, u64, Option<u64>)> = leaf_values
        .into_iter()
        .map(|(l, (vals, hi))| {
            let shared = vals
                .iter()
                .filter(|&&b| refs.get(b as usize).is_some_and(|&c| c > 1))
                .count();
            (l, (vals.len() as u64, shared as u64, hi))
        })
        .collect();
    Ok(plan
        .devices
        .iter()
        .map(|(_, _, root)| {
            let (mut m, mut s, mut h) = (0, 0, None);
            for l in &seqs[root] {
                if let Some((a, b, c)) = per_leaf.get(l) {
                    m += a;
                    s += b;
                    h = h.max(*c);
                }
            }
            (m, s, h)
        })
        .collect())
}

/// The listing `o` asks for, of the metadata `tm` reads.
pub fn ls(tm: &mut TransactionManager, o: &LsOptions) -> Result<LsReport> {
    let (sb, plan) = superblock_and_plan(tm, o.metadata_snap)?;
    let usage = if o.counts() {
        usage(tm, &plan, sb.data_sm_root.nr_blocks)?
    } else {
        vec![(0, 0, None); plan.devices.len()]
    };
    let rows = plan
        .devices
        .iter()
        .zip(usage)
        .map(|((dev, d, _), (mapped, shared, highest_block))| LsRow {
            dev: *dev,
            mapped,
            exclusive: mapped.saturating_sub(shared),
            shared,
            highest_block,
            transaction: d.transaction_id,
            create_time: d.creation_time,
            snap_time: d.snapshotted_time,
        })
        .collect();
    Ok(LsReport {
        data_block_size: sb.data_block_size,
        rows,
    })
}

/// One cell of thin_ls's table.
fn cell(f: LsField, r: &LsRow, block_sectors: u32) -> String {
    // u128: a block count or key from metadata times the block size can pass 2^64
    let bs = u128::from(block_sectors);
    let (mapped, ex, shared) = (
        u128::from(r.mapped),
        u128::from(r.exclusive),
        u128::from(r.shared),
    );
    let hb = u128::from(r.highest_block.unwrap_or(0));
    match f {
        LsField::Dev => r.dev.to_string(),
        LsField::MappedBlocks => mapped.to_string(),
        LsField::ExclusiveBlocks => ex.to_string(),
        LsField::SharedBlocks => shared.to_string(),
        LsField::HighestBlock => hb.to_string(),
        LsField::MappedSectors => (mapped * bs).to_string(),
        LsField::ExclusiveSectors => (ex * bs).to_string(),
        LsField::SharedSectors => (shared * bs).to_string(),
        LsField::HighestSector => ((hb + 1) * bs - 1).to_string(),
        LsField::MappedBytes => (mapped * bs * 512).to_string(),
        LsField::ExclusiveBytes => (ex * bs * 512).to_string(),
        LsField::SharedBytes => (shared * bs * 512).to_string(),
        LsField::HighestByte => ((hb + 1) * bs * 512 - 1).to_string(),
        LsField::Mapped => pretty_size(mapped * bs * 512),
        LsField::Exclusive => pretty_size(ex * bs * 512),
        LsField::Shared => pretty_size(shared * bs * 512),
        LsField::HighestMapped => pretty_size((hb + 1) * bs * 512 - 1),
        LsField::Transaction => r.transaction.to_string(),
        LsField::CreateTime => r.create_time.to_string(),
        LsField::SnapTime => r.snap_time.to_string(),
    }
}

/// thin_ls's table of a listing: the columns `o` names, right-aligned.
pub fn render(report: &LsReport, o: &LsOptions) -> String {
    let fields = o.columns();
    let mut rows: Vec<Vec<String>> = Vec::new();
    if !o.no_headers {
        rows.push(fields.iter().map(|f| f.name().to_string()).collect());
    }
    for r in &report.rows {
        rows.push(
            fields
                .iter()
                .map(|&f| cell(f, r, report.data_block_size))
                .collect(),
        );
    }
    let mut widths = vec![0; fields.len()];
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let mut s = String::new();
    for r in &rows {
        for (w, c) in widths.iter().zip(r) {
            let _ = write!(s, "{c:>w$} ");
        }
        s.push('\n');
    }
    s
}

/// thin_ls's output for `o` on the metadata `tm` reads.
pub fn ls_text(tm: &mut TransactionManager, o: &LsOptions) -> Result<String> {
    Ok(render(&ls(tm, o)?, o))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_print_as_thin_ls_prints_them() {
        assert_eq!(pretty_size(0), "0b");
        assert_eq!(pretty_size(120 * 128 * 512), "7680KiB");
        assert_eq!(pretty_size((319 * 128 * 512) - 1), "20MiB");
        assert_eq!(pretty_size(25_000 * 65536), "1562MiB");
        assert_eq!(pretty_size(10 * 65536), "640KiB");
    }

    #[test]
    fn field_names_round_trip() {
        for f in LsField::ALL {
            assert_eq!(LsField::parse(f.name()), Ok(f));
        }
        assert_eq!(LsField::parse("dev"), Err("Unknown field".into()));
    }
}
