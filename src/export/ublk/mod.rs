//! The ublk frontend: a dmkit device as a kernel block device, /dev/ublkbN (and
//! /dev/mapper/NAME pointing at it), served through the kernel's ublk driver.
//!
//! `attach` adds a ublk device whose parameters are the stack's composed limits,
//! starts one queue thread per core (`queue`), and starts the device. The device
//! is added with USER_RECOVERY and USER_RECOVERY_REISSUE where the driver has
//! them: when the daemon dies, the driver holds the device's requests (a mounted
//! filesystem sees a pause), and `attach` with the old id in a new daemon takes
//! the same /dev/ublkbN over, the requests the old daemon had taken reissued.
//!
//! Written on the `io-uring` crate the engine already uses rather than on
//! libublk: the driver's interface is a dozen structs and commands
//! (`sys`), libublk brings bindgen and libclang into the build and its own
//! executor, and dmkit's queues must be its engines, whose rings carry the
//! backing I/O (and librbd's completions) beside the driver's commands.

use crate::sync::Unpoison;
pub mod ctrl;
pub mod queue;
pub mod sys;

/// Whether this host can make ublk block devices: Err with what to do when the
/// control node cannot be opened (no driver, no permission).
pub fn available() -> Result<(), String> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(sys::CONTROL)
        .map(drop)
        .map_err(|e| ctrl::open_error(&e))
}

use crate::mapper::Device;
use ctrl::Control;
use queue::{QueueCtl, QueueSpec};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The run directory's folder mapping block device numbers to dmkit's
/// (see [`Frontend::set_map_dir`]).
pub const MAP_DIR: &str = "block-numbers";

/// Requests each queue holds at once.
const QUEUE_DEPTH: u16 = 128;
/// Largest request (the device's max_sectors is this).
const MAX_IO: u32 = 512 << 10;
/// How long a new daemon waits for the driver to finish quiescing a device the
/// old one left (the driver notices a dead server within seconds).
const RECOVERY_WAIT: Duration = Duration::from_secs(30);

struct Attached {
    dev: Arc<Device>,
    id: u32,
    queues: Vec<JoinHandle<()>>,
    ctl: Arc<QueueCtl>,
    cdev: Arc<std::fs::File>,
    /// /dev/mapper/NAME, if we made it.
    link: Option<PathBuf>,
    /// The size and logical block size the block device was started with.
    shape: (u64, u32),
    /// The map entry naming the block device's number (see [`Frontend::set_map_dir`]).
    map_entry: Option<PathBuf>,
}

impl Attached {
    fn block_device(&self) -> String {
        format!("/dev/ublkb{}", self.id)
    }
}

/// The daemon's attached devices.
#[derive(Default)]
pub struct Frontend {
    attached: Mutex<Vec<Attached>>,
    /// One attach at a time (the check that a device is not attached holds
    /// until it is).
    attaching: Mutex<()>,
    /// Attaching is refused (fuzzing the control protocol makes no block devices).
    disabled: bool,
    /// Where each block device's number is mapped to its dmkit device's.
    map_dir: std::sync::OnceLock<PathBuf>,
}

/// How many queues a device gets: one per core, at most 4.
fn nr_queues() -> u16 {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(4) as u16)
}

/// The device parameters the stack under `dev` honours.
fn params(dev: &Device) -> sys::Params {
    let limits = dev.limits();
    let lbs = dev.logical_block_size().max(512);
    let shift = |v: u64| {
        if v.is_power_of_two() {
            v.trailing_zeros() as u8
        } else {
            0
        }
    };
    let mut attrs = sys::ATTR_VOLATILE_CACHE;
    if limits.fua {
        attrs |= sys::ATTR_FUA;
    }
    if limits.read_only || dev.read_only() {
        attrs |= sys::ATTR_READ_ONLY;
    }
    let mut p = sys::Params {
        types: sys::PARAM_TYPE_BASIC,
        basic: sys::ParamBasic {
            attrs,
            logical_bs_shift: shift(u64::from(lbs)),
            physical_bs_shift: shift(u64::from(lbs)),
            io_min_shift: shift(limits.io_min.max(u64::from(lbs))),
            io_opt_shift: shift(limits.io_opt),
            max_sectors: MAX_IO >> 9,
            dev_sectors: dev.size_sectors(),
            ..Default::default()
        },
        ..Default::default()
    };
    if limits.discard || limits.write_zeroes {
        p.types |= sys::PARAM_TYPE_DISCARD;
        let gran = limits.io_min.max(u64::from(lbs)).min(u64::from(u32::MAX)) as u32;
        p.discard = sys::ParamDiscard {
            discard_granularity: gran,
            max_discard_sectors: if limits.discard { u32::MAX >> 9 } else { 0 },
            max_write_zeroes_sectors: if limits.write_zeroes { u32::MAX >> 9 } else { 0 },
            max_discard_segments: 1,
            ..Default::default()
        };
    }
    p
}

/// Open /dev/ublkcN, which devtmpfs (or udev) makes just after ADD_DEV.
fn open_cdev(id: u32) -> Result<std::fs::File, String> {
    let path = format!("/dev/ublkc{id}");
    let t = Instant::now();
    loop {
        match std::fs::OpenOptions::new().read(true).write(true).open(&path) {
            Ok(f) => return Ok(f),
            Err(e) if t.elapsed() > Duration::from_secs(5) => return Err(format!("opening {path}: {e}")),
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// Whether process `pid` is alive.
fn alive(pid: i32) -> bool {
    pid > 0 && std::path::Path::new(&format!("/proc/{pid}")).exists()
}

impl Frontend {
    /// A frontend that refuses to attach anything.
    pub fn disabled() -> Frontend {
        Frontend {
            disabled: true,
            ..Frontend::default()
        }
    }

    fn list(&self) -> std::sync::MutexGuard<'_, Vec<Attached>> {
        self.attached.lock().unpoisoned()
    }

    /// The attached devices and their ublk ids.
    pub fn ids(&self) -> Vec<(Arc<Device>, u32)> {
        self.list().iter().map(|a| (a.dev.clone(), a.id)).collect()
    }

    /// Make `dev` a block device, or (with `recover`: the id a previous daemon
    /// had it attached as) take that block device over. The block device's path.
    pub fn attach(&self, dev: &Arc<Device>, recover: Option<u32>) -> Result<String, String> {
        let _one = self.attaching.lock().unpoisoned();
        let name = dev.name();
        if self.disabled {
            return Err(format!("{name}: block devices are disabled here"));
        }
        if let Some(b) = dev.block_device() {
            return Err(format!("{name}: attached already as {b}"));
        }
        if dev.size_sectors() == 0 {
            return Err(format!("{name}: no table loaded (a block device needs a size)"));
        }
        let mut ctl = Control::open()?;
        let features = ctl.features();
        let mut recovered = None;
        if let Some(id) = recover {
            recovered = self
                .take_over(&mut ctl, id)
                .map_err(|e| format!("{name}: /dev/ublkb{id}: {e}"))?;
        }
        let (info, fresh) = match recovered {
            Some(info) => (info, false),
            None => (
                self.add(&mut ctl, dev, features)
                    .map_err(|e| format!("{name}: {e}"))?,
                true,
            ),
        };
        let id = info.dev_id;
        let started = self.start_queues(&mut ctl, dev, &info, fresh).and_then(|a| {
            let r = if fresh {
                ctl.start(id).map_err(|e| format!("starting the device: {e}"))
            } else {
                ctl.end_recovery(id)
                    .map_err(|e| format!("ending the recovery: {e}"))
            };
            match r {
                Ok(()) => Ok(a),
                Err(e) => {
                    // a recovered device stays quiesced rather than failing a
                    // mounted filesystem's requests
                    if fresh {
                        Self::stop(&mut ctl, a);
                    }
                    Err(e)
                }
            }
        });
        let mut a = match started {
            Ok(a) => a,
            Err(e) => {
                if fresh {
                    let _ = ctl.delete(id);
                }
                return Err(format!("{name}: {e}"));
            }
        };
        a.link = link(&name, id, dev.minor);
        a.map_entry = self.map(dev, id);
        tracing::info!(
            "{name}: {} as {} ({} queues of {}; driver features: {})",
            if fresh { "attached" } else { "recovered" },
            a.block_device(),
            info.nr_hw_queues,
            info.queue_depth,
            sys::feature_names(features).join(",")
        );
        let path = a.block_device();
        dev.set_block_device(Some(path.clone()));
        self.list().push(a);
        Ok(path)
    }

    /// ADD_DEV and SET_PARAMS for `dev`.
    fn add(&self, ctl: &mut Control, dev: &Device, features: u64) -> Result<sys::DevInfo, String> {
        // Before GET_FEATURES (Linux 6.5) the driver had recovery but not the
        // ioctl encoding; dmkit needs the encoding, so 6.5 is the floor.
        let mut flags = sys::F_CMD_IOCTL_ENCODE;
        flags |= features & (sys::F_USER_RECOVERY | sys::F_USER_RECOVERY_REISSUE);
        let mut info = sys::DevInfo {
            nr_hw_queues: nr_queues(),
            queue_depth: QUEUE_DEPTH,
            max_io_buf_bytes: MAX_IO,
            dev_id: u32::MAX,
            flags,
            ..Default::default()
        };
        ctl.add(&mut info).map_err(|e| match e.raw_os_error() {
            Some(libc::EPERM) | Some(libc::EACCES) => {
                "the ublk driver refused to add a device: permission denied (run the daemon as root)"
                    .to_string()
            }
            _ => format!("adding a ublk device: {e}"),
        })?;
        let mut p = params(dev);
        if let Err(e) = ctl.set_params(info.dev_id, &mut p) {
            let _ = ctl.delete(info.dev_id);
            return Err(format!("setting the device's parameters: {e}"));
        }
        Ok(info)
    }

    /// Start recovering device `id` left by a daemon that died; None if there is
    /// nothing to take over (then a new device is added).
    fn take_over(&self, ctl: &mut Control, id: u32) -> Result<Option<sys::DevInfo>, String> {
        let t = Instant::now();
        loop {
            let info = match ctl.info(id) {
                Ok(i) => i,
                Err(e) if e.raw_os_error() == Some(libc::ENODEV) => return Ok(None),
                Err(e) => return Err(format!("reading its state: {e}")),
            };
            match info.state {
                sys::S_DEV_LIVE
                    if alive(info.ublksrv_pid) && info.ublksrv_pid != std::process::id() as i32 =>
                {
                    return Err(format!("served by a running process (pid {})", info.ublksrv_pid))
                }
                sys::S_DEV_DEAD => {
                    // never started, or stopped: nothing is mounted on it
                    let _ = ctl.delete(id);
                    return Ok(None);
                }
                _ if info.flags & sys::F_USER_RECOVERY == 0 => {
                    return Err("added without recovery: it cannot be taken over (detach it)".into())
                }
                _ => {}
            }
            match ctl.start_recovery(id) {
                Ok(()) => return Ok(Some(info)),
                // the driver has not finished quiescing it yet
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) && t.elapsed() < RECOVERY_WAIT => {
                    std::thread::sleep(Duration::from_millis(100))
                }
                Err(e) => return Err(format!("starting the recovery: {e}")),
            }
        }
    }

    /// Start the device's queue threads and wait until each has its fetches at
    /// the driver. If one cannot, a new device is stopped (the driver aborts the
    /// others' fetches, so they end); a device being recovered is left quiesced,
    /// its requests held, for another attempt.
    fn start_queues(
        &self,
        ctl: &mut Control,
        dev: &Arc<Device>,
        info: &sys::DevInfo,
        fresh: bool,
    ) -> Result<Attached, String> {
        let cdev = Arc::new(open_cdev(info.dev_id)?);
        let qctl = Arc::new(QueueCtl::new().map_err(|e| format!("an eventfd: {e}"))?);
        let mut a = Attached {
            dev: dev.clone(),
            id: info.dev_id,
            queues: Vec::new(),
            ctl: qctl.clone(),
            cdev: cdev.clone(),
            link: None,
            shape: (dev.size_sectors(), dev.logical_block_size()),
            map_entry: None,
        };
        let mut failed = None;
        for q_id in 0..info.nr_hw_queues {
            let spec = QueueSpec {
                dev: dev.clone(),
                cdev: cdev.clone(),
                q_id,
                depth: info.queue_depth,
                max_io: info.max_io_buf_bytes as usize,
                ctl: qctl.clone(),
            };
            match std::thread::Builder::new()
                .name(format!("ublk{}q{q_id}", info.dev_id))
                .spawn(move || queue::run(spec))
            {
                Ok(h) => a.queues.push(h),
                Err(e) => {
                    failed = Some(format!("starting a queue thread: {e}"));
                    break;
                }
            }
        }
        let r = match failed {
            Some(e) => Err(e),
            None => qctl.wait_ready(a.queues.len()),
        };
        match r {
            Ok(()) => Ok(a),
            Err(e) if fresh => {
                Self::stop(ctl, a);
                Err(e)
            }
            Err(e) => {
                tracing::error!(
                    "/dev/ublkb{}: recovery failed, the device stays quiesced: {e}",
                    info.dev_id
                );
                Err(e)
            }
        }
    }

    /// STOP_DEV, then wait for the queues (the driver aborts their fetches).
    fn stop(ctl: &mut Control, a: Attached) {
        if let Err(e) = ctl.stop(a.id) {
            tracing::warn!("stopping /dev/ublkb{}: {e}", a.id);
        }
        for h in a.queues {
            let _ = h.join();
        }
        drop(a.cdev);
        for l in [a.link, a.map_entry].into_iter().flatten() {
            let _ = std::fs::remove_file(l);
        }
    }

    /// Remove `dev`'s block device. Refused while a filesystem or another
    /// exclusive holder has it.
    pub fn detach(&self, dev: &Arc<Device>) -> Result<(), String> {
        let name = dev.name();
        let mut list = self.list();
        let Some(i) = list.iter().position(|a| Arc::ptr_eq(&a.dev, dev)) else {
            return Err(format!("{name}: not attached"));
        };
        let path = list[i].block_device();
        if crate::io::hold::held(&path) {
            return Err(format!(
                "{name}: {path} is in use (mounted, or held by another device); unmount it first"
            ));
        }
        let mut ctl = Control::open()?;
        let a = list.remove(i);
        drop(list);
        let id = a.id;
        dev.set_block_device(None);
        Self::stop(&mut ctl, a);
        ctl.delete(id)
            .map_err(|e| format!("{name}: deleting {path}: {e}"))?;
        tracing::info!("{name}: detached {path}");
        Ok(())
    }

    /// Fail block device `id`, left by a previous daemon, whose dmkit device
    /// could not be made again: STOP_DEV makes the driver fail the requests it
    /// holds and remove the disk, so a filesystem on it gets errors rather than
    /// waiting for ever; the device is deleted once nothing has it open (the
    /// driver's DEL_DEV waits for the unmount, so on a thread of its own).
    pub fn fail(&self, id: u32) -> Result<(), String> {
        if self.disabled {
            return Err("block devices are disabled here".into());
        }
        let mut ctl = Control::open()?;
        let info = match ctl.info(id) {
            Ok(i) => i,
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => return Ok(()),
            Err(e) => return Err(format!("reading its state: {e}")),
        };
        if info.state == sys::S_DEV_LIVE
            && alive(info.ublksrv_pid)
            && info.ublksrv_pid != std::process::id() as i32
        {
            return Err(format!("served by a running process (pid {})", info.ublksrv_pid));
        }
        ctl.stop(id).map_err(|e| format!("stopping it: {e}"))?;
        tracing::error!("/dev/ublkb{id}: stopped (its device could not be restored); its I/O fails");
        let _ = std::thread::Builder::new()
            .name(format!("ublk{id}-delete"))
            .spawn(move || match ctl.delete(id) {
                Ok(()) => tracing::info!("/dev/ublkb{id}: deleted"),
                Err(e) => tracing::warn!("/dev/ublkb{id}: deleting: {e}"),
            });
        Ok(())
    }

    /// Record, in `dir`, each block device's number as a link to its dmkit
    /// device's: `dir/MAJOR:MINOR -> 511:N` (dmkit's major). The door's library reads it to give
    /// programs the device-mapper number of a node that is the ublk device (as
    /// /dev/mapper/NAME is), so libdevmapper and LVM see one device.
    pub fn set_map_dir(&self, dir: PathBuf) {
        let _ = std::fs::remove_dir_all(&dir);
        if let Err(e) = std::fs::create_dir_all(&dir) {
            tracing::warn!("{}: {e}", dir.display());
        }
        let _ = self.map_dir.set(dir);
    }

    fn map(&self, dev: &Device, id: u32) -> Option<PathBuf> {
        let dir = self.map_dir.get()?;
        let path = format!("/dev/ublkb{id}");
        let rdev = match std::fs::metadata(&path) {
            Ok(m) => std::os::unix::fs::MetadataExt::rdev(&m),
            Err(e) => {
                tracing::warn!("{path}: {e}");
                return None;
            }
        };
        let entry = dir.join(format!("{}:{}", libc::major(rdev), libc::minor(rdev)));
        let _ = std::fs::remove_file(&entry);
        let target = format!("{}:{}", crate::mapper::DM_MAJOR, dev.minor);
        match std::os::unix::fs::symlink(target, &entry) {
            Ok(()) => Some(entry),
            Err(e) => {
                tracing::warn!("{}: {e}", entry.display());
                None
            }
        }
    }

    /// Whether `dev`'s block device is held (mounted, or opened exclusively),
    /// which counts in its open count as the kernel's holders do.
    pub fn held(&self, dev: &Arc<Device>) -> bool {
        let path = match self.list().iter().find(|a| Arc::ptr_eq(&a.dev, dev)) {
            Some(a) => a.block_device(),
            None => return false,
        };
        crate::io::hold::held(&path)
    }

    /// Whether `dev`'s live table no longer fits the block device it is attached
    /// as (its size or logical block size changed at a resume).
    pub fn misfits(&self, dev: &Arc<Device>) -> bool {
        self.list()
            .iter()
            .find(|a| Arc::ptr_eq(&a.dev, dev))
            .is_some_and(|a| a.shape != (dev.size_sectors(), dev.logical_block_size()))
    }

    /// The device was renamed: move its /dev/mapper link.
    pub fn renamed(&self, dev: &Arc<Device>) {
        let mut list = self.list();
        if let Some(a) = list.iter_mut().find(|a| Arc::ptr_eq(&a.dev, dev)) {
            if let Some(l) = a.link.take() {
                let _ = std::fs::remove_file(l);
            }
            a.link = link(&dev.name(), a.id, dev.minor);
        }
    }

    /// The daemon is exiting: let every queue finish what it took and take no
    /// more; the driver keeps the rest for the next daemon (with recovery).
    pub fn pause_all(&self, limit: Duration) {
        for a in self.list().iter() {
            if !a.ctl.pause(a.queues.len(), limit) {
                tracing::warn!("{}: requests still in flight at exit", a.block_device());
            }
        }
    }
}

/// /dev/mapper/NAME -> ../ublkbN, unless something else has that name (a node
/// of the device's own device-mapper number, made by libdevmapper, is replaced).
fn link(name: &str, id: u32, minor: u32) -> Option<PathBuf> {
    let dir = PathBuf::from("/dev/mapper");
    let _ = std::fs::create_dir_all(&dir);
    let l = dir.join(name);
    let target = format!("../ublkb{id}");
    let ours = std::fs::read_link(&l).is_ok_and(|t| t.to_string_lossy().starts_with("../ublkb"))
        || l.symlink_metadata().is_ok_and(|m| {
            use std::os::unix::fs::{FileTypeExt, MetadataExt};
            m.file_type().is_block_device() && m.rdev() == libc::makedev(crate::mapper::DM_MAJOR.get(), minor)
        });
    if ours {
        let _ = std::fs::remove_file(&l);
    } else if l.symlink_metadata().is_ok() {
        tracing::warn!(
            "{}: exists (a kernel device-mapper device?); not linked",
            l.display()
        );
        return None;
    }
    match std::os::unix::fs::symlink(&target, &l) {
        Ok(()) => Some(l),
        Err(e) => {
            tracing::warn!("{}: {e}", l.display());
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mapper::{config::Config, Registry};

    fn device(table: &str, read_only: bool) -> Arc<Device> {
        let reg = Registry::new(Config::default(), crate::targets::types());
        reg.create("d", Some(table), read_only, None).expect("create");
        reg.get("d").expect("device")
    }

    #[test]
    fn parameters_are_the_stacks_limits() {
        // zero takes discards and zeroing: both offered, one segment
        let p = params(&device("0 8192 zero", false));
        assert_eq!(p.types, sys::PARAM_TYPE_BASIC | sys::PARAM_TYPE_DISCARD);
        assert_eq!(p.basic.dev_sectors, 8192);
        assert_eq!((p.basic.logical_bs_shift, p.basic.physical_bs_shift), (9, 9));
        assert_eq!(p.basic.max_sectors, MAX_IO >> 9);
        assert_ne!(
            p.basic.attrs & sys::ATTR_VOLATILE_CACHE,
            0,
            "flushes reach the stack"
        );
        assert_ne!(p.basic.attrs & sys::ATTR_FUA, 0);
        assert_eq!(p.basic.attrs & sys::ATTR_READ_ONLY, 0);
        assert_eq!(p.discard.max_discard_segments, 1);
        assert!(p.discard.max_discard_sectors > 0 && p.discard.max_write_zeroes_sectors > 0);
        assert_eq!(p.discard.discard_granularity, 512);

        // error takes discards but cannot zero: no write-zeroes
        let p = params(&device("0 8192 error", false));
        assert!(p.discard.max_discard_sectors > 0);
        assert_eq!(p.discard.max_write_zeroes_sectors, 0);

        // a read-only device is a read-only disk
        let p = params(&device("0 8192 zero", true));
        assert_ne!(p.basic.attrs & sys::ATTR_READ_ONLY, 0);
    }
}
