//! Two mapping trees compared side by side (`thin::delta::changed_runs`, the
//! walk that passes over shared subtrees unread, lvmd's GetMetadataDelta) and
//! one tree's mapped runs (`mapped_runs`, GetMetadataAllocated) on damaged
//! thin-pool metadata: a
//! valid pool image (a thin of two btree levels, a snapshot of it, the thin
//! rewritten in places after it, a snapshot of the snapshot with time stamps
//! changed and blocks unmapped, a held metadata snapshot) with byte patches,
//! re-sealed unless the first byte is odd (as `thin_metadata`).
//!
//! Input: the patches' first byte, then two bytes of the thin block to start
//! from, a byte of the most runs to return, a byte of choices (bit 0: in the
//! held metadata snapshot; bit 1: name the sides by root block, the next byte
//! giving the left root and the right one the byte after), then the patches.
//! Nothing may panic or abort; where the checker calls the metadata clean and
//! the sides are thins, the walk must succeed and give exactly the blocks that
//! differ (or, for one thin, are mapped) in thin_delta's full comparison.
#![no_main]
#[path = "../common.rs"]
mod common;
use dmkit::pdata::{BlockKind, MemDev};
use dmkit::thin::delta::{changed_runs, delta, mapped_runs, Delta, DeltaOptions, Side};
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

/// Thin blocks the base pool's thin spans.
const SPAN: u64 = 3000;

/// The pool image, and what each of its blocks holds (None: free).
fn base() -> &'static (Vec<u8>, Vec<Option<BlockKind>>) {
    static B: OnceLock<(Vec<u8>, Vec<Option<BlockKind>>)> = OnceLock::new();
    B.get_or_init(|| {
        common::thin_image(8192, |md| {
            // about 2,000 mappings: leaves of up to 126 under an internal root
            for vb in (0..SPAN).filter(|v| v % 3 != 1) {
                let b = md.alloc_data_block().expect("alloc");
                md.insert(0, vb, b).expect("insert");
            }
            md.commit().expect("commit");
            md.create_snap(1, 0).expect("snap");
            // the thin rewritten in three clusters and a few scattered blocks
            for vb in (400..430)
                .chain(1500..1510)
                .chain(2990..3010)
                .chain([7, 900, 2222])
            {
                let b = md.alloc_data_block().expect("alloc");
                md.insert(0, vb, b).expect("insert");
            }
            md.create_snap(2, 1).expect("snap");
            for vb in 100..140u64 {
                if let Some(m) = md.lookup(2, vb).expect("lookup") {
                    md.insert_with_time(2, vb, m.data_block, m.time + 3)
                        .expect("insert");
                }
            }
            for vb in 2000..2040 {
                md.remove(2, vb).expect("remove");
            }
        })
    })
}

/// The blocks thin_delta's full comparison calls different or one-sided (or,
/// with `same`, the same), from `from` on, as runs.
fn full_runs(
    tm: &mut dmkit::pdata::tm::TransactionManager,
    o: &DeltaOptions,
    from: u64,
    same: bool,
) -> Option<Vec<(u64, u64)>> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for r in delta(tm, o)
        .ok()?
        .ranges
        .iter()
        .filter(|r| (r.kind == Delta::Same) == same)
    {
        let begin = r.begin.max(from);
        let end = r.begin.saturating_add(r.length);
        if begin >= end {
            continue;
        }
        match runs.last_mut() {
            Some(p) if p.0 + p.1 == begin => p.1 += end - begin,
            _ => runs.push((begin, end - begin)),
        }
    }
    Some(runs)
}

fuzz_target!(|data: &[u8]| {
    let Some((&[first, f0, f1, max, choice, lroot, rroot], patches)) = data.split_first_chunk::<7>() else {
        return;
    };
    let (img0, kinds) = base();
    let mut p = vec![first];
    p.extend_from_slice(patches);
    let img = common::patched(img0, kinds, &p);
    let from = u64::from(u16::from_le_bytes([f0, f1])) % (SPAN + 100);
    let max = usize::from(max);
    let by_root = choice & 2 != 0;
    let clean = !by_root && dmkit::thin::check::check(Box::new(MemDev::from_image(img.clone())), false).ok();
    let mut tm = dmkit::pdata::tm::reader(Box::new(MemDev::from_image(img)), 64);
    for (l, r) in [(0, 1), (1, 2), (0, 2), (2, 2)] {
        let (left, right) = if by_root {
            (Side::Root(u64::from(lroot)), Side::Root(u64::from(rroot)))
        } else {
            (Side::Thin(l), Side::Thin(r))
        };
        let o = DeltaOptions {
            left: Some(left),
            right: Some(right),
            metadata_snap: choice & 1 != 0,
            ..DeltaOptions::default()
        };
        // what a side maps (GetMetadataAllocated's walk) when the two are one
        let same = l == r;
        let got = if same {
            mapped_runs(&mut tm, &o, from, max)
        } else {
            changed_runs(&mut tm, &o, from, max)
        };
        if by_root {
            break;
        }
        if !clean {
            continue;
        }
        let Ok((block_size, got)) = got else {
            panic!("clean metadata, yet the walk of thins {l} and {r} failed: {got:?}");
        };
        assert_eq!(block_size, 128, "the data block size");
        let Some(want) = full_runs(&mut tm, &o, from, same) else {
            panic!("clean metadata, yet thin_delta's walk of thins {l} and {r} failed");
        };
        assert_eq!(
            got[..],
            want[..want.len().min(max)],
            "thins {l} and {r} from {from}, at most {max} runs"
        );
    }
});
