//! What the fuzz targets share: a registry with a few devices over small files
//! in a directory of this process's own on a memory filesystem.

#![allow(dead_code)]

use dmkit::control::Ctx;
use dmkit::mapper::{config::Config, Registry};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

/// This process's scratch directory.
pub fn dir() -> &'static PathBuf {
    static D: OnceLock<PathBuf> = OnceLock::new();
    D.get_or_init(|| {
        let base = if std::path::Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        // one directory per fuzz target, so the corpus can name its files
        let target = std::env::current_exe()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "fuzz".into());
        let d = base.join(format!("dmkit-fuzz-{target}"));
        // fresh for each process: a pool formatted by an earlier run is not new
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("scratch directory");
        d
    })
}

/// A file of `bytes` zeroes (created once).
pub fn file(name: &str, bytes: u64) -> String {
    let p = dir().join(name);
    if !p.exists() {
        let f = std::fs::File::create(&p).expect("scratch file");
        f.set_len(bytes).expect("scratch file size");
    }
    p.display().to_string()
}

/// A registry with `z` (zero), `lin` (linear over a file), `pool` (thin-pool),
/// `thin` (a thin of it), `wc` (writecache) and `cr` (crypt), made once per
/// process.
pub fn registry() -> &'static Registry {
    &ctx().reg
}

/// The devices [`registry`] makes (a target may remove the others it finds).
pub const FIXTURE: &[&str] = &["z", "lin", "pool", "thin", "wc", "cr", "lw"];

/// The control requests' context over [`registry`] (no state file).
pub fn ctx() -> &'static Ctx {
    static C: OnceLock<Ctx> = OnceLock::new();
    C.get_or_init(|| Ctx::sandboxed(Arc::new(make_registry())))
}

fn make_registry() -> Registry {
    {
        let reg = Registry::new(
            Config {
                direct_io: false,
                restart_logs: None,
                ..Config::default()
            },
            dmkit::targets::types(),
        );
        // files the table corpus names, for targets it creates itself
        for (f, bytes) in [("tmeta", 2 << 20), ("tdata", 4 << 20), ("cow", 1 << 20)] {
            file(f, bytes);
        }
        let mk = |name: &str, table: String| {
            reg.create(name, Some(&table), false, None)
                .unwrap_or_else(|e| panic!("{name}: {e}"))
        };
        mk("z", "0 131072 zero".into());
        mk("lin", format!("0 8192 linear {} 0", file("lin", 4 << 20)));
        mk(
            "pool",
            format!(
                "0 32768 thin-pool {} {} 128 0 1 error_if_no_space",
                file("meta", 4 << 20),
                file("data", 16 << 20)
            ),
        );
        reg.message("pool", 0, &["create_thin 0".to_string()])
            .expect("create_thin");
        // the base of the thin's qemu:dirty-bitmap:1 context (nbd_requests)
        reg.message("pool", 0, &["create_snap 1 0".to_string()])
            .expect("create_snap");
        mk("thin", "0 16384 thin /dev/mapper/pool 0".into());
        mk(
            "wc",
            format!(
                "0 8192 writecache s {} {} 4096 0",
                file("origin", 4 << 20),
                file("cache", 1 << 20)
            ),
        );
        mk(
            "cr",
            format!(
                "0 8192 crypt aes-xts-plain64 {} 0 {} 0",
                "0123456789abcdef".repeat(4),
                file("crypt", 4 << 20)
            ),
        );
        // tags for a device above (dm-crypt's integrity modes)
        mk(
            "itag",
            format!(
                "0 2048 integrity {} 0 32 J 1 block_size:4096",
                file("itag", 4 << 20)
            ),
        );
        mk(
            "lw",
            format!(
                "0 8192 log-writes {} {}",
                file("lwdata", 4 << 20),
                file("lwlog", 1 << 20)
            ),
        );
        reg
    }
}

/// An in-memory byte stream: reads from the input, writes are kept.
pub struct Pipe<'a> {
    pub input: &'a [u8],
    pub output: Vec<u8>,
}

impl std::io::Read for Pipe<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = buf.len().min(self.input.len());
        buf[..n].copy_from_slice(&self.input[..n]);
        self.input = &self.input[n..];
        Ok(n)
    }
}

impl std::io::Write for Pipe<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.output.len() > 64 << 20 {
            return Err(std::io::Error::other("too much output"));
        }
        self.output.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Fill scratch file `name` with `data` (zero-padded to `bytes`), create device
/// `dev` from `table` (which names that file), read its first 256 KiB, send it
/// `message` if any, take its status, and remove it: a target's constructor and
/// I/O over metadata from the input.
pub fn open_on_image(
    name: &str,
    bytes: usize,
    data: &[u8],
    dev: &str,
    table: &dyn Fn(&str) -> String,
    message: Option<&str>,
) {
    let path = dir().join(name);
    let mut img = vec![0u8; bytes];
    let n = data.len().min(img.len());
    img[..n].copy_from_slice(&data[..n]);
    if std::fs::write(&path, &img).is_err() {
        return;
    }
    exercise(dev, &table(&path.display().to_string()), message);
}

/// Create device `dev` from `table`, read its first 256 KiB, send it `message`
/// if any, take its status, and remove it.
pub fn exercise(dev: &str, table: &str, message: Option<&str>) {
    let reg = registry();
    if reg.create(dev, Some(table), false, None).is_err() {
        return;
    }
    if let Ok(d) = reg.get(dev) {
        let mut b = vec![0u8; 256 << 10];
        let _ = dmkit::mapper::devio::read(&dmkit::mapper::engine::Dest::Dm(d), 0, &mut b);
    }
    if let Some(m) = message {
        let _ = reg.message(dev, 0, &[m.to_string()]);
    }
    let _ = reg.table_lines(Some(dev), true, false, false);
    let _ = reg.remove(dev, true, false);
    let _ = reg.remove(dev, false, false);
}

/// What each block of a metadata image holds, by the salt its checksum was made
/// with (None: none of `kinds`, a free block).
pub fn block_kinds(img: &[u8], kinds: &[dmkit::pdata::BlockKind]) -> Vec<Option<dmkit::pdata::BlockKind>> {
    use dmkit::pdata::checksum::block_csum;
    img.chunks_exact(dmkit::pdata::BLOCK_SIZE)
        .map(|b| {
            let stored = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            kinds.iter().copied().find(|k| block_csum(b, k.salt()) == stored)
        })
        .collect()
}

/// What a thin pool's metadata blocks can be, for [`block_kinds`].
/// A thin pool's metadata image in memory (256 blocks, data blocks of 64 KiB,
/// `nr_data_blocks` of them) with thin 0 created, `build` run on it, a
/// metadata snapshot reserved and all committed; and what each block holds.
pub fn thin_image(
    nr_data_blocks: u64,
    build: impl FnOnce(&mut dmkit::thin::ThinPoolMetadata),
) -> (Vec<u8>, Vec<Option<dmkit::pdata::BlockKind>>) {
    let dev = dmkit::pdata::MemDev::new(256);
    let opts = dmkit::thin::FormatOptions {
        data_block_size: 128,
        nr_data_blocks,
        cache_blocks: 64,
    };
    let mut md = dmkit::thin::ThinPoolMetadata::format(Box::new(dev.clone()), opts).expect("format");
    md.create_thin(0).expect("thin");
    build(&mut md);
    md.reserve_metadata_snap().expect("metadata snap");
    md.commit().expect("commit");
    let img = dev.image();
    let kinds = block_kinds(&img, &THIN_KINDS);
    (img, kinds)
}

pub const THIN_KINDS: [dmkit::pdata::BlockKind; 4] = [
    dmkit::pdata::BlockKind::Superblock,
    dmkit::pdata::BlockKind::BtreeNode,
    dmkit::pdata::BlockKind::Bitmap,
    dmkit::pdata::BlockKind::Index,
];

/// `img0` with the input's patches applied (after a first byte: 4 bytes of
/// offset, 1 byte of value, repeated). Unless the first byte is odd, each
/// patched block is re-sealed: its checksum recomputed with the salt of what it
/// held (a btree node's for a free block), its self block number left as
/// patched, so the patches reach the parsers as metadata that lies with a valid
/// checksum.
pub fn patched(img0: &[u8], kinds: &[Option<dmkit::pdata::BlockKind>], data: &[u8]) -> Vec<u8> {
    use dmkit::pdata::{checksum::block_csum, BlockKind, BLOCK_SIZE};
    let mut img = img0.to_vec();
    let reseal = data.first().is_none_or(|b| b & 1 == 0);
    let mut touched = std::collections::BTreeSet::new();
    for p in data.get(1..).unwrap_or(&[]).chunks_exact(5) {
        let off = u32::from_le_bytes([p[0], p[1], p[2], p[3]]) as usize % img.len();
        img[off] = p[4];
        touched.insert(off / BLOCK_SIZE);
    }
    if reseal {
        for b in touched {
            let kind = kinds[b].unwrap_or(BlockKind::BtreeNode);
            let block = &mut img[b * BLOCK_SIZE..(b + 1) * BLOCK_SIZE];
            let c = block_csum(block, kind.salt());
            block[0..4].copy_from_slice(&c.to_le_bytes());
        }
    }
    img
}

/// Remove the devices the inputs made once there are many, so the registry
/// (shared by every input) stays small and runs stay fast.
pub fn trim_registry(ctx: &Ctx) {
    let devs = ctx.reg.list();
    if devs.len() > 64 {
        for d in devs {
            let name = d.name();
            if !FIXTURE.contains(&name.as_str()) {
                let _ = ctx.reg.remove(&name, true, false);
            }
        }
        ctx.reg.reap_deferred();
    }
}
