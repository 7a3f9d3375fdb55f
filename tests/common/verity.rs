//! Verity trees made by `veritysetup format` (cryptsetup-bin, ci/install.sh),
//! for dmkit's `verity` target and the kernel oracle's.

use super::{need, run};
use std::path::Path;
use std::process::Command;

/// One `veritysetup format` run's parameters.
pub struct Format<'a> {
    pub version: u32,
    pub data_block: u32,
    pub hash_block: u32,
    pub hash: &'a str,
    /// hex, or "-" for none
    pub salt: &'a str,
    /// false: no superblock, the tree starts at hash block 0
    pub superblock: bool,
}

impl Format<'_> {
    /// `veritysetup VERB` with this format's options.
    fn veritysetup(&self, verb: &str) -> Command {
        let mut c = Command::new("veritysetup");
        c.arg(verb)
            .arg(format!("--format={}", self.version))
            .arg(format!("--data-block-size={}", self.data_block))
            .arg(format!("--hash-block-size={}", self.hash_block))
            .arg(format!("--hash={}", self.hash))
            .arg(format!("--salt={}", self.salt));
        if !self.superblock {
            c.arg("--no-superblock");
        }
        c
    }

    /// Build the tree of `data` on `hash_file`; the root hash veritysetup printed.
    pub fn run(&self, data: &Path, hash_file: &Path) -> String {
        need("veritysetup");
        let mut c = self.veritysetup("format");
        let out = run(c.arg(data).arg(hash_file));
        out.lines()
            .find_map(|l| l.strip_prefix("Root hash:"))
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|| panic!("no root hash in veritysetup's output:\n{out}"))
    }

    /// The table after `<start> <len> verity`, devices as given.
    pub fn table(&self, data: &str, hash_dev: &str, data_blocks: u64, root: &str, opts: &str) -> String {
        // the superblock takes the first hash block (use it with 4096-byte blocks)
        let start = u64::from(self.superblock);
        let t = format!(
            "{} {data} {hash_dev} {} {} {data_blocks} {start} {} {root} {}",
            self.version, self.data_block, self.hash_block, self.hash, self.salt
        );
        if opts.is_empty() {
            t
        } else {
            format!("{t} {opts}")
        }
    }

    /// `veritysetup verify`: whether the data matches the tree and root.
    pub fn verify(&self, data: &Path, hash_file: &Path, root: &str) -> bool {
        let mut c = self.veritysetup("verify");
        c.arg(data).arg(hash_file).arg(root);
        c.output().expect("spawn veritysetup").status.success()
    }
}

/// Flip every bit of the byte at `off` in `p`.
pub fn flip(p: &Path, off: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(p)
        .expect("open");
    let mut b = [0u8];
    f.read_exact_at(&mut b, off).expect("read");
    b[0] ^= 0xff;
    f.write_all_at(&b, off).expect("write");
}
