//! The target types: table arguments, status and table lines, lifecycle.

use crate::mapper::TargetError;
use super::{dev_key, map_merge_chunk, map_origin_write, map_snapshot_chunk, open_store, Core, OriginSnaps};
use crate::io::{errno, LeafKind, Op};
use crate::mapper::{arg_dev, Bio, DevRef, Limits, MapCtx, MapErr, Resolver, Target, TargetType};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// `snapshot-origin <origin>`: reads pass, writes copy into every snapshot first.
pub struct OriginTarget {
    dev: DevRef,
    snaps: Arc<OriginSnaps>,
}

impl OriginTarget {
    pub fn new(args: &[String], len: u64, r: &dyn Resolver) -> Result<OriginTarget, TargetError> {
        if args.len() != 1 {
            return Err("origin: incorrect number of arguments".into());
        }
        let dev = arg_dev(args, 0, 0, len, r).map_err(|e| format!("Cannot get target device: {e}"))?;
        let snaps = r.shared().get_or_init::<super::Origins>().get(dev_key(&dev));
        Ok(OriginTarget { dev, snaps })
    }
}

/// Split `bio` at multiples of `chunk` sectors and map each piece with `f`.
fn per_chunk(
    bio: Bio,
    chunk: u64,
    ctx: &mut MapCtx,
    mut f: impl FnMut(Bio, &mut MapCtx) -> Result<(), MapErr>,
) -> Result<(), MapErr> {
    let mut done = 0;
    while done < bio.nr_sectors {
        let s = bio.sector + done;
        let n = (chunk - (s & (chunk - 1))).min(bio.nr_sectors - done);
        f(bio.sub(done, n, s), ctx)?;
        done += n;
    }
    Ok(())
}

/// The `snapshot-origin` target type.
pub const ORIGIN_TYPE: TargetType = TargetType {
    name: "snapshot-origin",
    version: [1, 9, 0],
    new: |args, len, r| Ok(Box::new(OriginTarget::new(args, len, r)?)),
    sync: None,
};

impl Target for OriginTarget {
    fn type_name(&self) -> &'static str {
        ORIGIN_TYPE.name
    }

    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        if bio.op == Op::Read || bio.op == Op::Flush {
            return ctx.remap(&self.dev, bio, 0);
        }
        // Writes split at the smallest chunk of the snapshots that copy now (the
        // kernel's max_io_len, set at resume); that changes as snapshots come and
        // go, so it is asked here, for writes only, not of the engine.
        let Some(chunk) = self.snaps.min_chunk() else {
            return ctx.remap(&self.dev, bio, 0);
        };
        per_chunk(bio, chunk, ctx, |b, ctx| {
            map_origin_write(&self.snaps, &self.dev, b, ctx)
        })
    }

    fn table_params(&self) -> String {
        self.dev.table_name()
    }

    fn devices(&self) -> Vec<&DevRef> {
        vec![&self.dev]
    }

    fn flush_bypasses_map(&self) -> bool {
        true
    }

    fn limits(&self) -> Limits {
        // the kernel's origin takes no discards (num_discard_bios 0) nor zeroing
        Limits {
            discard: false,
            write_zeroes: false,
            ..Limits::stacked(&[&self.dev])
        }
    }
}

/// Optional features of a snapshot table.
#[derive(Clone, Copy, Debug, Default)]
pub struct Features {
    pub discard_zeroes_cow: bool,
    pub discard_passdown_origin: bool,
}

/// `snapshot` and `snapshot-merge <origin> <cow> <P|PO|N> <chunk> [<n> <feature>...]`.
pub struct SnapshotTarget {
    /// This table entry, as a core's owner.
    id: u64,
    merge: bool,
    core: Arc<Core>,
    snaps: Arc<OriginSnaps>,
    origin: DevRef,
    cow: DevRef,
    features: Features,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn parse_features(args: &[String]) -> Result<Features, TargetError> {
    let mut f = Features::default();
    let Some(n) = args.first() else {
        return Ok(f);
    };
    let n: usize = n
        .parse()
        .ok()
        .filter(|&n| n <= 2)
        .ok_or_else(|| format!("Invalid number of feature arguments ('{n}': 0 to 2)"))?;
    if args.len() != n + 1 {
        return Err(format!(
            "Invalid number of feature arguments ({n} announced, {} given)",
            args.len() - 1
        ).into());
    }
    for a in &args[1..] {
        match a.to_ascii_lowercase().as_str() {
            "discard_zeroes_cow" => f.discard_zeroes_cow = true,
            "discard_passdown_origin" => f.discard_passdown_origin = true,
            _ => return Err(format!("Unrecognised feature requested: '{a}'").into()),
        }
    }
    if f.discard_passdown_origin && !f.discard_zeroes_cow {
        return Err("discard_passdown_origin feature depends on discard_zeroes_cow".into());
    }
    Ok(f)
}

/// The exception store's type (`P`, `PO` or `N`) and chunk size in sectors (a
/// power of 2 and a multiple of the devices' block size `lbs`; 0: the store's
/// own): (persistent, overflow allowed, chunk).
fn store_args(kind: &str, chunk: &str, lbs: u64) -> Result<(bool, bool, u64), TargetError> {
    let store_err = |why: &str| format!("Couldn't create exception store: {why}");
    let (persistent, overflow_ok) = match kind.chars().next().map(|c| c.to_ascii_uppercase()) {
        Some('P') => match &kind[1..] {
            "" => (true, false),
            o if o.eq_ignore_ascii_case("O") => (true, true),
            o => {
                return Err(store_err(&format!(
                    "Exception store type constructor failed (Unsupported persistent store option: {o})"
                )).into())
            }
        },
        Some('N') => (false, false),
        _ => return Err(store_err("Exception store type is not P or N").into()),
    };
    let chunk: u64 = chunk
        .parse()
        .map_err(|_| store_err(&format!("Invalid chunk size '{chunk}'")))?;
    if chunk != 0 {
        if !chunk.is_power_of_two() {
            return Err(store_err(&format!("Chunk size is not a power of 2 ({chunk})")).into());
        }
        if !chunk.is_multiple_of(lbs) {
            return Err(store_err(&format!(
                "Chunk size is not a multiple of device blocksize ({chunk} sectors, block size {} bytes)",
                lbs * 512
            )).into());
        }
        if chunk > (i32::MAX as u64) >> 9 {
            return Err(store_err(&format!("Chunk size is too high ({chunk})")).into());
        }
    }
    Ok((persistent, overflow_ok, chunk))
}

impl SnapshotTarget {
    pub fn new(args: &[String], len: u64, r: &dyn Resolver, merge: bool) -> Result<SnapshotTarget, TargetError> {
        if args.len() < 4 {
            return Err("requires 4 or more arguments".into());
        }
        let features = parse_features(&args[4..])?;
        let origin = r
            .open(&args[0])
            .map_err(|e| format!("Cannot get origin device: {e}"))?;
        let cow = r
            .open(&args[1])
            .map_err(|e| format!("Cannot get COW device: {e}"))?;
        if dev_key(&origin) == dev_key(&cow) {
            return Err("COW device cannot be the same as origin device".into());
        }
        let lbs = u64::from(origin.logical_block_size().max(cow.logical_block_size()) / 512).max(1);
        let (persistent, overflow_ok, chunk) = store_args(&args[2], &args[3], lbs)?;
        if merge && !persistent {
            return Err("Snapshot exception store does not support snapshot-merge.".into());
        }
        let origin_size = origin.size_sectors();
        if let DevRef::Dm(o) = &origin {
            // checked when the table is resumed, as the kernel's device areas:
            // LVM loads a snapshot over an origin (`-real`) not resumed yet
            r.size_check(&o.0, &args[0], len);
        } else if len > origin_size {
            return Err(format!(
                "snapshot of {len} sectors is larger than its origin ({origin_size} sectors)"
            ).into());
        }
        let snaps = r.shared().get_or_init::<super::Origins>().get(dev_key(&origin));
        let cow_key = dev_key(&cow);
        let core = match snaps.by_cow(cow_key) {
            // Another table uses this COW device: it hands its exceptions over.
            Some(c) => {
                if c.persistent != persistent {
                    return Err("Snapshot cow pairing for exception table handover failed".into());
                }
                if merge
                    && snaps
                        .live()
                        .iter()
                        .any(|o| !Arc::ptr_eq(o, &c) && o.merging.load(Ordering::Acquire))
                {
                    return Err("A snapshot is already merging.".into());
                }
                c
            }
            None => {
                if merge && snaps.live().iter().any(|o| o.merging.load(Ordering::Acquire)) {
                    return Err("A snapshot is already merging.".into());
                }
                let cow_lbs = u64::from(cow.logical_block_size() / 512).max(1);
                let opened = open_store(&cow.dest(), persistent, chunk, cow_lbs)?;
                let c = Core::new(
                    origin.dest(),
                    cow.dest(),
                    cow_key,
                    len,
                    opened,
                    overflow_ok,
                    r.shared()
                        .get_or_init::<super::SnapCopier>()
                        .get(r.config().copy_subjob_bytes()),
                );
                snaps.register(&c);
                c
            }
        };
        Ok(SnapshotTarget {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            merge,
            core,
            snaps,
            origin,
            cow,
            features,
        })
    }

    /// Another table took this one's exceptions over: its I/O fails, as the
    /// kernel's invalidated hand-over source.
    fn handed_over(&self) -> bool {
        let o = self.core.owner.load(Ordering::Acquire);
        o != 0 && o != self.id
    }
}

/// The `snapshot` target type.
pub const SNAPSHOT_TYPE: TargetType = TargetType {
    name: "snapshot",
    version: [1, 16, 0],
    new: |args, len, r| Ok(Box::new(SnapshotTarget::new(args, len, r, false)?)),
    sync: None,
};

/// The `snapshot-merge` target type.
pub const MERGE_TYPE: TargetType = TargetType {
    name: "snapshot-merge",
    version: [1, 5, 0],
    new: |args, len, r| Ok(Box::new(SnapshotTarget::new(args, len, r, true)?)),
    sync: None,
};

impl Target for SnapshotTarget {
    fn type_name(&self) -> &'static str {
        if self.merge {
            MERGE_TYPE.name
        } else {
            SNAPSHOT_TYPE.name
        }
    }

    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        if self.handed_over() {
            ctx.complete(bio, LeafKind::Fail(errno::EIO));
            return Ok(());
        }
        if bio.op == Op::Flush {
            if self.merge {
                ctx.remap(&self.origin, bio, 0)?;
            }
            return ctx.remap(&self.cow, bio, 0);
        }
        if self.merge && bio.op == Op::Discard {
            // once merging, discards change nothing
            ctx.complete(bio, LeafKind::Drop);
            return Ok(());
        }
        let core = &self.core;
        per_chunk(bio, core.chunk, ctx, |b, ctx| {
            if self.merge {
                map_merge_chunk(core, &self.snaps, &self.origin, &self.cow, b, ctx)
            } else {
                map_snapshot_chunk(core, &self.features, &self.origin, &self.cow, b, ctx)
            }
        })
    }

    fn max_io_len(&self) -> u64 {
        self.core.chunk
    }

    fn table_params(&self) -> String {
        let kind = match (self.core.persistent, self.core.overflow_ok) {
            (false, _) => "N",
            (true, false) => "P",
            (true, true) => "PO",
        };
        let mut s = format!(
            "{} {} {kind} {}",
            self.origin.table_name(),
            self.cow.table_name(),
            self.core.chunk
        );
        let f = self.features;
        let n = u32::from(f.discard_zeroes_cow) + u32::from(f.discard_passdown_origin);
        if n > 0 {
            s += &format!(" {n}");
            if f.discard_zeroes_cow {
                s += " discard_zeroes_cow";
            }
            if f.discard_passdown_origin {
                s += " discard_passdown_origin";
            }
        }
        s
    }

    fn status_params(&self) -> String {
        if self.handed_over() {
            return "Invalid".into();
        }
        self.core.status()
    }

    fn devices(&self) -> Vec<&DevRef> {
        vec![&self.origin, &self.cow]
    }

    fn limits(&self) -> Limits {
        let mut l = Limits::stacked(&[&self.cow]);
        if self.merge {
            l = l.and(Limits::stacked(&[&self.origin]));
        }
        Limits {
            discard: self.features.discard_zeroes_cow,
            write_zeroes: false,
            ..l
        }
    }

    fn resume(&self) {
        let c = &self.core;
        // a newer table takes over; an older one resumed again stays handed over
        c.owner.fetch_max(self.id, Ordering::AcqRel);
        if self.handed_over() {
            return;
        }
        c.active.store(true, Ordering::Release);
        if self.merge {
            c.merging.store(true, Ordering::Release);
            c.start_merge(self.snaps.clone());
        }
    }

    fn presuspend(&self) {
        if self.merge && !self.handed_over() {
            self.core.stop_merge();
        }
    }

    fn events(&self) -> u64 {
        self.core.events.load(Ordering::Relaxed)
    }
}

impl Drop for SnapshotTarget {
    fn drop(&mut self) {
        if self.merge && !self.handed_over() {
            self.core.stop_merge();
        }
    }
}
