//! vhost-user-blk (issue 48): dmkit devices as a virtual machine's disks, with
//! the daemon on the host and QEMU's `vhost-user-blk-pci` in front of them, the
//! oracle's guest (6.1, TCG, two vCPUs) using them through its `virtio_blk`
//! driver. One boot for every check:
//!
//! - The guest sees each disk as the table describes it: its size, one queue
//!   per vCPU, a write cache, discards where the stack has them, its serial
//!   (GET_ID) the device's name, a read-only device read-only (a write refused,
//!   its bytes as on the host).
//! - fio with `--verify=crc32c` on the raw linear disk, two jobs on two queues.
//! - The guest turns the write cache off (`cache_type`, CONFIG_WCE): its writes
//!   reach the backing file as FUA writes (counted by `dmkit stats`).
//! - ext4 on a thin, a writecache, a crypt and a cdp device: `fstrim` in the guest
//!   reaches the pool (its mapped blocks, sampled on the host, fall by the
//!   file's size).
//! - While the guest writes (fio with verify on the linear disk, and on each
//!   filesystem files made durable with fsync before their md5 is recorded),
//!   the host kills the daemon (SIGKILL) twice and `serve --restore` listens
//!   again: QEMU reconnects, the guest sees no I/O error, fio's verify passes,
//!   every durable file reads back the same, e2fsck finds the four clean. The
//!   crypt device comes back suspended without its key (never recorded), the
//!   guest's I/O on it waiting, until the host sets the key and resumes it.
//! - The cdp disk's newest point (`cdp@flush:N` over NBD), taken by the
//!   guest's last flush, holds the same bytes as the device and a clean ext4.
//! - `detach --force` of the linear disk while the guest writes to it, and an
//!   attach again: QEMU reconnects as after a kill (the batches in hand are
//!   given back before the connection is cut).
//! - Refusals as with ublk: removal of an attached device, a detach while the
//!   VM is connected, a resume that changes the size, a second attach, a socket
//!   path that is an ordinary file (left untouched) or already served.
//! - Detach after the VM is gone removes the sockets; the devices can be removed.
//! - The daemon logged no panic and no error.
//!
//! A missing tool or kernel fails the test (ci/install.sh installs them).

use crate::common;
use crate::oracle;
use common::{tool_path, Daemon};
use oracle::{post, wait_for};
use std::time::Duration;

use common::MIB;
const DISKS: [&str; 6] = ["lin", "thin", "ro", "wc", "cr", "cdp"];
/// The crypt disk's key (never recorded: after a restart the host sets it again).
const KEY: &str = "5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c5c";

/// The pool's mapped data blocks.
fn pool_used(d: &Daemon) -> u64 {
    let st = d.ok(&["status", "pool"]);
    let used = st.split_whitespace().nth(5).and_then(|f| f.split('/').next());
    used.and_then(|u| u.parse().ok())
        .unwrap_or_else(|| panic!("pool status: {st}"))
}

#[test]
fn a_guest_uses_dmkit_devices_over_vhost_user_blk_across_daemon_kills() {
    let d = Daemon::start("vhost");
    let s = &d.dir;
    let lin = s.sparse("lin.img", 256 * MIB);
    let meta = s.sparse("meta.img", 16 * MIB);
    let data = s.sparse("data.img", 512 * MIB);
    let ro = common::image(s, "ro.img", 8 * MIB, Some(7));
    let origin = s.sparse("origin.img", 256 * MIB);
    let cache = s.sparse("cache.img", 64 * MIB);
    let mailbox = s.sparse("mailbox.img", MIB);
    let crypt = s.sparse("crypt.img", 128 * MIB);
    let (cdp_data, cdp_journal) = (
        s.sparse("cdp-data.img", 256 * MIB),
        s.sparse("cdp-journal.img", 64 * MIB),
    );
    let base = s.path("");
    let sock = |n: &str| base.join(format!("{n}.sock"));
    let sectors = |b: u64| b / 512;
    d.create(
        "lin",
        &format!("0 {} linear {} 0", sectors(256 * MIB), lin.display()),
    );
    d.create(
        "pool",
        &format!(
            "0 {} thin-pool {} {} 128 0",
            sectors(512 * MIB),
            meta.display(),
            data.display()
        ),
    );
    d.ok(&["message", "pool", "0", "create_thin", "0"]);
    d.create(
        "thin",
        &format!("0 {} thin /dev/mapper/pool 0", sectors(384 * MIB)),
    );
    d.ok(&[
        "create",
        "ro",
        "--readonly",
        "--table",
        &format!("0 {} linear {} 0", sectors(8 * MIB), ro.display()),
    ]);
    d.create(
        "wc",
        &format!(
            "0 {} writecache s {} {} 4096 0",
            sectors(256 * MIB),
            origin.display(),
            cache.display()
        ),
    );
    d.create(
        "cr",
        &format!(
            "0 {} crypt aes-xts-plain64 {KEY} 0 {} 0",
            sectors(128 * MIB),
            crypt.display()
        ),
    );
    d.create(
        "cdp",
        &format!(
            "0 {} cdp {} {}",
            sectors(128 * MIB),
            cdp_data.display(),
            cdp_journal.display()
        ),
    );
    for n in DISKS {
        let out = d.ok(&["attach", n, "--vhost-user", sock(n).to_str().unwrap()]);
        assert_eq!(out.trim(), sock(n).display().to_string());
        let line = d.info_line(n, "Block device:");
        assert!(
            line.ends_with(&format!(" vhost-user:{}", sock(n).display())),
            "{line}"
        );
    }

    // refusals before the VM comes
    let again = d.fails(&[
        "attach",
        "lin",
        "--vhost-user",
        s.path("other.sock").to_str().unwrap(),
    ]);
    assert!(again.contains("already attached as vhost-user:"), "{again}");
    let plain = s.path("plain.txt");
    std::fs::write(&plain, "keep me").unwrap();
    d.create("spare", &format!("0 2048 linear {} 0", lin.display()));
    let file = d.fails(&["attach", "spare", "--vhost-user", plain.to_str().unwrap()]);
    assert!(file.contains("exists and is not a socket"), "{file}");
    assert_eq!(std::fs::read_to_string(&plain).unwrap(), "keep me");
    let taken = d.fails(&["attach", "spare", "--vhost-user", sock("lin").to_str().unwrap()]);
    assert!(taken.contains("already serves lin"), "{taken}");
    d.ok(&["remove", "spare"]);
    let removed = d.fails(&["remove", "lin"]);
    assert!(removed.contains("attached as vhost-user:"), "{removed}");

    let ro_md5 = oracle::md5(&std::fs::read(&ro).unwrap());
    let ro_md5 = ro_md5.split_whitespace().next().unwrap_or_default().to_string();
    let script = r#"
set -e
mkdir -p /mnt/thin /mnt/wc /mnt/cr /mnt/cdp /tmp
ln -sf /bin/mke2fs /bin/mkfs.ext4
sum() { echo 3 > /proc/sys/vm/drop_caches; md5sum < "$1" | cut -d' ' -f1; }
dev_of() { for b in /sys/block/vd*; do s=$(cat $b/serial 2>/dev/null || true); [ "$s" = "$1" ] && echo /dev/${b##*/}; done; true; }
q() { cat /sys/block/${1#/dev/}/$2; }
LIN=$(dev_of lin); THIN=$(dev_of thin); RO=$(dev_of ro); WC=$(dev_of wc); CR=$(dev_of cr); CDP=$(dev_of cdp); MB=$(dev_of "")
echo "ORACLE disks lin=${LIN:+y} thin=${THIN:+y} ro=${RO:+y} wc=${WC:+y} cr=${CR:+y} cdp=${CDP:+y} mailbox=${MB:+y}"
fsdev() { case $1 in thin) echo $THIN;; wc) echo $WC;; cr) echo $CR;; cdp) echo $CDP;; esac; }
mb() { dd if=$MB bs=512 count=1 iflag=direct 2>/dev/null | head -c 4; }
wait_mb() { while [ "$(mb)" != "$1" ]; do sleep 0.2; done; }

echo "ORACLE lin-queues $(ls /sys/block/${LIN#/dev/}/mq | wc -l)"
echo "ORACLE lin-size $(q $LIN size)"
echo "ORACLE lin-cache $(q $LIN queue/write_cache | tr ' ' _)"
echo "ORACLE thin-discard $(q $THIN queue/discard_max_bytes)"
echo "ORACLE ro-flag $(q $RO ro)"
echo "ORACLE ro-sum $(sum $RO)"
if dd if=/dev/zero of=$RO bs=4096 count=1 oflag=direct 2>/dev/null; then echo "ORACLE ro-write accepted"; else echo "ORACLE ro-write refused"; fi

fio --name=raw --filename=$LIN --rw=randwrite --bs=4k --size=16M --offset_increment=64M --numjobs=2 \
    --ioengine=io_uring --iodepth=32 --direct=1 --verify=crc32c > /tmp/fio-raw 2>&1 \
  && echo "ORACLE fio-raw ok" || { echo "ORACLE fio-raw failed"; cat /tmp/fio-raw; }

# the guest turns the disk's write cache off (CONFIG_WCE): its writes reach
# the backing file as FUA writes, counted on the host
echo "write through" > /sys/block/${LIN#/dev/}/cache_type
echo "ORACLE wce $(cat /sys/block/${LIN#/dev/}/cache_type | tr ' ' _) $(q $LIN queue/write_cache | tr ' ' _)"
dd if=/dev/urandom of=$LIN bs=4k count=16 seek=4096 oflag=direct 2>/dev/null
echo "write back" > /sys/block/${LIN#/dev/}/cache_type

echo "ORACLE cdp-block $(q $CDP queue/logical_block_size)"
for fs in thin wc cr cdp; do
  dev=$(fsdev $fs)
  mkfs.ext4 -q -F $dev
  mount -t ext4 $dev /mnt/$fs
done
dd if=/dev/urandom of=/mnt/thin/big bs=1M count=64 2>/dev/null
sync
echo "ORACLE big-written"
wait_mb seen
rm /mnt/thin/big
sync
fstrim /mnt/thin
echo "ORACLE trimmed"
wait_mb go..

set +e
load() {
  n=0
  while [ "$(mb)" != done ]; do
    fio --name=load --filename=$LIN --rw=randwrite --bs=4k --size=8M --offset=128M --ioengine=io_uring \
        --iodepth=16 --direct=1 --verify=crc32c --verify_backlog=64 > /tmp/fio-load 2>&1 \
      || { echo "ORACLE fio-load-failed $n"; cat /tmp/fio-load; }
    n=$((n+1))
  done
  echo "ORACLE fio-load-runs $n"
}
writer() {
  n=0
  : > /tmp/sums-$1
  while [ "$(mb)" != done ]; do
    dd if=/dev/urandom of=/mnt/$1/w-$n bs=64k count=2 conv=fsync 2>/dev/null || echo "ORACLE write-failed-$1 $n"
    (cd /mnt/$1 && md5sum w-$n) >> /tmp/sums-$1
    n=$((n+1))
  done
  echo $n > /tmp/files-$1
}
echo "ORACLE load-running"
load &
writer thin &
writer wc &
writer cr &
writer cdp &
wait
for fs in thin wc cr cdp; do
  dev=$(fsdev $fs)
  echo 3 > /proc/sys/vm/drop_caches
  (cd /mnt/$fs && md5sum -c /tmp/sums-$fs > /tmp/check 2>&1) && echo "ORACLE sums-$fs same" \
    || { echo "ORACLE sums-$fs differ"; cat /tmp/check; }
  echo "ORACLE files-$fs $(cat /tmp/files-$fs)"
  umount /mnt/$fs
  e2fsck -fn $dev > /tmp/fsck 2>&1 && echo "ORACLE fsck-$fs clean" || { echo "ORACLE fsck-$fs dirty"; cat /tmp/fsck; }
done
echo "ORACLE io-errors $(dmesg | grep -c -i -E 'I/O error|blk_update_request|critical' || true)"
"#
    .to_string();
    let serial = s.path("serial.txt");
    let qemu_args: Vec<String> = DISKS
        .iter()
        .enumerate()
        .map(|(i, n)| {
            format!(
                "-chardev socket,id=vu{i},path={},reconnect=1 -device vhost-user-blk-pci,chardev=vu{i}",
                sock(n).display()
            )
        })
        .collect();
    let guest = {
        let dir = base.clone();
        let mailbox = mailbox.clone();
        let serial = serial.display().to_string();
        let bins = [tool_path("mke2fs"), tool_path("e2fsck"), tool_path("fio")].join(" ");
        let qemu = qemu_args.join(" ");
        std::thread::spawn(move || {
            oracle::run_env(
                &dir,
                &script,
                &[&mailbox],
                &[
                    ("ORACLE_BINS", &bins),
                    (
                        "ORACLE_MODULES",
                        "lib/crc16.ko fs/mbcache.ko fs/jbd2/jbd2.ko fs/ext4/ext4.ko",
                    ),
                    ("ORACLE_SMP", "2"),
                    ("ORACLE_QEMU_ARGS", &qemu),
                    ("ORACLE_SERIAL", &serial),
                    ("DMKIT_ORACLE_TIMEOUT", "900"),
                ],
            )
        })
    };

    wait_for(&serial, "ORACLE big-written");
    let fua = d.fua_writes("lin", &lin);
    assert!(
        fua >= 16,
        "the guest's writes with its cache off were not FUA: {fua}"
    );
    let before = pool_used(&d);
    // while the VM is connected
    let busy = d.fails(&["detach", "lin"]);
    assert!(busy.contains("a virtual machine is connected"), "{busy}");
    post(&mailbox, "seen");
    wait_for(&serial, "ORACLE trimmed");
    let after = pool_used(&d);
    // 64 MiB of 64 KiB blocks went back to the pool
    assert!(
        before >= after + 900,
        "fstrim did not reach the pool: {before} -> {after} blocks"
    );
    post(&mailbox, "go..");

    wait_for(&serial, "ORACLE load-running");
    let mut d = d;
    for _ in 0..2 {
        std::thread::sleep(Duration::from_secs(4));
        d = d.kill9_and_restore();
        let log = d.log();
        assert!(log.contains("restored 7 devices"), "{log}");
        // the crypt disk comes back waiting for its key (its guest I/O waits too)
        assert_eq!(d.info_line("cr", "State:"), "State:             SUSPENDED");
        d.ok(&["message", "cr", "0", "key", "set", KEY]);
        d.ok(&["resume", "cr"]);
    }
    // cut off from this side while the guest writes, and attached again: QEMU
    // reconnects as after a kill
    let lin_sock = sock("lin");
    d.ok(&["detach", "lin", "--force"]);
    assert!(!lin_sock.exists());
    std::thread::sleep(Duration::from_secs(2));
    d.ok(&["attach", "lin", "--vhost-user", lin_sock.to_str().unwrap()]);
    std::thread::sleep(Duration::from_secs(4));
    post(&mailbox, "done");
    let out = guest.join().expect("guest");
    let m = oracle::markers(&out);
    let g = |k: &str| oracle::marker(&m, k).to_string();
    assert_eq!(g("disks"), "lin=y thin=y ro=y wc=y cr=y cdp=y mailbox=y");
    assert_eq!(g("cdp-block"), "4096");
    assert_eq!(g("lin-queues"), "2");
    assert_eq!(g("lin-size"), (256 * MIB / 512).to_string());
    assert_eq!(g("lin-cache"), "write_back");
    assert_eq!(g("wce"), "write_through write_through");
    assert_ne!(g("thin-discard"), "0");
    assert_eq!(g("ro-flag"), "1");
    assert_eq!(g("ro-sum"), ro_md5);
    assert_eq!(g("ro-write"), "refused");
    assert_eq!(g("fio-raw"), "ok");
    assert!(!out.contains("ORACLE fio-load-failed"), "{out}");
    assert!(!out.contains("ORACLE write-failed"), "{out}");
    assert!(g("fio-load-runs").parse::<u32>().unwrap() >= 1);
    for fs in ["thin", "wc", "cr", "cdp"] {
        assert_eq!(g(&format!("sums-{fs}")), "same");
        assert!(g(&format!("files-{fs}")).parse::<u32>().unwrap() >= 1);
        assert_eq!(g(&format!("fsck-{fs}")), "clean");
    }
    assert_eq!(g("io-errors"), "0");
    assert_eq!(
        std::fs::read(&ro).unwrap(),
        common::pattern(7, (8 * MIB) as usize)
    );
    // the cdp disk's newest point, taken by the guest's last flush, is the
    // file system as the guest left it: the same bytes as the device, clean
    let newest = d.ok(&["message", "cdp", "0", "points", "1"]);
    let newest = newest.split_whitespace().next().expect("a point").to_string();
    assert!(newest.starts_with("flush:"), "{newest}");
    let (point, now) = (base.join("point.img"), base.join("now.img"));
    for (export, file) in [(format!("cdp@{newest}"), &point), ("cdp".to_string(), &now)] {
        let st = std::process::Command::new(tool_path("nbdcopy"))
            .arg(d.uri(&export))
            .arg(file)
            .status()
            .expect("nbdcopy");
        assert!(st.success(), "nbdcopy {export}");
    }
    assert!(
        std::fs::read(&point).unwrap() == std::fs::read(&now).unwrap(),
        "cdp@{newest} differs from the device"
    );
    let fsck = std::process::Command::new(tool_path("e2fsck"))
        .arg("-fn")
        .arg(&point)
        .output()
        .expect("e2fsck");
    assert!(fsck.status.success(), "e2fsck of cdp@{newest}: {fsck:?}");

    // the VM is gone: a resize is still refused while attached; detach, remove
    d.ok(&[
        "load",
        "lin",
        "--table",
        &format!("0 4096 linear {} 0", lin.display()),
    ]);
    let resize = d.fails(&["resume", "lin"]);
    assert!(resize.contains("cannot tell the guest of a new size"), "{resize}");
    d.ok(&["clear", "lin"]);
    for n in DISKS {
        d.ok(&["detach", n]);
        assert!(!sock(n).exists(), "{n}: socket left behind");
    }
    for n in ["lin", "thin", "ro", "wc", "cr", "cdp", "pool"] {
        d.ok(&["remove", n]);
    }
    let log = d.log();
    assert!(log.contains("a vhost-user frontend connected"), "{log}");
    assert!(!log.contains("panic") && !log.contains("ERROR"), "{log}");
}

/// `serve --vhost-user NAME=SOCKET`: the device is served on SOCKET once a
/// table is resumed on it (no VM needed to see it listen), and the option's
/// value is checked.
#[test]
fn serve_vhost_user_attaches_the_named_device_at_its_resume() {
    let sock = std::env::temp_dir().join(format!("dmkit-vhost-serve-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&sock);
    let arg = format!("vol={}", sock.display());
    let d = Daemon::start_with("vhost-serve", &["--vhost-user", &arg], &[]);
    let f = d.dir.sparse("vol.img", 8 * MIB);
    assert!(!sock.exists(), "listening before the device exists");
    d.create("vol", &format!("0 16384 linear {} 0", f.display()));
    let line = d.info_line("vol", "Block device:");
    assert!(
        line.ends_with(&format!(" vhost-user:{}", sock.display())),
        "{line}"
    );
    assert!(
        std::os::unix::net::UnixStream::connect(&sock).is_ok(),
        "nothing listens on {}",
        sock.display()
    );
    let removed = d.fails(&["remove", "vol"]);
    assert!(removed.contains("attached as vhost-user:"), "{removed}");
    d.ok(&["detach", "vol"]);
    assert!(!sock.exists(), "the socket stays after detach");
    d.ok(&["remove", "vol"]);
    drop(d);
    let o = std::process::Command::new(common::BIN)
        .args(["serve", "--vhost-user", "novalue"])
        .output()
        .expect("dmkit serve");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("expected NAME=SOCKET"),
        "{err}"
    );
}
