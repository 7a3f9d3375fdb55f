//! Salvage for `thin_repair` and `thin_dump --repair`: find the trees damaged
//! metadata still holds, and the superblock fields, as thin-provisioning-tools
//! 1.x recovers them.
//!
//! If the superblock checks out and its trees can be read, they are used as they
//! are. Otherwise every block is scanned for btree nodes; nodes are classed by
//! what they hold (device details, the top-level device→root map, mappings) and
//! the roots are the nodes no internal node points to. A top-level root and a
//! details root that name the same devices and the same number of mappings make
//! a pair; the newest pair wins. Fields the damage took are rebuilt: the
//! transaction id from the newest device's, the data size from the highest data
//! block mapped, the time from the newest mapping or device; the data block size
//! must come from the old superblock or from the caller.

use super::error::{Result, ThinError};
use super::ir::{plan_of, Header, Overrides, Plan};
use super::superblock::{
    unpack_block_time, DeviceDetails, Superblock, MAX_DATA_BLOCK_SIZE, MIN_DATA_BLOCK_SIZE,
};
use crate::pdata::btree::node;
use crate::pdata::cache::validate;
use crate::pdata::sm_disk;
use crate::pdata::space_map::SmKind;
use crate::pdata::tm::TransactionManager;
use crate::pdata::{BlockKind, BLOCK_SIZE};
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// What salvage found.
pub struct Found {
    pub plan: Plan,
    /// Things a user should know (details regenerated, ...).
    pub warnings: Vec<String>,
}

#[derive(Clone, Debug)]
enum Kind {
    /// Device details leaf.
    Details,
    /// Top-level leaf: device id → bottom root.
    Top,
    /// Bottom-level leaf: virtual block → block_time.
    Mapping,
    /// Internal node over children of one kind (settled later).
    Internal(Vec<u64>),
}

/// What a subtree holds, by kind.
#[derive(Clone, Debug, Default)]
struct Sum {
    kind: u8, // 1 details, 2 top, 3 mapping, 0 invalid
    keys: Vec<u64>,
    /// mapping: mappings; details: sum of mapped_blocks
    mappings: u64,
    highest_data: Option<u64>,
    max_time: u32,
    max_tid: u64,
    details: Vec<(u64, DeviceDetails)>,
    roots: Vec<(u64, u64)>,
}

struct Scan {
    nodes: HashMap<u64, Kind>,
    sums: HashMap<u64, Sum>,
    referenced: BTreeSet<u64>,
}

impl Scan {
    fn sum(&mut self, b: u64, depth: usize) -> Sum {
        if let Some(s) = self.sums.get(&b) {
            return s.clone();
        }
        let s = match self.nodes.get(&b).cloned() {
            None => Sum::default(),
            Some(Kind::Internal(kids)) if depth < 32 => {
                let mut acc = Sum::default();
                for (i, k) in kids.iter().enumerate() {
                    let c = self.sum(*k, depth + 1);
                    if c.kind == 0 || (i > 0 && c.kind != acc.kind) {
                        acc.kind = 0;
                        break;
                    }
                    if i > 0 && c.keys.first() <= acc.keys.last() {
                        acc.kind = 0;
                        break;
                    }
                    acc.kind = c.kind;
                    acc.keys.extend(c.keys);
                    acc.mappings += c.mappings;
                    acc.highest_data = acc.highest_data.max(c.highest_data);
                    acc.max_time = acc.max_time.max(c.max_time);
                    acc.max_tid = acc.max_tid.max(c.max_tid);
                    acc.details.extend(c.details);
                    acc.roots.extend(c.roots);
                }
                acc
            }
            Some(Kind::Internal(_)) => Sum::default(),
            Some(_) => self.sums.get(&b).cloned().unwrap_or_default(),
        };
        self.sums.insert(b, s.clone());
        s
    }
}

/// What a scan gives of the devices: each (id, details, mapping root), the
/// latest time, the next transaction and the highest data block mapped.
struct Salvaged {
    devices: Vec<(u64, DeviceDetails, u64)>,
    time: u32,
    tid: u64,
    highest: Option<u64>,
}

/// The devices the scan's best roots name: the newest top-level tree whose
/// device details agree with it, or (with a warning) the newest top tree alone.
fn salvage_devices(scan: &mut Scan, warnings: &mut Vec<String>) -> Result<Salvaged> {
    // settle every root candidate
    let blocks: Vec<u64> = scan.nodes.keys().copied().collect();
    let candidates: Vec<u64> = blocks
        .into_iter()
        .filter(|b| !scan.referenced.contains(b))
        .collect();
    let mut tops = Vec::new();
    let mut details = Vec::new();
    for b in candidates {
        let s = scan.sum(b, 0);
        match s.kind {
            2 => tops.push((b, s)),
            1 => details.push((b, s)),
            _ => {}
        }
    }
    // a top-level tree: count its devices' mappings, newest first
    let mut tops: Vec<(u64, Sum, u64, u32, Option<u64>)> = tops
        .into_iter()
        .map(|(b, s)| {
            let (mut n, mut t, mut hi) = (0, 0, None);
            for (_, r) in &s.roots {
                let m = scan.sum(*r, 0);
                n += m.mappings;
                t = t.max(m.max_time);
                hi = hi.max(m.highest_data);
            }
            (b, s, n, t, hi)
        })
        .collect();
    tops.sort_by_key(|t| std::cmp::Reverse((t.3, t.2, t.0)));
    details.sort_by_key(|d| std::cmp::Reverse((d.1.max_time, d.1.max_tid, d.0)));
    let pair = tops.iter().find_map(|t| {
        details
            .iter()
            .find(|d| d.1.keys == t.1.keys && d.1.mappings == t.2)
            .map(|d| (t.clone(), d.clone()))
    });
    let (devices, time, tid, highest) = match pair {
        Some((t, d)) => {
            let det: BTreeMap<u64, DeviceDetails> = d.1.details.iter().copied().collect();
            let devs =
                t.1.roots
                    .iter()
                    .filter_map(|(dev, root)| det.get(dev).map(|x| (*dev, *x, *root)))
                    .collect::<Vec<_>>();
            (devs, t.3.max(d.1.max_time), d.1.max_tid + 1, t.4)
        }
        None => {
            let t = tops
                .first()
                .ok_or_else(|| ThinError::Plain("no compatible roots found".into()))?;
            warnings.push(format!(
                "found {} mapping trees without device details",
                tops.len()
            ));
            let age = t.3 + 1;
            let devs =
                t.1.roots
                    .iter()
                    .map(|(dev, root)| {
                        let m = scan.sum(*root, 0).mappings;
                        let d = DeviceDetails {
                            mapped_blocks: m,
                            transaction_id: 0,
                            creation_time: age,
                            snapshotted_time: age,
                        };
                        (*dev, d, *root)
                    })
                    .collect();
            (devs, age, 1, t.4)
        }
    };
    Ok(Salvaged {
        devices,
        time,
        tid,
        highest,
    })
}

/// Recover the plan of a damaged (or intact) pool.
pub fn salvage(tm: &mut TransactionManager, o: &Overrides) -> Result<Found> {
    // the superblock, if it checks out
    let raw = tm.cache.read_raw(0)?;
    let sb_ok = validate(0, BlockKind::Superblock, &raw).is_ok();
    let ref_sb = sb_ok.then(|| Superblock::decode(&raw));
    if let (Some(sb), None) = (&ref_sb, o.nr_data_blocks) {
        // the data size it states is what the repaired pool gets
        sm_disk::check_root(SmKind::Data, &sb.data_sm_root, 0, tm.cache.nr_blocks())?;
    }
    if let Some(sb) = &ref_sb {
        if let Ok(mut p) = plan_of(tm, sb) {
            if trees_readable(tm, &p) {
                p.header.apply(o);
                return Ok(Found {
                    plan: p,
                    warnings: Vec::new(),
                });
            }
        }
    }
    let mut scan = scan(tm)?;
    let mut warnings = Vec::new();
    let Salvaged {
        devices,
        time,
        tid,
        highest,
    } = salvage_devices(&mut scan, &mut warnings)?;
    let dbs = match o.data_block_size.or(ref_sb.as_ref().map(|s| s.data_block_size)) {
        Some(s) => s,
        None => {
            return Err(ThinError::Plain(
                "data block size needs to be provided due to corruption in the superblock".into(),
            ))
        }
    };
    if !(MIN_DATA_BLOCK_SIZE..=MAX_DATA_BLOCK_SIZE).contains(&dbs) || !dbs.is_multiple_of(MIN_DATA_BLOCK_SIZE)
    {
        return Err(ThinError::Plain("invalid data block size".into()));
    }
    let found_nr = highest.map_or(0, |h| h + 1);
    let transaction = match (o.transaction_id, &ref_sb) {
        (Some(t), _) => t.max(tid),
        (None, Some(sb)) => sb.trans_id.max(tid),
        (None, None) => tid,
    };
    let nr_data_blocks = match (o.nr_data_blocks, &ref_sb) {
        (Some(n), _) => n.max(found_nr),
        (None, Some(sb)) => sb.data_sm_root.nr_blocks.max(found_nr),
        (None, None) => found_nr,
    };
    let header = Header {
        uuid: String::new(),
        time: ref_sb.as_ref().map_or(time, |s| s.time.max(time)),
        transaction,
        flags: 0,
        version: 2,
        data_block_size: dbs,
        nr_data_blocks,
    };
    let mut devices = devices;
    if !warnings.is_empty() {
        for d in &mut devices {
            d.1.transaction_id = transaction.saturating_sub(1);
        }
    }
    scan.sums.clear();
    Ok(Found {
        plan: Plan { header, devices },
        warnings,
    })
}

/// Every device's tree can be walked to its leaves.
fn trees_readable(tm: &mut TransactionManager, p: &Plan) -> bool {
    p.devices
        .iter()
        .all(|(_, _, r)| crate::pdata::btree::leaves(tm, *r, 8, false).is_ok())
}

/// Read every block, keep the btree nodes that check out.
/// What a device-details leaf (`d`, its `keys`) says: its devices, their
/// mappings, the latest time and transaction.
fn details_leaf_sum(d: &[u8; BLOCK_SIZE], keys: Vec<u64>) -> Sum {
    let details: Vec<(u64, DeviceDetails)> = (0..keys.len())
        .map(|i| (node::key(d, i), DeviceDetails::decode(node::value(d, i))))
        .collect();
    Sum {
        kind: 1,
        mappings: details.iter().map(|(_, x)| x.mapped_blocks).sum(),
        max_time: details
            .iter()
            .map(|(_, x)| x.creation_time.max(x.snapshotted_time))
            .max()
            .unwrap_or(0),
        max_tid: details.iter().map(|(_, x)| x.transaction_id).max().unwrap_or(0),
        keys,
        details,
        ..Sum::default()
    }
}

/// What a mapping leaf says: how many mappings, the highest data block and
/// the latest time its values hold.
fn mapping_leaf_sum(keys: Vec<u64>, vals: &[u64]) -> Sum {
    let mut sum = Sum {
        kind: 3,
        mappings: vals.len() as u64,
        ..Sum::default()
    };
    for v in vals {
        let (db, t) = unpack_block_time(*v);
        sum.highest_data = sum.highest_data.max(Some(db));
        sum.max_time = sum.max_time.max(t);
    }
    sum.keys = keys;
    sum
}

fn scan(tm: &mut TransactionManager) -> Result<Scan> {
    let nr_blocks = tm.cache.nr_blocks();
    let mut s = Scan {
        nodes: HashMap::new(),
        sums: HashMap::new(),
        referenced: BTreeSet::new(),
    };
    let mut maybe_top = Vec::new();
    let mut buf = Box::new([0u8; BLOCK_SIZE]);
    for b in 0..nr_blocks {
        if tm.cache.read_uncached(b, BlockKind::BtreeNode, &mut buf).is_err() {
            continue;
        }
        let d = &*buf;
        let (leaf_vs, is_leaf) = match node::flags(d) {
            node::LEAF => (node::value_size(d), true),
            node::INTERNAL => (8, false),
            _ => continue,
        };
        if !matches!(leaf_vs, 8 | 24) || node::check_header(b, d, leaf_vs).is_err() {
            continue;
        }
        let n = node::nr_entries(d);
        let keys: Vec<u64> = (0..n).map(|i| node::key(d, i)).collect();
        if keys.windows(2).any(|w| w[0] >= w[1]) {
            continue;
        }
        if !is_leaf {
            let kids: Vec<u64> = (0..n).map(|i| node::value_u64(d, i)).collect();
            if kids.iter().any(|&k| k >= nr_blocks) {
                continue;
            }
            s.nodes.insert(b, Kind::Internal(kids));
            continue;
        }
        if leaf_vs == 24 {
            s.nodes.insert(b, Kind::Details);
            s.sums.insert(b, details_leaf_sum(d, keys));
            continue;
        }
        let vals: Vec<u64> = (0..n).map(|i| node::value_u64(d, i)).collect();
        if n > 0 && vals.iter().all(|&v| v < nr_blocks) {
            maybe_top.push((b, keys.clone(), vals.clone()));
        }
        s.nodes.insert(b, Kind::Mapping);
        s.sums.insert(b, mapping_leaf_sum(keys, &vals));
    }
    for kids in s.nodes.values() {
        if let Kind::Internal(k) = kids {
            s.referenced.extend(k.iter().copied());
        }
    }
    // a leaf whose values are all mapping-tree roots is a top-level leaf
    for (b, keys, vals) in maybe_top {
        let all_roots = vals.iter().all(|v| {
            let k = s.sum(*v, 0).kind;
            k == 3 && !matches!(s.nodes.get(v), Some(Kind::Top))
        });
        if all_roots {
            s.nodes.insert(b, Kind::Top);
            s.sums.insert(
                b,
                Sum {
                    kind: 2,
                    roots: keys.iter().copied().zip(vals.iter().copied()).collect(),
                    keys,
                    ..Sum::default()
                },
            );
        }
    }
    // internal sums were computed before the top leaves were known
    let internal: Vec<u64> = s
        .nodes
        .iter()
        .filter(|(_, k)| matches!(k, Kind::Internal(_)))
        .map(|(b, _)| *b)
        .collect();
    for b in internal {
        s.sums.remove(&b);
    }
    Ok(s)
}
