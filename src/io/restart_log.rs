//! What a killed daemon must not take with it: changes acknowledged to clients
//! and not yet committed to the on-disk metadata.
//!
//! A thin pool maps a block once its write has landed and commits the mapping
//! at the next flush or period; a writecache does the same with its entries. A
//! power cut loses those changes, as with the kernel's targets, and whatever sat
//! above the device goes down with the machine. A killed daemon is different:
//! its clients live on (a filesystem mounted over ublk, whose requests the
//! kernel holds and reissues to the next daemon), believing every acknowledged
//! write done. So each such change is also recorded, before it is acknowledged,
//! in a file of the run directory mapped shared: the record is in the kernel's
//! page cache the moment it is stored, costs no system call, and outlives the
//! process (the data it describes went to the backing files before, and is in
//! the page cache too). The next daemon to open the same committed metadata in
//! the same boot replays the records and commits them. After a reboot the
//! records are ignored: the machine took its clients' memory with it, and the
//! on-disk format's own crash rules apply.
//!
//! Layout: a 128-byte header (magic, the identity of the committed metadata the
//! records follow, a generation, an overflow flag, the boot id, a checksum),
//! then 48-byte records each carrying the generation and a checksum. A new
//! generation begins at each commit: records of older ones stop counting at
//! once, and a record torn by a kill fails its checksum and ends the log.

use super::mapped::Mapped;
use std::fs::OpenOptions;
use std::io::Read;
use std::path::{Path, PathBuf};

const MAGIC: u64 = u64::from_le_bytes(*b"DMKRLOG1");
const HEADER: usize = 128;
const RECORD: usize = 48;
/// At most this many records per log (48 MiB of address space, filled lazily).
pub const MAX_RECORDS: usize = 1 << 20;

/// One acknowledged change: its kind and four words, as its owner defines them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    pub kind: u32,
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub d: u64,
}

/// What a previous daemon left in a log.
#[derive(Debug, PartialEq, Eq)]
pub enum Previous {
    /// No log, another boot's, or one that never began.
    Nothing,
    /// Records following the committed metadata `identity`.
    Records { identity: u64, records: Vec<Record> },
    /// More changes than the log holds were acknowledged: they cannot be replayed.
    Overflowed { identity: u64 },
}

pub struct RestartLog {
    map: Mapped,
    path: PathBuf,
    file: std::fs::File,
    cap: usize,
    len: usize,
    gen: u64,
    full: bool,
    /// The simulated disk of the metadata the log follows (crash trials).
    sim: Option<std::sync::Arc<super::sim::SimDisk>>,
}

fn boot_id() -> [u8; 40] {
    let mut b = [0u8; 40];
    if let Ok(s) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") {
        let s = s.trim().as_bytes();
        let n = s.len().min(b.len());
        b[..n].copy_from_slice(&s[..n]);
    }
    b
}

/// Where the header's checksum and boot id lie: the header is written in
/// pieces around them (`store_header`).
const HEADER_CSUM_AT: usize = 28;
const BOOT_AT: usize = 32;
/// Where a record's checksum lies.
const RECORD_CSUM_AT: usize = 12;

crate::layout! {
    /// The header: what the log follows, its generation, whether it
    /// overflowed, and the boot it was written in; its checksum covers the
    /// rest of its bytes.
    struct Header("restart log header", HEADER) {
        magic: u64 = 0,
        identity: u64 = 8,
        gen: u64 = 16,
        full: u32 = 24,
        csum: u32 = HEADER_CSUM_AT,
        boot: [u8; 40] = BOOT_AT,
    }
}

crate::layout! {
    /// A record: its generation, its kind, its checksum and four values.
    struct RecordFields("restart log record", RECORD) {
        gen: u64 = 0,
        kind: u32 = 8,
        csum: u32 = RECORD_CSUM_AT,
        a: u64 = 16,
        b: u64 = 24,
        c: u64 = 32,
        d: u64 = 40,
    }
}

/// The checksum of a header or record: everything but its own 4 bytes at `at`.
fn csum(b: &[u8], at: usize) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&b[..at]), &b[at + 4..])
}

impl Record {
    fn store(&self, gen: u64) -> [u8; RECORD] {
        let mut f = RecordFields {
            gen,
            kind: self.kind,
            csum: 0,
            a: self.a,
            b: self.b,
            c: self.c,
            d: self.d,
        };
        f.csum = csum(&f.encode(), RECORD_CSUM_AT);
        f.encode()
    }

    fn load(gen: u64, b: &[u8]) -> Option<Record> {
        let f = RecordFields::decode(b).ok()?;
        if f.gen != gen || f.csum != csum(b, RECORD_CSUM_AT) {
            return None;
        }
        Some(Record {
            kind: f.kind,
            a: f.a,
            b: f.b,
            c: f.c,
            d: f.d,
        })
    }
}

impl RestartLog {
    /// The log of the thing `what` whose backing file has `identity`, in `dir`.
    pub fn path(dir: &Path, what: &str, identity: (u64, u64)) -> PathBuf {
        dir.join(format!("{what}-{}-{}", identity.0, identity.1))
    }

    /// What the log at `path` holds from a daemon of this boot.
    pub fn previous(path: &Path) -> Previous {
        let mut bytes = Vec::new();
        let limit = (HEADER + MAX_RECORDS * RECORD) as u64;
        let read = std::fs::File::open(path).and_then(|f| f.take(limit).read_to_end(&mut bytes));
        if read.is_err() {
            return Previous::Nothing;
        }
        let Some(h) = bytes.get(..HEADER).and_then(|b| Header::decode(b).ok()) else {
            return Previous::Nothing;
        };
        if h.magic != MAGIC || h.csum != csum(&bytes[..HEADER], HEADER_CSUM_AT) || h.boot != boot_id() {
            return Previous::Nothing;
        }
        let (identity, gen) = (h.identity, h.gen);
        if h.full != 0 {
            return Previous::Overflowed { identity };
        }
        let records = bytes[HEADER..]
            .chunks_exact(RECORD)
            .take(MAX_RECORDS)
            .map_while(|r| Record::load(gen, r))
            .collect();
        Previous::Records { identity, records }
    }

    /// A new, empty log at `path` with room for `cap` records (bounded by
    /// MAX_RECORDS); it counts once `begin` names what it follows.
    pub fn create(path: &Path, cap: usize) -> std::io::Result<RestartLog> {
        Self::create_on(path, cap, None)
    }

    /// As [`create`](Self::create), for metadata on the simulated disk `sim`:
    /// once its crash is taken (`dmkit sim --kill`: the daemon is dead), what the
    /// target does afterwards no longer reaches the log.
    pub fn create_on(
        path: &Path,
        cap: usize,
        sim: Option<std::sync::Arc<super::sim::SimDisk>>,
    ) -> std::io::Result<RestartLog> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let cap = cap.clamp(1, MAX_RECORDS);
        // a new file renamed into place: a previous owner still mapping the old
        // one (a table being replaced) writes only to that
        let tmp = path.with_extension("new");
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        let len = HEADER + cap * RECORD;
        f.set_len(len as u64)?;
        let map = Mapped::new(&f, len)?;
        std::fs::rename(&tmp, path)?;
        Ok(RestartLog {
            map,
            path: path.to_path_buf(),
            file: f,
            cap,
            len: 0,
            gen: 0,
            full: false,
            sim,
        })
    }

    fn killed(&self) -> bool {
        self.sim.as_ref().is_some_and(|d| d.frozen())
    }

    /// Start over after a commit: the records that follow describe changes
    /// made on top of the committed metadata `identity`.
    pub fn begin(&mut self, identity: u64) {
        self.gen += 1;
        self.len = 0;
        self.full = false;
        self.store_header(identity);
    }

    fn store_header(&mut self, identity: u64) {
        if self.killed() {
            return;
        }
        let h = Header {
            magic: MAGIC,
            identity,
            gen: self.gen,
            full: u32::from(self.full),
            csum: 0,
            boot: boot_id(),
        }
        .encode();
        let c = csum(&h, HEADER_CSUM_AT);
        // the checksum zeroed first and stored last: a kill in between leaves a
        // header that fails its checksum, and nothing is replayed, as nothing
        // was uncommitted yet
        self.map.write_at(HEADER_CSUM_AT, &[0; 4]);
        self.map.write_at(0, &h[..HEADER_CSUM_AT]);
        self.map.write_at(BOOT_AT, &h[BOOT_AT..]);
        self.map.write_at(HEADER_CSUM_AT, &c.to_le_bytes());
    }

    /// Record a change before it is acknowledged. False once the log is full:
    /// the log says so (nothing of this generation will be replayed) and the
    /// owner should commit soon.
    pub fn append(&mut self, r: Record) -> bool {
        if self.full || self.killed() {
            return false;
        }
        if self.len == self.cap {
            self.full = true;
            self.store_header(self.identity());
            return false;
        }
        let out = r.store(self.gen);
        if !self.map.write_at(HEADER + self.len * RECORD, &out) {
            return false;
        }
        self.len += 1;
        true
    }

    /// Remove the log's file, once its owner has committed everything and goes
    /// away; not if another owner has put a new log in its place since.
    pub fn remove(&self) {
        use std::os::unix::fs::MetadataExt;
        let mine = self.file.metadata().map(|m| (m.dev(), m.ino()));
        let there = std::fs::metadata(&self.path).map(|m| (m.dev(), m.ino()));
        if let (Ok(a), Ok(b)) = (mine, there) {
            if a == b {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }

    /// What the records follow (as `begin` named it).
    pub fn identity(&self) -> u64 {
        let mut b = [0u8; 8];
        if self.map.read_at(8, &mut b) {
            u64::from_le_bytes(b)
        } else {
            0
        }
    }

    /// Records in this generation so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Records that still fit in this generation.
    pub fn room(&self) -> usize {
        if self.full {
            0
        } else {
            self.cap - self.len
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("dmkit-restart-log-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn rec(i: u64) -> Record {
        Record {
            kind: 1,
            a: i,
            b: i * 2,
            c: 7,
            d: u64::MAX - i,
        }
    }

    #[test]
    fn records_of_the_current_generation_are_what_a_next_daemon_reads() {
        let p = RestartLog::path(&dir("current"), "t", (1, 2));
        assert_eq!(RestartLog::previous(&p), Previous::Nothing);
        let mut l = RestartLog::create(&p, 4).unwrap();
        assert_eq!(RestartLog::previous(&p), Previous::Nothing, "not begun");
        l.begin(11);
        assert!(l.append(rec(1)) && l.append(rec(2)));
        assert_eq!(
            RestartLog::previous(&p),
            Previous::Records {
                identity: 11,
                records: vec![rec(1), rec(2)]
            }
        );
        // a commit: the old records stop counting, though still in the file
        l.begin(12);
        assert!(l.append(rec(3)));
        assert_eq!(
            RestartLog::previous(&p),
            Previous::Records {
                identity: 12,
                records: vec![rec(3)]
            }
        );
        // full: the log says it cannot be replayed
        assert!(l.append(rec(4)) && l.append(rec(5)) && l.append(rec(6)));
        assert!(!l.append(rec(7)));
        assert_eq!(RestartLog::previous(&p), Previous::Overflowed { identity: 12 });
        l.begin(13);
        assert_eq!(
            RestartLog::previous(&p),
            Previous::Records {
                identity: 13,
                records: vec![]
            }
        );
    }

    #[test]
    fn a_torn_record_or_header_ends_what_is_replayed() {
        let p = RestartLog::path(&dir("torn"), "t", (1, 2));
        let mut l = RestartLog::create(&p, 8).unwrap();
        l.begin(5);
        for i in 0..3 {
            assert!(l.append(rec(i)));
        }
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[HEADER + RECORD + 20] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        assert_eq!(
            RestartLog::previous(&p),
            Previous::Records {
                identity: 5,
                records: vec![rec(0)]
            }
        );
        bytes[9] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        assert_eq!(RestartLog::previous(&p), Previous::Nothing);
    }

    #[test]
    fn another_boots_log_is_ignored() {
        let p = RestartLog::path(&dir("boot"), "t", (1, 2));
        let mut l = RestartLog::create(&p, 8).unwrap();
        l.begin(5);
        assert!(l.append(rec(0)));
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[40] ^= 1;
        let c = csum(&bytes[..HEADER], 28);
        bytes[28..32].copy_from_slice(&c.to_le_bytes());
        std::fs::write(&p, &bytes).unwrap();
        assert_eq!(RestartLog::previous(&p), Previous::Nothing);
    }
}
