//! The metadata device: whole 4 KiB blocks in, whole blocks out, and a flush.
//! One over a backing file (`io::BackingFile`, the type all other I/O goes
//! through too), and an in-memory one that can simulate a crash
//! (drop unflushed writes, tear the last one).

use super::{Block, BLOCK_SIZE};
use crate::io::BackingFile;
use crate::sync::Unpoison;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

pub trait MetadataDev: Send {
    /// Number of whole 4 KiB blocks on the device.
    fn nr_blocks(&self) -> u64;
    fn read_block(&mut self, block: u64, buf: &mut Block) -> io::Result<()>;
    fn write_block(&mut self, block: u64, buf: &Block) -> io::Result<()>;
    /// Make every completed write durable (fdatasync).
    fn flush(&mut self) -> io::Result<()>;
    /// Look at the device's size again (it may have grown); the new block count.
    fn refresh_size(&mut self) -> io::Result<u64> {
        Ok(self.nr_blocks())
    }
    /// A second handle on the same device, for a reader on another thread.
    fn try_clone(&self) -> Option<Box<dyn MetadataDev>> {
        None
    }
    /// The simulated disk the device is on (`io::sim`), if any: commits mark
    /// their window on it and follow its fault policy.
    fn sim(&self) -> Option<Arc<crate::io::sim::SimDisk>> {
        None
    }
    /// Read `buf.len() / 4096` consecutive blocks from `block` (one I/O where the
    /// device can).
    fn read_blocks(&mut self, block: u64, buf: &mut [u8]) -> io::Result<()> {
        for (i, chunk) in buf.chunks_exact_mut(BLOCK_SIZE).enumerate() {
            let b: &mut Block = chunk
                .try_into()
                .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
            self.read_block(block + i as u64, b)?;
        }
        Ok(())
    }
}

/// A metadata device on a [`BackingFile`] (a regular file, a block device node
/// or an RBD image), through its synchronous calls: what the metadata writes,
/// and when it flushes, reaches the file as it does for every other user of it.
pub struct FileDev {
    f: Arc<BackingFile>,
    nr_blocks: u64,
    /// A writing tool's exclusive claim on the file, kept while it writes.
    claim: Option<Arc<crate::io::hold::Hold>>,
}

impl FileDev {
    pub fn open(path: &std::path::Path, writable: bool) -> io::Result<FileDev> {
        FileDev::new(Arc::new(buffered_backing(path, writable)?))
    }

    /// The metadata device on `f`.
    pub fn new(f: Arc<BackingFile>) -> io::Result<FileDev> {
        let nr_blocks = size_of(&f)? / BLOCK_SIZE as u64;
        Ok(FileDev {
            f,
            nr_blocks,
            claim: None,
        })
    }

    /// Keep `claim` (on this file) for as long as the device is open.
    pub fn with_claim(mut self, claim: crate::io::hold::Hold) -> FileDev {
        self.claim = Some(Arc::new(claim));
        self
    }
}

/// The size of `f` in bytes: a file's by seeking to its end (which works for
/// block devices too, where metadata().len() is 0), an image's from librbd.
fn size_of(f: &BackingFile) -> io::Result<u64> {
    match f.file() {
        Some(mut file) => {
            use std::io::Seek;
            file.seek(io::SeekFrom::End(0))
        }
        None => f.size(),
    }
}

impl MetadataDev for FileDev {
    fn nr_blocks(&self) -> u64 {
        self.nr_blocks
    }
    fn sim(&self) -> Option<Arc<crate::io::sim::SimDisk>> {
        self.f.sim().cloned()
    }
    fn read_block(&mut self, block: u64, buf: &mut Block) -> io::Result<()> {
        self.f.read_exact_at(buf, block * BLOCK_SIZE as u64)
    }
    fn write_block(&mut self, block: u64, buf: &Block) -> io::Result<()> {
        self.f.write_at(buf, block * BLOCK_SIZE as u64, false)
    }
    fn refresh_size(&mut self) -> io::Result<u64> {
        self.nr_blocks = size_of(&self.f)? / BLOCK_SIZE as u64;
        Ok(self.nr_blocks)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.f.sync()
    }
    fn read_blocks(&mut self, block: u64, buf: &mut [u8]) -> io::Result<()> {
        self.f.read_exact_at(buf, block * BLOCK_SIZE as u64)
    }
    fn try_clone(&self) -> Option<Box<dyn MetadataDev>> {
        Some(Box::new(FileDev {
            f: self.f.clone(),
            nr_blocks: self.nr_blocks,
            claim: self.claim.clone(),
        }))
    }
}

/// The metadata device on backing file `f`: a file reopened (read-write where
/// it allows, so a read-only pool can be reloaded writable), an image itself.
pub fn open_backing(f: &Arc<BackingFile>) -> io::Result<Box<dyn MetadataDev>> {
    if f.is_rbd() {
        return Ok(Box::new(FileDev::new(f.clone())?));
    }
    let b = buffered_backing(&f.path, true).or_else(|_| buffered_backing(&f.path, false))?;
    // on the simulated disk the table's file is on, in crash trials
    let b = match f.sim() {
        Some(d) => b.simulated(d.clone()),
        None => b,
    };
    Ok(Box::new(FileDev::new(Arc::new(b))?))
}

/// `path` opened buffered as a backing file.
fn buffered_backing(path: &std::path::Path, writable: bool) -> io::Result<BackingFile> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(writable)
        .open(path)?;
    BackingFile::from_files(path, file, None, !writable)
}

#[derive(Default)]
struct MemState {
    durable: Vec<u8>,
    /// Writes since the last flush, in order; reads see them.
    pending: Vec<(u64, Box<Block>)>,
    /// Latest pending write per block, index into `pending`.
    latest: std::collections::HashMap<u64, usize>,
    writes: u64,
    flushes: u64,
    /// Simulated power loss: once this many writes were issued, every
    /// further write and flush fails.
    write_limit: Option<u64>,
}

/// An in-memory metadata device. Clones share the same storage, so a test
/// can keep one handle while the metadata owns another.
#[derive(Clone)]
pub struct MemDev {
    state: Arc<Mutex<MemState>>,
    nr_blocks: u64,
}

impl MemDev {
    pub fn new(nr_blocks: u64) -> MemDev {
        MemDev::from_image(vec![0u8; nr_blocks as usize * BLOCK_SIZE])
    }

    pub fn from_image(image: Vec<u8>) -> MemDev {
        let nr_blocks = (image.len() / BLOCK_SIZE) as u64;
        MemDev {
            state: Arc::new(Mutex::new(MemState {
                durable: image,
                ..MemState::default()
            })),
            nr_blocks,
        }
    }

    fn lock(&self) -> MutexGuard<'_, MemState> {
        // A poisoned lock only means another test thread panicked; the bytes are fine.
        self.state.lock().unpoisoned()
    }

    /// The image as it is now, including unflushed writes.
    pub fn image(&self) -> Vec<u8> {
        let st = self.lock();
        let mut img = st.durable.clone();
        for (b, data) in &st.pending {
            let off = *b as usize * BLOCK_SIZE;
            img[off..off + BLOCK_SIZE].copy_from_slice(&data[..]);
        }
        img
    }

    /// Fail every write and flush after `n` more writes (None: never).
    pub fn fail_after_writes(&self, n: Option<u64>) {
        let mut st = self.lock();
        st.write_limit = n.map(|n| st.writes + n);
    }

    /// Number of writes not yet flushed.
    pub fn pending_writes(&self) -> usize {
        self.lock().pending.len()
    }

    /// (writes, flushes) issued so far.
    pub fn io_counts(&self) -> (u64, u64) {
        let st = self.lock();
        (st.writes, st.flushes)
    }

    /// The image a crash would leave: durable data plus the first `keep`
    /// unflushed writes, and if `tear`, the first half of the next one.
    pub fn crash_image(&self, keep: usize, tear: bool) -> Vec<u8> {
        let st = self.lock();
        let mut img = st.durable.clone();
        for (i, (b, data)) in st.pending.iter().enumerate() {
            let off = *b as usize * BLOCK_SIZE;
            if i < keep {
                img[off..off + BLOCK_SIZE].copy_from_slice(&data[..]);
            } else {
                if tear {
                    img[off..off + BLOCK_SIZE / 2].copy_from_slice(&data[..BLOCK_SIZE / 2]);
                }
                break;
            }
        }
        img
    }
}

impl MetadataDev for MemDev {
    fn nr_blocks(&self) -> u64 {
        self.nr_blocks
    }
    fn read_block(&mut self, block: u64, buf: &mut Block) -> io::Result<()> {
        if block >= self.nr_blocks {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "beyond end"));
        }
        let st = self.lock();
        if let Some(&i) = st.latest.get(&block) {
            buf.copy_from_slice(&st.pending[i].1[..]);
        } else {
            let off = block as usize * BLOCK_SIZE;
            buf.copy_from_slice(&st.durable[off..off + BLOCK_SIZE]);
        }
        Ok(())
    }
    fn write_block(&mut self, block: u64, buf: &Block) -> io::Result<()> {
        if block >= self.nr_blocks {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "beyond end"));
        }
        let mut st = self.lock();
        if st.write_limit.is_some_and(|l| st.writes >= l) {
            return Err(io::Error::other("simulated power loss"));
        }
        st.writes += 1;
        let i = st.pending.len();
        st.pending.push((block, Box::new(*buf)));
        st.latest.insert(block, i);
        Ok(())
    }
    fn flush(&mut self) -> io::Result<()> {
        let mut st = self.lock();
        if st.write_limit.is_some_and(|l| st.writes >= l) {
            return Err(io::Error::other("simulated power loss"));
        }
        st.flushes += 1;
        let pending = std::mem::take(&mut st.pending);
        st.latest.clear();
        for (b, data) in pending {
            let off = b as usize * BLOCK_SIZE;
            st.durable[off..off + BLOCK_SIZE].copy_from_slice(&data[..]);
        }
        Ok(())
    }
}
