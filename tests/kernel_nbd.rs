//! The kernel's own NBD client on a dmkit device (issue 17, part 3): inside the
//! oracle's guest (a stock Debian kernel under qemu, tests/oracle/run.sh),
//! `dmkit serve` exports a linear device over a virtio disk and `nbd-client`
//! attaches it as /dev/nbd0, in netlink mode with two connections and in ioctl
//! mode (`-nonetlink`). On each: mkfs.ext4, files written, md5s recorded,
//! fstrim, umount, `e2fsck -fn` clean, mounted again, md5s equal. The kernel
//! driver sends flushes, FUA writes and trims as a filesystem makes them.
//! On Debian's 6.1 kernel and on the 6.12 series (bookworm-security), whose
//! guest also loads ublk_drv: the kernel the ublk frontend will need.
//!
//! A missing tool or kernel fails the test (ci/install.sh installs them).

use crate::common;
use crate::oracle;
use common::{need_all, tool_path, Scratch, BIN};

const DISK: u64 = 256 << 20;

#[test]
fn kernel_nbd_client_runs_ext4_on_a_dmkit_device_in_netlink_and_ioctl_mode() {
    let m = check_kernel(None);
    // the same boot has no ublk driver: `dmkit attach` fails in one line, exit 1
    let attach = oracle::marker(&m, "attach");
    assert!(
        attach.starts_with("dmkit_attach:_ublk_is_not_available:_/dev/ublk-control_does_not_exist_(load_the_driver_with_`modprobe_ublk_drv`")
            && attach.ends_with("__rc=1_")
            && attach.matches("__").count() == 1,
        "{attach}"
    );
}

#[test]
fn kernel_nbd_client_on_the_6_12_kernel_with_ublk_drv_loaded() {
    let m = check_kernel(Some("6.12"));
    assert_eq!(
        oracle::marker(&m, "ublk-control"),
        "present",
        "ublk_drv loads in the 6.12 guest"
    );
}

/// Boot the kernel series `series` (None: Debian's default) and run the checks;
/// the guest's markers.
fn check_kernel(series: Option<&str>) -> std::collections::BTreeMap<String, String> {
    need_all(&["nbd-client", "mke2fs", "e2fsck"]);
    let s = Scratch::new("kernel-nbd");
    let disk = s.sparse("disk.img", DISK);
    let bins = [
        BIN.to_string(),
        tool_path("nbd-client"),
        tool_path("mke2fs"),
        tool_path("e2fsck"),
    ]
    .join(" ");
    let sectors = DISK / 512;
    let script = format!(
        r#"
set -e
mkdir -p /run/dmkit /mnt /tmp /etc
ln -sf /bin/mke2fs /bin/mkfs.ext4
dmkit serve --run-dir /run/dmkit > /tmp/dmkit.log 2>&1 &
i=0; while [ ! -S /run/dmkit/nbd.sock ] && [ $i -lt 200 ]; do sleep 0.1; i=$((i+1)); done
dmkit --run-dir /run/dmkit create lin --table "0 {sectors} linear /dev/vda 0"
check() {{
  nbd-client -unix /run/dmkit/nbd.sock /dev/nbd0 -name lin $2
  # in ioctl mode the device is set up by nbd-client's child after the parent
  # returns (seen on 6.12): wait for its size
  i=0; while [ "$(cat /sys/block/nbd0/size)" = 0 ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
  echo "ORACLE size-$1 $(cat /sys/block/nbd0/size)"
  echo "ORACLE open-$1 $(dmkit --run-dir /run/dmkit info lin | sed -n 's/^Open count: *//p')"
  mkfs.ext4 -q -F -E nodiscard /dev/nbd0
  mount -t ext4 /dev/nbd0 /mnt
  for f in 1 2 3 4 5 6; do dd if=/dev/urandom of=/mnt/f$f bs=64k count=$((f * 8)) 2>/dev/null; done
  sync
  (cd /mnt && md5sum f1 f2 f3 f4 f5 f6) > /tmp/sums
  rm /mnt/f2
  echo "ORACLE trim-$1 $(fstrim -v /mnt 2>&1 | tr ' ' _)"
  umount /mnt
  e2fsck -fn /dev/nbd0 > /tmp/fsck 2>&1 && echo "ORACLE fsck-$1 clean" || {{ echo "ORACLE fsck-$1 dirty"; cat /tmp/fsck; }}
  mount -t ext4 /dev/nbd0 /mnt
  grep -v f2 /tmp/sums > /tmp/sums2
  (cd /mnt && md5sum -c /tmp/sums2 > /dev/null) && echo "ORACLE md5-$1 same" || echo "ORACLE md5-$1 differ"
  umount /mnt
  nbd-client -d /dev/nbd0
  sleep 0.5
}}
# without ublk_drv (Debian's 6.1 has none): attach says what to do
if [ ! -c /dev/ublk-control ]; then
  echo "ORACLE attach $({{ dmkit --run-dir /run/dmkit attach lin 2>&1; echo " rc=$?"; }} | tr ' \n' __)"
fi
check netlink "-connections 2"
check ioctl -nonetlink
echo "ORACLE flushes $(dmkit --run-dir /run/dmkit stats lin | sed -n 's/^.* flushes=\([0-9]*\).*/\1/p')"
echo "ORACLE daemon $(kill -0 $(pidof dmkit) && echo alive)"
echo "ORACLE ublk-control $([ -c /dev/ublk-control ] && echo present || echo absent)"
"#
    );
    let modules = "drivers/block/nbd.ko lib/crc16.ko fs/mbcache.ko fs/jbd2/jbd2.ko fs/ext4/ext4.ko \
                   drivers/block/ublk_drv.ko";
    let mut env = vec![("ORACLE_BINS", bins.as_str()), ("ORACLE_MODULES", modules)];
    if let Some(k) = series {
        env.push(("DMKIT_ORACLE_KERNEL", k));
    }
    let serial = oracle::run_env(&s.0, &script, &[&disk], &env);
    let m = oracle::markers(&serial);
    // the kernel opens as many connections as asked: dmkit offers multi-conn
    assert_eq!(
        oracle::marker(&m, "open-netlink"),
        "2",
        "netlink: two connections"
    );
    assert_eq!(oracle::marker(&m, "open-ioctl"), "1", "ioctl: one connection");
    for mode in ["netlink", "ioctl"] {
        assert_eq!(
            oracle::marker(&m, &format!("size-{mode}")),
            sectors.to_string(),
            "{mode}: size"
        );
        assert_eq!(
            oracle::marker(&m, &format!("fsck-{mode}")),
            "clean",
            "{mode}: e2fsck"
        );
        assert_eq!(
            oracle::marker(&m, &format!("md5-{mode}")),
            "same",
            "{mode}: files"
        );
        let trim = oracle::marker(&m, &format!("trim-{mode}"));
        assert!(
            trim.contains("trimmed"),
            "{mode}: fstrim reached the device: {trim}"
        );
    }
    assert_eq!(oracle::marker(&m, "daemon"), "alive");
    // the kernel's client sent flushes (fsync, umount) and they reached the disk
    let flushes: u64 = oracle::marker(&m, "flushes").parse().expect("flush count");
    assert!(flushes > 0, "flushes to /dev/vda: {flushes}");
    assert!(
        !serial.contains("ORACLE-INSMOD-FAILED"),
        "a module did not load:\n{serial}"
    );
    m
}
