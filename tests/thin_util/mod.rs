//! Shared helpers for the thin metadata tests: the real Debian tools, a
//! reference model, and a small seeded PRNG (failing seeds are replayable).
#![allow(dead_code)]

use dmkit::pdata::{FileDev, MetadataDev};
use dmkit::thin::xml::{self, XmlMetadata};
use dmkit::thin::{FormatOptions, ThinPoolMetadata};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Where ci/fetch-tpt-ref.sh unpacks the thin-provisioning-tools 1.x reference.
pub fn ref_dir() -> PathBuf {
    std::env::var_os("TPT_REF")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/opt/dmkit-ref/thin-provisioning-tools"))
        .join("usr/sbin")
}

/// A thin-provisioning-tools 1.x reference binary; a missing one fails the test
/// (ci/install.sh fetches it).
pub fn tool(name: &str) -> PathBuf {
    let p = ref_dir().join(name);
    assert!(
        p.exists(),
        "{} missing: the thin-provisioning-tools 1.x reference (ci/fetch-tpt-ref.sh fetches it)",
        p.display()
    );
    p
}

/// thin_check 1.x's progress titles on standard error.
pub const PROGRESS: [&str; 5] = [
    "Checking thin metadata",
    "device details tree",
    "mapping tree",
    "data space map",
    "metadata space map",
];

/// Run the real thin_check; returns (exit ok, stdout, stderr with the
/// progress lines removed).
pub fn thin_check(path: &Path, extra: &[&str]) -> (bool, String, String) {
    let bin = tool("thin_check");
    let out = Command::new(bin)
        .args(extra)
        .arg(path)
        .output()
        .expect("run thin_check");
    let stderr: String = String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| !PROGRESS.contains(&l.trim()))
        .map(|l| format!("{l}\n"))
        .collect();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr,
    )
}

/// thin_check must pass with no complaint at all.
pub fn assert_thin_check_clean(path: &Path) {
    let (ok, stdout, stderr) = thin_check(path, &[]);
    assert!(
        ok && stderr.is_empty(),
        "thin_check failed on {}:\nstdout:\n{stdout}\nstderr:\n{stderr}",
        path.display()
    );
    assert!(
        stdout.contains("TRANSACTION_ID="),
        "thin_check did not run: {stdout}"
    );
}

pub fn thin_dump(path: &Path, metadata_snap: bool) -> String {
    let bin = tool("thin_dump");
    let mut c = Command::new(bin);
    if metadata_snap {
        c.arg("-m");
    }
    let out = c.arg(path).output().expect("run thin_dump");
    assert!(
        out.status.success(),
        "thin_dump failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf8")
}

pub fn thin_restore(xml_path: &Path, out: &Path) {
    let bin = tool("thin_restore");
    let o = Command::new(bin)
        .arg("-i")
        .arg(xml_path)
        .arg("-o")
        .arg(out)
        .output()
        .expect("run thin_restore");
    assert!(
        o.status.success(),
        "thin_restore failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

pub fn our_dump(path: &Path, metadata_snap: bool) -> String {
    let dev = FileDev::open(path, false).expect("open");
    dmkit::thin::dump::dump_to_string(Box::new(dev), metadata_snap).expect("dump")
}

/// A scratch file of `nr_blocks` metadata blocks, removed on drop.
pub struct Scratch {
    pub dir: PathBuf,
}

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!(
            "dmkit-thin-{tag}-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        ));
        std::fs::create_dir_all(&dir).expect("mkdir");
        Scratch { dir }
    }
    pub fn file(&self, name: &str, nr_blocks: u64) -> PathBuf {
        let p = self.dir.join(name);
        let f = std::fs::File::create(&p).expect("create");
        f.set_len(nr_blocks * 4096).expect("set_len");
        p
    }
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn format_file(path: &Path, nr_data_blocks: u64) -> ThinPoolMetadata {
    let dev = FileDev::open(path, true).expect("open");
    ThinPoolMetadata::format(
        Box::new(dev),
        FormatOptions {
            data_block_size: 128,
            nr_data_blocks,
            cache_blocks: 1024,
        },
    )
    .expect("format")
}

pub fn open_file(path: &Path) -> ThinPoolMetadata {
    let dev = FileDev::open(path, true).expect("open");
    ThinPoolMetadata::open(Box::new(dev) as Box<dyn MetadataDev>, 1024).expect("open")
}

/// Reference model: dev -> vblock -> (data block, time).
pub type Model = BTreeMap<u64, BTreeMap<u64, (u64, u32)>>;

/// Mappings as a parsed dump sees them.
pub fn model_of_xml(text: &str) -> Model {
    let md: XmlMetadata = xml::parse(text).expect("parse dump");
    md.devices
        .iter()
        .map(|d| (d.dev_id, md.blocks(d).map(|(v, b, t)| (v, (b, t))).collect()))
        .collect()
}

/// The model as read back through the API.
pub fn model_of_api(md: &mut ThinPoolMetadata) -> Model {
    let mut m = Model::new();
    for dev in md.devices() {
        let mut e = BTreeMap::new();
        md.mappings_in(dev, 0, u64::MAX, &mut |v, b, t| {
            e.insert(v, (b, t));
        })
        .expect("walk");
        m.insert(dev, e);
    }
    m
}

/// Deterministic workloads from a seed (dmkit's generator).
pub struct Rng(dmkit::rng::XorShift);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(dmkit::rng::XorShift::seeded(seed))
    }
    pub fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.0.below(n)
    }
}
