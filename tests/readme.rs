//! The README and the manual, run as a user runs them: the README's ```sh blocks,
//! then the manual's pages' in the order docs/manual/index.md lists the pages, in
//! one bash, in one scratch directory, with this build's dmkit first on PATH; then
//! again in a fresh directory. The blocks that need ublk run in the 6.12 kernel
//! under qemu, and here too where this kernel has ublk. Each block's stated results
//! are checked: the output its comments promise, and `# equal` checksums. And the
//! documents' relative links lead to files that exist.

use crate::common;
use crate::oracle;

use common::{tool_path, Scratch, BIN};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A ```sh block of the README or of a manual page: where it is, the heading
/// above it and its text.
struct Block {
    file: String,
    heading: String,
    line: usize,
    text: String,
}

impl Block {
    /// `docs/manual/thin.md:42`
    fn at(&self) -> String {
        format!("{}:{}", self.file, self.line)
    }
}

/// The ```sh blocks of one document (`file`, relative to the repository).
fn blocks(file: &str, doc: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut heading = String::new();
    let mut cur: Option<Block> = None;
    for (i, l) in doc.lines().enumerate() {
        match &mut cur {
            Some(b) if l.trim_end() == "```" => {
                out.push(std::mem::replace(
                    b,
                    Block {
                        file: String::new(),
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
                    file: file.to_string(),
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

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The manual's pages in the order its index lists them (its links to pages
/// beside it), each listed once; every page of docs/manual/ must be listed.
fn manual_pages() -> Vec<String> {
    let index = std::fs::read_to_string(repo().join("docs/manual/index.md")).expect("docs/manual/index.md");
    let mut pages: Vec<String> = Vec::new();
    for (_, target) in links(&index) {
        let page = target.split('#').next().unwrap_or_default();
        if page.ends_with(".md")
            && !page.contains('/')
            && page != "index.md"
            && !pages.iter().any(|p| p == page)
        {
            pages.push(page.to_string());
        }
    }
    let mut unlisted: Vec<String> = std::fs::read_dir(repo().join("docs/manual"))
        .expect("docs/manual")
        .map(|e| e.expect("docs/manual").file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md") && n != "index.md" && !pages.contains(n))
        .collect();
    unlisted.sort();
    assert!(
        unlisted.is_empty(),
        "docs/manual/index.md lists no link to {unlisted:?}: their blocks would not run"
    );
    pages
}

/// The documents whose blocks run, in order: README.md, then the manual's pages.
fn documents() -> Vec<String> {
    std::iter::once("README.md".to_string())
        .chain(manual_pages().into_iter().map(|p| format!("docs/manual/{p}")))
        .collect()
}

/// A block that needs ublk (`dmkit attach`, `serve --attach`): it runs here
/// where the kernel has ublk, and always in the 6.12 guest
/// (`the_readmes_ublk_blocks_run_in_the_6_12_guest`).
fn needs_ublk(b: &Block) -> bool {
    let attach = b
        .text
        .lines()
        .any(|l| l.contains("dmkit attach") && !l.contains("--vhost-user"));
    attach || b.text.contains("serve --attach")
}

/// Why a block is left to the guest, if it is.
fn skipped(b: &Block) -> Option<String> {
    let ublk = Path::new("/dev/ublk-control");
    (needs_ublk(b) && !ublk.exists()).then(|| {
        format!(
            "{} does not exist: the kernel has no ublk driver here; it runs in the 6.12 guest \
             (the_readmes_ublk_blocks_run_in_the_6_12_guest)",
            ublk.display()
        )
    })
}

/// What a block's output must contain: the results its comments state.
fn promised(heading: &str) -> &'static [&'static str] {
    match heading {
        h if h.starts_with("Using it like dmsetup") => &[
            "dmkit serve: running in the background (pid ",
            "fast\t(511:0)\ntop\t(511:1)\n",  // ls
            "top (511:1)\n `-fast (511:0)\n", // ls --tree
            "0 4194304 linear 511:0 0\n",     // table top
            " 1 AA\n",                        // status fast: both stripes alive
            "Read Ahead:        512\n",       // info top
            "1 dependencies\t: (511, 0)\n",   // deps top
        ],
        h if h.contains("The real dmsetup") => &[
            "Driver version:    4.48.0\n", // dmsetup version, through the door
            "dlin\t(511:",                 // dmsetup ls
            "dz\t(511:",
            "0 2097152 linear ", // dmsetup table dlin
            "dlin: Created new region with 4 area(s) as region ID 0\n", // dmstats create
            "dlin                 -    0 area       3 768.00m 256.00m", // dmstats report
        ],
        h if h.starts_with("Every flush a point in time") => &[
            "flush:",                                  // the mark's point
            " mark:before-upgrade\n",                   // points
            "read 65536/65536 bytes at offset 0\n",     // the point, the device
            "restored 1 devices (0 attached as block devices)",
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
        h if h.starts_with("Recipe: dmkit as TopoLVM's lvmd") => &[
            "serving TopoLVM's lvmd protocol on ",
            "/lvmd.sock\nserving CSI SnapshotMetadata on ",
            "/snapshot-metadata.sock\n",
        ],
        h if h.starts_with("Recipe: a VM on a dmkit disk") => &[
            "/vmdisk.sock\nBlock device:      vhost-user:/", // attach; info
            // the guest's line (its console ends lines with \r\n)
            "/vmdisk.sock\nthe guest sees /dev/vda: 2097152 sectors, serial vmdisk\r\n",
            "\nwritten by the guest\n", // head of the file
        ],
        h if h.starts_with("Recipe: a kernel block device (ublk)") => &[
            "/dev/ublkb0\n",                        // attach
            "Block device:      /dev/ublkb0\n512\n", // info; a linear's discard granularity
            "restored 1 devices (1 attached as block devices)",
            "lost+found\n", // ls after the restart
        ],
        h if h.starts_with("With ublk, the kernel opens the devices") => &[
            "Logical volume \"th\" created.\n",
            "Volume group \"vglab\" successfully removed\n",
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
        h if h.contains("authenticated encryption") => &[
            " 32768 32 J 8 block_size:4096 journal_sectors:792 interleave_sectors:32768 buffer_sectors:128 journal_watermark:50 commit_time:10000 fix_padding fix_hmac\n", // table av_dif
            "0 96736 crypt capi:authenc(hmac(sha256),xts(aes))-plain64 0 2 integrity:32:aead sector_size:4096\n", // table av, cut
            "read back\n",
            "dd: error reading '/dev/mapper/av': Invalid or incomplete multibyte or wide character\nthe read failed\n",
            "av and av_dif are gone\n",
        ],
        h if h.contains("dm-integrity") => &[
            "provided_data_sectors 129160\nflags fix_padding fix_hmac \n", // integritysetup dump
            " 0 4 J 8 journal_sectors:880 interleave_sectors:32768 buffer_sectors:128 journal_watermark:50 commit_time:10000 fix_padding fix_hmac internal_hash:crc32c\n", // table ig
            // the read stops at the changed block, the one before it right
            "qemu-img: error while reading from input image file: Input/output error\nthe read failed\n",
            "the first MiB read back\n",
            "0 129160 integrity 1 129160 -\n", // status after the changed byte
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
        h if h.starts_with("Recording every write") => &[
            "replayed 4 entries: 1 writes, 0 discards, 2 flushes, 1 marks\n",
            "read 65536/65536 bytes at offset 0\n",
            " mark sector 0 count 0 before\n",
            " mark sector 0 count 0 dm-log-writes-end\n",
        ],
        h if h.contains("Crash trials") => &[
            "100 trials of thin: 100 passed, 0 failed;",
            "100 trials of writecache: 100 passed, 0 failed;",
            "100 trials of snapshot: 100 passed, 0 failed;",
            "failed, as it must",
            "20 trials of thin: 20 passed, 0 failed;", // --kill
            "20 trials of writecache: 20 passed, 0 failed;",
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
        for run in ["run", "lw-run"] {
            if let Ok(pid) = std::fs::read_to_string(d.join(run).join("serve.pid")) {
                let _ = Command::new("kill").arg(pid.trim()).status();
                std::thread::sleep(Duration::from_millis(500));
            }
        }
    }
}

/// Run the README and the manual once in a fresh directory; the report of what
/// was skipped.
fn run_readme(tag: &str) -> Vec<String> {
    let blocks = all_blocks();
    let dir = Scratch::new(tag);
    let _cleanup = Cleanup(dir.0.clone());
    // the recipes run from the repository's root, where ci/ is
    std::os::unix::fs::symlink(repo().join("ci"), dir.path("ci")).expect("link ci");

    let mut report: Vec<String> = blocks
        .iter()
        .filter_map(|b| {
            skipped(b).map(|why| format!("skipped the block at {} ({}): {why}", b.at(), b.heading))
        })
        .collect();
    std::fs::write(dir.path("readme.sh"), script(&blocks, |b| skipped(b).is_none())).expect("script");

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
    check_output(
        &blocks,
        &text,
        |b| skipped(b).is_none(),
        &format!("{status} after {:.0} s", t0.elapsed().as_secs_f64()),
    );
    assert!(status.success(), "bash: {status}");
    report.push(format!(
        "ran {} blocks in {:.1} s",
        blocks.len(),
        t0.elapsed().as_secs_f64()
    ));
    report
}

/// Every document's ```sh blocks, in order.
fn all_blocks() -> Vec<Block> {
    let docs = documents();
    let blocks: Vec<Block> = docs
        .iter()
        .flat_map(|f| {
            let doc = std::fs::read_to_string(repo().join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
            blocks(f, &doc)
        })
        .collect();
    assert!(
        blocks.len() >= 10,
        "found {} sh blocks in {}",
        blocks.len(),
        docs.join(", ")
    );
    blocks
}

/// A bash script of the blocks `run` picks, each after its `@@BLOCK i` line,
/// stopping at the first command that fails (`@@FAILED`), `@@DONE` at the end.
fn script(blocks: &[Block], run: impl Fn(&Block) -> bool) -> String {
    let mut script =
        String::from("set -eE -o pipefail\ntrap 'echo \"@@FAILED (exit $?): $BASH_COMMAND\"' ERR\n");
    for (i, b) in blocks.iter().enumerate().filter(|(_, b)| run(b)) {
        script.push_str(&format!("echo '@@BLOCK {i}'\n"));
        script.push_str(&b.text);
    }
    script.push_str("echo '@@DONE'\n");
    script
}

/// The output `text` of [`script`] of the blocks `ran` picks: it ran to its end,
/// each section's output has what its comments promise, and `# equal` sums are
/// equal. `how`: how the run ended, for the message.
fn check_output(blocks: &[Block], text: &str, ran: impl Fn(&Block) -> bool, how: &str) {
    // the block that was running: the last marker in the log
    let last = text
        .rsplit("@@BLOCK ")
        .next()
        .and_then(|r| r.lines().next())
        .and_then(|n| n.trim().parse::<usize>().ok())
        .and_then(|i| blocks.get(i))
        .map_or_else(String::new, |b| {
            format!(" in the block at {} ({})", b.at(), b.heading)
        });
    assert!(
        text.contains("@@DONE") && !text.contains("@@FAILED"),
        "the README and the manual stopped ({how}){last}:\n{}",
        tail(text, 60)
    );
    // each block's output, by the markers; a section's promises hold for the
    // output of all its blocks
    let output_of = |i: usize| {
        let start = text.find(&format!("@@BLOCK {i}\n")).expect("block marker");
        let end = text[start + 1..].find("@@").map_or(text.len(), |e| start + 1 + e);
        &text[start..end]
    };
    for (i, b) in blocks.iter().enumerate().filter(|(_, b)| ran(b)) {
        let output = output_of(i);
        let last_of_section = blocks
            .iter()
            .skip(i + 1)
            .find(|n| ran(n))
            .is_none_or(|n| n.heading != b.heading);
        let section: String = (0..=i)
            .filter(|&j| blocks[j].heading == b.heading && ran(&blocks[j]))
            .map(output_of)
            .collect();
        for want in promised(&b.heading).iter().filter(|_| last_of_section) {
            assert!(
                section.contains(want),
                "{} ({}): the output lacks {want:?}:\n{}",
                b.at(),
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
                "{}: the md5 sums commented `# equal` differ: {sums:?}",
                b.at()
            );
        }
    }
}

/// The markdown links of a document outside code, with their line numbers:
/// inline ones, `[text](target)` and `![alt](target)`, and reference
/// definitions, `[label]: target`.
fn links(doc: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    // paragraphs outside fenced blocks: (first line, text)
    let mut paragraphs: Vec<(usize, String)> = Vec::new();
    let mut fenced = false;
    let mut cur: Option<(usize, String)> = None;
    for (i, l) in doc.lines().enumerate() {
        if l.trim_start().starts_with("```") {
            fenced = !fenced;
            paragraphs.extend(cur.take());
            continue;
        }
        if fenced || l.trim().is_empty() {
            paragraphs.extend(cur.take());
            continue;
        }
        let p = cur.get_or_insert_with(|| (i + 1, String::new()));
        p.1.push_str(l);
        p.1.push('\n');
    }
    paragraphs.extend(cur);
    for (first, p) in paragraphs {
        // code spans out: a run of backticks up to the next run as long
        let mut text = String::new();
        let mut rest = p.as_str();
        while let Some(at) = rest.find('`') {
            text.push_str(&rest[..at]);
            let run = rest[at..].len() - rest[at..].trim_start_matches('`').len();
            let after = &rest[at + run..];
            let fence = "`".repeat(run);
            let close = after
                .match_indices(&fence)
                .find(|&(j, _)| !after[..j].ends_with('`') && !after[j + run..].starts_with('`'));
            match close {
                Some((j, _)) => {
                    // keep the newlines, for the line numbers
                    text.extend(after[..j].chars().filter(|&c| c == '\n'));
                    rest = &after[j + run..];
                }
                None => {
                    text.push_str(&fence);
                    rest = after;
                }
            }
        }
        text.push_str(rest);
        let line_of = |at: usize| first + text[..at].matches('\n').count();
        for (at, _) in text.match_indices("](") {
            let target = &text[at + 2..];
            let end = target.find([')', ' ', '\n']).unwrap_or(target.len());
            out.push((line_of(at), target[..end].to_string()));
        }
        let mut offset = 0;
        for l in text.split_inclusive('\n') {
            let target = l
                .trim_start()
                .strip_prefix('[')
                .and_then(|d| d.split_once("]:"))
                .filter(|(label, _)| !label.contains(']'))
                .and_then(|(_, t)| t.split_whitespace().next());
            if let Some(t) = target {
                out.push((line_of(offset), t.to_string()));
            }
            offset += l.len();
        }
    }
    out
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The README and the manual top to bottom, twice: the second run in a fresh directory (a
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
        // the blocks that need ublk (`serve --attach` with LVM, and the ublk
        // recipe) run in the guest where this kernel has no ublk
        assert_eq!(skips, if ublk_here { 0 } else { 2 }, "{report:?}");
        assert!(report.last().is_some_and(|r| r.starts_with("ran ")), "{report:?}");
    }
}

/// The blocks that need ublk, run as written in the 6.12 kernel with
/// `ublk_drv` under qemu (issue 45: nothing is skipped anywhere), with bash,
/// Debian's lvm (its own lvm.conf), util-linux's losetup, mke2fs and
/// thin-provisioning-tools' thin_check brought from the host, as a Debian host
/// with ublk has them; the guest's busybox does the rest (mount, truncate, ls).
#[test]
fn the_readmes_ublk_blocks_run_in_the_6_12_guest() {
    let blocks = all_blocks();
    let ours: Vec<String> = blocks.iter().filter(|b| needs_ublk(b)).map(Block::at).collect();
    println!("blocks that need ublk: {}", ours.join(", "));
    // `serve --attach` with LVM, and the ublk recipe
    assert_eq!(ours.len(), 2, "{ours:?}");
    let body = script(&blocks, needs_ublk);
    assert!(
        !body.contains("@@SCRIPT"),
        "the heredoc's end marker is in the blocks"
    );
    let guest = format!(
        r#"set -e
# what a Debian host has and this guest's busybox root does not
mkdir -p /run/lock /mnt /tmp /work /usr/bin
ln -sf /bin/mke2fs /sbin/mkfs.ext4
ln -sf /bin/bash /usr/bin/bash
mount -t tmpfs -o size=2g tmpfs /work
cd /work
export PATH=/sbin:/bin:/usr/sbin:/usr/bin LC_ALL=C
echo "ORACLE bash $(bash -c 'echo ${{BASH_VERSINFO[0]}}')"
cat > /work/readme.sh <<'@@SCRIPT'
{body}@@SCRIPT
bash /work/readme.sh 2>&1 || echo "@@FAILED (bash exit $?)"
"#
    );
    let s = Scratch::new("readme-guest");
    let bins = [
        tool_path("bash"),
        BIN.to_string(),
        tool_path("lvm"),
        tool_path("losetup"),
        tool_path("mke2fs"),
    ]
    .join(" ");
    let serial = oracle::run_env(
        &s.0,
        &guest,
        &[],
        &[
            ("ORACLE_BINS", bins.as_str()),
            ("ORACLE_FILES", "/etc/lvm/lvm.conf /usr/sbin/thin_check"),
            (
                "ORACLE_MODULES",
                &format!("{} drivers/block/loop.ko", oracle::EXT4_UBLK_MODULES),
            ),
            ("ORACLE_DM_LATE", "1"),
            ("DMKIT_ORACLE_KERNEL", "6.12"),
            ("DMKIT_ORACLE_TIMEOUT", "900"),
            ("ORACLE_MEM", "1024"),
        ],
    );
    let m = oracle::markers(&serial);
    assert_eq!(oracle::marker(&m, "bash"), "5", "the host's bash runs the blocks");
    check_output(&blocks, &serial, needs_ublk, "in the guest");
}

/// Every relative link of README.md, RELIABILITY.md, BENCHMARKS.md and docs/
/// leads to a file that exists (its #anchor aside; web links are not followed).
/// A link that starts with `/` is read from the repository's root, as GitHub
/// reads it. (`mkdocs build --strict` checks the anchors of links inside docs/.)
#[test]
fn readme_links_exist() {
    fn markdown_under(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let p = e.expect("docs").path();
            if p.is_dir() {
                markdown_under(&p, out);
            } else if p.extension().is_some_and(|x| x == "md") {
                out.push(p);
            }
        }
    }
    let mut files: Vec<PathBuf> = ["README.md", "RELIABILITY.md", "BENCHMARKS.md"]
        .iter()
        .map(|f| repo().join(f))
        .collect();
    markdown_under(&repo().join("docs"), &mut files);
    let mut dead = Vec::new();
    let mut checked = 0;
    for f in &files {
        let doc = std::fs::read_to_string(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let name = f.strip_prefix(repo()).unwrap_or(f).display().to_string();
        for (line, target) in links(&doc) {
            let target = target.trim_start_matches('<').trim_end_matches('>');
            if target.is_empty()
                || target.starts_with('#')
                || ["http://", "https://", "mailto:"]
                    .iter()
                    .any(|s| target.starts_with(s))
            {
                continue;
            }
            let path = target.split(['#', '?']).next().unwrap_or_default();
            let file = match path.strip_prefix('/') {
                Some(p) => repo().join(p),
                None => f.parent().expect("a file's directory").join(path),
            };
            checked += 1;
            if !file.is_file() {
                dead.push(format!("{name}:{line}: {target}: no such file"));
            }
        }
    }
    assert!(checked >= 20, "only {checked} links found: is the parser blind?");
    assert!(dead.is_empty(), "dead links:\n{}", dead.join("\n"));
}
