//! The cache tools as a library: check, dump, restore, repair, writeback and
//! the metadata size estimate, with 1.x's results and messages (the CLI adds
//! its options and exit codes).

use super::error::{CacheError, Result};
use super::metadata::{self, CacheMetadata, Mapping};
use super::superblock::{self as sbm, Superblock, NEEDS_CHECK, SUPERBLOCK_LOCATION};
use super::xml::{self, XmlCache, XmlSuperblock};
use crate::io::BackingFile;
use crate::pdata::tm::TransactionManager;
use crate::pdata::{array, bitset, refcheck, BlockKind, MetadataDev};
use std::io::Write;

/// Blocks a reading tool caches: it reads each array block once.
const READER_CACHE_BLOCKS: usize = 16;

/// A transaction manager for reading only.
pub fn reader(dev: Box<dyn MetadataDev>) -> TransactionManager {
    crate::pdata::tm::reader(dev, READER_CACHE_BLOCKS)
}

/// The superblock, checked against the device.
pub fn superblock(tm: &mut TransactionManager) -> Result<Superblock> {
    sbm::read(&mut tm.cache, SUPERBLOCK_LOCATION)
}

/// The XML's superblock line for the metadata `sb` describes.
fn head_of(sb: &Superblock) -> XmlSuperblock {
    XmlSuperblock {
        uuid: String::new(),
        block_size: sb.data_block_size,
        nr_cache_blocks: sb.cache_blocks,
        policy: sb.policy(),
        hint_width: sb.policy_hint_size,
    }
}

fn io(e: std::io::Error) -> CacheError {
    CacheError::Output(e)
}

/// What of the metadata the XML shows: the valid mappings and the hints of
/// mapped cache blocks the hint array covers. `repair`: what cannot be read is
/// left out (a damaged dirty bitset makes every mapping dirty, as 1.x).
pub fn read_all(tm: &mut TransactionManager, sb: &Superblock, repair: bool) -> Result<XmlCache> {
    let mappings = if repair {
        let mut ignored = Vec::new();
        match metadata::read_mappings(tm, sb, Some(&mut ignored)) {
            Ok(m) => m,
            Err(_) if sb.version >= 2 => {
                // the dirty bitset is unreadable: read the mappings as version 1
                // does, and take every one for dirty
                let mut v1 = sb.clone();
                v1.version = 1;
                metadata::read_mappings(tm, &v1, Some(&mut ignored))?
                    .into_iter()
                    .map(|m| Mapping { dirty: true, ..m })
                    .collect()
            }
            Err(e) => return Err(e),
        }
    } else {
        metadata::read_mappings(tm, sb, None)?
    };
    let hint_array = match metadata::read_hints(tm, sb) {
        Ok(h) => h,
        Err(_) if repair => Vec::new(),
        Err(e) => return Err(e),
    };
    let hints = mappings
        .iter()
        .filter_map(|m| hint_array.get(m.cblock as usize).map(|&h| (m.cblock, h)))
        .collect();
    Ok(XmlCache {
        sb: head_of(sb),
        mappings,
        hints,
    })
}

/// cache_dump: the metadata as XML (`repair`: what can be read of it). The
/// mappings are checked first, then written as they are read again, with
/// the hints of the cache blocks they map: nothing is held but a bit per
/// cache block.
pub fn dump(dev: Box<dyn MetadataDev>, repair: bool, out: &mut dyn Write) -> Result<()> {
    let mut tm = reader(dev);
    let sb = superblock(&mut tm)?;
    let mut w = std::io::BufWriter::with_capacity(1 << 16, out);
    if repair {
        let md = read_all(&mut tm, &sb, true)?;
        xml::write(&md, &mut w).map_err(io)?;
        return w.flush().map_err(io);
    }
    metadata::check_mappings(&mut tm, &sb, None, false)?;
    let nr = sb.cache_blocks as u64;
    let hints = metadata::nr_hints(&mut tm, &sb)?;
    let head = head_of(&sb);
    w.write_all(xml::head(&head).as_bytes()).map_err(io)?;
    let mut mapped: Vec<u64> = crate::pdata::bounds::zeroed_vec(0, "cache_blocks", bitset::nr_words(nr))?;
    let mut failed: Option<std::io::Error> = None;
    metadata::walk_mappings(&mut tm, &sb, |m| {
        mapped[m.cblock as usize / 64] |= 1 << (m.cblock % 64);
        if failed.is_none() {
            failed = xml::write_mapping(&mut w, &m).err();
        }
    })?;
    if let Some(e) = failed {
        return Err(io(e));
    }
    w.write_all(xml::MIDDLE.as_bytes()).map_err(io)?;
    // (no hint array until hints are first saved)
    if hints > 0 {
        array::walk::<u32>(&mut tm, sb.hint_root, hints, &mut |first, vals| {
            for (i, &h) in vals.iter().enumerate() {
                let c = first as usize + i;
                if failed.is_none() && mapped[c / 64] & (1 << (c % 64)) != 0 {
                    failed = xml::write_hint(&mut w, c as u32, h).err();
                }
            }
            Ok(())
        })?;
    }
    if let Some(e) = failed {
        return Err(io(e));
    }
    w.write_all(xml::TAIL.as_bytes()).map_err(io)?;
    w.flush().map_err(io)
}

/// cache_restore: new metadata of `version` on `dev` from the XML (its
/// mappings and hints in cache block order, as [`xml::parse`] and
/// [`read_all`] give them), the clean-shutdown flag set unless
/// `omit_clean_shutdown`.
pub fn restore(
    md: &XmlCache,
    dev: Box<dyn MetadataDev>,
    version: u32,
    omit_clean_shutdown: bool,
) -> Result<()> {
    let nr = md.sb.nr_cache_blocks as u64;
    // the XML's mappings and hints are in cache block order: each array is
    // built from a cursor over them
    let (maps, hints) = (&md.mappings, &md.hints);
    let ordered = maps.windows(2).all(|w| w[0].cblock < w[1].cblock)
        && hints.windows(2).all(|w| w[0].0 < w[1].0)
        && maps.last().is_none_or(|m| (m.cblock as u64) < nr)
        && hints.last().is_none_or(|h| (h.0 as u64) < nr);
    if !ordered {
        return Err(CacheError::Invalid(
            "mappings and hints must be in cache block order, each below nr_cache_blocks".into(),
        ));
    }
    let (mut at, mut hint_at) = (0usize, 0usize);
    build(
        dev,
        &md.sb,
        version,
        !omit_clean_shutdown,
        &mut |c| match maps.get(at) {
            Some(m) if m.cblock as u64 == c => {
                at += 1;
                Ok(Some(*m))
            }
            _ => Ok(None),
        },
        &mut |c| match hints.get(hint_at) {
            Some(&(hc, h)) if hc as u64 == c => {
                hint_at += 1;
                Ok(h)
            }
            _ => Ok(0),
        },
    )
}

/// Blocks cached while new metadata is built: each is written once, in
/// order, so a few suffice (a restore's memory is its input's).
const BUILD_CACHE_BLOCKS: usize = 64;

/// New metadata of `version` on `dev`, as `head` describes it, with cache
/// block `c`'s mapping `mapping(c)` and hint `hint(c)` (asked for in cache
/// block order; hints only of mapped blocks), committed.
fn build(
    dev: Box<dyn MetadataDev>,
    head: &XmlSuperblock,
    version: u32,
    clean_shutdown: bool,
    mapping: &mut dyn FnMut(u64) -> Result<Option<Mapping>>,
    hint: &mut dyn FnMut(u64) -> Result<u32>,
) -> Result<()> {
    let mut out = CacheMetadata::format_cached(dev, head.block_size, version, BUILD_CACHE_BLOCKS)?;
    let (tm, sb) = out.parts();
    let nr = head.nr_cache_blocks as u64;
    if nr > sbm::max_cache_blocks(tm.cache.nr_blocks()) {
        return Err(CacheError::Plain(format!(
            "nr_cache_blocks {nr} is more than a mapping array on the output device can hold"
        )));
    }
    // a bit per cache block: mapped, and (version 2) dirty
    let words = bitset::nr_words(nr);
    let mut mapped: Vec<u64> = crate::pdata::bounds::zeroed_vec(0, "cache_blocks", words)?;
    let mut dirty: Vec<u64> = crate::pdata::bounds::zeroed_vec(0, "cache_blocks", words)?;
    let mut failed: Option<CacheError> = None;
    array::del(tm, sb.mapping_root)?;
    sb.mapping_root = array::build_with(tm, nr, &mut |c| {
        let m = match mapping(c) {
            Ok(Some(m)) => m,
            Ok(None) => return 0,
            Err(e) => {
                failed.get_or_insert(e);
                return 0;
            }
        };
        let bit = 1 << (c % 64);
        mapped[c as usize / 64] |= bit;
        if m.dirty {
            dirty[c as usize / 64] |= bit;
        }
        let flags = if m.dirty && version == 1 {
            sbm::M_VALID | sbm::M_DIRTY
        } else {
            sbm::M_VALID
        };
        sbm::pack_mapping(m.oblock, flags)
    })?;
    if version >= 2 {
        array::del(tm, sb.dirty_root)?;
        sb.dirty_root = array::build(tm, words, &dirty)?;
    }
    if sb.hint_root != 0 {
        array::del(tm, sb.hint_root)?;
    }
    sb.hint_root = array::build_with(tm, nr, &mut |c| {
        if mapped[c as usize / 64] & (1 << (c % 64)) == 0 || failed.is_some() {
            return 0;
        }
        hint(c).unwrap_or_else(|e| {
            failed.get_or_insert(e);
            0
        })
    })?;
    if let Some(e) = failed {
        return Err(e);
    }
    sb.cache_blocks = head.nr_cache_blocks;
    sb.set_policy(&head.policy)?;
    sb.policy_version = [2, 0, 0];
    sb.policy_hint_size = head.hint_width;
    out.commit(clean_shutdown)
}

/// cache_repair: what can be read of `input` written as new metadata of the
/// same version to `output`: the mappings that check out (see
/// [`metadata::Salvage`]), the hints of those if the hint array reads, copied
/// a block at a time. Metadata that reads cleanly is copied in one pass; when
/// it does not (a block unreadable, an origin block named twice), the output
/// is built again from what a first pass found.
pub fn repair(input: Box<dyn MetadataDev>, output: Box<dyn MetadataDev>) -> Result<()> {
    let mut tm = reader(input);
    let sb = superblock(&mut tm)?;
    let output = match output.try_clone() {
        Some(again) => {
            if let Ok(clean) = metadata::Salvage::assume_clean(&mut tm, &sb) {
                if let Ok(true) = copy(&mut tm, &sb, clean, true, output) {
                    return Ok(());
                }
            }
            again
        }
        None => output,
    };
    let salvage = metadata::Salvage::plan(&mut tm, &sb)?;
    copy(&mut tm, &sb, salvage, false, output).map(|_| ())
}

/// The repair's copy of what `salvage` keeps to `output`. `optimistic`: the
/// hint array is read as it is copied, and anything unexpected gives false
/// (the copy is then to be made again, carefully); else a hint array that does
/// not read entirely is left out.
fn copy(
    tm: &mut TransactionManager,
    sb: &Superblock,
    mut salvage: metadata::Salvage,
    optimistic: bool,
    output: Box<dyn MetadataDev>,
) -> Result<bool> {
    let nr = sb.cache_blocks as u64;
    let mut maps = array::Reader::<u64>::new(tm, sb.mapping_root, nr)?;
    let nr_hints = metadata::nr_hints(tm, sb).unwrap_or(0);
    let readable = |tm: &mut TransactionManager| {
        optimistic || array::walk::<u32>(tm, sb.hint_root, nr_hints, &mut |_, _| Ok(())).is_ok()
    };
    let mut hints = match nr_hints > 0 && readable(tm) {
        true => array::Reader::<u32>::new(tm, sb.hint_root, nr_hints).ok(),
        false => None,
    };
    if optimistic && nr_hints > 0 && hints.is_none() {
        return Ok(false);
    }
    let head = head_of(sb);
    let tm = std::cell::RefCell::new(tm);
    let r = build(
        output,
        &head,
        sb.version,
        true,
        &mut |c| {
            let v = maps.get(&mut tm.borrow_mut(), c)?;
            salvage
                .take(c, v)
                .map_err(|_| CacheError::Plain("an origin block is named twice".into()))
        },
        &mut |c| match hints.as_mut() {
            Some(h) if c < nr_hints => Ok(h.get(&mut tm.borrow_mut(), c)?),
            _ => Ok(0),
        },
    );
    match r {
        Ok(()) => Ok(salvage.held()),
        Err(_) if optimistic => Ok(false),
        Err(e) => Err(e),
    }
}

/// What cache_check does besides reading everything.
#[derive(Clone, Copy, Debug, Default)]
pub struct CheckOpts {
    pub sb_only: bool,
    pub skip_mappings: bool,
    pub skip_hints: bool,
    pub skip_discards: bool,
    pub ignore_non_fatal: bool,
    pub clear_needs_check: bool,
    /// Leaked metadata blocks freed, where nothing worse is found.
    pub auto_repair: bool,
}

/// The references a cache superblock's arrays hold.
fn reach(tm: &mut TransactionManager, r: &mut refcheck::Refs, sb: &Superblock) -> crate::pdata::Result<()> {
    r.tree(tm, sb.mapping_root, array::TREE)?;
    if sb.hint_root != 0 {
        r.tree(tm, sb.hint_root, array::TREE)?;
    }
    r.tree(tm, sb.discard_root, array::TREE)?;
    if sb.version >= 2 {
        r.tree(tm, sb.dirty_root, array::TREE)?;
    }
    Ok(())
}

/// cache_check: every structure read and checked, and the metadata space
/// map's counts against the references found. Ok with the notes to print, or
/// the messages of what is wrong (the last ones 1.x's summary). Leaked blocks
/// fail it unless `ignore_non_fatal`.
pub fn check(dev: Box<dyn MetadataDev>, o: &CheckOpts) -> std::result::Result<Vec<String>, Vec<String>> {
    let mut tm = reader(dev);
    let sb = superblock(&mut tm).map_err(|e| vec![e.to_string()])?;
    if o.sb_only {
        return Ok(Vec::new());
    }
    let mut errs = Vec::new();
    if !o.skip_mappings {
        if let Err(e) = metadata::check_mappings(&mut tm, &sb, Some(&mut errs), false) {
            errs.push(e.to_string());
        }
    }
    if !o.skip_hints && sb.policy_hint_size != 0 && sb.hint_root != 0 {
        let r = array::len::<u32>(&mut tm, sb.hint_root, sb.cache_blocks as u64)
            .and_then(|n| array::walk::<u32>(&mut tm, sb.hint_root, n, &mut |_, _| Ok(())));
        if let Err(e) = r {
            errs.push(format!("hint array: {e}"));
        }
    }
    if !o.skip_discards {
        let words = bitset::nr_words(sb.discard_nr_blocks);
        if let Err(e) = array::walk::<u64>(&mut tm, sb.discard_root, words, &mut |_, _| Ok(())) {
            errs.push(format!("discard bitset: {e}"));
        }
    }
    let mut notes = Vec::new();
    let mut leaked = Vec::new();
    match refcheck::recount(&mut tm, &sb.sm_root, &mut errs, &mut |tm, r| reach(tm, r, &sb)) {
        Ok(l) if l.is_empty() => {}
        Ok(l) => {
            notes.push(format!("{} metadata blocks have leaked.", l.len()));
            leaked = l;
        }
        Err(e) => errs.push(format!("metadata space map: {e}")),
    }
    if !errs.is_empty() {
        errs.extend(notes);
        errs.push("metadata contains errors".into());
        return Err(errs);
    }
    if o.auto_repair && !leaked.is_empty() {
        notes.push("Repairing metadata leaks.".into());
        let freed = CacheMetadata::open(tm.cache.into_dev())
            .and_then(|mut md| md.free_leaked(&leaked, o.clear_needs_check));
        return match freed {
            Ok(()) => Ok(notes),
            Err(e) => Err(vec![format!("repairing metadata leaks: {e}")]),
        };
    }
    if !notes.is_empty() && !o.ignore_non_fatal {
        notes.push("metadata space map contains leaks".into());
        notes.push("perhaps you wanted to run with --auto-repair".into());
        return Err(notes);
    }
    if o.clear_needs_check && sb.flags & NEEDS_CHECK != 0 {
        let mut clean = sb.clone();
        clean.flags &= !NEEDS_CHECK;
        let r = tm
            .cache
            .write_through(SUPERBLOCK_LOCATION, BlockKind::CacheSuperblock, &clean.encode())
            .and_then(|_| tm.cache.flush());
        if let Err(e) = r {
            return Err(vec![format!("clearing needs_check: {e}")]);
        }
    }
    Ok(notes)
}

/// What cache_writeback did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Writeback {
    /// Blocks to write back.
    pub total: u64,
    pub copied: u64,
    /// Cache blocks whose copy failed.
    pub failed: Vec<u32>,
}

/// Where cache_writeback copies, and whether it clears the dirty bits after.
pub struct WritebackOpts<'a> {
    pub fast: &'a BackingFile,
    pub fast_offset: u64,
    pub origin: &'a BackingFile,
    pub origin_offset: u64,
    pub update_metadata: bool,
    /// Called before copying and before updating the metadata.
    pub stage: &'a mut dyn FnMut(&str),
}

/// cache_writeback: copy every dirty cache block (every mapped one after an
/// unclean shutdown) from the fast device to its origin block, in origin block
/// order, then (`update_metadata`) clear their dirty bits in a commit.
/// Offsets are in bytes.
pub fn writeback(dev: Box<dyn MetadataDev>, o: WritebackOpts) -> Result<Writeback> {
    let mut md = CacheMetadata::open(dev)?;
    let sb = md.superblock().clone();
    let bs = sb.data_block_size as u64 * 512;
    let mut todo = md.select(&mut |m| m.dirty || !sb.clean_shutdown())?;
    todo.sort_unstable_by_key(|m| m.oblock);
    let mut res = Writeback {
        total: todo.len() as u64,
        ..Writeback::default()
    };
    (o.stage)("Copying cache blocks");
    let region = |m: &Mapping| -> Result<(u64, u64, u64)> {
        let src = (m.cblock as u64 * bs).checked_add(o.fast_offset);
        let dst = m
            .oblock
            .checked_mul(bs)
            .and_then(|d| d.checked_add(o.origin_offset));
        match (src, dst) {
            (Some(s), Some(d)) => Ok((s, d, bs)),
            _ => Err(CacheError::Invalid(format!(
                "cache block {} (origin block {}) is beyond any file offset",
                m.cblock, m.oblock
            ))),
        }
    };
    let regions = todo.iter().map(region).collect::<Result<Vec<_>>>()?;
    // a block past a device's end would be read as zeroes, or written where
    // the origin does not reach: refused before anything is copied
    for (what, dev, end) in [
        ("fast device", o.fast, regions.iter().map(|r| r.0 + r.2).max()),
        ("origin device", o.origin, regions.iter().map(|r| r.1 + r.2).max()),
    ] {
        let size = dev
            .size()
            .map_err(|e| CacheError::Invalid(format!("{what}: {e}")))?;
        if let Some(end) = end.filter(|&e| e > size) {
            return Err(CacheError::Invalid(format!(
                "{what} is too small: the blocks to write back reach byte {end}, it has {size}"
            )));
        }
    }
    let copier = crate::copier::Copier::new(0, 0);
    let mut ok = vec![true; todo.len()];
    if copier.copy_regions(o.fast, o.origin, &regions, false).is_err() {
        // find which blocks fail, one at a time
        for (i, r) in regions.iter().enumerate() {
            if copier.copy(o.fast, r.0, &[(o.origin, r.1)], r.2).is_err() {
                ok[i] = false;
                res.failed.push(todo[i].cblock);
            }
        }
    }
    o.origin
        .sync()
        .map_err(|e| CacheError::Plain(format!("origin device: flush failed: {e}")))?;
    res.copied = ok.iter().filter(|&&k| k).count() as u64;
    if o.update_metadata {
        (o.stage)("Updating metadata");
        for (m, _) in todo.iter().zip(&ok).filter(|(m, &k)| k && m.dirty) {
            md.set_dirty(m.cblock as u64, false)?;
        }
        md.commit(sb.clean_shutdown())?;
    }
    res.failed.sort_unstable();
    Ok(res)
}

/// cache_metadata_size's estimate, in sectors: a transaction overhead of 4
/// MiB, 16 bytes a block for the mappings and the hint width plus 8 for the
/// hints, no more than the largest metadata device.
pub fn metadata_size(nr_blocks: u64, max_hint_width: u32) -> f64 {
    let nr = nr_blocks as f64;
    let sectors = 8192.0 + nr * 16.0 / 512.0 + nr * (max_hint_width as f64 + 8.0) / 512.0;
    sectors.min((crate::pdata::space_map::MAX_METADATA_BLOCKS * 8) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pdata::MemDev;

    const TEXT: &str = "<superblock uuid=\"\" block_size=\"128\" nr_cache_blocks=\"1100\" policy=\"smq\" hint_width=\"4\">\n  <mappings>\n    <mapping cache_block=\"0\" origin_block=\"10\" dirty=\"true\"/>\n    <mapping cache_block=\"1\" origin_block=\"5\" dirty=\"false\"/>\n    <mapping cache_block=\"1050\" origin_block=\"7\" dirty=\"true\"/>\n  </mappings>\n  <hints>\n    <hint cache_block=\"0\" data=\"AQAAAA==\"/>\n    <hint cache_block=\"1\" data=\"AgAAAA==\"/>\n    <hint cache_block=\"1050\" data=\"AwAAAA==\"/>\n  </hints>\n</superblock>";

    fn dumped(dev: &MemDev) -> String {
        let mut out = Vec::new();
        dump(Box::new(dev.clone()), false, &mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn restore_dump_check_repair_both_versions() {
        let md = xml::parse(TEXT.as_bytes()).unwrap();
        for version in [1, 2] {
            let dev = MemDev::new(64);
            restore(&md, Box::new(dev.clone()), version, false).unwrap();
            assert_eq!(dumped(&dev), TEXT);
            assert_eq!(check(Box::new(dev.clone()), &CheckOpts::default()), Ok(vec![]));
            let out = MemDev::new(64);
            repair(Box::new(dev.clone()), Box::new(out.clone())).unwrap();
            assert_eq!(dumped(&out), TEXT);
            let live = CacheMetadata::open(Box::new(out)).unwrap();
            assert_eq!(live.superblock().version, version);
        }
    }

    #[test]
    fn lying_metadata_is_refused() {
        let md = xml::parse(TEXT.as_bytes()).unwrap();
        let dev = MemDev::new(64);
        restore(&md, Box::new(dev.clone()), 2, false).unwrap();
        // two cache blocks naming one origin block, with a valid checksum
        let mut live = CacheMetadata::open(Box::new(dev.clone())).unwrap();
        live.insert(5, 10).unwrap();
        live.commit(true).unwrap();
        let e = check(Box::new(dev.clone()), &CheckOpts::default()).unwrap_err();
        assert_eq!(
            e,
            [
                "origin block 10 is mapped by cache blocks 0 and 5",
                "metadata contains errors"
            ]
        );
        let e = dump(Box::new(dev.clone()), false, &mut Vec::new())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("origin block 10 is mapped by cache blocks 0 and 5"),
            "{e}"
        );
        // a cache block count beyond what the device holds: refused, naming it
        let mut tm = reader(Box::new(dev.clone()));
        let mut sb = superblock(&mut tm).unwrap();
        sb.cache_blocks = u32::MAX;
        tm.cache
            .write_through(0, BlockKind::CacheSuperblock, &sb.encode())
            .unwrap();
        drop(tm);
        let e = check(Box::new(dev.clone()), &CheckOpts::default()).unwrap_err();
        assert!(
            e[0].contains("cache_blocks is 4294967295, more than what a mapping array"),
            "{e:?}"
        );
        assert!(CacheMetadata::open(Box::new(dev)).is_err());
    }

    /// What the repair writes is what [`read_all`] salvages, whether the
    /// metadata reads cleanly (one pass) or not (an origin block named twice,
    /// a hint block that does not check out: a second, careful pass).
    #[test]
    fn repair_writes_what_read_all_salvages() {
        let md = xml::parse(TEXT.as_bytes()).unwrap();
        let dev = MemDev::new(64);
        restore(&md, Box::new(dev.clone()), 2, false).unwrap();
        // what read_all salvages, restored
        let salvaged = |dev: &MemDev| {
            let mut tm = reader(Box::new(dev.clone()));
            let sb = superblock(&mut tm).unwrap();
            let out = MemDev::new(64);
            let md = read_all(&mut tm, &sb, true).unwrap();
            restore(&md, Box::new(out.clone()), sb.version, false).unwrap();
            dumped(&out)
        };
        let repaired = |dev: &MemDev| {
            let out = MemDev::new(64);
            repair(Box::new(dev.clone()), Box::new(out.clone())).unwrap();
            dumped(&out)
        };
        assert_eq!(repaired(&dev), TEXT);
        // cache block 5 names origin block 10 too: cache block 0 keeps it
        let mut live = CacheMetadata::open(Box::new(dev.clone())).unwrap();
        live.insert(5, 10).unwrap();
        live.commit(true).unwrap();
        let want = salvaged(&dev);
        assert!(!want.contains("cache_block=\"5\""), "{want}");
        assert_eq!(repaired(&dev), want);
        // a hint block whose checksum is wrong: no hints
        let mut tm = reader(Box::new(dev.clone()));
        let sb = superblock(&mut tm).unwrap();
        let hint_block = array::blocks::<u32>(&mut tm, sb.hint_root, 1100).unwrap()[0];
        drop(tm);
        let mut img = dev.image();
        img[hint_block as usize * crate::pdata::BLOCK_SIZE + 100] ^= 1;
        let dev = MemDev::from_image(img);
        let want = salvaged(&dev);
        assert!(
            want.contains("<hint cache_block=\"0\" data=\"AAAAAA==\"/>"),
            "{want}"
        );
        assert_eq!(repaired(&dev), want);
    }

    #[test]
    fn sizes_as_1x() {
        assert_eq!(format!("{:.2}", metadata_size(1000, 4)), "8246.69");
        assert_eq!(format!("{:.2}", metadata_size(1_000_000, 4)), "62879.50");
        assert_eq!(metadata_size(0, 4), 8192.0);
        assert_eq!(metadata_size(1 << 32, 4), 33_292_800.0);
    }
}

/// The metadata's operations, with `check` passing after each commit (here
/// rather than beside the metadata, which does not use the tools).
#[cfg(test)]
mod metadata_tests {
    use crate::cache::metadata::{CacheMetadata, Mapping};
    use crate::pdata::MemDev;

    fn exercise(version: u32) {
        let dev = MemDev::new(256);
        let mut md = CacheMetadata::open_or_format(Box::new(dev.clone()), 128, version).unwrap();
        assert_eq!(md.nr_cache_blocks(), 0);
        md.resize(3000).unwrap();
        md.insert(0, 10).unwrap();
        md.insert(2999, 5).unwrap();
        md.insert(700, 150).unwrap();
        assert!(md.insert(1, 1 << 48).is_err());
        md.set_dirty(2999, true).unwrap();
        md.set_dirty(700, true).unwrap();
        md.set_dirty(700, false).unwrap();
        assert!(md.insert(3000, 1).is_err());
        assert!(md.set_dirty(5, true).is_err());
        md.resize_discards(256, 100).unwrap();
        md.set_discard(99, true).unwrap();
        let hints: Vec<u32> = (0..3000).collect();
        md.save_hints("smq", [2, 0, 0], Some(&hints)).unwrap();
        md.set_stats([1, 2, 3, 4]);
        md.commit(true).unwrap();
        let check = || crate::cache::tools::check(Box::new(dev.clone()), &Default::default());
        assert_eq!(check(), Ok(vec![]));
        drop(md);
        let e = CacheMetadata::open_or_format(Box::new(dev.clone()), 256, version)
            .err()
            .unwrap();
        assert!(e.to_string().contains("from 128 to 256"), "{e}");
        let mut md = CacheMetadata::open_or_format(Box::new(dev.clone()), 128, 1).unwrap();
        let sb = md.superblock().clone();
        assert_eq!(
            (sb.version, sb.clean_shutdown(), sb.policy(), sb.write_hits),
            (version, true, "smq".into(), 3)
        );
        assert_eq!(
            md.mappings().unwrap(),
            [
                Mapping {
                    cblock: 0,
                    oblock: 10,
                    dirty: false
                },
                Mapping {
                    cblock: 700,
                    oblock: 150,
                    dirty: false
                },
                Mapping {
                    cblock: 2999,
                    oblock: 5,
                    dirty: true
                },
            ]
        );
        assert_eq!(md.hints().unwrap()[2999], 2999);
        assert!(md.discarded(99).unwrap() && !md.discarded(98).unwrap());
        // shrinking over a mapped block is refused; past it, fine
        assert!(md
            .resize(2000)
            .unwrap_err()
            .to_string()
            .contains("cache block 2999 is in use"));
        md.remove(2999).unwrap();
        md.resize(2000).unwrap();
        assert_eq!(md.lookup(700).unwrap().map(|m| m.oblock), Some(150));
        md.commit(false).unwrap();
        assert_eq!(check(), Ok(vec![]));
        assert_eq!(md.hints().unwrap().len(), 2000);
        // past the origin the discard bitset covers (100 x 256 sectors: 200
        // blocks of 128) after a clean shutdown: refused, naming it
        md.insert(6, 300).unwrap();
        md.commit(true).unwrap();
        let e = md.mappings().unwrap_err().to_string();
        assert!(
            e.contains("cache block 6: origin block 300 is beyond the end of the origin (200 blocks)"),
            "{e}"
        );
        md.remove(6).unwrap();
        // an origin block named twice is refused, naming both cache blocks
        md.insert(5, 10).unwrap();
        let e = md.mappings().unwrap_err().to_string();
        assert!(
            e.contains("origin block 10 is mapped by cache blocks 0 and 5"),
            "{e}"
        );
    }

    #[test]
    fn format_map_dirty_hints_discards_v1() {
        exercise(1);
    }

    #[test]
    fn format_map_dirty_hints_discards_v2() {
        exercise(2);
    }
}
