//! The ublk frontend (issue 17), inside the oracle's guest on the 6.12 kernel
//! series with ublk_drv loaded: one boot for every check.
//!
//! - A linear device, a thin (its pool provisioning during the test) and a
//!   writecache, each attached as /dev/ublkbN with /dev/mapper/NAME: fio
//!   `--verify=crc32c` on the raw device; then mkfs.ext4, files written, md5s
//!   recorded, umount, `e2fsck -fn` clean, mounted again, md5s equal. The block
//!   device's queue limits are the stack's (sysfs). On the thin, `fstrim`
//!   reaches the pool: its mapped blocks fall.
//! - Errors: a second attach, detach while mounted, remove while attached, a
//!   resume that would resize it, and a daemon that is not root.
//! - Restart under load, six times (SIGKILL and SIGTERM in turn) with all three
//!   mounted and written: fio with verify on the linear and the thin, and on
//!   every stack a writer of files each made durable (fsync) before its md5 is
//!   recorded. After each restart, every file durable before the signal reads
//!   back the same on each stack, and so does a write the daemon acknowledged
//!   and was never asked to flush (O_DIRECT, no fsync): a killed thin pool or
//!   writecache loses no acknowledged write (`io::restart_log`). fio ends
//!   without an error and its verify passes.
//! - After the restarts, every file the writers finished (those written before
//!   them too, and those being written when a signal landed) reads back the same
//!   on all three, and `e2fsck -fn` finds each filesystem clean.
//! - A device that cannot be restored (its backing file removed while no daemon
//!   ran): after `serve --restore` its block device is stopped and deleted, and
//!   the log names it.
//! - The daemon logged no panic and no error (but that stop).
//! - A cdp device (every flush a point) goes through all of the above as the
//!   fourth; a point marked before the restarts, attached as a block device of
//!   its own and mounted read-only, holds the files as they were then.
//! - Detach: /dev/ublkbN and /dev/mapper/NAME go; the devices can be removed.
//!
//! A missing tool or kernel fails the test (ci/install.sh installs them).

use crate::common;
use crate::oracle;
use common::{tool_path, Scratch, BIN};
use oracle::{DMKIT_GUEST, EXT4_UBLK_MODULES};

use common::MIB;

#[test]
fn ublk_block_devices_restart_under_a_mounted_filesystem() {
    let s = Scratch::new("ublk");
    let disks = [
        s.sparse("lin.img", 256 * MIB),
        s.sparse("meta.img", 16 * MIB),
        s.sparse("data.img", 512 * MIB),
        s.sparse("cache.img", 64 * MIB),
        s.sparse("origin.img", 256 * MIB),
        s.sparse("cdpdata.img", 512 * MIB),
        s.sparse("cdpjournal.img", 64 * MIB),
    ];
    let bins = [
        BIN.to_string(),
        tool_path("mke2fs"),
        tool_path("e2fsck"),
        tool_path("fio"),
    ]
    .join(" ");
    let lin = 256 * MIB / 512;
    let data = 512 * MIB / 512;
    let thin = 384 * MIB / 512;
    let origin = 256 * MIB / 512;
    let script = format!(
        r#"
set -e
{DMKIT_GUEST}
start
$D create lin --table "0 {lin} linear /dev/vda 0"
$D create pool --table "0 {data} thin-pool /dev/vdb /dev/vdc 128 0"
$D message pool 0 create_thin 0
$D create thin --table "0 {thin} thin /dev/mapper/pool 0"
$D create wc --table "0 {origin} writecache s /dev/vde /dev/vdd 4096 0"
$D create cdp --table "0 {origin} cdp /dev/vdf /dev/vdg"
used() {{ $D status pool | cut -d' ' -f6 | cut -d/ -f1; }}
q() {{ cat /sys/block/$(basename $(readlink -f /dev/mapper/$1))/queue/$2; }}

for dev in lin thin wc cdp; do
  b=$($D attach $dev)
  echo "ORACLE path-$dev $b $(readlink /dev/mapper/$dev)"
  echo "ORACLE limits-$dev lbs=$(q $dev logical_block_size) discard=$(q $dev discard_max_bytes) gran=$(q $dev discard_granularity) fua=$(q $dev fua) cache=$(q $dev write_cache | tr ' ' _) max=$(q $dev max_sectors_kb)"
  fio --name=raw --filename=/dev/mapper/$dev --rw=randwrite --bs=4k --size=24M --ioengine=io_uring \
      --iodepth=16 --direct=1 --verify=crc32c > /tmp/fio-raw-$dev 2>&1 \
    && echo "ORACLE fio-raw-$dev ok" || {{ echo "ORACLE fio-raw-$dev failed"; cat /tmp/fio-raw-$dev; }}
  mkfs.ext4 -q -F /dev/mapper/$dev
  mkdir -p /mnt/$dev
  mount -t ext4 /dev/mapper/$dev /mnt/$dev
  for f in 1 2 3 4; do dd if=/dev/urandom of=/mnt/$dev/f$f bs=64k count=$((f * 64)) 2>/dev/null; done
  sync
  (cd /mnt/$dev && md5sum f1 f2 f3 f4) > /tmp/sums-$dev
  if [ $dev = thin ]; then
    before=$(used)
    rm /mnt/thin/f4; sync
    fstrim /mnt/thin
    echo "ORACLE trim-thin $before $(used)"
    grep -v f4 /tmp/sums-thin > /tmp/s; mv /tmp/s /tmp/sums-thin
  fi
  umount /mnt/$dev
  # cdp: the filesystem unmounted, a point to come back to after the restarts
  if [ $dev = cdp ]; then $D message cdp 0 mark base > /dev/null; cp /tmp/sums-cdp /tmp/base-sums; fi
  e2fsck -fn /dev/mapper/$dev > /tmp/fsck 2>&1 && echo "ORACLE fsck-$dev clean" || {{ echo "ORACLE fsck-$dev dirty"; cat /tmp/fsck; }}
  mount -t ext4 /dev/mapper/$dev /mnt/$dev
  (cd /mnt/$dev && md5sum -c /tmp/sums-$dev > /dev/null) && echo "ORACLE md5-$dev same" || echo "ORACLE md5-$dev differ"
done
$D ls | grep -q "^lin.*/dev/ublkb" && echo "ORACLE ls shows"

echo "ORACLE again $({{ $D attach lin 2>&1; echo " rc=$?"; }} | tr ' \n' __)"
echo "ORACLE detach-mounted $($D detach lin 2>&1 | tr ' ' _)"
echo "ORACLE remove-attached $($D remove lin 2>&1 | tr ' ' _)"
$D load lin --table "0 1024 linear /dev/vda 0"
echo "ORACLE resize-attached $($D resume lin 2>&1 | tr ' ' _)"
$D clear lin
# a daemon that is not root: no permission for /dev/ublk-control
echo "user:x:1000:1000::/tmp:/bin/sh" >> /etc/passwd
mkdir -p /tmp/user && truncate -s 16M /tmp/user/f.img && chown -R 1000:1000 /tmp/user
U() {{ su user -s /bin/sh -c "$*"; }}
U 'dmkit serve --run-dir /tmp/user > /tmp/user/log 2>&1 & echo $! > /tmp/user/pid'
i=0; while [ ! -S /tmp/user/control.sock ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
U 'dmkit --run-dir /tmp/user create u --table "0 32768 linear /tmp/user/f.img 0"'
echo "ORACLE attach-user $(U 'dmkit --run-dir /tmp/user attach u 2>&1; echo " rc=$?"' | tr ' \n' __)"
kill $(cat /tmp/user/pid)

# restarts with writes running on all three mounted filesystems: fio with
# verify on the linear and the thin (its file laid out and synced first, so
# its writes overwrite mapped blocks in place), and on every stack a writer of
# files each made durable (fsync) before its md5 is recorded
for dev in lin thin; do
  fio --name=v --filename=/mnt/$dev/fio.dat --size=4M --rw=write --bs=64k --fallocate=none > /dev/null 2>&1
done
sync
load() {{
  n=0
  while [ ! -f /tmp/stop ]; do
    fio --name=v --filename=/mnt/$1/fio.dat --size=4M --rw=randwrite --bs=4k --ioengine=psync \
        --direct=1 --verify=crc32c --fallocate=none > /tmp/fio-$1 2>&1 || {{ echo "ORACLE fio-$1-failed $n"; cat /tmp/fio-$1; }}
    n=$((n+1))
  done
  echo "ORACLE fio-$1-runs $n"
}}
writer() {{
  n=0
  : > /tmp/durable-$1
  while [ ! -f /tmp/stop ]; do
    echo w-$n > /tmp/writing-$1
    dd if=/dev/urandom of=/mnt/$1/w-$n bs=64k count=2 conv=fsync 2>/dev/null
    (cd /mnt/$1 && md5sum w-$n) >> /tmp/durable-$1
    n=$((n+1))
    sleep 0.2
  done
}}
for dev in lin thin; do load $dev & echo $! >> /tmp/loads; done
for dev in lin thin wc cdp; do writer $dev & echo $! >> /tmp/loads; done
# check K DEV: the files durable before signal K read back the same
kept() {{
  echo 3 > /proc/sys/vm/drop_caches
  (cd /mnt/$2 && md5sum -c /tmp/kept-$2-$1 > /tmp/kept 2>&1) && echo yes || {{ echo no; grep -v OK /tmp/kept | head -3 | sed "s/^/DIAG $2 /" >&2; }}
}}
k=0
for sig in KILL TERM KILL KILL TERM KILL; do
  k=$((k+1))
  sleep 1
  # what each filesystem holds as durable now: its writer's files so far ...
  for dev in lin thin wc cdp; do cp /tmp/durable-$dev /tmp/kept-$dev-$k; done
  # ... and a write acknowledged by the daemon and never flushed
  for dev in lin thin wc cdp; do
    dd if=/dev/urandom of=/tmp/direct bs=64k count=2 2>/dev/null
    dd if=/tmp/direct of=/mnt/$dev/direct-$k bs=64k oflag=direct 2>/dev/null
    echo "$(md5sum < /tmp/direct | cut -d' ' -f1)  direct-$k" | tee -a /tmp/directs-$dev >> /tmp/kept-$dev-$k
  done
  kill -$sig $(cat /tmp/pid)
  while kill -0 $(cat /tmp/pid) 2>/dev/null; do sleep 0.05; done
  start --restore
  for dev in lin thin wc cdp; do
    echo "ORACLE restart-$dev-$k $sig $(readlink /dev/mapper/$dev) $(wc -l < /tmp/kept-$dev-$k) $(kept $k $dev)"
  done
done
sleep 1
touch /tmp/stop
for p in $(cat /tmp/loads); do wait $p; done
# every file the writers finished, and those written before the restarts, read
# back the same (the writecache's through its reopened cache metadata)
for dev in lin thin wc cdp; do
  cat /tmp/durable-$dev /tmp/directs-$dev >> /tmp/sums-$dev
  echo 3 > /proc/sys/vm/drop_caches
  (cd /mnt/$dev && md5sum -c /tmp/sums-$dev > /dev/null) && echo "ORACLE md5-after-$dev same $(wc -l < /tmp/sums-$dev)" || echo "ORACLE md5-after-$dev differ"
done
for dev in lin thin wc cdp; do
  umount /mnt/$dev
  e2fsck -fn /dev/mapper/$dev > /tmp/fsck 2>&1 && echo "ORACLE fsck-after-$dev clean" || {{ echo "ORACLE fsck-after-$dev dirty"; cat /tmp/fsck; }}
done
echo "ORACLE recovered $(grep -c recovered /tmp/dmkit.log)"
# cdp's point from before the restarts (marked while unmounted), as a block
# device of its own: the filesystem as it was then
$D create cdpbase --table "0 {origin} cdp-point /dev/mapper/cdp mark:base"
$D attach cdpbase > /dev/null
mkdir -p /mnt/base && mount -t ext4 -o ro /dev/mapper/cdpbase /mnt/base
(cd /mnt/base && md5sum -c /tmp/base-sums > /dev/null) && echo "ORACLE cdp-base same $(ls /mnt/base | grep -c '^w-')" || echo "ORACLE cdp-base differ"
umount /mnt/base
$D detach cdpbase && $D remove cdpbase
echo "ORACLE cdp-points $($D message cdp 0 points 100000 | wc -l)"

# a device that cannot come back (its backing file went while no daemon ran):
# its block device is stopped and deleted, not left holding its I/O
truncate -s 64M /tmp/lost.img
$D create lost --table "0 131072 linear /tmp/lost.img 0"
lb=$($D attach lost)
echo "ORACLE lost-attached $([ -b $lb ] && echo yes)"
kill -KILL $(cat /tmp/pid)
while kill -0 $(cat /tmp/pid) 2>/dev/null; do sleep 0.05; done
rm /tmp/lost.img
start --restore
i=0; while [ -e $lb ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
echo "ORACLE lost-gone $([ -e $lb ] && echo present || echo gone) $(ls /dev/mapper/lost 2>/dev/null | wc -l)"
echo "ORACLE lost-logged $(grep -c "device 'lost' not restored" /tmp/dmkit.log) $(grep -c 'stopped (its device could not be restored)' /tmp/dmkit.log)"

for dev in lin thin wc cdp; do $D detach $dev; done
echo "ORACLE gone $(ls /dev/ublkb* /dev/mapper/lin 2>/dev/null | wc -l)"
$D remove thin && $D remove pool && $D remove wc && $D remove lin && $D remove cdp && echo "ORACLE removed yes"
echo "ORACLE daemon $(kill -0 $(cat /tmp/pid) && echo alive)"
# the daemon logged no panic and no error (shown for the assertion's message)
grep -i "panic\|error" /tmp/dmkit.log | head -5 || :
echo "ORACLE log-panics $(grep -ci panic /tmp/dmkit.log)"
echo "ORACLE log-errors $(grep ERROR /tmp/dmkit.log | grep -v "lost\|could not be restored" | wc -l)"
"#
    );
    let env = [
        ("ORACLE_BINS", bins.as_str()),
        ("ORACLE_MODULES", EXT4_UBLK_MODULES),
        ("DMKIT_ORACLE_KERNEL", "6.12"),
        ("DMKIT_ORACLE_TIMEOUT", "900"),
    ];
    let paths: Vec<&std::path::Path> = disks.iter().map(|p| p.as_path()).collect();
    let serial = oracle::run_env(&s.0, &script, &paths, &env);
    let m = oracle::markers(&serial);
    let get = |k: &str| oracle::marker(&m, k).to_string();

    for (dev, lbs) in [("lin", 512), ("thin", 512), ("wc", 4096), ("cdp", 4096)] {
        let path = get(&format!("path-{dev}"));
        assert!(
            path.starts_with("/dev/ublkb") && path.contains(" ../ublkb"),
            "{dev}: attached with a /dev/mapper link: {path}"
        );
        let limits = get(&format!("limits-{dev}"));
        assert!(limits.contains(&format!("lbs={lbs} ")), "{dev}: {limits}");
        assert!(limits.contains("fua=1"), "{dev}: {limits}");
        assert!(limits.contains("cache=write_back"), "{dev}: {limits}");
        assert!(limits.contains("max=512"), "{dev}: {limits}");
        assert!(
            !limits.contains("discard=0 "),
            "{dev}: discard offered, as the stack honours it: {limits}"
        );
        for check in ["fio-raw", "fsck", "md5"] {
            let want = match check {
                "fio-raw" => "ok",
                "fsck" => "clean",
                _ => "same",
            };
            assert_eq!(get(&format!("{check}-{dev}")), want, "{dev}: {check}");
        }
    }
    // the thin pool's block is 64 KiB: so is the discard granularity
    assert!(
        get("limits-thin").contains("gran=65536"),
        "{}",
        get("limits-thin")
    );
    // the writecache's block is 4 KiB: its logical block size and granularity
    assert!(get("limits-wc").contains("gran=4096"), "{}", get("limits-wc"));
    let trim: Vec<u64> = get("trim-thin")
        .split(' ')
        .map(|v| v.parse().expect("used data blocks"))
        .collect();
    assert!(
        trim[1] + 60 < trim[0],
        "fstrim gave the pool back the deleted file's blocks (16 MiB = 256 blocks): {trim:?}"
    );
    assert_eq!(get("ls"), "shows");
    let again = get("again");
    assert!(
        again.contains("attached_already_as_/dev/ublkb") && again.contains("_rc=1"),
        "{again}"
    );
    assert!(
        get("detach-mounted").contains("is_in_use_(mounted"),
        "{}",
        get("detach-mounted")
    );
    assert!(
        get("remove-attached").contains("attached_as_/dev/ublkb"),
        "{}",
        get("remove-attached")
    );

    assert!(
        get("resize-attached").contains("whose_size_the_kernel_cannot_change"),
        "{}",
        get("resize-attached")
    );
    let user = get("attach-user");
    assert!(
        user.contains("no_permission_to_open_/dev/ublk-control") && user.contains("_rc=1"),
        "{user}"
    );

    let sigs = ["KILL", "TERM", "KILL", "KILL", "TERM", "KILL"];
    for dev in ["lin", "thin", "wc", "cdp"] {
        for (k, sig) in sigs.iter().enumerate() {
            let k = k + 1;
            let r = get(&format!("restart-{dev}-{k}"));
            let f: Vec<&str> = r.split(' ').collect();
            assert_eq!(f.len(), 4, "{dev}: restart {k}: {r}");
            assert_eq!(f[0], *sig, "{dev}: restart {k}");
            assert!(
                f[1].starts_with("../ublkb"),
                "{dev}: restart {k} kept the block device: {r}"
            );
            let files: u32 = f[2].parse().expect("files");
            assert!(
                files >= 1,
                "{dev}: restart {k}: files made durable before it: {r}"
            );
            assert_eq!(
                f[3], "yes",
                "{dev}: after SIG{sig} {k}, the files made durable before it and a write never flushed read back the same"
            );
        }
        let after = get(&format!("md5-after-{dev}"));
        assert!(
            after.starts_with("same "),
            "{dev}: files after the restarts: {after}"
        );
        assert_eq!(
            get(&format!("fsck-after-{dev}")),
            "clean",
            "{dev}: fsck after the restarts"
        );
    }
    for dev in ["lin", "thin"] {
        assert!(
            !m.keys().any(|k| k.starts_with(&format!("fio-{dev}-failed"))),
            "{dev}: fio failed across a restart: {m:?}"
        );
        let runs: u32 = get(&format!("fio-{dev}-runs")).parse().expect("runs");
        assert!(runs >= 1, "{dev}: fio ran");
    }
    // four devices attached, six restarts
    assert_eq!(
        get("recovered"),
        "24",
        "every restart took every block device over"
    );
    // cdp: the point marked before the restarts, attached and mounted, holds
    // the files as they were then (f1..f4 and none of the writer's)
    assert_eq!(
        get("cdp-base"),
        "same 0",
        "the cdp point from before the restarts"
    );
    let points: u32 = get("cdp-points").parse().expect("points");
    assert!(points > 10, "cdp kept a point a flush: {points}");
    assert_eq!(get("lost-attached"), "yes");
    assert_eq!(
        get("lost-gone"),
        "gone 0",
        "the block device of a device that could not be restored is deleted, and its link"
    );
    assert_eq!(
        get("lost-logged"),
        "1 1",
        "the lost device is reported by name, and its block device's stop logged"
    );
    assert_eq!(get("gone"), "0", "detach removes /dev/ublkbN and the link");
    assert_eq!(get("removed"), "yes");
    assert_eq!(get("daemon"), "alive");
    assert_eq!(get("log-panics"), "0", "the daemon logged a panic");
    assert_eq!(get("log-errors"), "0", "the daemon logged an error");
}
