//! `thin_rmap`, `thin_trim`, `thin_delta`, `thin_ls`: read-only views of a pool's
//! mappings (trim also discards the data device's free blocks).

use super::{open_input, req, DeltaArgs, Failure, LsArgs, Outcome, RmapArgs, TrimArgs};
use crate::pdata::btree::{self, node};
use crate::pdata::space_map::SmKind;
use crate::pdata::tm::TransactionManager;
use crate::pdata::BlockKind;
use crate::thin::dump::{pick_superblock, reader, superblock_error};
use crate::thin::ir::{plan_of, Plan};
use crate::thin::superblock::{unpack_block_time, Superblock};
use crate::thin::ThinError;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::Write;
use std::path::Path;

/// Open metadata for reading, with 1.x's input checks.
fn open(p: &Path) -> Result<TransactionManager, Failure> {
    Ok(reader(Box::new(open_input(p, false)?), 256))
}

fn load(tm: &mut TransactionManager, metadata_snap: bool) -> Result<(Superblock, Plan), Failure> {
    let sb = pick_superblock(tm, metadata_snap).map_err(|e| match superblock_error(e) {
        ThinError::NoSnapshotHeld => Failure::Message("no current metadata snap".into()),
        e => Failure::Message(e.to_string()),
    })?;
    let plan = plan_of(tm, &sb)?;
    Ok((sb, plan))
}

/// Write `s` to standard output; a closed pipe ends the tool quietly.
fn emit(s: &str) -> Outcome {
    let mut out = std::io::stdout().lock();
    match out.write_all(s.as_bytes()).and_then(|_| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if super::broken_pipe(&e) => Err(Failure::Quiet(super::EXIT_FAILURE)),
        Err(e) => Err(Failure::Message(format!("output error: {e}"))),
    }
}

/// Every mapping of the tree at `root`: (virtual block, data block, time).
fn mappings(tm: &mut TransactionManager, root: u64) -> Result<Vec<(u64, u64, u32)>, Failure> {
    let mut v = Vec::new();
    btree::walk(tm, root, 8, &mut |k, val| {
        let (b, t) = unpack_block_time(crate::pdata::le64(val, 0));
        v.push((k, b, t));
        Ok(())
    })
    .map_err(|e| Failure::Message(e.to_string()))?;
    Ok(v)
}

// ---- thin_rmap -------------------------------------------------------------

pub fn run_rmap(a: RmapArgs) -> Outcome {
    let mut tm = open(&req(a.input))?;
    let (_, plan) = load(&mut tm, false)?;
    let inside = |b: u64| a.region.iter().any(|r| b >= r.begin && b < r.end);
    // (data begin, data end, dev, thin begin)
    let mut runs: Vec<(u64, u64, u64, u64)> = Vec::new();
    for (dev, _, root) in &plan.devices {
        let mut cur: Option<(u64, u64, u64)> = None; // data, thin, len
        for (v, b, _) in mappings(&mut tm, *root)? {
            if !inside(b) {
                continue;
            }
            match &mut cur {
                Some((d0, v0, len)) if *d0 + *len == b && *v0 + *len == v => *len += 1,
                _ => {
                    if let Some((d0, v0, len)) = cur.take() {
                        runs.push((d0, d0 + len, *dev, v0));
                    }
                    cur = Some((b, v, 1));
                }
            }
        }
        if let Some((d0, v0, len)) = cur {
            runs.push((d0, d0 + len, *dev, v0));
        }
    }
    runs.sort_unstable();
    let mut s = String::new();
    for (db, de, dev, tb) in runs {
        let _ = writeln!(s, "data {db}..{de} -> thin({dev}) {tb}..{}", tb + (de - db));
    }
    emit(&s)
}

// ---- thin_trim -------------------------------------------------------------

pub fn run_trim(a: TrimArgs) -> Outcome {
    let meta = req(a.metadata_dev);
    let data = req(a.data_dev);
    // trim discards what the metadata calls free: a live pool's metadata moves
    // under it, so both its files are claimed as a pool holds them
    let dev = open_input(&meta, false)?;
    let _claims = [super::claim(&meta)?, super::claim(&data)?];
    // a second handle for the pool once the check (which takes the first) passed
    let again = crate::pdata::MetadataDev::try_clone(&dev)
        .ok_or_else(|| Failure::Message(format!("{}: cannot open it twice", meta.display())))?;
    let r = crate::thin::check::check_with(Box::new(dev), crate::thin::check::CheckOptions::default());
    if !a.quiet && r.passed(false) {
        // 1.x's thin_trim reports its check as thin_check does
        super::check::print_report(&r, false, false);
    }
    if !r.passed(false) {
        if !a.quiet {
            eprintln!("metadata contains errors (run thin_check for details).\nperhaps you need to run thin_repair.");
        }
        return Err(Failure::Quiet(65));
    }
    let md = crate::thin::ThinPoolMetadata::open(again, 1024)?;
    let block_bytes = md.data_block_size() as u64 * 512;
    let nr = md.nr_data_blocks();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&data)
        .map_err(|e| Failure::Message(format!("{}: {e}", data.display())))?;
    // seek-to-end sizes block devices too
    let size = {
        use std::io::Seek;
        (&f).seek(std::io::SeekFrom::End(0))
            .map_err(|e| Failure::Message(format!("{}: {e}", data.display())))?
    };
    let want = nr.saturating_mul(block_bytes);
    if size < want {
        return Err(Failure::Message(format!(
            "unexpected data device size, wanted {want} bytes"
        )));
    }
    // each run of free blocks, and everything past the last used one
    let mut b = 0;
    while b < nr {
        if md.data_block_ref_count(b) != 0 {
            b += 1;
            continue;
        }
        let start = b;
        while b < nr && md.data_block_ref_count(b) == 0 {
            b += 1;
        }
        let len = if b == nr {
            size - start * block_bytes
        } else {
            (b - start) * block_bytes
        };
        use rustix::fs::{fallocate, FallocateFlags};
        fallocate(
            &f,
            FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
            start * block_bytes,
            len,
        )
        .map_err(|e| Failure::Message(format!("{}: discard of blocks {start}..{b}: {e}", data.display())))?;
    }
    Ok(())
}

// ---- thin_delta ------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Delta {
    LeftOnly,
    RightOnly,
    Same,
    Different,
}

impl Delta {
    fn tag(self) -> &'static str {
        match self {
            Delta::LeftOnly => "left_only",
            Delta::RightOnly => "right_only",
            Delta::Same => "same",
            Delta::Different => "different",
        }
    }
}

/// A delta range: kind, first block, length, first data block(s) left and right.
type Range = (Delta, u64, u64, u64, u64);

/// A device's mappings a leaf at a time: (virtual block, data block).
struct Cursor {
    leaves: Vec<u64>,
    li: usize,
    entries: Vec<(u64, u64)>,
    ei: usize,
}

impl Cursor {
    fn new(tm: &mut TransactionManager, root: u64) -> Result<Cursor, Failure> {
        let (leaves, _) = btree::leaves(tm, root, 8, false).map_err(|e| Failure::Message(e.to_string()))?;
        Ok(Cursor {
            leaves,
            li: 0,
            entries: Vec::new(),
            ei: 0,
        })
    }

    /// At the start of leaf `li` (nothing of it taken yet).
    fn at_leaf_start(&self) -> Option<u64> {
        (self.ei >= self.entries.len())
            .then(|| self.leaves.get(self.li).copied())
            .flatten()
    }

    fn load(&mut self, tm: &mut TransactionManager) -> Result<(), Failure> {
        while self.ei >= self.entries.len() && self.li < self.leaves.len() {
            let b = self.leaves[self.li];
            self.li += 1;
            let d = tm
                .read(b, BlockKind::BtreeNode)
                .map_err(|e| Failure::Message(e.to_string()))?;
            node::check_header(b, d, 8).map_err(|e| Failure::Message(e.to_string()))?;
            self.entries.clear();
            self.entries
                .extend((0..node::nr_entries(d)).map(|i| (node::key(d, i), node::value_u64(d, i) >> 24)));
            self.ei = 0;
        }
        Ok(())
    }

    fn peek(&mut self, tm: &mut TransactionManager) -> Result<Option<(u64, u64)>, Failure> {
        self.load(tm)?;
        Ok(self.entries.get(self.ei).copied())
    }
}

/// The ranges where two devices' mappings agree or differ, thin-contiguous ranges
/// of one kind merged; read a leaf at a time, and a leaf both share is read once.
fn delta_stream(tm: &mut TransactionManager, lroot: u64, rroot: u64) -> Result<Vec<Range>, Failure> {
    let (mut l, mut r) = (Cursor::new(tm, lroot)?, Cursor::new(tm, rroot)?);
    let mut out: Vec<Range> = Vec::new();
    let mut push = |k: Delta, v: u64, dl: u64, dr: u64| match out.last_mut() {
        Some((pk, pv, len, _, _)) if *pk == k && *pv + *len == v => *len += 1,
        _ => out.push((k, v, 1, dl, dr)),
    };
    loop {
        // the same leaf on both sides: all of it is the same
        if let (Some(a), Some(b)) = (l.at_leaf_start(), r.at_leaf_start()) {
            if a == b {
                l.load(tm)?;
                for &(v, d) in &l.entries {
                    push(Delta::Same, v, d, d);
                }
                l.ei = l.entries.len();
                r.li += 1;
                continue;
            }
        }
        match (l.peek(tm)?, r.peek(tm)?) {
            (Some(a), Some(b)) if a.0 == b.0 => {
                let k = if a.1 == b.1 { Delta::Same } else { Delta::Different };
                push(k, a.0, a.1, b.1);
                l.ei += 1;
                r.ei += 1;
            }
            (Some(a), Some(b)) if a.0 < b.0 => {
                push(Delta::LeftOnly, a.0, a.1, 0);
                l.ei += 1;
            }
            (Some(a), None) => {
                push(Delta::LeftOnly, a.0, a.1, 0);
                l.ei += 1;
            }
            (_, Some(b)) => {
                push(Delta::RightOnly, b.0, 0, b.1);
                r.ei += 1;
            }
            (None, None) => break,
        }
    }
    Ok(out)
}

pub fn run_delta(a: DeltaArgs) -> Outcome {
    let input = req(a.input.clone());
    if let Some(pool) = live_pool(&input) {
        let mut words = vec!["thin_delta".to_string()];
        for (f, v) in [
            ("--thin1", a.thin1),
            ("--thin2", a.thin2),
            ("--root1", a.root1),
            ("--root2", a.root2),
        ] {
            if let Some(v) = v {
                words.extend([f.to_string(), v.to_string()]);
            }
        }
        if a.verbose {
            words.push("--verbose".into());
        }
        if a.metadata_snap {
            words.push("-m".into());
        }
        return ask_daemon(pool, words);
    }
    let mut tm = open(&input)?;
    emit(&delta_text(&mut tm, &a)?)
}

/// thin_delta's output for `a` on the metadata `tm` reads.
pub fn delta_text(tm: &mut TransactionManager, a: &DeltaArgs) -> Result<String, Failure> {
    let (sb, plan) = load(tm, a.metadata_snap)?;
    let side = |n: u8, thin: Option<u64>, root: Option<u64>| -> Result<(String, u64), Failure> {
        match (thin, root) {
            (Some(t), _) => plan
                .devices
                .iter()
                .find(|d| d.0 == t)
                .map(|d| (format!("{}=\"{t}\"", if n == 1 { "left" } else { "right" }), d.2))
                .ok_or_else(|| Failure::Message(format!("Unable to find mapping tree for snap{n} ({t})"))),
            (None, Some(r)) => Ok((
                format!("{}=\"{r}\"", if n == 1 { "left_root" } else { "right_root" }),
                r,
            )),
            (None, None) => Err(Failure::Message(format!("--thin{n} or --root{n} not specified"))),
        }
    };
    let (lattr, lroot) = side(1, a.thin1, a.root1)?;
    let (rattr, rroot) = side(2, a.thin2, a.root2)?;
    let ranges = delta_stream(tm, lroot, rroot)?;
    let flags = if sb.flags & crate::thin::superblock::NEEDS_CHECK != 0 {
        " flags=\"1\""
    } else {
        ""
    };
    let mut s = format!(
        "<superblock uuid=\"\" time=\"{}\" transaction=\"{}\"{flags} data_block_size=\"{}\" nr_data_blocks=\"{}\">\n  <diff {lattr} {rattr}>\n",
        sb.time, sb.trans_id, sb.data_block_size, sb.data_sm_root.nr_blocks
    );
    let mut open: Option<Delta> = None;
    for (k, v, len, dl, dr) in ranges {
        if !a.verbose {
            let _ = writeln!(s, "    <{} begin=\"{v}\" length=\"{len}\"/>", k.tag());
            continue;
        }
        if open != Some(k) {
            if let Some(o) = open {
                let _ = writeln!(s, "    </{}>", o.tag());
            }
            let _ = writeln!(s, "    <{}>", k.tag());
            open = Some(k);
        }
        match k {
            Delta::Different => {
                let _ = writeln!(
                    s,
                    "      <range begin=\"{v}\" left_data_begin=\"{dl}\" right_data_begin=\"{dr}\" length=\"{len}\"/>"
                );
            }
            _ => {
                let d = if k == Delta::RightOnly { dr } else { dl };
                let _ = writeln!(
                    s,
                    "      <range begin=\"{v}\" data_begin=\"{d}\" length=\"{len}\"/>"
                );
            }
        }
    }
    if let Some(o) = open {
        let _ = writeln!(s, "    </{}>", o.tag());
    }
    s.push_str("  </diff>\n</superblock>");
    Ok(s)
}

// ---- thin_ls ---------------------------------------------------------------

/// thin_ls's fields, in its names.
pub const LS_FIELDS: &[&str] = &[
    "DEV",
    "MAPPED_BLOCKS",
    "EXCLUSIVE_BLOCKS",
    "SHARED_BLOCKS",
    "HIGHEST_BLOCK",
    "MAPPED_SECTORS",
    "EXCLUSIVE_SECTORS",
    "SHARED_SECTORS",
    "HIGHEST_SECTOR",
    "MAPPED_BYTES",
    "EXCLUSIVE_BYTES",
    "SHARED_BYTES",
    "HIGHEST_BYTE",
    "MAPPED",
    "EXCLUSIVE",
    "SHARED",
    "HIGHEST_MAPPED",
    "TRANSACTION",
    "CREATE_TIME",
    "SNAP_TIME",
];

/// A field name on the command line, as its index in [`LS_FIELDS`].
pub fn ls_field(s: &str) -> Result<usize, String> {
    LS_FIELDS
        .iter()
        .position(|f| *f == s)
        .ok_or_else(|| "Unknown field".to_string())
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

/// Per device: mapped, shared, highest mapped block.
pub fn usage(
    tm: &mut TransactionManager,
    plan: &Plan,
    nr_data_blocks: u64,
) -> Result<Vec<(u64, u64, Option<u64>)>, Failure> {
    // each device's leaves; how many times each leaf is used
    let mut seqs: HashMap<u64, Vec<u64>> = HashMap::new();
    let mut uses: HashMap<u64, u32> = HashMap::new();
    for (_, _, root) in &plan.devices {
        if !seqs.contains_key(root) {
            let (l, _) = btree::leaves(tm, *root, 8, false).map_err(|e| Failure::Message(e.to_string()))?;
            seqs.insert(*root, l);
        }
        for l in &seqs[root] {
            *uses.entry(*l).or_default() += 1;
        }
    }
    // references to each data block, counting a shared leaf once per use
    let mut refs: Vec<u8> =
        crate::pdata::bounds::zeroed_vec(0, SmKind::Data.nr_blocks_field(), nr_data_blocks)
            .map_err(|e| Failure::Message(e.to_string()))?;
    let mut leaf_values: HashMap<u64, (Vec<u64>, Option<u64>)> = HashMap::new();
    for (&l, &n) in &uses {
        let d = tm
            .read(l, BlockKind::BtreeNode)
            .map_err(|e| Failure::Message(e.to_string()))?;
        node::check_header(l, d, 8).map_err(|e| Failure::Message(e.to_string()))?;
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

pub fn run_ls(a: LsArgs) -> Outcome {
    let input = req(a.input.clone());
    if let Some(pool) = live_pool(&input) {
        let mut words = vec!["thin_ls".to_string()];
        if !a.format.is_empty() {
            let names: Vec<&str> = a.format.iter().map(|&f| LS_FIELDS[f]).collect();
            words.extend(["-o".to_string(), names.join(",")]);
        }
        if a.no_headers {
            words.push("--no-headers".into());
        }
        if a.metadata_snap {
            words.push("-m".into());
        }
        return ask_daemon(pool, words);
    }
    let mut tm = open(&input)?;
    let counting = a.format.is_empty() || a.format.iter().any(|&f| (1..17).contains(&f));
    if counting {
        eprintln!("Scanning data mappings");
    }
    emit(&ls_text(&mut tm, &a)?)
}

/// thin_ls's output for `a` on the metadata `tm` reads.
pub fn ls_text(tm: &mut TransactionManager, a: &LsArgs) -> Result<String, Failure> {
    let (sb, plan) = load(tm, a.metadata_snap)?;
    let fields: Vec<usize> = if a.format.is_empty() {
        ["DEV", "MAPPED", "CREATE_TIME", "SNAP_TIME"]
            .iter()
            .filter_map(|f| ls_field(f).ok())
            .collect()
    } else {
        a.format.clone()
    };
    let counting = fields.iter().any(|&f| (1..17).contains(&f));
    let usage = if counting {
        usage(tm, &plan, sb.data_sm_root.nr_blocks)?
    } else {
        vec![(0, 0, None); plan.devices.len()]
    };
    // u128: a block count or key from metadata times the block size can pass 2^64
    let bs = u128::from(sb.data_block_size);
    let mut rows: Vec<Vec<String>> = Vec::new();
    if !a.no_headers {
        rows.push(fields.iter().map(|&f| LS_FIELDS[f].to_string()).collect());
    }
    for ((dev, d, _), (mapped, shared, hi)) in plan.devices.iter().zip(usage) {
        let ex = u128::from(mapped.saturating_sub(shared));
        let (mapped, shared) = (u128::from(mapped), u128::from(shared));
        let hb = u128::from(hi.unwrap_or(0));
        let row = fields
            .iter()
            .map(|&f| match LS_FIELDS[f] {
                "DEV" => dev.to_string(),
                "MAPPED_BLOCKS" => mapped.to_string(),
                "EXCLUSIVE_BLOCKS" => ex.to_string(),
                "SHARED_BLOCKS" => shared.to_string(),
                "HIGHEST_BLOCK" => hb.to_string(),
                "MAPPED_SECTORS" => (mapped * bs).to_string(),
                "EXCLUSIVE_SECTORS" => (ex * bs).to_string(),
                "SHARED_SECTORS" => (shared * bs).to_string(),
                "HIGHEST_SECTOR" => ((hb + 1) * bs - 1).to_string(),
                "MAPPED_BYTES" => (mapped * bs * 512).to_string(),
                "EXCLUSIVE_BYTES" => (ex * bs * 512).to_string(),
                "SHARED_BYTES" => (shared * bs * 512).to_string(),
                "HIGHEST_BYTE" => ((hb + 1) * bs * 512 - 1).to_string(),
                "MAPPED" => pretty_size(mapped * bs * 512),
                "EXCLUSIVE" => pretty_size(ex * bs * 512),
                "SHARED" => pretty_size(shared * bs * 512),
                "HIGHEST_MAPPED" => pretty_size((hb + 1) * bs * 512 - 1),
                "TRANSACTION" => d.transaction_id.to_string(),
                "CREATE_TIME" => d.creation_time.to_string(),
                _ => d.snapshotted_time.to_string(),
            })
            .collect();
        rows.push(row);
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
    Ok(s)
}

/// `/dev/mapper/NAME` when no such file exists: the pool NAME in the daemon.
fn live_pool(input: &Path) -> Option<String> {
    let name = input.strip_prefix("/dev/mapper/").ok()?.to_str()?;
    (!input.exists() && !name.is_empty() && !name.contains('/')).then(|| name.to_string())
}

/// Run a tool on a live pool: a message to the pool through the daemon, which
/// commits, holds the metadata still and answers from the committed trees.
fn ask_daemon(pool: String, tool_words: Vec<String>) -> Outcome {
    let sock = crate::client::default_run_dir().join("control.sock");
    let mut s = std::os::unix::net::UnixStream::connect(&sock).map_err(|e| {
        Failure::Message(format!(
            "cannot reach the dmkit daemon at {} for pool {pool}: {e}",
            sock.display()
        ))
    })?;
    let mut words = vec!["message".to_string(), pool.clone(), "0".to_string()];
    words.extend(tool_words);
    let (ok, out, err) = crate::client::call(&mut s, &words, b"")
        .map_err(|e| Failure::Message(format!("talking to the daemon: {e}")))?;
    if !ok {
        if let Some(DaemonDev::Other(why)) = daemon_device(&pool) {
            return Err(Failure::Message(why));
        }
        // the pool's own words, without the registry's "NAME: message '...' refused: "
        let e = err.trim_end();
        let e = e.rsplit_once(" refused: ").map_or(e, |x| x.1);
        return Err(Failure::Message(e.to_string()));
    }
    // the tool's text, and the one newline `online` added to it
    emit(out.strip_suffix('\n').unwrap_or(&out))
}

/// What the daemon serves as `/dev/mapper/NAME`, for a tool's error.
pub(super) enum DaemonDev {
    /// A thin pool, with its metadata file.
    Pool(String),
    /// Not a thin pool: the error to give.
    Other(String),
}

/// Ask the daemon (if one answers) what device NAME is.
pub(super) fn daemon_device(name: &str) -> Option<DaemonDev> {
    let sock = crate::client::default_run_dir().join("control.sock");
    let mut s = std::os::unix::net::UnixStream::connect(sock).ok()?;
    let words = ["table".to_string(), name.to_string()];
    let (ok, out, _) = crate::client::call(&mut s, &words, b"").ok()?;
    if !ok {
        return None;
    }
    let first: Vec<&str> = out.lines().next().unwrap_or("").split(' ').collect();
    Some(match first.get(2) {
        Some(&"thin-pool") => DaemonDev::Pool(first.get(3).unwrap_or(&"?").to_string()),
        Some(t) => DaemonDev::Other(format!("dev {name} is a {t} device, not a thin-pool")),
        None => DaemonDev::Other(format!("dev {name} has no table, so it is not a thin-pool")),
    })
}

/// Why `/dev/mapper/NAME` is no input file, when the daemon serves NAME.
pub(super) fn mapper_hint(input: &Path) -> Option<String> {
    let name = live_pool(input)?;
    Some(match daemon_device(&name)? {
        DaemonDev::Other(why) => why,
        DaemonDev::Pool(meta) => format!(
            "{} is dmkit's pool {name}, not a kernel device: its metadata is {meta}, which the tools \
             read once the pool is removed (thin ls and thin delta also read the live pool)",
            input.display()
        ),
    })
}

/// A tool run inside the daemon on a live pool's metadata (`words`: the tool's
/// name and arguments, as [`run_ls`] and [`run_delta`] send them).
pub fn online(dev: Box<dyn crate::pdata::MetadataDev>, words: &[String]) -> Result<String, String> {
    use clap::Parser;
    let mut tm = reader(dev, 4096);
    let argv = words.iter().cloned().chain(std::iter::once("-".to_string()));
    let r = match words.first().map(String::as_str) {
        Some("thin_ls") => super::LsArgs::try_parse_from(argv)
            .map_err(|e| e.to_string())
            .and_then(|a| ls_text(&mut tm, &a).map_err(failure_text)),
        Some("thin_delta") => super::DeltaArgs::try_parse_from(argv)
            .map_err(|e| e.to_string())
            .and_then(|a| delta_text(&mut tm, &a).map_err(failure_text)),
        _ => Err("unknown tool".into()),
    };
    // one newline more, which the client takes off: the text arrives exactly
    r.map(|t| t + "\n").map_err(|e| e.trim_end().to_string())
}

fn failure_text(f: Failure) -> String {
    match f {
        Failure::Message(m) => m,
        Failure::Quiet(c) => format!("failed ({c})"),
    }
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
}
