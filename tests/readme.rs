//! The README, run as a user runs it: its ```sh blocks in order, in one bash, in
//! one scratch directory, with this build's dmkit first on PATH; then again in a
//! fresh directory. Only the ublk block is left out where the kernel has no ublk
//! driver (the test says so). Each block's stated results are checked: the output
//! its comments promise, and `# equal` checksums.

mod common;

use common::{Scratch, BIN};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A ```sh block of the README: the heading above it and its text.
struct Block {
    heading: String,
    line: usize,
    text: String,
}

fn blocks(readme: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut heading = String::new();
    let mut cur: Option<Block> = None;
    for (i, l) in readme.lines().enumerate() {
        match &mut cur {
            Some(b) if l.trim_end() == "```" => {
                out.push(std::mem::replace(
                    b,
                    Block {
                        heading: String::new(),
                        line: 0,
                        text: String::new(),
                    },
                ));
                cur = None;
            }
            Some(b) => {
                b.text.push_str(l);
                b.text.push('\n');
            }
            None if l.trim_end() == "```sh" => {
                cur = Some(Block {
                    heading: heading.clone(),
                    line: i + 1,
                    text: String::new(),
                })
            }
            None if l.starts_with('#') => heading = l.trim_start_matches('#').trim().to_string(),
            None => {}
        }
    }
    out
}

/// Why a block is left out here, if it is.
fn skipped(b: &Block) -> Option<String> {
    let ublk = Path::new("/dev/ublk-control");
    let needs_ublk = b.text.contains("dmkit attach") || b.text.contains("serve --attach");
    (needs_ublk && !ublk.exists()).then(|| {
        format!(
            "{} does not exist: the kernel has no ublk driver here",
            ublk.display()
        )
    })
}

/// What a block's output must contain: the results its comments state.
fn promised(heading: &str) -> &'static [&'static str] {
    match heading {
        h if h.starts_with("Using it like dmsetup") => &[
            "dmkit serve: running in the background (pid ",
            "fast\t(253:0)\ntop\t(253:1)\n",  // ls
            "top (253:1)\n `-fast (253:0)\n", // ls --tree
            "0 4194304 linear 253:0 0\n",     // table top
            " 1 AA\n",                        // status fast: both stripes alive
            "Read Ahead:        512\n",       // info top
            "1 dependencies\t: (253, 0)\n",   // deps top
        ],
        h if h.contains("The real dmsetup") => &[
            "Driver version:    4.48.0\n", // dmsetup version, through the door
            "dlin\t(253:",                 // dmsetup ls
            "dz\t(253:",
            "0 2097152 linear ", // dmsetup table dlin
            "dlin: Created new region with 4 area(s) as region ID 0\n", // dmstats create
            "dlin                 -    0 area       3 768.00m 256.00m", // dmstats report
        ],
        h if h.contains("thin pool with snapshots") => &[
            "0 20971520 thin-pool 0 ", // status pool
            " 0/163840 - rw discard_passdown queue_if_no_space - 1024 \n",
            "2 dependencies\t: ", // deps pool: data and metadata
            "/data.img) (",
            "/meta.img)\n",
        ],
        h if h.contains("snapshot of a device") => &["0 2097152 snapshot ", "lv: merged\n"],
        h if h.contains("The cache tools") => &[
            "cache_writeback -> ",                 // the links
            "\n1\n62879.50 sectors\n",             // one dirty mapping; cache_metadata_size
            "1/1 blocks successfully copied\n2\n", // writeback; both clean after
        ],
        h if h.contains("dm-cache, lvmcache") => &[
            "0 2097152 cache 8 ", // status lvcache
            "/1024 ",
            " 1 writeback 2 migration_threshold 2048 smq 0 rw - \n",
            "lvcache: no dirty block left\n",
            "read 1048576/1048576 bytes at offset 0\n",
            "<superblock uuid=\"\" block_size=\"128\" nr_cache_blocks=\"1024\" policy=\"cleaner\" hint_width=\"4\">\n",
        ],
        h if h.contains("write cache") => {
            &["0 2097152 writecache 0 ", "mycache: nothing left to write back\n"]
        }
        h if h.contains("encrypted device") => &[
            "\tsector: 4096 [bytes]\n",      // luksDump: the data segment
            "version: 2\nheader: primary\n", // luks dump
            "\nsector size: 4096\ndata offset: 16777216 bytes (32768 sectors)\n",
            "  0: pbkdf2 sha256 ",
            "0 2064384 crypt aes-xts-plain64 ",
            " 0 ",
            "/vol.img 32768 1 sector_size:4096\n", // table secret
            "vol.img: no key slot matches this passphrase\nexit 2\n",
        ],
        h if h.contains("dm-verity") => &[
            "Root hash:",
            "\nhash type: 1\nalgorithm: sha256\ndata block size: 4096\nhash block size: 4096\ndata blocks: 2048\nsalt: 0123abcd\nhash start block: 1\nhash blocks: 17\n", // verity dump
            "hash device bytes: 73728\n0 16384 verity 1 ro.img ro.hash 4096 4096 2048 1 sha256 ", // verity table
            "0 16384 verity V\n", // status checked
            "  status:      verified\n", // veritysetup status, through the door
            "0 16384 verity C\n", // after the change
        ],
        h if h.contains("NBD over TCP with TLS") => &[
            "protocol: newstyle-fixed with TLS, using structured packets\n",
            "a client without TLS is refused\n",
            "Key stored to psk/keys.psk\n",
        ],
        h if h.contains("Ceph RBD") => &["0 2097152 linear rbd:rbd/vol:conf="],
        h if h.contains("incremental backup") => &["backup.raw\n", "full2.raw\n"],
        h if h.contains("dm-era") => &[
            "0 131072 era 8 ",
            "/1024 3 ", // status tracked: era 3, a snapshot held
            "<blocks>\n  <range begin=\"64\" end=\"66\"/>\n</blocks>",
            "16\n", // blocks dated era 1
        ],
        h if h.contains("The thin tools") => &[
            "bin/thin_check -> ",
            "1.1.0\n", // thin_check -V
        ],
        // and the extents block under the same heading
        h if h.contains("1024-segment") => &["1024\n", "seg.img flushes=", " linear 7:"],
        h if h.contains("Crash trials") => &[
            "100 trials of thin (",
            "100 trials of writecache (",
            "100 trials of snapshot (",
            "failed, as it must",
            "20 trials of thin (", // --kill
            "20 trials of writecache (",
        ],
        _ => &[],
    }
}

/// Everything a run may leave behind when it fails half-way: its daemons, the
/// Ceph cluster, mounts.
struct Cleanup(PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let d = &self.0;
        let _ = Command::new("fusermount3")
            .arg("-u")
            .arg(d.join("tsnap2-fuse"))
            .stderr(Stdio::null())
            .status();
        let _ = Command::new("umount")
            .arg(d.join("mnt"))
            .stderr(Stdio::null())
            .status();
        if d.join("ceph").exists() {
            let ci = Path::new(env!("CARGO_MANIFEST_DIR")).join("ci/ceph-cluster.sh");
            let _ = Command::new(ci).arg("stop").arg(d.join("ceph")).status();
        }
        if let Ok(pid) = std::fs::read_to_string(d.join("run/serve.pid")) {
            let _ = Command::new("kill").arg(pid.trim()).status();
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

/// Run the README once in a fresh directory; the report of what was skipped.
fn run_readme(tag: &str) -> Vec<String> {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).expect("README.md");
    let blocks = blocks(&readme);
    assert!(
        blocks.len() >= 10,
        "found {} sh blocks in README.md",
        blocks.len()
    );
    let dir = Scratch::new(tag);
    let _cleanup = Cleanup(dir.0.clone());
    // the recipes run from the repository's root, where ci/ is
    std::os::unix::fs::symlink(Path::new(env!("CARGO_MANIFEST_DIR")).join("ci"), dir.path("ci"))
        .expect("link ci");

    let mut script =
        String::from("set -eE -o pipefail\ntrap 'echo \"@@FAILED (exit $?): $BASH_COMMAND\"' ERR\n");
    let mut report = Vec::new();
    for (i, b) in blocks.iter().enumerate() {
        script.push_str(&format!("echo '@@BLOCK {i}'\n"));
        match skipped(b) {
            Some(why) => {
                report.push(format!(
                    "skipped the block at README.md:{} ({}): {why}",
                    b.line, b.heading
                ));
                script.push_str("true\n");
            }
            None => script.push_str(&b.text),
        }
    }
    script.push_str("echo '@@DONE'\n");
    std::fs::write(dir.path("readme.sh"), &script).expect("script");

    let log = dir.path("readme.log");
    let out = std::fs::File::create(&log).expect("log");
    let bin_dir = Path::new(BIN).parent().expect("bin dir");
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let t0 = Instant::now();
    let status = Command::new("bash")
        .arg("readme.sh")
        .current_dir(&dir.0)
        .env("PATH", path)
        .env_remove("DMKIT_RUN_DIR")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("log"))
        .stderr(out)
        .status()
        .expect("bash");
    let text = std::fs::read_to_string(&log).expect("log");
    assert!(
        status.success() && text.contains("@@DONE"),
        "the README stopped ({status}) after {:.0} s:\n{}",
        t0.elapsed().as_secs_f64(),
        tail(&text, 60)
    );

    // each block's output, by the markers; a section's promises hold for the
    // output of all its blocks
    let output_of = |i: usize| {
        let start = text.find(&format!("@@BLOCK {i}\n")).expect("block marker");
        let end = text[start + 1..].find("@@").map_or(text.len(), |e| start + 1 + e);
        &text[start..end]
    };
    for (i, b) in blocks.iter().enumerate() {
        let output = output_of(i);
        if skipped(b).is_some() {
            continue;
        }
        let last_of_section = blocks.get(i + 1).is_none_or(|n| n.heading != b.heading);
        let section: String = (0..=i)
            .filter(|&j| blocks[j].heading == b.heading)
            .map(output_of)
            .collect();
        for want in promised(&b.heading).iter().filter(|_| last_of_section) {
            assert!(
                section.contains(want),
                "README.md:{} ({}): the output lacks {want:?}:\n{}",
                b.line,
                b.heading,
                tail(&section, 40)
            );
        }
        // `md5sum A B   # equal`
        if b.text
            .lines()
            .any(|l| l.contains("md5sum") && l.trim_end().ends_with("# equal"))
        {
            let sums: Vec<&str> = output
                .lines()
                .filter_map(|l| l.split_once("  ").map(|x| x.0))
                .filter(|h| h.len() == 32 && h.chars().all(|c| c.is_ascii_hexdigit()))
                .collect();
            assert!(
                sums.len() >= 2 && sums.iter().all(|s| *s == sums[0]),
                "README.md:{}: the md5 sums commented `# equal` differ: {sums:?}",
                b.line
            );
        }
    }
    report.push(format!(
        "ran {} blocks in {:.1} s",
        blocks.len(),
        t0.elapsed().as_secs_f64()
    ));
    report
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The README top to bottom, twice: the second run in a fresh directory (a
/// recipe that leaves something behind that only its first run tolerates, or
/// that names the first directory, fails there).
#[test]
fn the_readme_runs_as_written_twice() {
    for tag in ["readme-1", "readme-2"] {
        let report = run_readme(tag);
        for r in &report {
            println!("{tag}: {r}");
        }
        // what it printed: one line per skipped block, then the summary
        let skips = report.iter().filter(|r| r.starts_with("skipped")).count();
        let ublk_here = Path::new("/dev/ublk-control").exists();
        // the blocks that need ublk: `serve --attach` with LVM, and the ublk recipe
        assert_eq!(skips, if ublk_here { 0 } else { 2 }, "{report:?}");
        assert!(report.last().is_some_and(|r| r.starts_with("ran ")), "{report:?}");
    }
}
