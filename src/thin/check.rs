//! `thin_check`: walk every tree from the superblock, check each node's
//! structure, recount every metadata and data block reference, and compare
//! with the space maps on disk.
//!
//! The phases, verdicts and messages are thin-provisioning-tools 1.x's: the
//! details tree, the top-level mapping tree (and the two trees agreeing on the
//! devices), each device's mappings against its recorded count, then the data
//! and metadata space maps. Everything is fatal except leaked blocks (a count
//! higher than the references, which loses space but no data) and under-full
//! nodes; `--auto-repair` fixes leaks when nothing fatal was found.

use super::metadata::{read_superblock, read_superblock_alone, ThinPoolMetadata, DEFAULT_CACHE_BLOCKS};
use super::progress::Progress;
use super::superblock::{DeviceDetails, Superblock, SUPERBLOCK_LOCATION};
use crate::pdata::btree::node;
use crate::pdata::cache::FastMap;
use crate::pdata::sm_disk::{self, decode_index_entry, SmRoot};
use crate::pdata::space_map::{SmKind, SpaceMap};
use crate::pdata::tm::reader;
use crate::pdata::tm::TransactionManager;
use crate::pdata::{Block, BlockKind, MetadataDev, PdataError, BLOCK_SIZE};
use std::collections::BTreeMap;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Tree {
    Details,
    Top,
    Bottom,
    DataIndex,
    RefCount,
}

impl Tree {
    fn leaf_vs(self) -> usize {
        match self {
            Tree::Details => 24,
            Tree::Top | Tree::Bottom => 8,
            Tree::DataIndex => 16,
            Tree::RefCount => 4,
        }
    }
}

/// A line of the check's report on standard error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Line {
    /// A phase begins (1.x's sub-titles: "device details tree", ...).
    Title(String),
    /// Something found, or done.
    Msg(String),
}

/// What a check found.
#[derive(Default, Debug)]
pub struct Report {
    /// TRANSACTION_ID and METADATA_FREE_BLOCKS, once the superblock was read.
    pub info: Option<(u64, u64)>,
    pub lines: Vec<Line>,
    /// The fatal error that ended the check, if any.
    pub fatal: Option<String>,
    /// The non-fatal verdict (leaks, under-full nodes), if any and not repaired.
    pub non_fatal: Option<String>,
    /// Every fatal finding, one per line (the details behind `fatal`).
    pub errors: Vec<String>,
    /// Every non-fatal finding.
    pub leaks: Vec<String>,
    pub transaction_id: u64,
    pub free_metadata_blocks: u64,
}

impl Report {
    /// Nothing wrong at all.
    pub fn ok(&self) -> bool {
        self.fatal.is_none() && self.non_fatal.is_none() && self.errors.is_empty() && self.leaks.is_empty()
    }

    /// The exit verdict: fatal errors always fail, non-fatal ones unless ignored.
    pub fn passed(&self, ignore_non_fatal: bool) -> bool {
        self.fatal.is_none() && (ignore_non_fatal || self.non_fatal.is_none())
    }

    fn title(&mut self, s: &str) {
        self.lines.push(Line::Title(s.into()));
    }
    fn msg(&mut self, s: String) {
        self.lines.push(Line::Msg(s));
    }
    fn fail(&mut self, s: String) {
        self.errors.push(s.clone());
        self.fatal = Some(s);
    }
}

/// Reference counts found by the walk: a byte per block, large counts on the
/// side, and references past the end kept apart to be reported.
struct Recount {
    small: Vec<u8>,
    big: FastMap<u64, u32>,
    beyond: BTreeMap<u64, u32>,
}

impl Recount {
    fn new(field: &'static str, nr_blocks: u64) -> crate::pdata::Result<Recount> {
        Ok(Recount {
            small: crate::pdata::bounds::zeroed_vec(0, field, nr_blocks)?,
            big: FastMap::default(),
            beyond: BTreeMap::new(),
        })
    }

    /// One more reference to `b`; returns the count before it.
    fn inc(&mut self, b: u64) -> u32 {
        let Some(c) = self.small.get_mut(b as usize) else {
            let e = self.beyond.entry(b).or_default();
            *e += 1;
            return *e - 1;
        };
        match *c {
            0..=253 => {
                *c += 1;
                *c as u32 - 1
            }
            254 => {
                *c = 255;
                self.big.insert(b, 255);
                254
            }
            _ => {
                let e = self.big.entry(b).or_insert(255);
                *e = e.saturating_add(1);
                *e - 1
            }
        }
    }

    fn get(&self, b: u64) -> u32 {
        match self.small.get(b as usize) {
            Some(255) => self.big.get(&b).copied().unwrap_or(255),
            Some(&c) => c as u32,
            None => self.beyond.get(&b).copied().unwrap_or(0),
        }
    }
}

/// Where a node sits: its tree, whether it is the root, the key range its
/// parent gives it, and its depth.
#[derive(Clone, Copy)]
struct At {
    t: Tree,
    is_root: bool,
    lo: u64,
    hi: u64,
    depth: usize,
}

/// What a subtree holds: its mappings, and the nodes in it that could not be used.
#[derive(Clone, Copy, Default)]
struct Summary {
    mappings: u64,
    errors: u32,
    checksum_errors: u32,
    io_errors: u32,
    /// The subtree's top node itself could not be used (not summed by `add`).
    own_fault: bool,
}

impl Summary {
    fn add(&mut self, o: Summary) {
        self.mappings += o.mappings;
        self.errors = self.errors.saturating_add(o.errors);
        self.checksum_errors = self.checksum_errors.saturating_add(o.checksum_errors);
        self.io_errors = self.io_errors.saturating_add(o.io_errors);
    }
}

struct Checker {
    tm: TransactionManager,
    meta_expected: Recount,
    data_expected: Recount,
    /// Bottom-level subtrees already walked: what they hold (shared subtrees are
    /// read once and counted for every device that has them).
    bottom: FastMap<u64, Summary>,
    /// Node buffers, one per level of the walk in progress.
    spare: Vec<Box<Block>>,
    /// Problems found in the current (non-bottom) tree walk.
    errors: Vec<String>,
    progress: Progress,
    ignore_non_fatal: bool,
    underfull: u64,
    /// `--skip-mappings`: the details and top-level trees only.
    skip: bool,
    /// Bottom-level nodes that could not be used.
    bad_bottom: u64,
    /// Distinct nodes that failed to read, by cause (1.x's totals count a node
    /// devices share once).
    bad_io: u64,
    bad_checksum: u64,
}

impl Checker {
    fn err(&mut self, s: String) {
        if self.errors.len() < 1000 {
            self.errors.push(s);
        }
    }

    /// Count a reference to metadata block `b`; true on its first arrival.
    fn meta_ref(&mut self, b: u64) -> bool {
        self.meta_expected.inc(b) == 0
    }

    /// Walk a whole tree; returns what its leaves hold (for bottom trees).
    fn tree(&mut self, root: u64, t: Tree) -> Summary {
        let mut leaf_depth = None;
        let at = At {
            t,
            is_root: true,
            lo: 0,
            hi: u64::MAX,
            depth: 0,
        };
        self.node(root, at, &mut leaf_depth)
    }

    /// Visit a node: every arrival counts, the first one reads and descends.
    fn node(&mut self, b: u64, at: At, leaf_depth: &mut Option<usize>) -> Summary {
        let first = self.meta_ref(b);
        if at.t == Tree::Bottom {
            if let Some(s) = self.bottom.get(&b) {
                return *s;
            }
        }
        if !first {
            return Summary::default();
        }
        let s = self.read_node(b, at, leaf_depth);
        if at.t == Tree::Bottom {
            self.bottom.insert(b, s);
        }
        s
    }

    fn read_node(&mut self, b: u64, at: At, leaf_depth: &mut Option<usize>) -> Summary {
        if at.t == Tree::Bottom {
            self.bad_bottom += 1; // taken back below if the node is good
        }
        let bad = |io: bool| Summary {
            mappings: 0,
            errors: 1,
            checksum_errors: u32::from(!io),
            io_errors: u32::from(io),
            own_fault: true,
        };
        if at.depth > 32 {
            self.err(format!("metadata block {b}: btree too deep (cycle?)"));
            return bad(false);
        }
        self.progress.tick(1);
        let mut d = self.spare.pop().unwrap_or_else(|| Box::new([0u8; BLOCK_SIZE]));
        let s = match self.tm.cache.read_uncached(b, BlockKind::BtreeNode, &mut d) {
            Ok(()) => {
                let s = self.node_contents(b, &d, at, leaf_depth);
                if at.t == Tree::Bottom && !s.own_fault {
                    self.bad_bottom -= 1;
                }
                s
            }
            Err(e) => {
                let io = matches!(e, PdataError::Io { .. } | PdataError::OutOfRange { .. });
                let cs = matches!(e, PdataError::Checksum { .. });
                if at.t == Tree::Bottom {
                    self.bad_io += u64::from(io);
                    self.bad_checksum += u64::from(cs);
                }
                self.err(format!("node error: {e}"));
                Summary {
                    checksum_errors: u32::from(cs),
                    ..bad(io)
                }
            }
        };
        self.spare.push(d);
        s
    }

    /// What the node holds; `own_fault` if the node itself is at fault.
    fn node_contents(&mut self, b: u64, d: &Block, at: At, leaf_depth: &mut Option<usize>) -> Summary {
        match self.contents(b, d, at, leaf_depth) {
            Some(s) => s,
            None => Summary {
                errors: 1,
                own_fault: true,
                ..Summary::default()
            },
        }
    }

    fn contents(&mut self, b: u64, d: &Block, at: At, leaf_depth: &mut Option<usize>) -> Option<Summary> {
        let At {
            t,
            is_root,
            lo,
            hi,
            depth,
        } = at;
        if let Err(e) = node::check_header(b, d, t.leaf_vs()) {
            self.err(format!("node error: {e}"));
            return None;
        }
        let n = node::nr_entries(d);
        let max = node::max(d);
        if !is_root && n < max / 3 {
            self.underfull += 1;
            if !self.ignore_non_fatal {
                self.err(format!(
                    "node error: metadata block {b}: btree node has {n} entries, fewer than the minimum {}",
                    max / 3
                ));
                return None;
            }
        }
        if !is_root && n == 0 {
            return Some(Summary::default());
        }
        for i in 0..n {
            let k = node::key(d, i);
            if i > 0 && k <= node::key(d, i - 1) {
                self.err(format!(
                    "node error: metadata block {b}: keys out of order at entry {i}"
                ));
                return None;
            }
            if k < lo || k >= hi {
                self.err(format!(
                    "node error: metadata block {b}: key {k} outside its parent's range [{lo}, {hi})"
                ));
                return None;
            }
        }
        let mut s = Summary::default();
        if !node::is_leaf(d) {
            for i in 0..n {
                let clo = node::key(d, i);
                let chi = if i + 1 < n { node::key(d, i + 1) } else { hi };
                let c = node::value_u64(d, i);
                let child = At {
                    t,
                    is_root: false,
                    lo: clo.max(lo),
                    hi: chi,
                    depth: depth + 1,
                };
                s.add(self.node(c, child, leaf_depth));
            }
            return Some(s);
        }
        match leaf_depth {
            None => *leaf_depth = Some(depth),
            Some(ld) if *ld != depth => {
                self.err(format!(
                    "node error: metadata block {b}: leaves at different depths"
                ));
                return None;
            }
            _ => {}
        }
        match t {
            Tree::Bottom => {
                for i in 0..n {
                    self.data_expected.inc(node::value_u64(d, i) >> 24);
                }
                s.mappings = n as u64;
            }
            Tree::DataIndex => {
                for i in 0..n {
                    let loc = decode_index_entry(node::value(d, i)).0;
                    self.meta_ref(loc);
                }
            }
            Tree::Details | Tree::Top | Tree::RefCount => {}
        }
        Some(s)
    }

    /// Walk a details or top-level tree, collecting its entries; the walk's
    /// errors are returned prefixed with `what`.
    fn index_tree(&mut self, root: u64, t: Tree, what: &str) -> Result<BTreeMap<u64, [u8; 24]>, String> {
        self.errors.clear();
        self.tree(root, t);
        if let Some(e) = self.errors.first() {
            return Err(format!("{what}: {e}"));
        }
        // the walk checked every node; now read the entries
        let mut out = BTreeMap::new();
        let vs = t.leaf_vs();
        let r = crate::pdata::btree::walk(&mut self.tm, root, vs, &mut |k, v| {
            let mut e = [0u8; 24];
            e[..vs].copy_from_slice(v);
            out.insert(k, e);
            Ok(())
        });
        match r {
            Ok(()) => Ok(out),
            Err(e) => Err(format!("{what}: node error: {e}")),
        }
    }

    /// Compare a space map with the recount: bad counts (fatal) and leaks.
    fn compare(&self, sm: &SpaceMap, bad: &mut Vec<String>, leaked: &mut Vec<(u64, u32)>) {
        let expected = match sm.kind {
            SmKind::Metadata => &self.meta_expected,
            SmKind::Data => &self.data_expected,
        };
        let kind = kind_word(sm.kind);
        let nr = sm.nr_blocks();
        let beyond = expected
            .beyond
            .keys()
            .copied()
            .chain((nr..expected.small.len() as u64).filter(|&b| expected.get(b) != 0));
        for b in beyond {
            bad.push(format!(
                "{kind} block {b} is referenced but beyond the space map ({nr} blocks)"
            ));
        }
        // Equal bytes below 255 are equal counts: only the rest needs a look.
        for (b, (&a, &e)) in sm.counts.iter().zip(&expected.small).enumerate() {
            if a == e && a != 255 {
                continue;
            }
            let b = b as u64;
            let (a, e) = (sm.count(b), expected.get(b));
            if a == 1 && e == 0 {
                leaked.push((b, e));
            } else if a != e {
                bad.push(format!(
                    "Bad reference count for {kind} block {b}.  Expected {e}, but space map contains {a}."
                ));
            }
        }
        for b in expected.small.len() as u64..nr {
            match sm.count(b) {
                0 => {}
                1 => leaked.push((b, 0)),
                a => bad.push(format!(
                    "Bad reference count for {kind} block {b}.  Expected 0, but space map contains {a}."
                )),
            }
        }
    }
}

fn kind_word(k: SmKind) -> &'static str {
    match k {
        SmKind::Metadata => "metadata",
        SmKind::Data => "data",
    }
}

/// Check metadata; `metadata_snap` checks the held snapshot's trees only.
pub fn check(dev: Box<dyn MetadataDev>, metadata_snap: bool) -> Report {
    check_with(
        dev,
        CheckOptions {
            metadata_snap,
            ..CheckOptions::default()
        },
    )
}

/// What `check_with` looks at and may do (thin_check's options).
#[derive(Clone, Copy, Debug, Default)]
pub struct CheckOptions {
    /// The held metadata snapshot's trees only.
    pub metadata_snap: bool,
    /// The superblock only (`--super-block-only`).
    pub super_block_only: bool,
    /// Not the per-device mapping trees (`--skip-mappings`); the space maps' counts
    /// cannot then be checked and are not.
    pub skip_mappings: bool,
    /// Under-full nodes are not errors (`--ignore-non-fatal-errors`).
    pub ignore_non_fatal: bool,
    /// Fix leaked blocks if nothing fatal is found (`--auto-repair`).
    pub auto_repair: bool,
    /// Clear needs_check if nothing fatal is found (`--clear-needs-check-flag`;
    /// fixes leaks too, as 1.x does).
    pub clear_needs_check: bool,
    pub override_mapping_root: Option<u64>,
    pub override_details_root: Option<u64>,
    /// A progress line on stderr if it is a terminal.
    pub progress: bool,
}

impl CheckOptions {
    fn writes(&self) -> bool {
        self.auto_repair || self.clear_needs_check
    }
}

/// Check `dev`. To repair (`auto_repair`, `clear_needs_check`) it must be open for
/// writing; the repair is one committed transaction.
pub fn check_with(dev: Box<dyn MetadataDev>, o: CheckOptions) -> Report {
    let mut report = Report::default();
    let nr_blocks = dev.nr_blocks();
    if nr_blocks == 0 {
        report.fail("Metadata device/file too small.  Is this binary metadata?".into());
        return report;
    }
    let mut tm = reader(dev, 64);
    let Some((sb, held)) = superblocks(&mut tm, &o, &mut report) else {
        return report;
    };
    if o.super_block_only {
        return finish(tm, o, report, &sb, Vec::new(), Vec::new());
    }
    let recounts = Recount::new("metadata device blocks", nr_blocks).and_then(|m| {
        Ok((
            m,
            Recount::new(SmKind::Data.nr_blocks_field(), sb.data_sm_root.nr_blocks)?,
        ))
    });
    let (meta_expected, data_expected) = match recounts {
        Ok(r) => r,
        Err(e) => {
            report.fail(e.to_string());
            return report;
        }
    };
    // The space maps load on a second thread while the trees are walked.
    let preload = (!o.metadata_snap && !o.skip_mappings)
        .then(|| tm.cache.dev().try_clone())
        .flatten()
        .map(|dev2| {
            let (data_root, meta_root) = (sb.data_sm_root, sb.meta_sm_root);
            std::thread::spawn(move || {
                let mut tm2 = reader(dev2, 64);
                let d = sm_disk::load(&mut tm2, SmKind::Data, &data_root);
                let m = sm_disk::load(&mut tm2, SmKind::Metadata, &meta_root);
                (d, m)
            })
        });
    let mut c = Checker {
        tm,
        meta_expected,
        data_expected,
        bottom: FastMap::default(),
        spare: Vec::new(),
        errors: Vec::new(),
        progress: Progress::new(
            "checking metadata blocks",
            sb.meta_sm_root.nr_allocated,
            o.progress,
        ),
        ignore_non_fatal: o.ignore_non_fatal,
        underfull: 0,
        skip: o.skip_mappings,
        bad_bottom: 0,
        bad_io: 0,
        bad_checksum: 0,
    };
    if let Some(held) = held {
        devices_and_mappings(&mut c, &mut report, &held, "");
        return report;
    }
    if !live_and_held_trees(&mut c, &mut report, &sb) {
        return report;
    }
    if o.skip_mappings {
        let tm = c.tm;
        return finish(tm, o, report, &sb, Vec::new(), Vec::new());
    }
    let (pre_data, pre_meta) = match preload.map(|h| h.join()) {
        Some(Ok((d, m))) => (Some(d), Some(m)),
        _ => (None, None),
    };
    let Some(data_leaks) = data_space_map(&mut c, &mut report, &sb, pre_data) else {
        return report;
    };
    let Some(meta_leaks) = metadata_space_map(&mut c, &mut report, &sb, pre_meta) else {
        return report;
    };
    if c.underfull > 0 && o.ignore_non_fatal {
        report
            .leaks
            .push(format!("{} btree nodes are under-full", c.underfull));
    }
    let tm = c.tm;
    finish(tm, o, report, &sb, data_leaks, meta_leaks)
}

/// Read the superblock (and, checking the metadata snapshot, the held one),
/// say what they hold in `report`, and apply the root overrides: None if the
/// check ends here (`report` says why).
fn superblocks(
    tm: &mut TransactionManager,
    o: &CheckOptions,
    report: &mut Report,
) -> Option<(Superblock, Option<Superblock>)> {
    let read = if o.super_block_only {
        read_superblock_alone
    } else {
        read_superblock
    };
    let mut sb = match read(&mut tm.cache) {
        Ok(sb) => sb,
        Err(e) => {
            let s = match e {
                super::ThinError::Pdata(PdataError::Checksum { .. }) => {
                    "bad checksum in superblock".to_string()
                }
                e => e.to_string(),
            };
            report.fail(s);
            return None;
        }
    };
    if o.metadata_snap && sb.held_root == 0 {
        report.fail("no current metadata snap".into());
        return None;
    }
    // the snapshot's superblock is read before anything is said of the live one
    // (1.x: a bad one is the only line, even with --super-block-only)
    let held = if o.metadata_snap {
        match tm.read(sb.held_root, BlockKind::Superblock) {
            Ok(d) => Some(Superblock::decode(d)),
            Err(e) => {
                report.errors.push(format!("metadata snap superblock: {e}"));
                report.fail(format!("metadata snap: {}", superblock_error(&e)));
                return None;
            }
        }
    } else {
        None
    };
    report.transaction_id = sb.trans_id;
    report.free_metadata_blocks = sb
        .meta_sm_root
        .nr_blocks
        .saturating_sub(sb.meta_sm_root.nr_allocated);
    report.info = Some((report.transaction_id, report.free_metadata_blocks));
    if let Some(r) = o.override_mapping_root {
        sb.mapping_root = r;
    }
    if let Some(r) = o.override_details_root {
        sb.details_root = r;
    }
    Some((sb, held))
}

/// The live trees, then those of a held metadata snapshot: false if the check
/// ends here.
fn live_and_held_trees(c: &mut Checker, report: &mut Report, sb: &Superblock) -> bool {
    c.meta_ref(SUPERBLOCK_LOCATION);
    if !devices_and_mappings(c, report, sb, "") {
        return false;
    }
    if sb.held_root == 0 || !c.meta_ref(sb.held_root) {
        return true;
    }
    match c.tm.read(sb.held_root, BlockKind::Superblock) {
        Ok(d) => {
            let h = Superblock::decode(d);
            devices_and_mappings(c, report, &h, "metadata snap: ")
        }
        Err(e) => {
            report.errors.push(format!("metadata snap superblock: {e}"));
            report.fail(format!("metadata snap: {}", superblock_error(&e)));
            false
        }
    }
}

/// The data space map: its own blocks, then its counts (`pre`: loaded
/// beforehand). Its leaked blocks, or None if the check ends here.
fn data_space_map(
    c: &mut Checker,
    report: &mut Report,
    sb: &Superblock,
    pre: Option<crate::pdata::Result<SpaceMap>>,
) -> Option<Vec<(u64, u32)>> {
    report.title("data space map");
    c.errors.clear();
    c.tree(sb.data_sm_root.bitmap_root, Tree::DataIndex);
    c.tree(sb.data_sm_root.ref_count_root, Tree::RefCount);
    counts(c, report, SmKind::Data, &sb.data_sm_root, pre)
}

/// The metadata space map: its index block, bitmaps and overflow tree, then
/// its counts. Its leaked blocks, or None if the check ends here.
fn metadata_space_map(
    c: &mut Checker,
    report: &mut Report,
    sb: &Superblock,
    pre: Option<crate::pdata::Result<SpaceMap>>,
) -> Option<Vec<(u64, u32)>> {
    report.title("metadata space map");
    c.meta_ref(sb.meta_sm_root.bitmap_root);
    match c.tm.read(sb.meta_sm_root.bitmap_root, BlockKind::Index) {
        Ok(d) => {
            let d = Box::new(*d);
            let nr = sb.meta_sm_root.nr_blocks.div_ceil(16320).min(255) as usize;
            for i in 0..nr {
                let loc = decode_index_entry(&d[16 + 16 * i..32 + 16 * i]).0;
                if loc != 0 {
                    c.meta_ref(loc);
                }
            }
        }
        Err(e @ PdataError::Checksum { .. }) => {
            report.errors.push(e.to_string());
            report.fail("metadata space map: bad checksum in index block".into());
            return None;
        }
        Err(e) => {
            report.fail(format!("metadata space map: {e}"));
            return None;
        }
    }
    c.errors.clear();
    c.tree(sb.meta_sm_root.ref_count_root, Tree::RefCount);
    counts(c, report, SmKind::Metadata, &sb.meta_sm_root, pre)
}

/// A space map whose own blocks were walked: an error found there ends the
/// check, else its counts are checked. Its leaked blocks, or None if the check
/// ends here.
fn counts(
    c: &mut Checker,
    report: &mut Report,
    kind: SmKind,
    root: &SmRoot,
    pre: Option<crate::pdata::Result<SpaceMap>>,
) -> Option<Vec<(u64, u32)>> {
    if let Some(e) = c.errors.first().cloned() {
        report.fail(format!("{} space map: {e}", kind_word(kind)));
        return None;
    }
    let mut leaks = Vec::new();
    space_map(c, report, kind, root, pre, &mut leaks).then_some(leaks)
}

fn superblock_error(e: &PdataError) -> String {
    match e {
        PdataError::Checksum { .. } => "bad checksum in superblock".into(),
        e => e.to_string(),
    }
}

/// The details tree, the top-level tree, the two agreeing, and (unless skipped)
/// every device's mappings. False if a fatal error ended the check.
fn devices_and_mappings(c: &mut Checker, report: &mut Report, sb: &Superblock, prefix: &str) -> bool {
    // 1.x's order, titles included: the top-level mapping tree is read first
    // (before any title), then the details tree under its title; the
    // "mapping tree" title comes once the two agree, and not when the
    // mappings are skipped
    let roots = match c.index_tree(sb.mapping_root, Tree::Top, &format!("{prefix}mapping top-level")) {
        Ok(r) => r,
        Err(e) => {
            report.fail(e);
            return false;
        }
    };
    if prefix.is_empty() {
        report.title("device details tree");
    }
    let details = match c.index_tree(
        sb.details_root,
        Tree::Details,
        &format!("{prefix}device details tree"),
    ) {
        Ok(d) => d,
        Err(e) => {
            report.fail(e);
            return false;
        }
    };
    if !details.keys().eq(roots.keys()) {
        report.fail(format!(
            "{prefix}Inconsistency between the details tree and the mapping tree"
        ));
        return false;
    }
    if c.skip {
        return true;
    }
    if prefix.is_empty() {
        report.title("mapping tree");
    }
    let mut lines = Vec::new();
    let mut details_of_faults = Vec::new();
    let mut nodes = Summary::default();
    for (dev, v) in &roots {
        let root = u64::from_le_bytes([v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]]);
        let expected = details
            .get(dev)
            .map(|d| DeviceDetails::decode(d).mapped_blocks)
            .unwrap_or(0);
        c.errors.clear();
        let s = c.tree(root, Tree::Bottom);
        details_of_faults.append(&mut c.errors);
        // the walk says whether the root itself was unusable
        if s.own_fault {
            lines.push(format!(
                "{prefix}Thin device {dev} is missing root with {expected} mappings"
            ));
            continue;
        }
        if s.errors > 0 {
            nodes.add(Summary { mappings: 0, ..s });
            lines.push(format!(
                "{prefix}Thin device {dev} has {} errors and is missing {} mappings, while expected {expected}",
                s.errors,
                expected.saturating_sub(s.mappings)
            ));
        } else if s.mappings != expected {
            lines.push(format!(
                "{prefix}Thin device {dev} has unexpected number of mappings, expected {expected}, actual {}",
                s.mappings
            ));
        }
    }
    if lines.is_empty() {
        return true;
    }
    if nodes.errors > 0 {
        report.msg(format!(
            "{} nodes in data mapping tree contain errors",
            c.bad_bottom
        ));
        report.msg(format!(
            "{} io errors, {} checksum errors",
            c.bad_io, c.bad_checksum
        ));
    }
    for l in lines {
        report.msg(l.clone());
        report.errors.push(l);
    }
    report.errors.append(&mut details_of_faults);
    report.fatal = Some("Check of mappings failed".into());
    false
}

/// Load a space map and compare it with the recount. False if fatal.
fn space_map(
    c: &mut Checker,
    report: &mut Report,
    kind: SmKind,
    root: &SmRoot,
    loaded: Option<crate::pdata::Result<SpaceMap>>,
    leaks: &mut Vec<(u64, u32)>,
) -> bool {
    let word = kind_word(kind);
    let loaded = loaded.unwrap_or_else(|| sm_disk::load(&mut c.tm, kind, root));
    let sm = match loaded {
        Ok(sm) => sm,
        Err(PdataError::Checksum {
            block,
            kind: BlockKind::Bitmap,
            ..
        }) => {
            let m = format!("Index entry points to block ({block}) that isn't a bitmap");
            report.errors.push(m.clone());
            report.msg(m);
            report.fail(format!("{word} space map: Fatal errors in {word} space map"));
            return false;
        }
        Err(e) => {
            report.fail(format!("{word} space map: {e}"));
            return false;
        }
    };
    let mut bad = Vec::new();
    c.compare(&sm, &mut bad, leaks);
    for b in &bad {
        report.msg(b.clone());
        report.errors.push(b.clone());
    }
    if !leaks.is_empty() {
        let l = format!("{} {word} blocks have leaked.", leaks.len());
        report.msg(l.clone());
        report.leaks.push(l);
    }
    // 0.9's thin_restore leaves nr_allocated off by one; only complain about more.
    if sm.nr_allocated().abs_diff(root.nr_allocated) > 1 && bad.is_empty() && leaks.is_empty() {
        let l = format!(
            "{word} space map: nr_allocated is {} but {} blocks are in use",
            root.nr_allocated,
            sm.nr_allocated()
        );
        report.msg(l.clone());
        report.errors.push(l);
        bad.push(String::new());
    }
    if !bad.is_empty() {
        report.fatal = Some(format!("{word} space map: Fatal errors in {word} space map"));
        return false;
    }
    true
}

/// The end of a check with nothing fatal: report leaks, and repair what was asked.
fn finish(
    tm: TransactionManager,
    o: CheckOptions,
    mut report: Report,
    sb: &Superblock,
    data_leaks: Vec<(u64, u32)>,
    meta_leaks: Vec<(u64, u32)>,
) -> Report {
    let leaks = !data_leaks.is_empty() || !meta_leaks.is_empty();
    let needs_check = sb.flags & super::superblock::NEEDS_CHECK != 0;
    if !o.writes() || (!leaks && !needs_check) {
        if leaks {
            let kind = if data_leaks.is_empty() { "metadata" } else { "data" };
            report.non_fatal = Some(format!(
                "{kind} space map contains leaks\nperhaps you wanted to run with --auto-repair"
            ));
        } else if !report.leaks.is_empty() && !o.ignore_non_fatal {
            report.non_fatal = report.leaks.first().cloned();
        }
        return report;
    }
    // One transaction: the counts set to what the trees hold, the flag cleared.
    let dev = tm.cache.into_dev();
    let mut md = match ThinPoolMetadata::open(dev, DEFAULT_CACHE_BLOCKS) {
        Ok(md) => md,
        Err(e) => {
            report.fail(format!("repair: {e}"));
            return report;
        }
    };
    if !data_leaks.is_empty() {
        report.msg("Repairing data leaks.".into());
    }
    if !meta_leaks.is_empty() {
        report.msg("Repairing metadata leaks.".into());
    }
    let r = md.repair_counts(&data_leaks, &meta_leaks).and_then(|()| {
        if needs_check {
            md.set_needs_check(false);
        }
        md.commit()
    });
    if let Err(e) = r {
        report.fail(format!("repair: {e}"));
        return report;
    }
    if needs_check {
        report.msg("Cleared needs_check flag".into());
    }
    report
}
