//! The target versions dmkit reports are one kernel's: Linux 6.12's (the
//! kernel whose dm ioctl interface version, 4.48.0, the door reports), read from
//! that kernel's own `dmsetup targets` in the oracle's guest. LVM and cryptsetup
//! decide what to send by these numbers, so a mix of kernels would promise
//! features that are not there.

use crate::common;
use crate::oracle;

use common::{Daemon, Scratch};

/// Targets dmkit has that the kernel has not: (name, why).
const DMKIT_ONLY: &[(&str, &str)] = &[
    (
        "xor",
        "the toy transforming target that shows how a target owns its buffers (docs/targets.md)",
    ),
    (
        "cdp",
        "continuous data protection: every flush a point in time (docs/design/cdp.md); the kernel has none",
    ),
    (
        "cdp-point",
        "a cdp device as it was at one of its points, read-only",
    ),
];

#[test]
fn target_versions_are_linux_6_12s() {
    let s = Scratch::new("versions");
    let script = "dmsetup targets | while read n v; do echo \"ORACLE target-$n $v\"; done\n\
                  echo \"ORACLE driver $(dmsetup version | sed -n 's/^Driver version: *//p')\"\n";
    // the targets dm-mod does not carry itself
    let modules = format!(
        "drivers/md/dm-flakey.ko drivers/md/dm-delay.ko drivers/md/dm-zero.ko drivers/md/dm-crypt.ko \
         lib/reed_solomon/reed_solomon.ko drivers/md/dm-verity.ko drivers/md/dm-era.ko \
         drivers/md/dm-cache.ko drivers/md/dm-cache-smq.ko drivers/md/dm-log-writes.ko {} drivers/md/dm-integrity.ko",
        oracle::RAID_MODULES
    );
    let serial = oracle::run_env(
        &s.0,
        script,
        &[],
        &[("ORACLE_MODULES", &modules), ("DMKIT_ORACLE_KERNEL", "6.12")],
    );
    let m = oracle::markers(&serial);
    let kernel: Vec<(String, String)> = m
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("target-").map(|n| (n.to_string(), v.clone())))
        .collect();
    assert!(kernel.len() >= 12, "the guest listed its targets: {m:?}");

    let d = Daemon::start("versions");
    let mut ours: Vec<(String, String)> = d
        .ok(&["targets"])
        .lines()
        .filter_map(|l| l.split_once(char::is_whitespace))
        .map(|(n, v)| (n.to_string(), v.trim().to_string()))
        .collect();
    ours.sort();
    ours.retain(|(n, _)| !DMKIT_ONLY.iter().any(|(o, _)| o == n));
    assert_eq!(ours, kernel, "dmkit's targets and versions are the 6.12 kernel's");

    // and the door reports that kernel's interface version
    let door = common::run(
        std::process::Command::new(common::BIN)
            .arg("--run-dir")
            .arg(&d.run)
            .args(["exec", "--"])
            .arg(common::tool_path("dmsetup"))
            .arg("version")
            .env("LC_ALL", "C"),
    );
    let driver = door
        .lines()
        .find_map(|l| l.strip_prefix("Driver version:"))
        .map(str::trim)
        .unwrap_or_else(|| panic!("no driver version in {door}"));
    assert_eq!(
        driver,
        oracle::marker(&m, "driver"),
        "the door's interface version"
    );
}
