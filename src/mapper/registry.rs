//! The set of mapped devices and the dmsetup operations on them.

use super::{Device, Table, TableEntry, DM_MAJOR};
use crate::io::BackingFile;
use crate::table::{parse_table, TableError};
use crate::targets::{self, DevRef, DmHold, Resolver};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ControlError {
    #[error("{0}: No such device")]
    NoDevice(String),
    #[error("{0}: device already exists")]
    Exists(String),
    #[error("{0}")]
    Table(#[from] TableError),
    #[error("{name}: {what}")]
    Device { name: String, what: String },
}

fn dev_err(name: &str, what: impl Into<String>) -> ControlError {
    ControlError::Device {
        name: name.to_string(),
        what: what.into(),
    }
}

/// Options fixed for the daemon's life.
#[derive(Clone, Debug)]
pub struct Config {
    /// Open backing files with O_DIRECT where the file system allows it.
    pub direct_io: bool,
}

impl Default for Config {
    fn default() -> Config {
        Config { direct_io: true }
    }
}

/// (st_dev, st_ino) of a file or (0, rdev) of a block device, and read-only.
type FileKey = (u64, u64, bool);

pub struct Registry {
    devices: Mutex<BTreeMap<String, Arc<Device>>>,
    /// Open backing files by (st_dev, st_ino or rdev, read-only): every table line
    /// naming a file shares one open file, so a file is one set of descriptors and
    /// flushes can be sent to it once.
    files: Mutex<Vec<(FileKey, std::sync::Weak<BackingFile>)>>,
    next_minor: Mutex<u32>,
    pub config: Config,
}

impl Registry {
    pub fn new(config: Config) -> Registry {
        Registry {
            devices: Mutex::new(BTreeMap::new()),
            files: Mutex::new(Vec::new()),
            next_minor: Mutex::new(0),
            config,
        }
    }

    fn devices(&self) -> MutexGuard<'_, BTreeMap<String, Arc<Device>>> {
        self.devices.lock().unwrap_or_else(|p| p.into_inner())
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

    /// `dmsetup create NAME --table ...`: create, load, resume.
    pub fn create(
        &self,
        name: &str,
        table: &str,
        read_only: bool,
        uuid: Option<String>,
    ) -> Result<(), ControlError> {
        if name.is_empty() || name.len() > 127 || name.contains('/') || name == "." || name == ".." {
            return Err(dev_err(name, "invalid device name"));
        }
        if self.devices().contains_key(name) {
            return Err(ControlError::Exists(name.to_string()));
        }
        let minor = {
            let mut m = self.next_minor.lock().unwrap_or_else(|p| p.into_inner());
            *m += 1;
            *m - 1
        };
        let dev = Arc::new(Device::new(name.to_string(), minor, uuid, read_only));
        // Build the table before the device is visible, so a failed create leaves nothing.
        let t = self.build_table(&dev, table)?;
        dev.live.store(Some(Arc::new(t)));
        let mut devs = self.devices();
        if devs.contains_key(name) {
            return Err(ControlError::Exists(name.to_string()));
        }
        devs.insert(name.to_string(), dev);
        Ok(())
    }

    /// `dmsetup load`: construct the table and keep it as the inactive one.
    pub fn load(&self, name: &str, table: &str) -> Result<(), ControlError> {
        let dev = self.get(name)?;
        let _c = dev.control.lock().unwrap_or_else(|p| p.into_inner());
        let t = self.build_table(&dev, table)?;
        *dev.inactive.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(t));
        Ok(())
    }

    /// `dmsetup clear`: drop the inactive table.
    pub fn clear(&self, name: &str) -> Result<(), ControlError> {
        let dev = self.get(name)?;
        dev.inactive.lock().unwrap_or_else(|p| p.into_inner()).take();
        Ok(())
    }

    pub fn suspend(&self, name: &str, noflush: bool) -> Result<(), ControlError> {
        let dev = self.get(name)?;
        let _c = dev.control.lock().unwrap_or_else(|p| p.into_inner());
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
        let dev = self.get(name)?;
        let _c = dev.control.lock().unwrap_or_else(|p| p.into_inner());
        let next = dev.inactive.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = next {
            if !dev.suspended.load(Ordering::SeqCst) {
                dev.suspend_and_drain();
                // The old table's writes stay durable across the swap, as the
                // kernel's suspend before a table swap flushes.
                let _ = dev.flush_sync();
            }
            // No request is in flight: the old table (and its files) can go.
            dev.live.store(Some(t));
        }
        if let Some(t) = dev.live.load_full() {
            for e in &t.entries {
                e.target.resume();
            }
        }
        dev.suspended.store(false, Ordering::SeqCst);
        Ok(())
    }

    pub fn remove(&self, name: &str, force: bool) -> Result<(), ControlError> {
        let dev = self.get(name)?;
        let _c = dev.control.lock().unwrap_or_else(|p| p.into_inner());
        if dev.holders.load(Ordering::SeqCst) > 0 {
            let users: Vec<String> = self
                .list()
                .into_iter()
                .filter(|d| !Arc::ptr_eq(d, &dev) && table_uses(d, &dev))
                .map(|d| d.name.clone())
                .collect();
            return Err(dev_err(
                name,
                format!(
                    "Device or resource busy: used by the table of {}",
                    users.join(", ")
                ),
            ));
        }
        let opens = dev.open_count.load(Ordering::SeqCst);
        if opens > 0 && !force {
            return Err(dev_err(
                name,
                format!("Device or resource busy: open count {opens}"),
            ));
        }
        dev.removed.store(true, Ordering::SeqCst);
        dev.suspend_and_drain();
        let _ = dev.flush_sync();
        dev.live.store(None);
        dev.inactive.lock().unwrap_or_else(|p| p.into_inner()).take();
        self.devices().remove(name);
        Ok(())
    }

    pub fn message(&self, name: &str, sector: u64, words: &[String]) -> Result<String, ControlError> {
        let dev = self.get(name)?;
        if let Some(w) = words.first().filter(|w| w.starts_with('@')) {
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
        e.target
            .message(words)
            .map_err(|why| dev_err(name, format!("message '{}' refused: {why}", words.join(" "))))
    }

    fn build_table(&self, dev: &Arc<Device>, text: &str) -> Result<Table, ControlError> {
        let lines = parse_table(text)?;
        let resolver = TableResolver {
            reg: self,
            dev,
            read_only: dev.read_only,
        };
        let mut entries = Vec::with_capacity(lines.len());
        for l in &lines {
            let target = targets::construct(&l.target_type, &l.args, l.len, &resolver)
                .map_err(|what| TableError::line(l.line_no, format!("{}: {what}", l.target_type)))?;
            entries.push(TableEntry {
                start: l.start,
                len: l.len,
                target,
            });
        }
        let table = Table::new(entries);
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

    // ---- dmsetup output ----

    /// The named device, or every device; None when there are none.
    fn selected(&self, name: Option<&str>) -> Result<Option<Vec<Arc<Device>>>, ControlError> {
        let devs = match name {
            Some(n) => vec![self.get(n)?],
            None => self.list(),
        };
        Ok((!devs.is_empty()).then_some(devs))
    }

    /// `dmsetup table|status [NAME]`: `<start> <len> <type> <params>` per target.
    pub fn table_lines(&self, name: Option<&str>, status: bool) -> Result<String, ControlError> {
        let Some(devs) = self.selected(name)? else {
            return Ok("No devices found\n".into());
        };
        let mut out = String::new();
        for d in devs {
            let prefix = if name.is_none() {
                format!("{}: ", d.name)
            } else {
                String::new()
            };
            let Some(t) = d.live.load_full() else {
                if name.is_none() {
                    let _ = writeln!(out, "{prefix}");
                }
                continue;
            };
            for e in &t.entries {
                let params = if status {
                    e.target.status_params()
                } else {
                    e.target.table_params()
                };
                let _ = writeln!(
                    out,
                    "{prefix}{} {} {} {params}",
                    e.start,
                    e.len,
                    e.target.type_name()
                );
            }
        }
        Ok(out)
    }

    /// `dmsetup info [NAME]` in the long form.
    pub fn info(&self, name: Option<&str>) -> Result<String, ControlError> {
        let Some(devs) = self.selected(name)? else {
            return Ok("No devices found\n".into());
        };
        let mut out = String::new();
        for d in devs {
            let live = d.live.load().is_some();
            let inactive = d.inactive.lock().unwrap_or_else(|p| p.into_inner()).is_some();
            let mut state = if d.suspended.load(Ordering::SeqCst) {
                "SUSPENDED"
            } else {
                "ACTIVE"
            }
            .to_string();
            if d.read_only {
                state.push_str(" (READ-ONLY)");
            }
            let tables = match (live, inactive) {
                (false, false) => "None",
                (true, false) => "LIVE",
                (false, true) => "INACTIVE",
                (true, true) => "LIVE & INACTIVE",
            };
            let targets = d.live.load().as_ref().map_or(0, |t| t.entries.len());
            let opens = d.open_count.load(Ordering::SeqCst) + d.holders.load(Ordering::SeqCst);
            let row = |out: &mut String, k: &str, v: String| {
                let _ = writeln!(out, "{:<19}{v}", format!("{k}:"));
            };
            row(&mut out, "Name", d.name.clone());
            row(&mut out, "State", state);
            row(&mut out, "Read Ahead", "256".into());
            row(&mut out, "Tables present", tables.into());
            row(&mut out, "Open count", opens.to_string());
            row(&mut out, "Event number", d.events().to_string());
            row(&mut out, "Major, minor", format!("{DM_MAJOR}, {}", d.minor));
            row(&mut out, "Number of targets", targets.to_string());
            if let Some(u) = &d.uuid {
                let _ = writeln!(out, "UUID: {u}");
            }
            out.push('\n');
        }
        Ok(out)
    }

    /// `dmsetup ls`.
    pub fn ls(&self) -> String {
        let devs = self.list();
        if devs.is_empty() {
            return "No devices found\n".into();
        }
        devs.iter()
            .map(|d| format!("{}\t({DM_MAJOR}:{})\n", d.name, d.minor))
            .collect()
    }

    /// `dmkit stats NAME`: the backing files under a device (through stacked
    /// devices) and the flushes each has received.
    pub fn stats(&self, name: &str) -> Result<String, ControlError> {
        let dev = self.get(name)?;
        let mut files = Vec::new();
        super::collect_files(&dev, &mut files, 0);
        Ok(files
            .iter()
            .map(|f| {
                format!(
                    "{} flushes={}\n",
                    f.path.display(),
                    f.flushes.load(Ordering::Relaxed)
                )
            })
            .collect())
    }

    /// `dmsetup targets`.
    pub fn targets() -> String {
        targets::TARGET_TYPES
            .iter()
            .map(|(n, v)| format!("{n:<16} v{}.{}.{}\n", v[0], v[1], v[2]))
            .collect()
    }

    /// Open a backing file, or share the one already open for the same file.
    fn open_file(&self, p: &Path, read_only: bool) -> Result<DevRef, String> {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let m = std::fs::metadata(p).map_err(|e| e.to_string())?;
        let key = if m.file_type().is_block_device() {
            (0, m.rdev(), read_only)
        } else {
            (m.dev(), m.ino(), read_only)
        };
        let mut files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        files.retain(|(_, w)| w.strong_count() > 0);
        if let Some(f) = files
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|(_, w)| w.upgrade())
        {
            return Ok(DevRef::File(f));
        }
        let f = Arc::new(BackingFile::open(p, read_only, self.config.direct_io).map_err(|e| e.to_string())?);
        files.push((key, Arc::downgrade(&f)));
        Ok(DevRef::File(f))
    }

    fn by_minor(&self, minor: u32) -> Option<Arc<Device>> {
        self.devices().values().find(|d| d.minor == minor).cloned()
    }
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
        let inactive = d.inactive.lock().unwrap_or_else(|p| p.into_inner()).clone();
        live.iter().chain(inactive.iter()).any(|t| walk(t, target, depth))
    }
    refs(d, target, 0)
}

struct TableResolver<'a> {
    reg: &'a Registry,
    dev: &'a Arc<Device>,
    read_only: bool,
}

impl Resolver for TableResolver<'_> {
    fn open(&self, name: &str) -> Result<DevRef, String> {
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
                let p = format!("/dev/block/{ma}:{mi}");
                return self.reg.open_file(Path::new(&p), self.read_only);
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
            None => self.reg.open_file(Path::new(name), self.read_only),
        }
    }
}
