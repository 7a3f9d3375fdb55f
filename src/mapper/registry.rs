//! The set of mapped devices and the dmsetup operations on them.

use super::config::Config;
use super::{DevRef, DmHold, Resolver, Shared, TargetType};
use super::{Device, Table, TableEntry, DM_MAJOR};
use crate::io::BackingFile;
use crate::mapper::TargetError;
use crate::sync::Unpoison;
use crate::table::{parse_table, TableError};
use std::collections::BTreeMap;

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

pub use super::errors::ControlError;

/// How a refused message is named in errors (which the door logs): its first
/// two words, never what follows them, which may be a key (dm-crypt's `key set`).
fn message_verb(words: &[String]) -> String {
    let shown: Vec<&str> = words.iter().take(2).map(String::as_str).collect();
    let more = if words.len() > 2 { " ..." } else { "" };
    format!("{}{more}", shown.join(" "))
}

/// Whether a live or inactive table of `d` names device `other`.
fn refers_to(d: &Device, other: &Arc<Device>) -> bool {
    let names = |t: &crate::mapper::Table| {
        t.entries.iter().any(|e| {
            e.target
                .devices()
                .iter()
                .any(|r| matches!(r, DevRef::Dm(h) if Arc::ptr_eq(&h.0, other)))
        })
    };
    d.live.load().as_deref().is_some_and(names)
        || d.inactive.lock().unpoisoned().as_deref().is_some_and(names)
}

/// Refused for `name` with EINVAL.
fn dev_err(name: &str, what: impl Into<String>) -> ControlError {
    refused_by(name, TargetError::invalid(what))
}

/// Refused for `name` with EBUSY: something holds the device.
fn dev_busy(name: &str, what: impl Into<String>) -> ControlError {
    refused_by(name, TargetError::busy(what))
}

/// Refused for `name` as a target (or the registry on its behalf) refused,
/// with its errno.
fn refused_by(name: &str, e: TargetError) -> ControlError {
    ControlError::Device {
        name: name.to_string(),
        errno: e.errno(),
        what: e.what().to_string(),
    }
}

/// The kernel's rules for a device name (dm-ioctl.c's check_name and the
/// ioctl's DM_NAME_LEN): each refusal says which rule and the limit.
fn check_name(name: &str) -> Result<(), ControlError> {
    let why = if name.is_empty() {
        Some("a name is 1 to 127 bytes, and this one is empty".to_string())
    } else if name.len() > 127 {
        Some(format!(
            "a name is at most 127 bytes, and this one is {}",
            name.len()
        ))
    } else if name.contains('/') {
        Some("a name cannot contain '/'".to_string())
    } else if matches!(name, "control" | "." | "..") {
        Some(
            "\"control\", \".\" and \"..\" are reserved (the control node, and the directory's own entries)"
                .to_string(),
        )
    } else {
        None
    };
    match why {
        Some(why) => {
            let quoted = crate::table::bounded(name);
            Err(dev_err(&quoted, format!("invalid device name '{quoted}': {why}")))
        }
        None => Ok(()),
    }
}

/// A uuid as the kernel takes it: at most 128 bytes.
fn check_uuid(name: &str, uuid: Option<&str>) -> Result<(), ControlError> {
    match uuid {
        Some(u) if u.is_empty() || u.len() > 128 => {
            Err(dev_err(name, format!("invalid uuid '{u}': 1 to 128 bytes")))
        }
        _ => Ok(()),
    }
}

/// The minors in use, and the next to give. Unlike the kernel (the lowest free
/// one), a number is not given again until every number above it has been
/// given: a node left behind by a removed device (no udev takes it away here)
/// then opens nothing rather than whatever device came next. The cursor is
/// recorded with the devices, so a restarted daemon goes on from it.
#[derive(Default)]
struct Minors {
    used: std::collections::BTreeSet<u32>,
    /// Where the search for a free number starts.
    next: u32,
}

impl Minors {
    /// The first free number from the cursor on, wrapping at MAX_MINORS.
    fn take(&mut self) -> u32 {
        let free_from = |used: &std::collections::BTreeSet<u32>, from: u32| {
            let mut m = from;
            for &u in used.range(from..) {
                if u != m {
                    break;
                }
                m += 1;
            }
            (m < MAX_MINORS).then_some(m)
        };
        // the registry refuses a device past MAX_MINORS devices before this
        let m = free_from(&self.used, self.next)
            .or_else(|| free_from(&self.used, 0))
            .unwrap_or(0);
        self.used.insert(m);
        self.next = (m + 1) % MAX_MINORS;
        m
    }

    /// Take `minor` itself (DM_PERSISTENT_DEV_FLAG): false if a device has it.
    fn take_this(&mut self, minor: u32) -> bool {
        self.used.insert(minor)
    }

    fn give(&mut self, minor: u32) {
        self.used.remove(&minor);
    }

    /// Give back a number no device ever had (a create that failed): the
    /// cursor goes back to it when it was the last one given.
    fn untake(&mut self, minor: u32) {
        self.used.remove(&minor);
        if self.next == (minor + 1) % MAX_MINORS {
            self.next = minor;
        }
    }
}

#[cfg(test)]
#[test]
fn minors_are_not_given_again_until_the_numbers_wrap() {
    let mut m = Minors::default();
    assert_eq!((m.take(), m.take(), m.take()), (0, 1, 2));
    m.give(1);
    assert_eq!(m.take(), 3, "a removed device's number is not given at once");
    assert!(
        m.take_this(5) && !m.take_this(5) && m.take_this(1),
        "a chosen one, free or given back"
    );
    assert_eq!((m.take(), m.take()), (4, 6), "a chosen number is skipped");
    m.next = MAX_MINORS - 1;
    m.give(0);
    assert_eq!(
        (m.take(), m.take()),
        (MAX_MINORS - 1, 0),
        "wraps to the lowest free"
    );
}

/// Minor numbers are below this (the kernel's MINORBITS: 20 bits).
const MAX_MINORS: u32 = 1 << 20;

/// (st_dev, st_ino) of a file or (0, rdev) of a block device, and read-only.
type FileKey = (u64, u64, bool);

pub struct Registry {
    devices: Mutex<BTreeMap<String, Arc<Device>>>,
    /// Open backing files by (st_dev, st_ino or rdev, read-only): every table line
    /// naming a file shares one open file, so a file is one set of descriptors and
    /// flushes can be sent to it once.
    files: Mutex<Vec<(FileKey, std::sync::Weak<BackingFile>)>>,
    /// Minors: a new device (or a creation under way) takes the lowest free one,
    /// and a removed or failed one gives it back (as the kernel's idr).
    minors: Mutex<Minors>,
    /// Devices by uuid (a uuid names at most one device).
    uuids: Mutex<std::collections::HashMap<String, std::sync::Weak<Device>>>,
    /// Some device may be marked for deferred removal ([`Registry::reap_deferred`]
    /// has something to look for).
    deferred: std::sync::atomic::AtomicBool,
    /// State targets share across devices (snapshot origins).
    shared: Shared,
    pub config: Config,
    /// The target types tables may use (`crate::targets::types()`; the core
    /// itself knows only `error`).
    types: &'static [TargetType],
    /// What changed since the state file last recorded it ([`Registry::take_changed`]).
    changed: Mutex<Changed>,
    /// What the frontends' servers hold (`dmkit stats --server`).
    pub server: ServerCounters,
}

/// The NBD server's load, kept by the server and shown by `dmkit stats --server`.
#[derive(Debug, Default)]
pub struct ServerCounters {
    /// Reactor threads serving connections.
    pub reactors: std::sync::atomic::AtomicUsize,
    /// Connections in the transmission phase.
    pub connections: std::sync::atomic::AtomicUsize,
    /// The connections each reactor serves, in the reactors' order: what a
    /// new connection's placement reads (set when the reactors start).
    pub per_reactor: std::sync::OnceLock<Vec<std::sync::Arc<std::sync::atomic::AtomicUsize>>>,
    /// Each reactor's busy connections whose clients ran on its CPU at its
    /// last look (see `export::nbd::placement`).
    pub local: std::sync::OnceLock<Vec<std::sync::Arc<std::sync::atomic::AtomicUsize>>>,
    /// Connections moved from one reactor to another, in all.
    pub moved: std::sync::atomic::AtomicUsize,
    /// Connections in their handshake.
    pub handshakes: std::sync::atomic::AtomicUsize,
    /// Bytes of buffers the reactors hold (request data, receive buffers).
    pub buffer_bytes: std::sync::atomic::AtomicUsize,
}

impl ServerCounters {
    /// `dmkit stats --server`: one `key=value` line.
    pub fn line(&self) -> String {
        let l = |a: &std::sync::atomic::AtomicUsize| a.load(Ordering::Relaxed);
        let list = |v: &std::sync::OnceLock<Vec<std::sync::Arc<std::sync::atomic::AtomicUsize>>>| {
            let per: Vec<String> = v
                .get()
                .map_or(Vec::new(), |v| v.iter().map(|a| l(a).to_string()).collect());
            if per.is_empty() {
                "-".to_string()
            } else {
                per.join(",")
            }
        };
        format!(
            "reactors={} connections={} per_reactor={} handshakes={} buffer_bytes={} local={} moved={}\n",
            l(&self.reactors),
            l(&self.connections),
            list(&self.per_reactor),
            l(&self.handshakes),
            l(&self.buffer_bytes),
            list(&self.local),
            l(&self.moved),
        )
    }
}

/// The devices whose record in the state file is out of date: by name, or all
/// of them (a rename changes how other tables name the renamed device).
#[derive(Debug, Default)]
pub struct Changed {
    pub all: bool,
    pub names: std::collections::BTreeSet<String>,
}

/// Marks a device (or every device) changed when dropped: after the operation
/// that holds it, so a record taken meanwhile cannot miss the change.
struct Touch<'a>(&'a Registry, Option<&'a str>);

impl Drop for Touch<'_> {
    fn drop(&mut self) {
        let mut c = self.0.changed.lock().unpoisoned();
        match self.1 {
            Some(n) => {
                c.names.insert(n.to_string());
            }
            None => c.all = true,
        }
    }
}

impl Registry {
    /// Make every target type's shared state durable (daemon shutdown, after the
    /// devices' flushes: thin pools commit).
    pub fn sync_targets(&self) {
        for t in self.types {
            if let Some(sync) = t.sync {
                sync(&self.shared);
            }
        }
    }

    pub fn new(config: Config, types: &'static [TargetType]) -> Registry {
        Registry {
            devices: Mutex::new(BTreeMap::new()),
            files: Mutex::new(Vec::new()),
            minors: Mutex::new(Minors::default()),
            uuids: Mutex::new(std::collections::HashMap::new()),
            deferred: std::sync::atomic::AtomicBool::new(false),
            shared: Shared::new(config.restart_logs.clone()),
            config,
            types,
            changed: Mutex::new(Changed::default()),
            server: ServerCounters::default(),
        }
    }

    /// What changed since the last call (the state file's incremental record).
    pub fn take_changed(&self) -> Changed {
        std::mem::take(&mut *self.changed.lock().unpoisoned())
    }

    fn touch<'a>(&'a self, name: &'a str) -> Touch<'a> {
        Touch(self, Some(name))
    }

    fn devices(&self) -> MutexGuard<'_, BTreeMap<String, Arc<Device>>> {
        self.devices.lock().unpoisoned()
    }

    pub fn get(&self, name: &str) -> Result<Arc<Device>, ControlError> {
        self.devices()
            .get(name)
            .cloned()
            .ok_or_else(|| ControlError::NoDevice(name.to_string()))
    }

    pub fn list(&self) -> Vec<Arc<Device>> {
        self.devices().values().cloned().collect()
    }

    /// Every device, each after the devices its tables (live or inactive) open
    /// (the order to create them in again); otherwise by name. Linear in the
    /// number of devices and table references: the state file is written after
    /// every change, so this must not grow faster than the devices do.
    pub fn creation_order(&self) -> Vec<Arc<Device>> {
        let devs = self.list();
        let index: std::collections::HashMap<*const Device, usize> = devs
            .iter()
            .enumerate()
            .map(|(i, d)| (Arc::as_ptr(d), i))
            .collect();
        // the dmkit devices each device's tables open, by index
        let deps: Vec<Vec<usize>> = devs
            .iter()
            .map(|d| {
                let live = d.live.load_full();
                let inactive = d.inactive.lock().unpoisoned().clone();
                let mut out = Vec::new();
                for t in live.iter().chain(inactive.iter()) {
                    for e in &t.entries {
                        for r in e.target.held_devices() {
                            if let DevRef::Dm(h) = r {
                                out.extend(index.get(&Arc::as_ptr(&h.0)).copied());
                            }
                        }
                    }
                }
                out
            })
            .collect();
        deps_first(&deps).into_iter().map(|i| devs[i].clone()).collect()
    }

    /// `BASE@SPEC`: device BASE as it was at point SPEC, read-only, where BASE's
    /// table is one target that offers such views (`Target::view_type`: cdp's
    /// `flush:N`, `mark:LABEL`, `time:RFC3339`). Made on first use as the
    /// device `BASE@SPEC` with the table `0 <size> <view type> BASE SPEC`, and
    /// removed at its last close (an NBD client asking for the export
    /// `vol@flush:12`); a device of that name is returned as it is.
    pub fn open_view(&self, name: &str) -> Result<Arc<Device>, ControlError> {
        if let Ok(d) = self.get(name) {
            return Ok(d);
        }
        let none = || ControlError::NoDevice(name.to_string());
        let (base, spec) = name.split_once('@').ok_or_else(none)?;
        // a point names itself in one word of letters, digits and `:.-+_`
        // (an RFC 3339 time, a flush number, a mark's label): nothing a client
        // sends can reach the table as more than that word
        let word = |c: char| c.is_ascii_alphanumeric() || ":.-+_".contains(c);
        if spec.is_empty() || !spec.chars().all(word) {
            return Err(none());
        }
        let dev = self.get(base).map_err(|_| none())?;
        let live = dev.live.load_full().ok_or_else(none)?;
        let [e] = &live.entries[..] else {
            return Err(none());
        };
        let ty = e.target.view_type().ok_or_else(none)?;
        let table = format!(
            "0 {} {ty} {}:{} {spec}",
            dev.size_sectors(),
            super::DM_MAJOR,
            dev.minor,
        );
        match self.create(name, Some(&table), true, None) {
            Ok(()) | Err(ControlError::Exists(_)) => {}
            Err(e) => return Err(e),
        }
        let d = self.get(name)?;
        d.deferred_remove.store(true, Ordering::SeqCst);
        self.deferred.store(true, Ordering::SeqCst);
        Ok(d)
    }

    /// `dmsetup create NAME --table ...`: create, load, resume (`--notable`: no
    /// table, `None`). Relative paths in the table are the daemon's.
    pub fn create(
        &self,
        name: &str,
        table: Option<&str>,
        read_only: bool,
        uuid: Option<String>,
    ) -> Result<(), ControlError> {
        self.create_in(name, table, read_only, uuid, None, None)
    }

    /// [`Registry::create`] for a caller in directory `cwd`, which relative paths
    /// in the table are resolved against (as the kernel's lookup of a path is the
    /// caller's); the table keeps them absolute.
    pub fn create_in(
        &self,
        name: &str,
        table: Option<&str>,
        read_only: bool,
        uuid: Option<String>,
        minor: Option<u32>,
        cwd: Option<&Path>,
    ) -> Result<(), ControlError> {
        let _t = self.touch(name);
        check_name(name)?;
        check_uuid(name, uuid.as_deref())?;
        if minor.is_some_and(|m| m >= MAX_MINORS) {
            return Err(dev_err(
                name,
                format!(
                    "minor number {} out of range (below {MAX_MINORS})",
                    minor.unwrap_or(0)
                ),
            ));
        }
        {
            let devs = self.devices();
            if devs.contains_key(name) {
                return Err(ControlError::Exists(name.to_string()));
            }
            self.uuid_free(name, uuid.as_deref())?;
        }
        let minor = match minor {
            Some(m) if self.minors.lock().unpoisoned().take_this(m) => m,
            Some(m) => {
                return Err(dev_busy(
                    name,
                    format!("Device or resource busy: minor number {m} is in use"),
                ))
            }
            None => self.take_minor(),
        };
        let dev = Arc::new(Device::new(name.to_string(), minor, uuid.clone(), read_only));
        // Build the table before the device is visible, so a failed create leaves
        // nothing, its minor included.
        if let Some(table) = table {
            let built = self.build_table(&dev, table, cwd, read_only).and_then(|t| {
                // create is load + resume: the targets' resume checks run first
                t.preresume().map_err(|why| refused_by(name, why))?;
                Ok(t)
            });
            match built {
                Ok(t) => dev.live.store(Some(Arc::new(t))),
                Err(e) => {
                    self.minors.lock().unpoisoned().untake(minor);
                    return Err(e);
                }
            }
        }
        let mut devs = self.devices();
        let clash = if devs.contains_key(name) {
            Err(ControlError::Exists(name.to_string()))
        } else {
            self.uuid_free(name, uuid.as_deref())
        };
        if let Err(e) = clash {
            drop(devs);
            self.minors.lock().unpoisoned().untake(minor);
            return Err(e);
        }
        self.index_uuid(&dev);
        devs.insert(name.to_string(), dev.clone());
        drop(devs);
        if let Some(t) = dev.live.load_full() {
            t.resume();
        }
        Ok(())
    }

    fn take_minor(&self) -> u32 {
        self.minors.lock().unpoisoned().take()
    }

    fn give_minor(&self, minor: u32) {
        self.minors.lock().unpoisoned().give(minor);
    }

    /// The number the next device without a chosen one gets the search from
    /// (recorded with the devices, so a restarted daemon does not give again
    /// the numbers of devices removed before it).
    pub fn next_minor(&self) -> u32 {
        self.minors.lock().unpoisoned().next
    }

    /// Go on from a recorded [`Registry::next_minor`].
    pub fn set_next_minor(&self, next: u32) {
        self.minors.lock().unpoisoned().next = next % MAX_MINORS;
    }

    /// No device but `name` has `uuid` (the kernel refuses a duplicate with EBUSY).
    fn uuid_free(&self, name: &str, uuid: Option<&str>) -> Result<(), ControlError> {
        let Some(u) = uuid else { return Ok(()) };
        let uuids = self.uuids.lock().unpoisoned();
        match uuids.get(u).and_then(std::sync::Weak::upgrade) {
            Some(d) if d.name() != name && !d.removed.load(Ordering::SeqCst) => Err(dev_busy(
                name,
                format!(
                    "Device or resource busy: uuid '{u}' is in use by device '{}'",
                    d.name()
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Index `dev` by its uuid (after [`Registry::uuid_free`] said it is free).
    fn index_uuid(&self, dev: &Arc<Device>) {
        if let Some(u) = dev.uuid() {
            self.uuids.lock().unpoisoned().insert(u, Arc::downgrade(dev));
        }
    }

    /// `dmsetup rename NAME NEW`: the device (and its NBD export) takes the new
    /// name; connections already attached go on.
    pub fn rename(&self, name: &str, new: &str) -> Result<(), ControlError> {
        check_name(new)?;
        let mut devs = self.devices();
        if devs.contains_key(new) {
            return Err(dev_busy(
                new,
                "Device or resource busy: a device with that name exists",
            ));
        }
        let dev = devs
            .remove(name)
            .ok_or_else(|| ControlError::NoDevice(name.to_string()))?;
        dev.set_name(new);
        dev.event_nr.fetch_add(1, Ordering::Relaxed);
        // What changed: the device under both names, and the devices whose
        // tables name it (their record names it anew), not every device.
        let mut c = self.changed.lock().unpoisoned();
        c.names.insert(name.to_string());
        c.names.insert(new.to_string());
        // (only a device some table holds is looked for in the others)
        if dev.holders.load(Ordering::SeqCst) > 0 {
            for (n, d) in devs.iter() {
                if refers_to(d, &dev) {
                    c.names.insert(n.clone());
                }
            }
        }
        drop(c);
        devs.insert(new.to_string(), dev);
        Ok(())
    }

    /// `dmsetup rename NAME --setuuid UUID`: only a device without a uuid can be
    /// given one (the kernel refuses to change a uuid).
    pub fn set_uuid(&self, name: &str, uuid: &str) -> Result<(), ControlError> {
        let _t = self.touch(name);
        check_uuid(name, Some(uuid))?;
        let devs = self.devices();
        let dev = devs
            .get(name)
            .ok_or_else(|| ControlError::NoDevice(name.to_string()))?;
        if let Some(u) = dev.uuid() {
            return Err(dev_err(
                name,
                format!("Invalid argument: the device already has uuid '{u}'"),
            ));
        }
        self.uuid_free(name, Some(uuid))?;
        dev.set_uuid(uuid);
        self.index_uuid(dev);
        dev.event_nr.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// `dmsetup load`: construct the table and keep it as the inactive one.
    pub fn load(&self, name: &str, table: &str) -> Result<(), ControlError> {
        self.load_in(name, table, None, None)
    }

    /// [`Registry::load`] for a caller in directory `cwd` (see [`Registry::create_in`]).
    /// `read_only`: the table's mode (the device takes it at the resume that
    /// makes the table live); None keeps the device's.
    pub fn load_in(
        &self,
        name: &str,
        table: &str,
        cwd: Option<&Path>,
        read_only: Option<bool>,
    ) -> Result<(), ControlError> {
        let _t = self.touch(name);
        let dev = self.get(name)?;
        let _c = crate::sync::lock(&dev.control);
        let ro = read_only.unwrap_or_else(|| dev.read_only());
        let t = self.build_table(&dev, table, cwd, ro)?;
        *dev.inactive.lock().unpoisoned() = Some(Arc::new(t));
        Ok(())
    }

    /// `dmsetup clear`: drop the inactive table.
    pub fn clear(&self, name: &str) -> Result<(), ControlError> {
        let _t = self.touch(name);
        let dev = self.get(name)?;
        dev.inactive.lock().unpoisoned().take();
        Ok(())
    }

    pub fn suspend(&self, name: &str, noflush: bool) -> Result<(), ControlError> {
        let dev = self.get(name)?;
        let _c = crate::sync::lock(&dev.control);
        if dev.suspended.load(Ordering::SeqCst) {
            return Ok(());
        }
        dev.suspend_and_drain();
        if !noflush {
            dev.flush_sync()
                .map_err(|e| dev_err(name, format!("flush on suspend failed: {e}")))?;
        }
        Ok(())
    }

    /// `dmsetup resume`: swap in the inactive table (suspending first), then let
    /// queued I/O go.
    pub fn resume(&self, name: &str) -> Result<(), ControlError> {
        let _t = self.touch(name);
        let dev = self.get(name)?;
        let _c = crate::sync::lock(&dev.control);
        resume_locked(&dev).map_err(|e| refused_by(name, e))
    }

    /// `dmsetup remove [--force] [--deferred]`. A device in another table's use
    /// cannot go. An open one (an NBD client attached) cannot either: `--force`
    /// first replaces its table with `error` (I/O in flight completes, later I/O
    /// fails) and the remove then fails busy, as dmsetup's does; `--deferred` marks
    /// it to be removed at its last close.
    pub fn remove(&self, name: &str, force: bool, deferred: bool) -> Result<(), ControlError> {
        let dev = self.get(name)?;
        let _c = crate::sync::lock(&dev.control);
        if dev.holders.load(Ordering::SeqCst) > 0 {
            if deferred {
                // as the kernel: marked, removed when its last user goes, and success
                dev.deferred_remove.store(true, Ordering::SeqCst);
                self.deferred.store(true, Ordering::SeqCst);
                return Ok(());
            }
            let users: Vec<String> = self
                .list()
                .into_iter()
                .filter(|d| !Arc::ptr_eq(d, &dev) && table_uses(d, &dev))
                .map(|d| d.name())
                .collect();
            return Err(dev_busy(
                name,
                format!(
                    "Device or resource busy: used by the table of {}",
                    users.join(", ")
                ),
            ));
        }
        if let Some(b) = dev.block_device() {
            return Err(dev_busy(
                name,
                format!("Device or resource busy: attached as {b} (dmkit detach {name} first)"),
            ));
        }
        let opens = dev.settled_open_count();
        if opens > 0 && deferred {
            dev.deferred_remove.store(true, Ordering::SeqCst);
            self.deferred.store(true, Ordering::SeqCst);
            // The last close may have come meanwhile.
            if dev.open_count.load(Ordering::SeqCst) > 0 {
                return Ok(());
            }
        } else if opens > 0 {
            let done = if force {
                self.replace_with_error(&dev);
                "; --force replaced its table with an error target, so its I/O fails until it is closed and removed"
            } else {
                ""
            };
            return Err(dev_busy(
                name,
                format!("Device or resource busy: open count {opens}{done}"),
            ));
        }
        self.drop_device(&dev);
        Ok(())
    }

    /// Remove the devices marked for deferred removal that nothing holds or
    /// opens any more (after a remove or a table swap let go of them).
    pub fn reap_deferred(&self) {
        // cleared before the scan: a device marked meanwhile sets it again
        if !self.deferred.swap(false, Ordering::SeqCst) {
            return;
        }
        loop {
            let ready: Vec<Arc<Device>> = self
                .list()
                .into_iter()
                .filter(|d| d.deferred_remove.load(Ordering::SeqCst))
                .collect();
            let before = self.devices().len();
            for d in &ready {
                self.closed(d);
            }
            // a removal may free the device under it
            if self.devices().len() == before {
                if ready.iter().any(|d| !d.removed.load(Ordering::SeqCst)) {
                    // still held or open: looked for again next time
                    self.deferred.store(true, Ordering::SeqCst);
                }
                return;
            }
        }
    }

    /// `dmsetup remove_all [--force] [--deferred]`: remove every device, the
    /// devices that use others first; the ones that cannot go are named.
    pub fn remove_all(&self, force: bool, deferred: bool) -> Result<(), ControlError> {
        let mut errors: Vec<String>;
        loop {
            errors = Vec::new();
            let before = self.devices().len();
            for d in self.list() {
                if d.holders.load(Ordering::SeqCst) > 0 && !deferred {
                    continue; // its users go first
                }
                if let Err(e) = self.remove(&d.name(), force, deferred) {
                    errors.push(e.to_string());
                }
            }
            self.reap_deferred();
            if self.devices().len() == before {
                break;
            }
        }
        for d in self.list() {
            if d.holders.load(Ordering::SeqCst) > 0 && !d.deferred_remove.load(Ordering::SeqCst) {
                errors.push(
                    dev_busy(
                        &d.name(),
                        "Device or resource busy: used by another device's table",
                    )
                    .to_string(),
                );
            }
        }
        errors.sort();
        errors.dedup();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(ControlError::Usage(errors.join("\n")))
        }
    }

    /// Load a table of one `error` target of the same size and resume it, as
    /// `dmsetup remove --force` does before it tries the remove.
    fn replace_with_error(&self, dev: &Arc<Device>) {
        let size = dev.size_sectors();
        if size == 0 {
            return;
        }
        let t = Table::new(vec![TableEntry {
            start: 0,
            len: size,
            target: Box::new(super::error::Error),
        }]);
        *dev.inactive.lock().unpoisoned() = Some(Arc::new(t));
        if let Err(e) = resume_locked(dev) {
            tracing::warn!("{}: resuming the error table: {e}", dev.name());
        }
        dev.event_nr.fetch_add(1, Ordering::Relaxed);
    }

    /// An NBD client let go of `dev`: a deferred remove happens at the last close.
    pub fn closed(&self, dev: &Arc<Device>) {
        if dev.open_count.load(Ordering::SeqCst) > 0 || !dev.deferred_remove.load(Ordering::SeqCst) {
            return;
        }
        let _c = crate::sync::lock(&dev.control);
        let still_ours = self
            .devices()
            .get(&dev.name())
            .is_some_and(|d| Arc::ptr_eq(d, dev));
        if still_ours
            && dev.open_count.load(Ordering::SeqCst) == 0
            && dev.holders.load(Ordering::SeqCst) == 0
            && !dev.removed.load(Ordering::SeqCst)
        {
            self.drop_device(dev);
        }
    }

    /// Take `dev` out of service and out of the registry (its control lock held).
    fn drop_device(&self, dev: &Arc<Device>) {
        dev.removed.store(true, Ordering::SeqCst);
        dev.suspend_and_drain();
        let _ = dev.flush_sync();
        dev.live.store(None);
        dev.inactive.lock().unpoisoned().take();
        let mut devs = self.devices();
        let name = dev.name();
        let _t = self.touch(&name);
        if devs.get(&name).is_some_and(|d| Arc::ptr_eq(d, dev)) {
            devs.remove(&name);
        }
        drop(devs);
        if let Some(u) = dev.uuid() {
            let mut uuids = self.uuids.lock().unpoisoned();
            if uuids.get(&u).is_some_and(|w| w.as_ptr() == Arc::as_ptr(dev)) {
                uuids.remove(&u);
            }
        }
        self.give_minor(dev.minor);
    }

    pub fn message(&self, name: &str, sector: u64, words: &[String]) -> Result<String, ControlError> {
        let _t = self.touch(name);
        let dev = self.get(name)?;
        // dmsetup joins its arguments and the kernel splits them on white space, so
        // `"create_thin 2"` as one argument is two words.
        let words: Vec<String> = words
            .iter()
            .flat_map(|w| w.split_whitespace())
            .map(str::to_string)
            .collect();
        let words = words.as_slice();
        if words.is_empty() {
            return Err(dev_err(name, "message: message text required"));
        }
        if words.first().is_some_and(|w| w == "__panic") && crate::panics::test_panics_enabled() {
            // tests of crate::panics: the device's next request panics where it
            // is mapped, or (`__panic control`) this control request does
            if words.get(1).is_some_and(|w| w == "control") {
                panic!("{name}: the panic asked for by `__panic control`");
            }
            dev.arm_panic();
            return Ok(String::new());
        }
        if let Some(w) = words.first().filter(|w| w.starts_with('@')) {
            if w.eq_ignore_ascii_case("@cancel_deferred_remove") && words.len() == 1 {
                // Succeeds whether or not a remove was pending, as the kernel's.
                dev.deferred_remove.store(false, Ordering::SeqCst);
                return Ok(String::new());
            }
            let size = dev.live.load().as_ref().map_or(0, |t| t.size);
            if let Some(r) = dev.stats.message(words, size) {
                return r.map_err(|e| refused_by(name, e));
            }
            return Err(dev_err(
                name,
                format!("message '{w}': not supported by dmkit's core"),
            ));
        }
        let Some(t) = dev.live.load_full() else {
            return Err(dev_err(name, "message: device has no live table"));
        };
        if sector >= t.size {
            return Err(dev_err(
                name,
                format!(
                    "message: sector {sector} is beyond the end of the device ({} sectors)",
                    t.size
                ),
            ));
        }
        let e = &t.entries[t.entry_at(sector)];
        e.target.message(words).map_err(|why| {
            refused_by(
                name,
                why.context(format_args!("message '{}' refused", message_verb(words))),
            )
        })
    }

    fn build_table(
        &self,
        dev: &Arc<Device>,
        text: &str,
        cwd: Option<&Path>,
        read_only: bool,
    ) -> Result<Table, ControlError> {
        let lines = parse_table(text)?;
        if let Some(c) = cwd.filter(|c| !c.is_absolute()) {
            return Err(dev_err(
                &dev.name(),
                format!("the caller's directory '{}' is not absolute", c.display()),
            ));
        }
        let resolver = TableResolver {
            reg: self,
            dev,
            read_only,
            cwd,
            size_checks: Default::default(),
        };
        let mut entries = Vec::with_capacity(lines.len());
        for l in &lines {
            let target = self
                .construct(&l.target_type, &l.args, l.len, &resolver)
                .map_err(|e| {
                    TableError::refused(l.line_no, e.errno(), format!("{}: {}", l.target_type, e.what()))
                })?;
            entries.push(TableEntry {
                start: l.start,
                len: l.len,
                target,
            });
        }
        let mut table = Table::new(entries);
        table.read_only = read_only;
        table.size_checks = resolver.size_checks.take();
        let lbs = u64::from(table.logical_block_size / 512);
        for (e, l) in table.entries.iter().zip(&lines) {
            if lbs > 1 && (e.start % lbs != 0 || e.len % lbs != 0) {
                return Err(TableError::line(
                    l.line_no,
                    format!(
                        "target not aligned to the logical block size ({} bytes)",
                        table.logical_block_size
                    ),
                )
                .into());
            }
        }
        Ok(table)
    }

    /// The target type named `name`, if tables may use it.
    pub fn target_type(&self, name: &str) -> Option<&'static TargetType> {
        self.types.iter().find(|t| t.name == name)
    }

    /// Every target type tables may use, in `dmsetup targets` order.
    pub fn target_types(&self) -> &'static [TargetType] {
        self.types
    }

    /// A target of type `name` from its arguments; errors name the field.
    fn construct(
        &self,
        name: &str,
        args: &[String],
        len: u64,
        r: &dyn Resolver,
    ) -> Result<Box<dyn super::Target>, TargetError> {
        match self.target_type(name) {
            Some(t) => (t.new)(args, len, r),
            None => Err(format!("unknown target type '{name}'").into()),
        }
    }

    /// Open a backing file, or share the one already open for the same file. The
    /// file is held exclusively while any table names it (`io::hold`), read-only
    /// or not, as the kernel's dm_get_device claims.
    fn open_file(&self, p: &Path, read_only: bool) -> Result<DevRef, TargetError> {
        let hold = crate::io::hold::hold(p).map_err(|e| match e {
            crate::io::hold::HoldError::Io { err, .. } => err.to_string(),
            busy => busy.to_string(),
        })?;
        let (a, b) = hold.identity;
        self.shared((a, b, read_only), || {
            let mut f = BackingFile::open(p, read_only, self.config.direct_io).map_err(|e| e.to_string())?;
            f.hold = Some(hold);
            Ok(match &self.config.sim {
                Some(d) if d.knows(f.identity) => f.simulated(d.clone()),
                _ => f,
            })
        })
    }

    /// The device whose table (live or inactive) holds the file at `path`, the
    /// first in creation order (`dmkit holder`, what a refused tool names).
    pub fn holder(&self, path: &Path) -> Option<String> {
        let id = crate::io::hold::identity(path).ok()?;
        self.creation_order().into_iter().find_map(|d| {
            let live = d.live.load_full();
            let inactive = d.inactive.lock().unpoisoned().clone();
            let holds = live.iter().chain(inactive.iter()).any(|t| {
                t.entries.iter().any(|e| {
                    e.target
                        .held_devices()
                        .iter()
                        .any(|r| matches!(r, DevRef::File(f) if !f.is_rbd() && f.identity == id))
                })
            });
            holds.then(|| d.name())
        })
    }

    /// Open an RBD image, or share the one already open: an image is opened
    /// (and its exclusive lock taken) once per daemon.
    fn open_rbd(&self, spec: &crate::io::rbd::RbdSpec, read_only: bool) -> Result<DevRef, TargetError> {
        let (a, b) = BackingFile::rbd_identity(spec);
        self.shared((a, b, read_only), || {
            BackingFile::open_rbd(spec, read_only).map_err(TargetError::from)
        })
    }

    /// The backing file open under `key`, or a new one from `open`.
    fn shared(
        &self,
        key: (u64, u64, bool),
        open: impl FnOnce() -> Result<BackingFile, TargetError>,
    ) -> Result<DevRef, TargetError> {
        crate::io::shared(&self.files, key, open).map(DevRef::File)
    }

    /// The device whose uuid is `uuid`, from the uuid index (checked against
    /// the device, which the index may have outlived).
    pub fn by_uuid(&self, uuid: &str) -> Option<Arc<Device>> {
        let d = self
            .uuids
            .lock()
            .unpoisoned()
            .get(uuid)
            .and_then(std::sync::Weak::upgrade)?;
        let listed = self.devices().get(&d.name()).is_some_and(|x| Arc::ptr_eq(x, &d));
        (listed && d.uuid().as_deref() == Some(uuid)).then_some(d)
    }

    /// The device with minor number `minor`.
    pub fn by_minor(&self, minor: u32) -> Option<Arc<Device>> {
        self.devices().values().find(|d| d.minor == minor).cloned()
    }
}

/// The body of `resume`, with `dev`'s control lock held: swap in the inactive table
/// (suspending first), then let queued I/O go.
/// Resume `dev`: its targets' preresume first (a refusal leaves the device
/// suspended with the new table still inactive, as the kernel's failed resume
/// does), then the table swap, then their resume.
fn resume_locked(dev: &Device) -> Result<(), TargetError> {
    let next = dev.inactive.lock().unpoisoned().take();
    let coming = next.clone().or_else(|| dev.live.load_full());
    if let Some(Err(why)) = coming.as_ref().map(|t| t.preresume()) {
        if let Some(n) = next {
            *dev.inactive.lock().unpoisoned() = Some(n);
        }
        return Err(why);
    }
    if let Some(t) = next {
        if !dev.suspended.load(Ordering::SeqCst) {
            dev.suspend_and_drain();
            // The old table's writes stay durable across the swap, as the
            // kernel's suspend before a table swap flushes.
            let _ = dev.flush_sync();
        }
        // No request is in flight: the old table (and its files) can go.
        dev.read_only.store(t.read_only, Ordering::SeqCst);
        dev.live.store(Some(t));
    }
    // Held suspended by another device (a suspended pool holds its thins): the
    // targets resume, and I/O goes, when that device lets go (Device::internal_resume).
    if !dev.internally_suspended() {
        if let Some(t) = dev.live.load_full() {
            t.resume();
        }
    }
    dev.suspended.store(false, Ordering::SeqCst);
    Ok(())
}

/// Nodes `0..deps.len()` in an order that puts each after the nodes it depends
/// on (`deps[i]`), otherwise in index order: depth-first, iterative (a deep
/// stack of devices must not overflow the thread's stack). A cycle, which
/// tables cannot build, would only be cut.
pub fn deps_first(deps: &[Vec<usize>]) -> Vec<usize> {
    let mut state = vec![0u8; deps.len()]; // 0 new, 1 on the path, 2 placed
    let mut order = Vec::with_capacity(deps.len());
    for root in 0..deps.len() {
        let mut stack = vec![(root, 0usize)];
        while let Some(&mut (v, ref mut next)) = stack.last_mut() {
            if *next == 0 {
                if state[v] != 0 {
                    stack.pop();
                    continue;
                }
                state[v] = 1;
            }
            match deps[v].get(*next) {
                Some(&w) => {
                    *next += 1;
                    if state[w] == 0 {
                        stack.push((w, 0));
                    }
                }
                None => {
                    state[v] = 2;
                    order.push(v);
                    stack.pop();
                }
            }
        }
    }
    order
}

/// Whether `d`'s live or inactive table refers to `target` (directly or through
/// stacked devices).
fn table_uses(d: &Device, target: &Arc<Device>) -> bool {
    fn walk(t: &Table, target: &Arc<Device>, depth: u32) -> bool {
        depth < 32
            && t.entries.iter().any(|e| {
                e.target.devices().into_iter().any(|r| match r {
                    DevRef::Dm(h) => Arc::ptr_eq(&h.0, target) || refs(&h.0, target, depth + 1),
                    DevRef::File(_) => false,
                })
            })
    }
    fn refs(d: &Device, target: &Arc<Device>, depth: u32) -> bool {
        let live = d.live.load_full();
        let inactive = d.inactive.lock().unpoisoned().clone();
        live.iter().chain(inactive.iter()).any(|t| walk(t, target, depth))
    }
    refs(d, target, 0)
}

/// The node of block device `ma:mi`: udev's /dev/block link, else the name
/// the kernel gives it (/sys/dev/block/MA:MI/uevent), where no udev runs.
fn block_node(ma: u32, mi: u32) -> std::path::PathBuf {
    let link = std::path::PathBuf::from(format!("/dev/block/{ma}:{mi}"));
    if link.exists() {
        return link;
    }
    std::fs::read_to_string(format!("/sys/dev/block/{ma}:{mi}/uevent"))
        .ok()
        .and_then(|u| {
            u.lines()
                .find_map(|l| l.strip_prefix("DEVNAME=").map(|n| Path::new("/dev").join(n)))
        })
        .unwrap_or(link)
}

struct TableResolver<'a> {
    reg: &'a Registry,
    dev: &'a Arc<Device>,
    read_only: bool,
    /// The caller's directory, for relative paths (None: the daemon's).
    cwd: Option<&'a Path>,
    /// What the table needs of other dmkit devices, checked at its resume.
    size_checks: std::cell::RefCell<Vec<(Arc<Device>, String, u64)>>,
}

/// `name` as an absolute path: relative ones from `cwd` (else the daemon's
/// directory), `.` components dropped.
fn absolute(name: &str, cwd: Option<&Path>) -> std::path::PathBuf {
    let p = Path::new(name);
    if p.is_absolute() {
        return p.to_path_buf();
    }
    let base = match cwd {
        Some(c) => c.to_path_buf(),
        None => std::env::current_dir().unwrap_or_else(|_| "/".into()),
    };
    base.join(p)
        .components()
        .filter(|c| !matches!(c, std::path::Component::CurDir))
        .collect()
}

impl Resolver for TableResolver<'_> {
    fn size_check(&self, dev: &Arc<Device>, name: &str, end: u64) {
        self.size_checks
            .borrow_mut()
            .push((dev.clone(), name.to_string(), end));
    }
    fn device(&self) -> &Arc<Device> {
        self.dev
    }
    fn config(&self) -> &Config {
        &self.reg.config
    }
    fn shared(&self) -> &Shared {
        &self.reg.shared
    }
    fn open(&self, name: &str) -> Result<DevRef, TargetError> {
        if let Some(spec) = crate::io::rbd::RbdSpec::parse(name) {
            return self.reg.open_rbd(&spec?, self.read_only);
        }
        let dm = if let Some(n) = name.strip_prefix("/dev/mapper/") {
            Some(
                self.reg
                    .get(n)
                    .map_err(|_| format!("no dmkit device named '{n}'"))?,
            )
        } else if let Some((ma, mi)) = name.split_once(':') {
            let (ma, mi) = (
                ma.parse::<u32>().map_err(|_| format!("invalid major '{ma}'"))?,
                mi.parse::<u32>().map_err(|_| format!("invalid minor '{mi}'"))?,
            );
            if ma == DM_MAJOR {
                Some(
                    self.reg
                        .by_minor(mi)
                        .ok_or_else(|| format!("no dmkit device {ma}:{mi}"))?,
                )
            } else {
                return self.reg.open_file(&block_node(ma, mi), self.read_only);
            }
        } else {
            None
        };
        match dm {
            Some(d) => {
                if Arc::ptr_eq(&d, self.dev) || table_uses(&d, self.dev) {
                    return Err("a device cannot map onto itself (the tables would form a cycle)".into());
                }
                Ok(DevRef::Dm(DmHold::new(d)))
            }
            None => self.reg.open_file(&absolute(name, self.cwd), self.read_only),
        }
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uuid_names_one_device_until_it_is_removed() {
        let r = Registry::new(Config::default(), &[crate::mapper::error::TYPE]);
        r.create("a", Some("0 8 error"), false, Some("U-1".into()))
            .expect("a");
        let e = r.create("b", Some("0 8 error"), false, Some("U-1".into()));
        assert!(e.is_err_and(|e| e.to_string().contains("in use by device 'a'")));
        r.rename("a", "c").expect("rename");
        let e = r.create("b", Some("0 8 error"), false, Some("U-1".into()));
        assert!(e.is_err_and(|e| e.to_string().contains("in use by device 'c'")));
        r.create("b", Some("0 8 error"), false, None).expect("b");
        let e = r.set_uuid("b", "U-1");
        assert!(e.is_err());
        r.remove("c", false, false).expect("remove");
        r.set_uuid("b", "U-1").expect("free once c is gone");
        assert_eq!(r.get("b").expect("b").minor, 1, "b kept its minor");
        r.create("d", Some("0 8 error"), false, None).expect("d");
        assert_eq!(
            r.get("d").expect("d").minor,
            2,
            "a removed device's minor is not given again"
        );
    }
}
