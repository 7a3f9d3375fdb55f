//! The era tools as a library: check, dump, invalidate and restore, with
//! 1.x's results and messages (the CLI adds its options and exit codes).

use super::error::{EraError, Result};
use super::metadata::{EraMetadata, WRITESETS};
use super::superblock::{self as sbm, Superblock, Writeset, INVALID_WRITESET_ROOT, SUPERBLOCK_LOCATION};
use super::xml::{self, XmlEra, XmlSuperblock, XmlWriteset};
use crate::pdata::refcheck::{self, Refs};
use crate::pdata::tm::TransactionManager;
use crate::pdata::{array, bitset, bounds, btree, BlockKind, MetadataDev, PdataError};
use std::collections::BTreeMap;
use std::io::Write;

/// A transaction manager for reading only.
pub fn reader(dev: Box<dyn MetadataDev>) -> TransactionManager {
    crate::pdata::tm::reader(dev, super::metadata::CACHE_BLOCKS)
}

/// The superblock at `loc` as the tools read it: a bad checksum is 1.x's
/// "bad checksum in superblock"; a version past 1 is "unknown superblock
/// version"; every size and block number is then checked against the device.
pub fn superblock_at(tm: &mut TransactionManager, loc: u64) -> Result<Superblock> {
    let dev_blocks = tm.cache.nr_blocks();
    let sb = match tm.read(loc, BlockKind::EraSuperblock) {
        Ok(d) => Superblock::decode(d),
        Err(PdataError::Checksum { .. }) => return Err(EraError::Plain("bad checksum in superblock".into())),
        Err(e) => return Err(e.into()),
    };
    if sb.version > sbm::VERSION {
        return Err(EraError::Plain("unknown superblock version".into()));
    }
    sbm::check_fields(&sb, loc, dev_blocks)?;
    Ok(sb)
}

/// The live superblock, or (`snap`) the metadata snapshot's.
pub fn superblock(tm: &mut TransactionManager, snap: bool) -> Result<Superblock> {
    let live = superblock_at(tm, SUPERBLOCK_LOCATION)?;
    if !snap {
        return Ok(live);
    }
    if live.metadata_snap == 0 {
        return Err(EraError::Plain("no current metadata snap".into()));
    }
    superblock_at(tm, live.metadata_snap)
}

/// The writeset tree: era -> writeset, each era a u32 and each size bounded.
pub fn writesets(tm: &mut TransactionManager, root: u64) -> Result<BTreeMap<u32, Writeset>> {
    let mut out = BTreeMap::new();
    let mut bad: Option<String> = None;
    let max = sbm::max_bits(tm.cache.nr_blocks());
    btree::walk(tm, root, sbm::WRITESET_SIZE, &mut |k, v| {
        let ws = Writeset::decode(v);
        match u32::try_from(k) {
            Ok(era) if (ws.nr_bits as u64) <= max => {
                out.insert(era, ws);
            }
            Ok(era) => {
                bad.get_or_insert(format!(
                    "writeset of era {era} has {} bits, more than the {max} a bitset on the metadata \
                     device can hold",
                    ws.nr_bits
                ));
            }
            Err(_) => {
                bad.get_or_insert(format!("writeset tree holds era {k}, more than 32 bits"));
            }
        }
        Ok(())
    })?;
    match bad {
        Some(what) => Err(PdataError::Corrupt { block: root, what }.into()),
        None => Ok(out),
    }
}

/// The writesets from the oldest archived one to the current era, in order,
/// the current writeset last (1.x's rules and words when they are not so).
pub fn ordered_writesets(tm: &mut TransactionManager, sb: &Superblock) -> Result<Vec<(u32, Writeset)>> {
    let mut all = writesets(tm, sb.writeset_tree_root)?;
    if sb.current_writeset.root != INVALID_WRITESET_ROOT {
        if all.contains_key(&sb.current_era) {
            return Err(EraError::Plain(
                "Duplicated era found in current_writeset and the writeset tree".into(),
            ));
        }
        all.insert(sb.current_era, sb.current_writeset);
    }
    if all.is_empty() {
        return Ok(Vec::new());
    }
    let begin = sb.current_era.wrapping_sub((all.len() - 1) as u32);
    let mut out = Vec::with_capacity(all.len());
    let mut era = begin;
    for _ in 0..all.len() {
        match all.get(&era) {
            Some(ws) => out.push((era, *ws)),
            None => return Err(EraError::Plain(format!("Writeset of era {era} is not present"))),
        }
        era = era.wrapping_add(1);
    }
    Ok(out)
}

fn io(e: std::io::Error) -> EraError {
    EraError::Output(e)
}

/// era_dump: the metadata as XML, or (`logical`) only the era array with the
/// writesets folded into it.
pub fn dump(dev: Box<dyn MetadataDev>, logical: bool, out: &mut dyn Write) -> Result<()> {
    let mut tm = reader(dev);
    let sb = superblock(&mut tm, false)?;
    let ordered = ordered_writesets(&mut tm, &sb)?;
    let nr = sb.nr_blocks as u64;
    let head = XmlSuperblock {
        uuid: String::new(),
        block_size: sb.data_block_size,
        nr_blocks: sb.nr_blocks,
        current_era: sb.current_era,
    };
    // logical: the latest era whose writeset marks a block, over the array's
    let mut latest: Vec<u32> = Vec::new();
    if logical && !ordered.is_empty() {
        latest = bounds::zeroed_vec(SUPERBLOCK_LOCATION, "nr_blocks", nr)?;
        for (era, ws) in &ordered {
            let words = bitset::read(&mut tm, ws.root, ws.nr_bits as u64)?;
            for (b, slot) in latest.iter_mut().enumerate() {
                if words.get(b / 64).is_some_and(|w| w & (1 << (b % 64)) != 0) {
                    *slot = *era;
                }
            }
        }
        out.write_all(xml::superblock_open(&head).as_bytes())
            .map_err(io)?;
    } else {
        let mut text = xml::superblock_open(&head).into_bytes();
        let mut sets = Vec::with_capacity(ordered.len());
        for (era, ws) in &ordered {
            sets.push(XmlWriteset {
                era: *era,
                nr_bits: ws.nr_bits,
                words: bitset::read(&mut tm, ws.root, ws.nr_bits as u64)?,
            });
        }
        out.write_all(&text).map_err(io)?;
        for ws in &sets {
            text.clear();
            let mut w = std::io::BufWriter::new(&mut *out);
            xml::write_writeset(&mut w, ws, sb.nr_blocks).map_err(io)?;
            w.flush().map_err(io)?;
        }
    }
    out.write_all(xml::ERA_ARRAY_OPEN.as_bytes()).map_err(io)?;
    let mut w = std::io::BufWriter::new(&mut *out);
    let mut failed: Option<std::io::Error> = None;
    array::walk::<u32>(&mut tm, sb.era_array_root, nr, &mut |first, vals| {
        if failed.is_some() {
            return Ok(());
        }
        let r = if latest.is_empty() {
            xml::write_eras(&mut w, first, vals)
        } else {
            let folded: Vec<u32> = vals
                .iter()
                .enumerate()
                .map(|(i, &v)| match latest[first as usize + i] {
                    0 => v,
                    e => e,
                })
                .collect();
            xml::write_eras(&mut w, first, &folded)
        };
        if let Err(e) = r {
            failed = Some(e);
        }
        Ok(())
    })?;
    if let Some(e) = failed {
        return Err(io(e));
    }
    w.write_all(xml::CLOSE.as_bytes()).map_err(io)?;
    w.flush().map_err(io)
}

/// The blocks written in era `since` or later, as era_invalidate finds them:
/// the origin's size in blocks and a bitset of them (64 a word).
pub fn marked_since(dev: Box<dyn MetadataDev>, since: u32, snap: bool) -> Result<(u64, Vec<u64>)> {
    let mut tm = reader(dev);
    let sb = superblock(&mut tm, snap)?;
    let nr = sb.nr_blocks as u64;
    let mut marked: Vec<u64> = bounds::zeroed_vec(sb.blocknr, "nr_blocks", bitset::nr_words(nr))?;
    let wsets = writesets(&mut tm, sb.writeset_tree_root)?;
    for (era, ws) in wsets.range(since..) {
        let words = bitset::read(&mut tm, ws.root, ws.nr_bits as u64)
            .map_err(|e| EraError::Plain(format!("writeset of era {era}: {e}")))?;
        for (m, w) in marked.iter_mut().zip(words) {
            *m |= w;
        }
    }
    // the array dates what no archived writeset covers: unless the oldest
    // writeset is from `since` or before, the array is read (with no writeset
    // at all too, as in 1.3.3: 1.1 read nothing then)
    if wsets.keys().next().is_none_or(|&first| first > since) {
        array::walk::<u32>(&mut tm, sb.era_array_root, nr, &mut |first, vals| {
            for (i, &e) in vals.iter().enumerate() {
                if e >= since {
                    let b = first as usize + i;
                    marked[b / 64] |= 1 << (b % 64);
                }
            }
            Ok(())
        })?;
    }
    Ok((nr, marked))
}

/// era_invalidate: the blocks written in era `since` or later, as 1.3.3 lists
/// them: those of the archived writesets from `since` on and, unless the oldest
/// archived writeset is from `since` or before, those the era array dates from
/// `since` on. The current writeset is not read (a live device's is taken in
/// by a metadata snapshot, which archives it).
pub fn invalidate(dev: Box<dyn MetadataDev>, since: u32, snap: bool) -> Result<String> {
    let (nr, marked) = marked_since(dev, since, snap)?;
    let mut out = String::from("<blocks>\n");
    let mut b = 0u64;
    let is = |b: u64| marked[(b / 64) as usize] & (1 << (b % 64)) != 0;
    while b < nr {
        if !is(b) {
            b += 1;
            continue;
        }
        let begin = b;
        while b < nr && is(b) {
            b += 1;
        }
        if b - begin > 1 {
            out.push_str(&format!("  <range begin=\"{begin}\" end=\"{b}\"/>\n"));
        } else {
            out.push_str(&format!("  <block block=\"{begin}\"/>\n"));
        }
    }
    out.push_str("</blocks>");
    Ok(out)
}

/// The references an era superblock's trees hold.
fn reach(tm: &mut TransactionManager, r: &mut Refs, sb: &Superblock) -> crate::pdata::Result<()> {
    r.tree(tm, sb.writeset_tree_root, WRITESETS)?;
    r.tree(tm, sb.era_array_root, array::TREE)?;
    if sb.current_writeset.root != INVALID_WRITESET_ROOT {
        r.tree(tm, sb.current_writeset.root, array::TREE)?;
    }
    Ok(())
}

/// Compare the metadata space map with the references found: a block with
/// fewer references than its count is leaked, one with more is fatal.
fn recount(tm: &mut TransactionManager, sb: &Superblock, errs: &mut Vec<String>) -> Result<usize> {
    let leaked = refcheck::recount(tm, &sb.sm_root, errs, &mut |tm, r| -> Result<()> {
        reach(tm, r, sb)?;
        if sb.metadata_snap != 0 {
            r.take(sb.metadata_snap);
            let snap = superblock_at(tm, sb.metadata_snap)?;
            r.tree(tm, snap.writeset_tree_root, WRITESETS)?;
            r.tree(tm, snap.era_array_root, array::TREE)?;
        }
        Ok(())
    })?;
    Ok(leaked.len())
}

/// era_check: every structure read and checked, and the metadata space map's
/// counts against the references found. Ok, or the messages of what is wrong
/// (the last one 1.x's summary).
/// Leaked blocks fail it unless `ignore_non_fatal`.
pub fn check(
    dev: Box<dyn MetadataDev>,
    sb_only: bool,
    ignore_non_fatal: bool,
) -> std::result::Result<Vec<String>, Vec<String>> {
    let mut tm = reader(dev);
    let sb = superblock(&mut tm, false).map_err(|e| vec![e.to_string()])?;
    if sb_only {
        return Ok(Vec::new());
    }
    let mut errs = Vec::new();
    let mut notes = Vec::new();
    match recount(&mut tm, &sb, &mut errs) {
        Ok(0) => {}
        Ok(n) => notes.push(format!("{n} metadata blocks have leaked.")),
        Err(e) => errs.push(format!("metadata space map: {e}")),
    }
    let mut sets: Vec<(String, Writeset)> = Vec::new();
    match writesets(&mut tm, sb.writeset_tree_root) {
        Ok(w) => sets.extend(
            w.into_iter()
                .map(|(era, ws)| (format!("writeset of era {era}"), ws)),
        ),
        Err(e) => errs.push(format!("writeset tree: {e}")),
    }
    if sb.current_writeset.root != INVALID_WRITESET_ROOT {
        sets.push(("current writeset".into(), sb.current_writeset));
    }
    for (what, ws) in sets {
        let words = bitset::nr_words(ws.nr_bits as u64);
        if let Err(e) = array::walk::<u64>(&mut tm, ws.root, words, &mut |_, _| Ok(())) {
            errs.push(format!("{what}: {e}"));
        }
    }
    let mut bad_eras = Vec::new();
    let r = array::walk::<u32>(
        &mut tm,
        sb.era_array_root,
        sb.nr_blocks as u64,
        &mut |first, vals| {
            for (i, &e) in vals.iter().enumerate() {
                if e > sb.current_era && bad_eras.len() < 100 {
                    bad_eras.push(format!(
                        "invalid era value at data block {}: {e}",
                        first + i as u64
                    ));
                }
            }
            Ok(())
        },
    );
    if let Err(e) = r {
        errs.push(format!("era array: {e}"));
    }
    errs.extend(bad_eras);
    if errs.is_empty() && (notes.is_empty() || ignore_non_fatal) {
        Ok(notes)
    } else {
        errs.extend(notes);
        errs.push("fatal errors in metadata".into());
        Err(errs)
    }
}

/// era_restore: new metadata on `dev` from the XML, as 1.x writes it (every
/// writeset archived in the tree, no current writeset, the clean flag set).
pub fn restore(md: &XmlEra, dev: Box<dyn MetadataDev>) -> Result<()> {
    let mut out = EraMetadata::format(dev, md.sb.block_size)?;
    let (tm, sb) = out.parts();
    array::del(tm, sb.era_array_root)?;
    sb.era_array_root = array::build(tm, md.sb.nr_blocks as u64, &md.eras)?;
    for ws in &md.writesets {
        let root = array::build(tm, bitset::nr_words(ws.nr_bits as u64), &ws.words)?;
        let v = Writeset {
            nr_bits: ws.nr_bits,
            root,
        };
        let (r, old) = btree::insert(tm, sb.writeset_tree_root, ws.era as u64, &v.encode(), WRITESETS)?;
        sb.writeset_tree_root = r;
        if let Some(old) = old {
            bitset::del(tm, Writeset::decode(&old).root)?;
        }
    }
    sb.flags = sbm::CLEAN_SHUTDOWN;
    sb.nr_blocks = md.sb.nr_blocks;
    sb.current_era = md.sb.current_era;
    sb.current_writeset = Writeset {
        nr_bits: md.sb.nr_blocks,
        root: INVALID_WRITESET_ROOT,
    };
    out.commit()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pdata::MemDev;

    #[test]
    fn restore_dump_invalidate_check() {
        let text = "<superblock uuid=\"\" block_size=\"128\" nr_blocks=\"70\" current_era=\"3\">\n  <writeset era=\"2\" nr_bits=\"70\">\n    <marked block_begin=\"0\" len=\"1\"/>\n    <marked block_begin=\"60\" len=\"8\"/>\n  </writeset>\n  <writeset era=\"3\" nr_bits=\"70\">\n    <marked block_begin=\"5\" len=\"1\"/>\n  </writeset>\n  <era_array>\n    <era block=\"1\" era=\"1\"/>\n    <era block=\"69\" era=\"2\"/>\n  </era_array>\n</superblock>";
        let md = xml::parse(text.as_bytes()).unwrap();
        let dev = MemDev::new(64);
        restore(&md, Box::new(dev.clone())).unwrap();
        let mut out = Vec::new();
        dump(Box::new(dev.clone()), false, &mut out).unwrap();
        let dumped = String::from_utf8(out).unwrap();
        assert_eq!(xml::parse(dumped.as_bytes()).unwrap(), md);
        assert_eq!(dumped, xml::write(&md));
        let mut out = Vec::new();
        dump(Box::new(dev.clone()), true, &mut out).unwrap();
        let logical = String::from_utf8(out).unwrap();
        assert!(logical.contains("<era block=\"60\" era=\"2\"/>\n    <era block=\"61\" era=\"2\"/>"));
        assert!(
            logical.contains("<era block=\"5\" era=\"3\"/>")
                && logical.contains("<era block=\"1\" era=\"1\"/>")
        );
        assert!(!logical.contains("<writeset"));
        assert_eq!(
            invalidate(Box::new(dev.clone()), 3, false).unwrap(),
            "<blocks>\n  <block block=\"5\"/>\n</blocks>"
        );
        assert_eq!(
            invalidate(Box::new(dev.clone()), 1, false).unwrap(),
            "<blocks>\n  <range begin=\"0\" end=\"2\"/>\n  <block block=\"5\"/>\n  <range begin=\"60\" end=\"68\"/>\n  <block block=\"69\"/>\n</blocks>"
        );
        assert_eq!(
            invalidate(Box::new(dev.clone()), 4, true)
                .unwrap_err()
                .to_string(),
            "no current metadata snap"
        );
        check(Box::new(dev.clone()), false, false).unwrap();
        // the target opens it and carries on from era 3
        let mut live = EraMetadata::open_or_format(Box::new(dev.clone()), 128).unwrap();
        live.resize(70).unwrap();
        live.rollover().unwrap();
        live.digest_all().unwrap();
        live.commit().unwrap();
        assert_eq!(live.current_era(), 4);
        drop(live);
        check(Box::new(dev.clone()), false, false).unwrap();
        let mut out = Vec::new();
        dump(Box::new(dev.clone()), false, &mut out).unwrap();
        let after = xml::parse(&out[..]).unwrap();
        assert_eq!(after.writesets.len(), 1);
        assert_eq!(
            (after.eras[0], after.eras[5], after.eras[61], after.eras[1]),
            (2, 3, 2, 1)
        );
        // an era array dating a block after the current era fails the check
        let mut bad = md.clone();
        bad.eras[3] = 9;
        let dev = MemDev::new(64);
        restore(&bad, Box::new(dev.clone())).unwrap();
        assert_eq!(
            check(Box::new(dev), false, false).unwrap_err(),
            ["invalid era value at data block 3: 9", "fatal errors in metadata"]
        );
    }
}

/// The metadata's operations, with `check` passing after each commit (here
/// rather than beside the metadata, which does not use the tools).
#[cfg(test)]
mod metadata_tests {
    use crate::era::metadata::*;
    use crate::pdata::array;
    use crate::pdata::MemDev;

    #[test]
    fn format_resize_mark_checkpoint_digest_snap() {
        let dev = MemDev::new(256);
        let mut md = EraMetadata::open_or_format(Box::new(dev.clone()), 128).unwrap();
        assert_eq!(md.stats().era, 0);
        md.resize(3000).unwrap();
        md.rollover().unwrap();
        md.commit().unwrap();
        assert_eq!(md.current_era(), 1);
        assert!(md.mark(5).unwrap());
        assert!(!md.mark(5).unwrap());
        assert!(md.mark(2999).unwrap());
        assert!(md.mark(3000).is_err());
        md.rollover().unwrap();
        md.mark(7).unwrap();
        let snap = md.take_snap().unwrap();
        md.commit().unwrap();
        assert_eq!(md.stats().snap, snap);
        let check = || crate::era::tools::check(Box::new(dev.clone()), false, false);
        assert_eq!(check(), Ok(vec![]));
        md.digest_all().unwrap();
        md.commit().unwrap();
        // the digest shadowed what the snapshot shares: every count still right
        assert_eq!(check(), Ok(vec![]));
        let mut eras = vec![0u32; 3000];
        let (tm, sb) = md.parts();
        let root = sb.era_array_root;
        array::walk::<u32>(tm, root, 3000, &mut |f, v| {
            eras[f as usize..f as usize + v.len()].copy_from_slice(v);
            Ok(())
        })
        .unwrap();
        assert_eq!((eras[5], eras[2999], eras[7], eras[6]), (1, 1, 2, 0));
        md.drop_snap().unwrap();
        md.commit().unwrap();
        assert_eq!(check(), Ok(vec![]));
        // reopened, it is all there; a different block size is refused
        let before = md.nr_allocated();
        drop(md);
        let e = EraMetadata::open_or_format(Box::new(dev.clone()), 256)
            .err()
            .unwrap();
        assert!(e.to_string().contains("from 128 to 256"), "{e}");
        let md = EraMetadata::open_or_format(Box::new(dev), 128).unwrap();
        assert_eq!(
            (md.current_era(), md.nr_blocks(), md.nr_allocated()),
            (3, 3000, before)
        );
    }
}
