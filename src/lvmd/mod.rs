//! `dmkit lvmd`: TopoLVM's lvmd served from dmkit thin pools, and CSI's
//! SnapshotMetadata (changed-block tracking) from the same pools.
//!
//! lvmd is a client of a running dmkit daemon: a volume is a thin device of
//! a device class's pool and a dmkit device over it (made a kernel block
//! device with `attach` unless `--no-attach`). Each change is a series of
//! steps — a record, the pool message, the device, the attach — and the
//! record ([`store`]) says which step a volume had reached, so a lvmd that
//! dies between any two is finished or undone by the next ([`Lvmd::recover`])
//! before it answers anyone.

pub mod config;
pub mod dmkit;
mod server;
mod service;
mod snapmeta;
pub mod store;

use config::{Config, DeviceClass};
use dmkit::Dmkit;
use std::collections::HashMap;
use std::path::PathBuf;
use store::{Step, Store, Volume};

/// The generated messages and servers of proto/lvmd.proto.
pub mod pb {
    tonic::include_proto!("proto");
}

/// The generated messages and server of proto/csi_snapshot_metadata.proto.
pub mod csi {
    tonic::include_proto!("csi.v1");
}

pub use server::run;

/// LVM's default extent: a volume's size is rounded up to it, as lvcreate does.
pub const EXTENT_BYTES: u64 = 4 << 20;

/// The largest thin device id a pool takes (24 bits, as the kernel's).
const MAX_DEV_ID: u64 = (1 << 24) - 1;

/// How `dmkit lvmd` runs.
#[derive(Clone, Debug)]
pub struct Options {
    pub config: PathBuf,
    pub run_dir: PathBuf,
    /// The records directory (default RUN_DIR/lvmd).
    pub state: PathBuf,
    /// Make each volume a kernel block device (`dmkit attach`).
    pub attach: bool,
    /// Where the SnapshotMetadata service listens (a unix socket).
    pub snapshot_metadata: Option<PathBuf>,
    /// The CSI driver name Identity's GetPluginInfo answers.
    pub csi_driver_name: String,
    /// Ranges as runs (VARIABLE_LENGTH) rather than pool blocks.
    pub variable_length: bool,
    /// For tests only: exit (status 137, as a kill) once this many steps of
    /// changes have been taken.
    pub test_exit_after_steps: Option<u64>,
    /// For tests only: SnapshotMetadata reads pages of this many runs
    /// instead of 65,536, so a small volume's answer spans pages.
    pub test_page_runs: Option<usize>,
}

impl Options {
    /// Runs of blocks SnapshotMetadata reads a page at a time.
    pub fn page_runs(&self) -> usize {
        self.test_page_runs.map_or(snapmeta::PAGE_RUNS, |n| n.max(1))
    }
}

/// What a request can fail with; each maps to the gRPC code TopoLVM expects.
#[derive(Debug, Clone, PartialEq)]
pub enum Error {
    NotFound(String),
    Exhausted(String),
    Invalid(String),
    Exists(String),
    OutOfRange(String),
    Unimplemented(String),
    /// The volume's block device is held (mounted): what was asked needs it free.
    InUse(String),
    Internal(String),
}

impl From<String> for Error {
    fn from(e: String) -> Error {
        Error::Internal(e)
    }
}

type Result<T> = std::result::Result<T, Error>;

/// A volume as lvmd answers for it.
#[derive(Clone, Debug, PartialEq)]
pub struct VolumeInfo {
    pub name: String,
    pub size_bytes: u64,
    pub major: u32,
    pub minor: u32,
    pub tags: Vec<String>,
    pub path: String,
    pub attr: String,
}

/// A device class's pool as Watch reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct ClassUsage {
    pub name: String,
    pub default: bool,
    pub pool: dmkit::PoolUsage,
    /// Free bytes with the class's overprovision ratio, as lvmd computes them.
    pub overprovision_free: u64,
}

/// How far a create got before it failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Made {
    Nothing,
    /// The thin device, not the dmkit device.
    Thin,
    /// The thin device and the dmkit device.
    Device,
}

/// lvmd's state: its configuration, the daemon, the records.
pub struct Lvmd {
    pub cfg: Config,
    pub dm: Dmkit,
    store: Store,
    attach: bool,
    /// Where each attached volume's block device is (learnt at attach).
    nodes: HashMap<String, (PathBuf, u32, u32)>,
    /// The next thin device id to give, per pool.
    next_dev_id: HashMap<String, u64>,
    steps: u64,
    exit_after: Option<u64>,
    /// Runs of blocks SnapshotMetadata reads a page at a time.
    page_runs: usize,
}

/// LVM's rule for volume names: letters, digits and `+_.-`, not starting with
/// `-`, at most 127 bytes, not `.` or `..`.
fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 127
        && !name.starts_with('-')
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"+_.-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "volume name '{}' is not one LVM takes (letters, digits, + _ . -; not starting with -; at most 127)",
            crate::table::bounded(name)
        )))
    }
}

/// A requested size: positive, rounded up to LVM's extent.
fn size_of(bytes: i64) -> Result<u64> {
    if bytes <= 0 {
        return Err(Error::Invalid(format!("size_bytes {bytes}: must be more than 0")));
    }
    let b = bytes as u64;
    // rounded, it must still be a CSI size (an int64)
    b.checked_next_multiple_of(EXTENT_BYTES)
        .filter(|&r| r <= i64::MAX as u64)
        .ok_or_else(|| Error::OutOfRange(format!("size_bytes {bytes}: too large")))
}

impl Lvmd {
    pub fn new(cfg: Config, opts: &Options) -> std::result::Result<Lvmd, String> {
        Ok(Lvmd {
            cfg,
            dm: Dmkit {
                run_dir: opts.run_dir.clone(),
            },
            store: Store::open(&opts.state, |n| check_name(n).is_ok())?,
            attach: opts.attach,
            nodes: HashMap::new(),
            next_dev_id: HashMap::new(),
            steps: 0,
            exit_after: opts.test_exit_after_steps,
            page_runs: opts.page_runs(),
        })
    }

    /// One step of a change taken: with the test option, the process ends here
    /// as a kill would end it.
    fn step(&mut self) {
        self.steps += 1;
        if self.exit_after == Some(self.steps) {
            tracing::warn!(
                "lvmd: exiting after step {} (--test-exit-after-steps)",
                self.steps
            );
            std::process::exit(137);
        }
    }

    /// Make NAME's record `v`, durably: a step.
    fn put(&mut self, name: &str, v: Volume) -> Result<()> {
        self.store.put(name, v)?;
        self.step();
        Ok(())
    }

    /// NAME's record at step `to`, durably: a step.
    fn set_step(&mut self, name: &str, to: Step) -> Result<()> {
        let v = self
            .store
            .volumes
            .get(name)
            .cloned()
            .ok_or_else(|| Error::Internal(format!("{name}: its record went")))?;
        self.put(name, Volume { step: to, ..v })
    }

    fn class(&self, name: &str) -> Result<DeviceClass> {
        self.cfg.class(name).cloned().ok_or_else(|| {
            Error::NotFound(if name.is_empty() {
                "no default device class".to_string()
            } else {
                format!("device class not found: {name}")
            })
        })
    }

    fn volume(&self, name: &str, class: &DeviceClass) -> Result<Volume> {
        match self.store.volumes.get(name) {
            Some(v) if v.device_class == class.name && v.step != Step::Creating => Ok(v.clone()),
            _ => Err(Error::NotFound(format!(
                "logical volume {} is not found",
                crate::table::bounded(name)
            ))),
        }
    }

    /// Check every device class's pool, then finish or undo what a previous
    /// lvmd left half done, so that every record is Ready and its device there.
    pub fn recover(&mut self) -> std::result::Result<(), String> {
        for dc in &self.cfg.device_classes {
            let pool = &dc.pool().name;
            let types = self
                .dm
                .target_types(pool)
                .map_err(|e| format!("device class {}: thin pool {pool}: {e}", dc.name))?;
            if types.first().map(String::as_str) != Some("thin-pool") {
                return Err(format!(
                    "device class {}: {pool} is a {} device, not a thin-pool",
                    dc.name,
                    types.join(",")
                ));
            }
        }
        // a metadata snapshot a previous lvmd reserved and did not release
        for dc in &self.cfg.device_classes {
            let pool = &dc.pool().name;
            let marker = snapmeta::metadata_snap_marker(pool);
            if self.store.marked(&marker) {
                tracing::info!("lvmd: thin pool {pool}: releasing the metadata snapshot a stopped lvmd held");
                // (already released, if it stopped between the release and the marker)
                let _ = self.dm.message(pool, "release_metadata_snap");
                self.store.mark(&marker, false)?;
            }
        }
        // thin ids: past every one a pool holds and every one a record names
        for dc in self.cfg.device_classes.clone() {
            let pool = dc.pool().name.clone();
            let held = self.dm.thin_ids(&pool)?.into_iter().max().map(|m| m + 1);
            let recorded = self.volumes_in(&pool).map(|v| v.dev_id + 1).max();
            self.next_dev_id.insert(pool, held.max(recorded).unwrap_or(0));
        }
        let names: Vec<String> = self.store.volumes.keys().cloned().collect();
        for name in names {
            let Some(v) = self.store.volumes.get(&name).cloned() else {
                continue;
            };
            let Some(dc) = self.cfg.class(&v.device_class).cloned() else {
                tracing::warn!(
                    "lvmd: volume {name}: its device class {} is no longer configured; left as it is",
                    v.device_class
                );
                continue;
            };
            match v.step {
                Step::Creating | Step::Removing => {
                    if let (Step::Creating, Some(origin)) = (v.step, &v.origin) {
                        // stopped while the origin was suspended for the snapshot
                        let o = dc.device_name(origin);
                        if self.dm.exists(&o)? {
                            self.dm.resume(&o)?;
                        }
                    }
                    let what = if v.step == Step::Creating {
                        "a create"
                    } else {
                        "a remove"
                    };
                    tracing::info!("lvmd: volume {name}: {what} left half done; finishing its removal");
                    self.teardown(&dc, &name, &v)?;
                    self.store.remove(&name)?;
                }
                Step::Resizing | Step::Ready => {
                    let dev = dc.device_name(&name);
                    let table = self.thin_table(&dc, &v);
                    if !self.dm.exists(&dev)? {
                        tracing::info!("lvmd: volume {name}: making its device {dev} again");
                        self.dm.create(&dev, &table, v.read_only)?;
                    } else if v.step == Step::Resizing {
                        tracing::info!(
                            "lvmd: volume {name}: finishing its resize to {} bytes",
                            v.size_bytes
                        );
                        self.reload(&dev, &table)?;
                    }
                    if v.step == Step::Resizing {
                        self.store.put(
                            &name,
                            Volume {
                                step: Step::Ready,
                                ..v
                            },
                        )?;
                    }
                    if self.attach {
                        self.attach_dev(&dev)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn thin_table(&self, dc: &DeviceClass, v: &Volume) -> String {
        format!(
            "0 {} thin /dev/mapper/{} {}",
            v.size_bytes / 512,
            dc.pool().name,
            v.dev_id
        )
    }

    /// The volume's device and thin device gone, whichever of them exist.
    /// Each is removed first and looked for only if that fails (a listing of
    /// every device or thin id costs as many lines as there are volumes).
    fn teardown(&mut self, dc: &DeviceClass, name: &str, v: &Volume) -> std::result::Result<(), String> {
        let dev = dc.device_name(name);
        if self.attach || self.nodes.contains_key(&dev) {
            // detaching a device that is not attached only says so
            let _ = self.dm.call(&["detach", &dev]);
            self.nodes.remove(&dev);
        }
        if let Err(e) = self.dm.remove(&dev) {
            if self.dm.exists(&dev)? {
                return Err(e);
            }
        }
        self.step();
        let pool = dc.pool().name.clone();
        if let Err(e) = self.dm.message(&pool, &format!("delete {}", v.dev_id)) {
            if self.dm.thin_ids(&pool)?.contains(&v.dev_id) {
                return Err(e);
            }
        }
        self.step();
        Ok(())
    }

    /// The block device `dev` is attached as, if something holds it (a mount,
    /// an exclusive open): a removal or a resize would pull it from under them.
    fn held(&self, dev: &str) -> Option<String> {
        let (node, _, _) = self.nodes.get(dev)?;
        crate::io::hold::held(node).then(|| node.display().to_string())
    }

    /// A new table on `dev`. Its block device, if attached, goes first and
    /// comes back after at the new size (ublk cannot resize one in place).
    fn reload(&mut self, dev: &str, table: &str) -> std::result::Result<(), String> {
        let attached = self.nodes.contains_key(dev) || self.dm.call(&["info", dev])?.contains("/dev/ublkb");
        if attached {
            self.dm.call(&["detach", dev])?;
            self.nodes.remove(dev);
        }
        self.dm.reload(dev, table)?;
        if attached || self.attach {
            self.attach_dev(dev)?;
        }
        Ok(())
    }

    fn attach_dev(&mut self, dev: &str) -> std::result::Result<(), String> {
        if self.nodes.contains_key(dev) {
            return Ok(());
        }
        // a device attached before (by a previous lvmd, or restored attached)
        let info = self.dm.call(&["info", dev])?;
        let out = if info.contains("/dev/ublkb") {
            info
        } else {
            self.dm.call(&["attach", dev])?
        };
        let node = out
            .split_whitespace()
            .find(|w| w.starts_with("/dev/ublkb"))
            .ok_or_else(|| format!("{dev}: attach named no block device: {}", out.trim()))?;
        use std::os::unix::fs::MetadataExt;
        let rdev = std::fs::metadata(node)
            .map_err(|e| format!("{node}: {e}"))?
            .rdev();
        let (major, minor) = (rustix::fs::major(rdev), rustix::fs::minor(rdev));
        self.nodes
            .insert(dev.to_string(), (PathBuf::from(node), major, minor));
        Ok(())
    }

    fn info(
        &self,
        dc: &DeviceClass,
        name: &str,
        v: &Volume,
        numbers: Option<(u32, u32)>,
    ) -> Result<VolumeInfo> {
        let dev = dc.device_name(name);
        let (path, major, minor) = match (self.nodes.get(&dev), numbers) {
            (Some((p, a, b)), _) => (p.to_string_lossy().into_owned(), *a, *b),
            (None, Some((a, b))) => (format!("/dev/mapper/{dev}"), a, b),
            (None, None) => {
                let (a, b) = self.dm.devnum(&dev)?;
                (format!("/dev/mapper/{dev}"), a, b)
            }
        };
        // lv_attr as lvs prints a thin volume: V(irtual) w/r i(nherited) - a(ctive) - t(hin) z(ero) - -
        let attr = format!("V{}i-a-tz--", if v.read_only { 'r' } else { 'w' });
        Ok(VolumeInfo {
            name: name.to_string(),
            size_bytes: v.size_bytes,
            major,
            minor,
            tags: v.tags.clone(),
            path,
            attr,
        })
    }

    /// The volumes recorded in a pool (of any class over it).
    fn volumes_in<'a>(&'a self, pool: &'a str) -> impl Iterator<Item = &'a Volume> + 'a {
        self.store.volumes.values().filter(move |v| {
            self.cfg
                .class(&v.device_class)
                .is_some_and(|d| d.pool().name == pool)
        })
    }

    /// The bytes of volumes recorded in a pool (LVM's virtual size of a pool).
    fn virtual_bytes(&self, pool: &str) -> u64 {
        self.volumes_in(pool).map(|v| v.size_bytes).sum()
    }

    /// lvmd's free bytes of a thin class: the pool's size times the
    /// overprovision ratio, less the volumes' sizes.
    fn overprovision_free(&self, dc: &DeviceClass, usage: &dmkit::PoolUsage) -> u64 {
        let virt_pool = (dc.pool().overprovision_ratio * usage.size_bytes() as f64).floor() as u64;
        virt_pool.saturating_sub(self.virtual_bytes(&dc.pool().name))
    }

    fn free(&self, dc: &DeviceClass) -> Result<u64> {
        let usage = self.dm.pool_usage(&dc.pool().name)?;
        Ok(self.overprovision_free(dc, &usage))
    }

    /// The next thin device id of a pool: past every id the pool held when
    /// lvmd started and every id lvmd gave since ([`Lvmd::recover`]). The
    /// ids above those are lvmd's, as a volume group's thin ids are LVM's.
    fn alloc_dev_id(&mut self, pool: &str) -> Result<u64> {
        let next = self.next_dev_id.entry(pool.to_string()).or_insert(0);
        let id = *next;
        if id > MAX_DEV_ID {
            return Err(Error::Exhausted(format!(
                "thin pool {pool}: no thin device id left"
            )));
        }
        *next = id + 1;
        Ok(id)
    }

    pub fn create_lv(
        &mut self,
        name: &str,
        class: &str,
        size_bytes: i64,
        tags: Vec<String>,
    ) -> Result<VolumeInfo> {
        let dc = self.class(class)?;
        check_name(name)?;
        let size = size_of(size_bytes)?;
        let v = self.begin_create(&dc, name, size, tags, None, false)?;
        let (pool, dev_id) = (dc.pool().name.clone(), v.dev_id);
        let made = self.make(&dc, name, &v, |s| {
            s.dm.message(&pool, &format!("create_thin {dev_id}"))
        });
        self.finish_create(&dc, name, made)
    }

    pub fn create_snapshot(
        &mut self,
        name: &str,
        class: &str,
        source: &str,
        size_bytes: i64,
        access: &str,
        tags: Vec<String>,
    ) -> Result<VolumeInfo> {
        let dc = self.class(class)?;
        check_name(name)?;
        let src = self.volume(source, &dc).map_err(|_| {
            Error::NotFound(format!(
                "source logical volume {} is not found",
                crate::table::bounded(source)
            ))
        })?;
        let size = if size_bytes == 0 {
            src.size_bytes
        } else {
            size_of(size_bytes)?
        };
        if size < src.size_bytes {
            return Err(Error::OutOfRange(format!(
                "requested size {size} is smaller than source logical volume: {}",
                src.size_bytes
            )));
        }
        let read_only = match access {
            "ro" => true,
            "rw" | "" => false,
            a => {
                return Err(Error::Invalid(format!(
                    "access_type '{}': ro or rw",
                    crate::table::bounded(a)
                )))
            }
        };
        let v = self.begin_create(&dc, name, size, tags, Some(source), read_only)?;
        let (pool, dev_id) = (dc.pool().name.clone(), v.dev_id);
        let origin_dev = dc.device_name(source);
        let made = self.make(&dc, name, &v, |s| {
            // the origin is suspended around the snapshot, as LVM does, so the
            // snapshot holds every write the origin acknowledged
            s.dm.suspend(&origin_dev)?;
            s.step();
            let r =
                s.dm.message(&pool, &format!("create_snap {dev_id} {}", src.dev_id));
            let resumed = s.dm.resume(&origin_dev);
            r.and(resumed.map(|_| String::new()))
        });
        self.finish_create(&dc, name, made)
    }

    /// A new volume's checks and its Creating record (a step): the name is
    /// free, the class has the room, a thin id is given.
    fn begin_create(
        &mut self,
        dc: &DeviceClass,
        name: &str,
        size: u64,
        tags: Vec<String>,
        origin: Option<&str>,
        read_only: bool,
    ) -> Result<Volume> {
        if self.store.volumes.contains_key(name) {
            return Err(Error::Exists(format!("logical volume {name} already exists")));
        }
        let free = self.free(dc)?;
        if free < size {
            return Err(Error::Exhausted(format!(
                "no enough space left on VG: free={free}, requested={size}"
            )));
        }
        let v = Volume {
            device_class: dc.name.clone(),
            dev_id: self.alloc_dev_id(&dc.pool().name)?,
            size_bytes: size,
            tags,
            origin: origin.map(str::to_string),
            read_only,
            step: Step::Creating,
        };
        self.put(name, v.clone())?;
        Ok(v)
    }

    /// The thin device (by `pool_step`), the dmkit device, its attach; on an
    /// error, what was made before it.
    fn make(
        &mut self,
        dc: &DeviceClass,
        name: &str,
        v: &Volume,
        pool_step: impl FnOnce(&mut Lvmd) -> std::result::Result<String, String>,
    ) -> std::result::Result<(), (Made, Error)> {
        pool_step(self).map_err(|e| (Made::Nothing, Error::Internal(e)))?;
        self.step();
        let dev = dc.device_name(name);
        if let Err(e) = self.dm.create(&dev, &self.thin_table(dc, v), v.read_only) {
            // a device of that name lvmd did not make: left alone
            let taken = self.dm.exists(&dev).unwrap_or(false);
            return Err((
                Made::Thin,
                match taken {
                    true => Error::Exists(format!(
                        "a dmkit device {dev} exists already (not one of lvmd's volumes)"
                    )),
                    false => Error::Internal(e),
                },
            ));
        }
        self.step();
        if self.attach {
            self.attach_dev(&dev)
                .map_err(|e| (Made::Device, Error::Internal(e)))?;
            self.step();
        }
        Ok(())
    }

    /// Record a made volume Ready, or undo a failed one (only what this
    /// request made: a device or thin id that was there before is not ours)
    /// and say why.
    fn finish_create(
        &mut self,
        dc: &DeviceClass,
        name: &str,
        made: std::result::Result<(), (Made, Error)>,
    ) -> Result<VolumeInfo> {
        let Some(v) = self.store.volumes.get(name).cloned() else {
            return Err(Error::Internal(format!("{name}: its record went")));
        };
        if let Err((made, e)) = made {
            let pool = dc.pool().name.clone();
            let undo = match made {
                Made::Nothing => Ok(()),
                Made::Thin => self.dm.message(&pool, &format!("delete {}", v.dev_id)).map(drop),
                Made::Device => self.teardown(dc, name, &v),
            };
            self.store.remove(name)?;
            if let Err(u) = undo {
                tracing::warn!("lvmd: volume {name}: undoing a failed create: {u}");
            }
            return Err(e);
        }
        self.set_step(name, Step::Ready)?;
        let v = self.volume(name, dc)?;
        self.info(dc, name, &v, None)
    }

    pub fn remove_lv(&mut self, name: &str, class: &str) -> Result<()> {
        let dc = self.class(class)?;
        let v = self.volume(name, &dc)?;
        let dev = dc.device_name(name);
        // an open device cannot go: ask before the record says Removing
        if let Ok(open) = self.dm.call(&["info", "-c", "--noheadings", "-o", "open", &dev]) {
            if open.trim().parse::<u64>().unwrap_or(0) > 0 {
                return Err(Error::Internal(format!(
                    "logical volume {name} in use (its device {dev} is open)"
                )));
            }
        }
        if let Some(node) = self.held(&dev) {
            return Err(Error::Internal(format!(
                "logical volume {name} in use (its block device {node} is mounted or held)"
            )));
        }
        self.set_step(name, Step::Removing)?;
        self.teardown(&dc, name, &v)?;
        self.store.remove(name)?;
        Ok(())
    }

    pub fn resize_lv(&mut self, name: &str, class: &str, size_bytes: i64) -> Result<u64> {
        let dc = self.class(class)?;
        let v = self.volume(name, &dc)?;
        let size = size_of(size_bytes)?;
        if size <= v.size_bytes {
            return Ok(v.size_bytes);
        }
        let free = self.free(&dc)?;
        if free < size - v.size_bytes {
            return Err(Error::Exhausted(format!(
                "no enough space left on VG: free={free}, requested={}",
                size - v.size_bytes
            )));
        }
        let dev = dc.device_name(name);
        if let Some(node) = self.held(&dev) {
            // ublk cannot change a block device's size (before Linux 6.16's
            // UBLK_CMD_UPDATE_SIZE): it is attached again, which a mount forbids
            return Err(Error::InUse(format!(
                "logical volume {name} in use: its block device {node} is mounted or held, and a ublk \
                 device's size cannot change under it; unmount it to resize"
            )));
        }
        let grown = Volume {
            size_bytes: size,
            step: Step::Resizing,
            ..v
        };
        self.put(name, grown.clone())?;
        self.reload(&dev, &self.thin_table(&dc, &grown))?;
        self.step();
        self.set_step(name, Step::Ready)?;
        Ok(size)
    }

    pub fn list(&mut self, class: &str) -> Result<Vec<VolumeInfo>> {
        let dc = self.class(class)?;
        // every device's numbers in one request
        let all = self.dm.call(&[
            "info",
            "-c",
            "--noheadings",
            "-o",
            "name,major,minor",
            "--separator",
            ":",
        ])?;
        let numbers: HashMap<&str, (u32, u32)> = all
            .lines()
            .filter_map(|l| {
                let mut f = l.trim().split(':');
                let n = f.next()?;
                Some((n, (f.next()?.parse().ok()?, f.next()?.parse().ok()?)))
            })
            .collect();
        self.store
            .volumes
            .iter()
            .filter(|(_, v)| v.device_class == dc.name && v.step != Step::Creating)
            .map(|(n, v)| self.info(&dc, n, v, numbers.get(dc.device_name(n).as_str()).copied()))
            .collect()
    }

    /// GetFreeBytes: the overprovisioned free bytes less the class's spare.
    pub fn free_bytes(&self, class: &str) -> Result<u64> {
        let dc = self.class(class)?;
        Ok(self.free(&dc)?.saturating_sub(dc.spare_bytes()))
    }

    pub fn usage(&self) -> Result<Vec<ClassUsage>> {
        self.cfg
            .device_classes
            .iter()
            .map(|dc| {
                let pool = self.dm.pool_usage(&dc.pool().name)?;
                Ok(ClassUsage {
                    name: dc.name.clone(),
                    default: dc.default,
                    overprovision_free: self.overprovision_free(dc, &pool),
                    pool,
                })
            })
            .collect()
    }

    /// A recorded, finished volume by name, with its class (SnapshotMetadata's ids).
    pub fn snapshot(&self, name: &str) -> Option<(DeviceClass, Volume)> {
        let v = self.store.volumes.get(name)?;
        if v.step != Step::Ready {
            return None;
        }
        Some((self.cfg.class(&v.device_class)?.clone(), v.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_up_to_lvms_extent_and_names_follow_lvms_rules() {
        assert_eq!(size_of(1), Ok(EXTENT_BYTES));
        assert_eq!(size_of(1 << 30), Ok(1 << 30));
        assert!(matches!(size_of(0), Err(Error::Invalid(_))));
        assert!(matches!(size_of(-5), Err(Error::Invalid(_))));
        assert!(matches!(size_of(i64::MAX), Err(Error::OutOfRange(_))));
        assert!(check_name("pvc-0a1b_2.c+d").is_ok());
        for bad in ["", "-x", "a/b", "a b", ".", ".."] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
        assert!(check_name(&"a".repeat(128)).is_err());
    }
}
