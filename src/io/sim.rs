//! A simulated disk under real backing files, for crash trials (`dmkit sim`).
//!
//! A file registered here keeps working as a normal file: every read sees what was
//! last written. Beside it the simulation keeps what a disk with a volatile write
//! cache would have on its media: the bytes as of the last completed flush, plus
//! the writes since, in order. A simulated power loss ([`crash_images`]) keeps a
//! seed-chosen subset of those writes, tearing some at sector boundaries (a disk
//! writes sectors atomically, nothing larger); FUA writes are always kept. It can
//! also fail a chosen read or write with EIO.
//!
//! The simulated disk is a backend chosen by configuration: a registry whose
//! `Config::sim` names a [`SimDisk`] opens every file registered with it as a
//! simulated backing file (`io::backing`), whose operations pass the hooks here:
//! the I/O queue carries them out synchronously, at its next wait, in a
//! seed-chosen order (`Sqe::Sim`); the synchronous paths (dm-io, the metadata
//! device, a sync) call them directly. Nothing else in the process sees it.

use crate::sync::Unpoison;
use std::collections::HashMap;
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};

use super::SECTOR;

/// A simulated disk under some files: what their media holds, the writes not yet
/// flushed, the crash point and the faults (one per crash trial).
pub struct SimDisk {
    state: Mutex<State>,
}

/// A write since the last flush: `data` None is a range zeroed (discard, write-zeroes).
struct Entry {
    offset: u64,
    len: u64,
    data: Option<Vec<u8>>,
    fua: bool,
}

struct Disk {
    path: PathBuf,
    /// The media as of the last completed flush.
    durable: Vec<u8>,
    log: Vec<Entry>,
}

/// Which I/O to fail with EIO: the `nth` read or write (counted from 0 over every
/// registered file) once `armed`.
#[derive(Clone, Copy, Debug)]
pub struct FailPlan {
    pub nth: u64,
    pub reads: bool,
    pub writes: bool,
}

/// Where the power goes, counted over every registered file from the start of
/// the simulation (the counts of a run without a crash, [`counts`], say how
/// many there are to choose from).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrashAt {
    /// Just after the nth write (from 1) is recorded: it is among the writes the
    /// crash keeps, loses or tears.
    Write(u64),
    /// As the nth flush (from 1) issued inside a commit ([`commit_window`]) is
    /// about to take effect: everything the commit wrote before it is still
    /// unflushed (for a metadata commit, the superblock write and the flush after
    /// it when the order is broken).
    CommitFlush(u64),
}

/// Events recorded so far, of the kinds a crash can be placed at.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub writes: u64,
    pub flushes: u64,
    /// Flushes issued while a commit was open.
    pub commit_flushes: u64,
    /// Writes issued while a commit was open.
    pub commit_writes: u64,
}

/// How a crash treats the writes not yet flushed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fates {
    /// Each is kept, lost or torn on its own (kept 1/2, lost 1/4, torn 1/4).
    Independent,
    /// Newest first: the last write to each file is kept and every older one is
    /// lost (1/2), torn (1/4) or kept (1/4), as a disk whose cache writes back
    /// in reverse. The harshest order for code that relies on a missing flush.
    NewestFirst,
    /// Every write is kept: the daemon was killed, the machine's page cache
    /// and disks carry on (`dmkit sim --kill`).
    Kept,
}

#[derive(Default)]
struct State {
    disks: HashMap<(u64, u64), Disk>,
    /// Set by a crash: from then on nothing is recorded (the media is fixed).
    frozen: bool,
    counts: Counts,
    crash_at: Option<CrashAt>,
    /// Commits open now (targets mark them with [`commit_window`]).
    commits_open: u32,
    /// I/Os counted (`ios`) when each write, and each flush inside a commit, came.
    ios_at_write: Vec<u64>,
    ios_at_commit_flush: Vec<u64>,
    ios: u64,
    fail: Option<FailPlan>,
    failed: u64,
    /// Orders completions that are ready together ([`shuffle`]).
    rng: u64,
    /// The disk's fault policy: metadata commits break their order
    /// ([`faults::set_broken_commit_order`]).
    broken_commit_order: bool,
    /// Every write, zeroing and flush recorded, in order, folded into one
    /// number ([`SimDisk::fingerprint`]).
    fingerprint: u64,
}

fn key_of_fd(fd: RawFd) -> Option<(u64, u64)> {
    // SAFETY: fstat only writes the stat buffer it is given; an invalid fd is an error.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above; `st` is a live, writable stat buffer.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return None;
    }
    Some((st.st_dev, st.st_ino))
}

fn key_of_path(path: &Path) -> std::io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path)?;
    Ok((m.dev(), m.ino()))
}

impl std::fmt::Debug for SimDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SimDisk")
    }
}

impl SimDisk {
    /// A disk with no files yet; `broken_commit_order`: the fault policy of
    /// [`broken_commit_order`](Self::broken_commit_order).
    pub fn new(broken_commit_order: bool) -> Arc<SimDisk> {
        Arc::new(SimDisk {
            state: Mutex::new(State {
                rng: 0x2545_f491_4f6c_dd1d,
                broken_commit_order,
                ..State::default()
            }),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unpoisoned()
    }

    /// Put `path` under the simulation; its present content is taken as durable.
    pub fn register(&self, path: &Path) -> std::io::Result<()> {
        let key = key_of_path(path)?;
        let durable = std::fs::read(path)?;
        self.state().disks.insert(
            key,
            Disk {
                path: path.to_path_buf(),
                durable,
                log: Vec::new(),
            },
        );
        Ok(())
    }

    /// Whether the file with this (st_dev, st_ino) is on this disk.
    pub fn knows(&self, identity: (u64, u64)) -> bool {
        self.state().disks.contains_key(&identity)
    }

    /// Seed the order in which ready completions are reported.
    pub fn seed_completions(&self, seed: u64) {
        self.state().rng = seed | 1;
    }

    /// Put completions that are ready together in a seed-chosen order, as a
    /// device with several I/Os in flight completes them in any order.
    pub fn shuffle<T>(&self, v: &mut [T]) {
        if v.len() < 2 {
            return;
        }
        let mut st = self.state();
        for i in (1..v.len()).rev() {
            v.swap(i, (crate::rng::step(&mut st.rng) % (i as u64 + 1)) as usize);
        }
    }

    /// Take the crash once `n` more writes have been recorded (None: only when asked).
    pub fn crash_after_writes(&self, n: Option<u64>) {
        let mut st = self.state();
        st.crash_at = n.map(|n| CrashAt::Write(st.counts.writes + n));
    }

    /// Take the crash at `at` (None: only when asked).
    pub fn crash_at(&self, at: Option<CrashAt>) {
        self.state().crash_at = at;
    }

    /// The writes, zeroings and flushes recorded so far, in their order, as one
    /// number (file, place, length, FUA and bytes of each): two runs of the same
    /// trial that did the same I/O in the same order have the same fingerprint.
    pub fn fingerprint(&self) -> u64 {
        self.state().fingerprint
    }

    /// Events recorded since the disk was made.
    pub fn counts(&self) -> Counts {
        self.state().counts
    }

    /// Reads and writes counted before the event `at` (all so far for None): a
    /// [`FailPlan`] below this fails an I/O before that crash point.
    pub fn ios_before(&self, at: Option<CrashAt>) -> u64 {
        let st = self.state();
        let at_event = |v: &Vec<u64>, n: u64| {
            usize::try_from(n.saturating_sub(1))
                .ok()
                .and_then(|i| v.get(i).copied())
                .unwrap_or(st.ios)
        };
        match at {
            Some(CrashAt::Write(n)) => at_event(&st.ios_at_write, n),
            Some(CrashAt::CommitFlush(n)) => at_event(&st.ios_at_commit_flush, n),
            None => st.ios,
        }
    }

    /// Fail one I/O as `plan` says (counted from now).
    pub fn fail_io(&self, plan: Option<FailPlan>) {
        let mut st = self.state();
        st.fail = plan.map(|p| FailPlan {
            nth: st.ios + p.nth,
            ..p
        });
    }

    /// I/Os failed so far by [`fail_io`](Self::fail_io).
    pub fn failed(&self) -> u64 {
        self.state().failed
    }

    /// Whether the crash has been taken (what completes afterwards does not count).
    pub fn frozen(&self) -> bool {
        self.state().frozen
    }

    /// Take the crash now: the media stops changing.
    pub fn freeze(&self) {
        self.state().frozen = true;
    }

    /// Writes recorded since the disk was made.
    pub fn writes(&self) -> u64 {
        self.state().counts.writes
    }

    /// Test-only fault that the simulation must catch (`dmkit sim --break`), a
    /// policy of this disk: metadata commits on it send the superblock without
    /// the flush that must precede it.
    pub fn broken_commit_order(&self) -> bool {
        self.state().broken_commit_order
    }

    /// The content each registered file has after the crash, with `pick(n)` (a
    /// seed-driven choice in `0..n`) deciding the fate of every unflushed write as
    /// `fates` says: kept whole, lost, or torn (each of its sectors kept or lost on
    /// its own). FUA writes are always kept.
    pub fn crash_images(&self, fates: Fates, mut pick: impl FnMut(u64) -> u64) -> Vec<(PathBuf, Vec<u8>)> {
        let mut st = self.state();
        st.frozen = true;
        let mut keys: Vec<_> = st.disks.keys().copied().collect();
        keys.sort_unstable(); // HashMap order must not feed the seed's choices
        let mut out = Vec::new();
        for k in keys {
            let Some(d) = st.disks.get(&k) else { continue };
            let mut img = d.durable.clone();
            let newest = d.log.len().saturating_sub(1);
            for (i, e) in d.log.iter().enumerate() {
                // 0, 1: kept; 2: lost; 3: torn
                let fate = match fates {
                    _ if e.fua => 0,
                    Fates::Independent => pick(4),
                    Fates::Kept => 0,
                    Fates::NewestFirst if i == newest => 0,
                    Fates::NewestFirst => [2, 2, 3, 0][pick(4) as usize],
                };
                let sectors = e.len.div_ceil(SECTOR);
                for s in 0..sectors {
                    let keep = match fate {
                        0 | 1 => true,
                        2 => false,
                        _ => pick(2) == 0,
                    };
                    if keep {
                        let lo = s * SECTOR;
                        let hi = ((s + 1) * SECTOR).min(e.len);
                        apply(
                            &mut img,
                            e.offset + lo,
                            e.data.as_deref().map(|b| &b[lo as usize..hi as usize]),
                            hi - lo,
                        );
                    }
                }
            }
            out.push((d.path.clone(), img));
        }
        out
    }

    /// Run `f` on the state if `fd` is a file on this disk and the crash has not
    /// been taken yet; else nothing happens (Ok).
    fn with_disk(
        &self,
        fd: RawFd,
        f: impl FnOnce(&mut State, (u64, u64)) -> Result<(), i32>,
    ) -> Result<(), i32> {
        let Some(key) = key_of_fd(fd) else {
            return Ok(());
        };
        let mut st = self.state();
        if !st.frozen && st.disks.contains_key(&key) {
            f(&mut st, key)
        } else {
            Ok(())
        }
    }

    fn record(&self, fd: RawFd, offset: u64, len: u64, data: Option<&[u8]>, fua: bool) -> Result<(), i32> {
        self.with_disk(fd, |st, key| {
            if should_fail(st, true) {
                return Err(libc::EIO);
            }
            st.counts.writes += 1;
            st.ios_at_write.push(st.ios);
            if st.commits_open > 0 {
                st.counts.commit_writes += 1;
            }
            trace_io(
                st,
                key,
                &format!("write {offset}+{len} fua {fua} zero {}", data.is_none()),
            );
            fold(
                st,
                key,
                &[1, offset, len, u64::from(fua)],
                data.unwrap_or_default(),
            );
            if let Some(d) = st.disks.get_mut(&key) {
                d.log.push(Entry {
                    offset,
                    len,
                    data: data.map(<[u8]>::to_vec),
                    fua,
                });
            }
            if st.crash_at == Some(CrashAt::Write(st.counts.writes)) {
                st.frozen = true;
            }
            Ok(())
        })
    }

    /// Before a write of `data` at `offset` of `fd`: record it, or fail it (errno).
    pub fn on_write(&self, fd: RawFd, offset: u64, data: &[u8], fua: bool) -> Result<(), i32> {
        self.record(fd, offset, data.len() as u64, Some(data), fua)
    }

    /// Before a range of `fd` is zeroed or deallocated.
    pub fn on_zero(&self, fd: RawFd, offset: u64, len: u64) -> Result<(), i32> {
        self.record(fd, offset, len, None, false)
    }

    /// Before a read of `fd`: fail it (errno) if the plan says so.
    pub fn on_read(&self, fd: RawFd) -> Result<(), i32> {
        self.with_disk(fd, |st, _| {
            if should_fail(st, false) {
                Err(libc::EIO)
            } else {
                Ok(())
            }
        })
    }

    /// After a flush of `fd` completed: what was written before it is on the media.
    pub fn on_flush(&self, fd: RawFd) {
        let _ = self.with_disk(fd, |st, key| {
            st.counts.flushes += 1;
            if st.commits_open > 0 {
                st.counts.commit_flushes += 1;
                st.ios_at_commit_flush.push(st.ios);
                if st.crash_at == Some(CrashAt::CommitFlush(st.counts.commit_flushes)) {
                    // the power goes before the flush reaches the media
                    trace_io(st, key, "flush: the crash");
                    st.frozen = true;
                    return Ok(());
                }
            }
            trace_io(st, key, "flush");
            fold(st, key, &[2], &[]);
            if let Some(d) = st.disks.get_mut(&key) {
                for e in std::mem::take(&mut d.log) {
                    apply(&mut d.durable, e.offset, e.data.as_deref(), e.len);
                }
            }
            Ok(())
        });
    }
}

/// A plain pointer to the simulated disk of a backing file, for the request
/// path: valid while the file lives, as its descriptors are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimRef(NonNull<SimDisk>);

// SAFETY: it points at a `SimDisk`, which is Send + Sync (its state is behind a
// mutex); the backing file holding the disk outlives every operation that
// carries the reference, as it does for its descriptors.
unsafe impl Send for SimRef {}
// SAFETY: as above.
unsafe impl Sync for SimRef {}

impl SimRef {
    /// The reference to `disk`; the caller keeps the disk alive while it is used
    /// (its backing file holds it).
    pub(super) fn to(disk: &SimDisk) -> SimRef {
        SimRef(NonNull::from(disk))
    }

    pub fn disk(&self) -> &SimDisk {
        // SAFETY: see the type's comment: the disk outlives every use.
        unsafe { self.0.as_ref() }
    }
}

/// A commit is open on `disk` (if its files are simulated) until the guard drops:
/// a target marks the span in which it makes its changes durable (metadata
/// writes, the flush, the superblock), so the crash can be placed inside it.
/// Costs nothing for files that are not simulated.
#[must_use]
pub fn commit_window(disk: Option<&Arc<SimDisk>>) -> CommitWindow {
    if let Some(d) = disk {
        d.state().commits_open += 1;
    }
    CommitWindow { disk: disk.cloned() }
}

pub struct CommitWindow {
    disk: Option<Arc<SimDisk>>,
}

impl Drop for CommitWindow {
    fn drop(&mut self) {
        if let Some(d) = &self.disk {
            let mut st = d.state();
            st.commits_open = st.commits_open.saturating_sub(1);
        }
    }
}

fn apply(img: &mut Vec<u8>, offset: u64, data: Option<&[u8]>, len: u64) {
    let (lo, hi) = (offset as usize, (offset + len) as usize);
    if hi > img.len() {
        img.resize(hi, 0);
    }
    match data {
        Some(b) => img[lo..hi].copy_from_slice(b),
        None => img[lo..hi].fill(0),
    }
}

/// Fold an event on the file `key` into the disk's fingerprint: the file by its
/// name (its identity changes from run to run), the event's numbers and bytes.
fn fold(st: &mut State, key: (u64, u64), numbers: &[u64], bytes: &[u8]) {
    use std::hash::{Hash, Hasher};
    // SipHash with fixed keys: the same events give the same number in any run
    let mut h = std::hash::DefaultHasher::new();
    st.fingerprint.hash(&mut h);
    st.disks.get(&key).and_then(|d| d.path.file_name()).hash(&mut h);
    numbers.hash(&mut h);
    bytes.hash(&mut h);
    st.fingerprint = h.finish();
}

/// What an I/O takes on the simulated disk, in a trial's virtual time
/// ([`crate::sync::sched`]): time-driven policies (a cache's ticks, periodic
/// commits) see time pass as the workload runs.
const IO_TIME: (std::time::Duration, std::time::Duration) = (
    std::time::Duration::from_micros(20),
    std::time::Duration::from_micros(200),
);

/// Count an I/O and say whether the failure plan fails it.
fn should_fail(st: &mut State, write: bool) -> bool {
    crate::sync::sched::elapse(IO_TIME.0, IO_TIME.1);
    let n = st.ios;
    st.ios += 1;
    match st.fail {
        Some(p) if p.nth == n && ((write && p.writes) || (!write && p.reads)) => {
            st.failed += 1;
            true
        }
        Some(p) if p.nth == n => {
            // not this kind: fail the next one that is
            st.fail = Some(FailPlan { nth: n + 1, ..p });
            false
        }
        _ => false,
    }
}

/// `DMKIT_SIM_TRACE_IO=1`: print every write and flush the simulation records.
fn trace_io(st: &State, key: (u64, u64), what: &str) {
    if std::env::var_os("DMKIT_SIM_TRACE_IO").is_some() {
        let name = st
            .disks
            .get(&key)
            .map(|d| d.path.display().to_string())
            .unwrap_or_default();
        eprintln!("io: {what} {name}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;

    #[test]
    fn crash_keeps_flushed_and_fua_and_tears_at_sectors() {
        let dir = std::env::temp_dir().join(format!("dmkit-sim-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("disk");
        std::fs::write(&p, vec![0u8; 8192]).unwrap();
        let disk = SimDisk::new(false);
        disk.register(&p).unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        let fd = f.as_raw_fd();
        disk.on_write(fd, 0, &[1; 1024], false).unwrap();
        f.write_all_at(&[1; 1024], 0).unwrap();
        disk.on_flush(fd);
        disk.on_write(fd, 1024, &[2; 1024], true).unwrap();
        disk.on_write(fd, 2048, &[3; 2048], false).unwrap();
        // lose every plain write, tear none
        let imgs = disk.crash_images(Fates::Independent, |_| 2);
        let img = &imgs[0].1;
        assert!(img[..1024].iter().all(|&b| b == 1), "flushed write kept");
        assert!(img[1024..2048].iter().all(|&b| b == 2), "FUA write kept");
        assert!(img[2048..4096].iter().all(|&b| b == 0), "unflushed write lost");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
