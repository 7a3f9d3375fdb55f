//! `thin-pool <metadata dev> <data dev> <block size> <low water> [<n> <features>...]`.

use crate::mapper::TargetError;
use super::{Features, Mode, Pool};
use crate::mapper::devio;
use crate::mapper::{arg_dev, arg_u64, Bio, DevRef, Limits, MapCtx, MapErr, Resolver, Target, TargetType};
use crate::thin::ThinError;
use std::sync::Arc;

pub struct ThinPool {
    pub pool: Arc<Pool>,
    metadata: DevRef,
    data: DevRef,
    low_water: u64,
    /// Features as the table asked for them (the table line prints these).
    requested: Features,
    nr_blocks: u64,
}

impl ThinPool {
    pub fn new(args: &[String], len: u64, r: &dyn Resolver) -> Result<ThinPool, TargetError> {
        if args.len() < 4 {
            return Err(format!(
                "thin-pool takes at least 4 arguments (<metadata dev> <data dev> <data block size> <low water mark>), got {}",
                args.len()
            ).into());
        }
        let bs = arg_u64(args, 2, "data block size")?;
        if !(128..=2_097_152).contains(&bs) || bs % 128 != 0 {
            return Err(format!(
                "invalid data block size {bs}: must be a multiple of 128 sectors (64 KiB) from 128 to 2097152"
            ).into());
        }
        let low_water = arg_u64(args, 3, "low water mark")?;
        let mut features = Features::default();
        if args.len() > 4 {
            let n = arg_u64(args, 4, "feature count")? as usize;
            if n > 4 || args.len() != 5 + n {
                return Err(format!(
                    "feature count {n} does not match the {} feature words given (at most 4)",
                    args.len() - 5
                ).into());
            }
            for w in &args[5..] {
                match w.to_ascii_lowercase().as_str() {
                    "skip_block_zeroing" => features.zero_new_blocks = false,
                    "ignore_discard" => features.discard_enabled = false,
                    "no_discard_passdown" => features.discard_passdown = false,
                    "read_only" => features.read_only = true,
                    "error_if_no_space" => features.error_if_no_space = true,
                    other => return Err(format!("unknown thin-pool feature '{other}'").into()),
                }
            }
        }
        let nr_blocks = len / bs;
        if nr_blocks == 0 {
            return Err(format!(
                "pool length {len} is smaller than one data block ({bs} sectors)"
            ).into());
        }
        let name = args.first().ok_or("missing metadata device")?;
        let metadata = r
            .open(name)
            .map_err(|e| format!("metadata device '{name}': {e}"))?;
        let data = arg_dev(args, 1, 0, len, r)?;
        let (mf, df) = (metadata.dest(), data.dest());
        if devio::identity(&mf) == devio::identity(&df) {
            return Err("metadata and data devices must differ".into());
        }
        let pool = Pool::get(
            &r.shared().get_or_init::<super::Pools>(),
            r.device(),
            &mf,
            &df,
            bs,
            nr_blocks,
            features,
            low_water,
            r.config(),
        )?;
        Ok(ThinPool {
            pool,
            metadata,
            data,
            low_water,
            requested: features,
            nr_blocks,
        })
    }

    /// Run a pool message under the lock, then commit it. `shares` is the
    /// thin whose blocks the message makes shared (create_snap's origin): its
    /// lock-free cache of unshared blocks is forgotten first. No other message
    /// can make a cached entry stale: create_thin adds a device, delete takes
    /// one no table uses (refused otherwise) and whose blocks are therefore in
    /// no cache (a cache holds blocks one active thin maps alone), and the
    /// rest touch no mapping. (Forgetting every active thin's cache instead
    /// cost ~8 ns a slot: 78 ms a message with 10,000 active thins.)
    fn run(
        &self,
        shares: Option<u64>,
        f: impl FnOnce(&mut crate::thin::ThinPoolMetadata, &[u64]) -> Result<(), ThinError>,
    ) -> Result<String, TargetError> {
        let aborts = {
            let mut m = self.pool.lock();
            if m.mode == Mode::ReadOnly {
                // the kernel's pool_message in read-only or fail mode
                return Err(TargetError::new(libc::EOPNOTSUPP, "pool is read-only"));
            }
            let active: Vec<u64> = m.active.iter().map(|(id, _)| *id).collect();
            if let Some(f) = shares.and_then(|id| m.fast.get(&id)) {
                f.clear();
            }
            match f(&mut m.md, &active) {
                Ok(()) => m.dirty = true,
                Err(e) => {
                    if matches!(e, ThinError::Pdata(_)) {
                        self.pool.metadata_failed(&mut m, &e);
                    }
                    return Err(refusal(&e));
                }
            }
            self.pool.space_returned(&mut m);
            m.aborts
        };
        self.pool.commit_now()?;
        // Another thread's commit may have carried the change and failed: the
        // transaction was dropped and this commit, on a read-only pool, wrote
        // nothing (a delete reported done would come back after a restart).
        if self.pool.lock().aborts != aborts {
            return Err("metadata failure: the change was rolled back and the pool is read-only".into());
        }
        Ok(String::new())
    }
}

fn dev_id(w: Option<&String>, what: &str) -> Result<u64, TargetError> {
    let w = w.ok_or_else(|| format!("missing {what}"))?;
    let v = w.parse::<u64>().map_err(|_| format!("invalid {what} '{w}'"))?;
    if v >= 1 << 24 {
        return Err(format!("{what} {v} is more than 24 bits").into());
    }
    Ok(v)
}

/// The `thin-pool` target type.
pub const TYPE: TargetType = TargetType {
    name: "thin-pool",
    version: [1, 23, 0],
    new: |args, len, r| Ok(Box::new(ThinPool::new(args, len, r)?)),
    sync: Some(|s| {
        if let Some(pools) = s.get::<super::Pools>() {
            pools.commit_all();
        }
    }),
};

impl Target for ThinPool {
    fn type_name(&self) -> &'static str {
        TYPE.name
    }
    /// I/O to the pool device itself goes to the data device (thin devices map their
    /// data blocks through here, so the pool device counts their I/O in flight).
    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        ctx.remap(&self.data, bio, 0)
    }
    /// The data device's limits; discards only without `ignore_discard`; the
    /// optimal I/O size a whole data block unless the data device's is a multiple
    /// of it (pool_io_hints).
    fn limits(&self) -> Limits {
        let mut l = self.data.limits();
        l.discard = l.discard && self.requested.discard_enabled;
        let block = self.pool.block_sectors * crate::io::SECTOR;
        // the kernel's pool_io_hints: io_min is the data block size
        l.io_min = l.io_min.max(block);
        if l.io_opt < block || !l.io_opt.is_multiple_of(block) {
            l.io_opt = block;
        }
        l
    }
    fn table_params(&self) -> String {
        let f = self.requested;
        let mut words = Vec::new();
        if !f.zero_new_blocks {
            words.push("skip_block_zeroing");
        }
        if !f.discard_enabled {
            words.push("ignore_discard");
        }
        if !f.discard_passdown {
            words.push("no_discard_passdown");
        }
        if f.read_only {
            words.push("read_only");
        }
        if f.error_if_no_space {
            words.push("error_if_no_space");
        }
        let mut s = format!(
            "{} {} {} {} {} ",
            self.metadata.table_name(),
            self.data.table_name(),
            self.pool.block_sectors,
            self.low_water,
            words.len()
        );
        for w in words {
            s.push_str(w);
            s.push(' ');
        }
        s
    }
    fn status_params(&self) -> String {
        // Counts are taken after a commit, as the kernel's status does (unless
        // asked with noflush, or suspended). A commit the I/O in flight holds
        // back is the pool thread's to retry: the counts are then the last
        // commit's.
        match self.pool.try_commit() {
            Ok(true) => {}
            Ok(false) => tracing::debug!("thin-pool status: {}", super::POSTPONED),
            Err(e) => tracing::warn!("thin-pool status: commit failed: {e}"),
        }
        self.status_params_noflush()
    }

    fn status_params_noflush(&self) -> String {
        let m = self.pool.lock();
        let md = &m.md;
        let total_meta = md.nr_metadata_blocks();
        let free_meta = md.nr_free_metadata_blocks();
        let reserve = (total_meta / 10).min(4096);
        let used_meta = total_meta - free_meta.saturating_sub(reserve);
        let total_data = md.nr_data_blocks();
        let used_data = total_data - md.nr_free_data_blocks();
        let held = md.held_root().map_or("-".to_string(), |h| h.to_string());
        let mode = match m.mode {
            Mode::Write => "rw",
            Mode::OutOfDataSpace => "out_of_data_space",
            Mode::ReadOnly => "ro",
        };
        let discard = if !m.features.discard_enabled {
            "ignore_discard"
        } else if m.features.discard_passdown {
            "discard_passdown"
        } else {
            "no_discard_passdown"
        };
        let space = if m.features.error_if_no_space {
            "error_if_no_space"
        } else {
            "queue_if_no_space"
        };
        let check = if md.needs_check() { "needs_check" } else { "-" };
        let meta_dev_blocks = self.metadata.size_sectors() / 8;
        let threshold = (meta_dev_blocks / 4).min(1024);
        format!(
            "{} {used_meta}/{total_meta} {used_data}/{total_data} {held} {mode} {discard} {space} {check} {threshold} ",
            md.transaction_id()
        )
    }
    fn message(&self, words: &[String]) -> Result<String, TargetError> {
        // Message names match without case, as the kernel's strcasecmp does.
        let cmd = words.first().map(|w| w.to_ascii_lowercase()).unwrap_or_default();
        let mut w: Vec<&str> = words.iter().map(String::as_str).collect();
        if let Some(first) = w.first_mut() {
            *first = &cmd;
        }
        match w.as_slice() {
            ["create_thin", _] => {
                let id = dev_id(words.get(1), "device id")?;
                self.run(None, |md, _| md.create_thin(id))
            }
            ["create_snap", _, _] => {
                let id = dev_id(words.get(1), "device id")?;
                let origin = dev_id(words.get(2), "origin id")?;
                self.run(Some(origin), |md, _| md.create_snap(id, origin))
            }
            ["delete", _] => {
                let id = dev_id(words.get(1), "device id")?;
                self.run(None, |md, active| {
                    if active.contains(&id) {
                        return Err(ThinError::Active(id));
                    }
                    md.delete(id)
                })
            }
            ["set_transaction_id", cur, new] => {
                let cur = cur
                    .parse::<u64>()
                    .map_err(|_| format!("invalid current transaction id '{cur}'"))?;
                let new = new
                    .parse::<u64>()
                    .map_err(|_| format!("invalid new transaction id '{new}'"))?;
                self.run(None, |md, _| md.set_transaction_id(cur, new))
            }
            ["reserve_metadata_snap"] => {
                // The snapshot must show committed state: commit first.
                self.pool.commit_now()?;
                self.run(None, |md, _| md.reserve_metadata_snap().map(|_| ()))
            }
            ["release_metadata_snap"] => self.run(None, |md, _| md.release_metadata_snap()),
            // dmkit's own: thin_ls and thin_delta on the live pool, no metadata
            // snapshot needed (`dmkit thin ls /dev/mapper/POOL`). The pool commits,
            // then holds its metadata lock, so no commit moves the trees being read.
            ["thin_ls", ..] | ["thin_delta", ..] => {
                if let Err(e) = self.pool.commit_now() {
                    tracing::warn!(
                        "thin-pool {}: commit before {cmd}: {e}",
                        devio::describe(&self.pool.metadata)
                    );
                }
                let _m = self.pool.lock();
                let dev = devio::metadata_dev(&self.pool.metadata)
                    .map_err(|e| format!("{}: {e}", devio::describe(&self.pool.metadata)))?;
                crate::thin::online::online(dev, words).map_err(TargetError::from)
            }
            _ => Err(format!(
                "unknown or malformed thin-pool message '{}'",
                words.join(" ")
            ).into()),
        }
    }
    fn devices(&self) -> Vec<&DevRef> {
        vec![&self.data]
    }
    fn held_devices(&self) -> Vec<&DevRef> {
        vec![&self.metadata, &self.data]
    }
    /// As the kernel's pool_preresume: a table smaller than the metadata's data
    /// space (a shrink) is refused, and so is a data device smaller than the table.
    fn preresume(&self) -> Result<(), TargetError> {
        let have = self.pool.lock().md.nr_data_blocks();
        if self.nr_blocks < have {
            return Err(format!(
                "pool target ({} blocks) too small: expected {have}",
                self.nr_blocks
            ).into());
        }
        let data_sectors = self.data.size_sectors();
        if data_sectors < self.nr_blocks * self.pool.block_sectors {
            return Err(format!(
                "data device ({data_sectors} sectors) smaller than the pool target ({} sectors)",
                self.nr_blocks * self.pool.block_sectors
            ).into());
        }
        Ok(())
    }
    /// The table applies and space grows, what waited for space is requeued,
    /// then the thins the suspend held resume (the kernel's pool_resume).
    fn resume(&self) {
        self.pool.apply(self.requested, self.low_water, self.nr_blocks);
        self.pool.resume_active_thins();
    }
    fn events(&self) -> u64 {
        self.pool.events.load(std::sync::atomic::Ordering::Relaxed)
    }
    /// The pool's active thins are suspended internally first (their pieces
    /// queued for space wait for the resume at the top, as the kernel's
    /// pool_presuspend), so the suspend never waits for space.
    fn presuspend(&self) {
        self.pool.suspend_active_thins();
        self.pool.requeue_no_space();
    }
    fn postsuspend(&self) {
        if let Err(e) = self.pool.commit_now() {
            tracing::warn!("thin-pool suspend: commit failed: {e}");
        }
    }
}

/// The errno the kernel's pool message returns for what the metadata refused
/// (dm-thin-metadata.c): EEXIST for a device id in use, ENODATA for one not
/// there, EBUSY for one a table uses; EINVAL otherwise.
fn refusal(e: &ThinError) -> TargetError {
    let errno = match e {
        ThinError::DeviceExists(_) => libc::EEXIST,
        ThinError::NoSuchDevice(_) => libc::ENODATA,
        ThinError::Active(_) => libc::EBUSY,
        _ => libc::EINVAL,
    };
    TargetError::new(errno, e.to_string())
}
