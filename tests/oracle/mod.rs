//! The kernel oracle from a test: boot a stock Debian kernel under qemu
//! (`tests/oracle/run.sh`, see shared/specs/kernel-oracle.md) with a script and
//! disk images, and read what the guest printed.
//!
//! A missing tool or a failed kernel download fails the test (ci/install.sh
//! installs and fetches them).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Shell helpers for guest scripts: `sum DEV` (md5 of a device, caches dropped)
/// and `mk NAME TABLE` (create and make its node).
pub const GUEST_HELPERS: &str = r#"
set -e
sum() { echo 3 > /proc/sys/vm/drop_caches; md5sum < "$1" | cut -d' ' -f1; }
mk() { dmsetup create "$1" --table "$2"; dmsetup mknodes; }
"#;

/// Shell for guest scripts that run dmkit (its binary in `ORACLE_BINS`): the
/// directories, `mkfs.ext4`, `$D` (the CLI of the daemon on /run/dmkit) and
/// `start [ARGS]`: the daemon started (its pid in /tmp/pid, its log appended
/// to /tmp/dmkit.log), back once it answers.
pub const DMKIT_GUEST: &str = r#"
mkdir -p /run/dmkit /mnt /tmp /etc
ln -sf /bin/mke2fs /bin/mkfs.ext4
D="dmkit --run-dir /run/dmkit"
start() {
  rm -f /run/dmkit/control.sock
  dmkit serve --run-dir /run/dmkit $1 >> /tmp/dmkit.log 2>&1 &
  echo $! > /tmp/pid
  i=0; while [ ! -S /run/dmkit/control.sock ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
  $D version > /dev/null
}
"#;

/// The modules (`ORACLE_MODULES`) for ext4 on a ublk device in the 6.12 guest.
pub const EXT4_UBLK_MODULES: &str =
    "lib/crc16.ko fs/mbcache.ko fs/jbd2/jbd2.ko fs/ext4/ext4.ko drivers/block/ublk_drv.ko";

/// The modules (`ORACLE_MODULES`) for the kernel's dm-raid in the 6.12 guest,
/// each after those it needs.
pub const RAID_MODULES: &str = "crypto/xor.ko lib/raid6/raid6_pq.ko crypto/async_tx/async_tx.ko \
     crypto/async_tx/async_memcpy.ko crypto/async_tx/async_xor.ko crypto/async_tx/async_pq.ko \
     crypto/async_tx/async_raid6_recov.ko drivers/md/md-mod.ko drivers/md/raid456.ko drivers/md/raid1.ko \
     drivers/md/raid0.ko drivers/md/raid10.ko drivers/md/dm-raid.ko";

/// The modules (`ORACLE_MODULES`) for the kernel's dm-integrity in the 6.12
/// guest, each after those it needs.
pub const INTEGRITY_MODULES: &str =
    "crypto/xor.ko crypto/async_tx/async_tx.ko crypto/async_tx/async_xor.ko drivers/md/dm-integrity.ko";

/// Boot the kernel with `script` (written into `dir`) and the disks; the serial
/// output.
pub fn run(dir: &Path, script: &str, disks: &[&Path]) -> String {
    run_env(dir, script, disks, &[])
}

/// [`run`] with environment for run.sh (`ORACLE_BINS`, `ORACLE_MODULES`).
pub fn run_env(dir: &Path, script: &str, disks: &[&Path], env: &[(&str, &str)]) -> String {
    let run = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/oracle/run.sh");
    let sp = dir.join("guest.sh");
    std::fs::write(&sp, script).expect("write script");
    let out = Command::new("bash")
        .arg(&run)
        .arg(&sp)
        .args(disks)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("run tests/oracle/run.sh");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_ne!(
        out.status.code(),
        Some(77),
        "kernel oracle unavailable (ci/install.sh installs it):\n{stderr}"
    );
    assert!(
        out.status.success() && stdout.contains("ORACLE-EXIT 0"),
        "oracle run failed ({:?}):\nserial:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    eprintln!("--- guest serial ---\n{stdout}--- end ---");
    stdout
}

/// Wait until the guest has printed `marker` on its serial console.
pub fn wait_for(serial: &Path, marker: &str) {
    let t0 = Instant::now();
    loop {
        let s = std::fs::read_to_string(serial).unwrap_or_default();
        if s.contains(marker) {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(400),
            "the guest never printed {marker:?}:\n{s}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Tell the guest something: four bytes at the start of its mailbox disk.
pub fn post(mailbox: &Path, word: &str) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(mailbox)
        .expect("mailbox");
    f.write_all_at(word.as_bytes(), 0).expect("post");
    f.sync_all().expect("sync mailbox");
}

/// The guest's `ORACLE <key> <value...>` lines.
pub fn markers(serial: &str) -> BTreeMap<String, String> {
    serial
        .lines()
        .filter_map(|l| l.trim().strip_prefix("ORACLE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        .collect()
}

pub fn marker<'a>(m: &'a BTreeMap<String, String>, k: &str) -> &'a str {
    m.get(k)
        .map(String::as_str)
        .unwrap_or_else(|| panic!("guest printed no {k} marker: {m:?}"))
}

/// md5 of `bytes`, as the guest's md5sum prints it.
pub fn md5(bytes: &[u8]) -> String {
    let mut c = Command::new("md5sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("md5sum");
    use std::io::Write;
    let mut stdin = c.stdin.take().unwrap();
    let data = bytes.to_vec();
    let w = std::thread::spawn(move || stdin.write_all(&data).expect("feed md5sum"));
    let out = c.wait_with_output().expect("md5sum");
    w.join().unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}
