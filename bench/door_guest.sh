#!/usr/bin/env bash
# The dm ioctl door against the kernel's own device-mapper, in one boot of the
# 6.12 guest (tests/oracle/run.sh, qemu TCG): first dmkit (`serve --attach`, no
# dm-mod loaded; every command through `dmkit exec`), then the kernel (dm-mod
# loaded by load_dm), the same commands, each timed alone, medians:
#   - `dmsetup create` + `dmsetup remove` of a zero device (with --attach dmkit
#     makes it a ublk block device, as the kernel makes a disk);
#   - `dmsetup status` with 1,000 devices present (made without tables);
#   - `lvcreate` + `lvremove` of a thin in a pool (LVM on a virtio disk);
#   - one DM_TABLE_STATUS ioctl with libdevmapper's 16 KiB buffer, and a bare
#     round trip between two processes (bench/door/ioctls.c), the least a
#     daemon's answer can cost.
# Both sides run under the same software emulation: absolute times are the
# emulator's, only the ratios mean something (kernel-oracle.md: no absolute
# performance figures from the oracle).
# Usage: bench/door_guest.sh [REPS]   (default 9; needs `cargo build --release`
# and what ci/install.sh installs)
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${1:-9}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
truncate -s 256M "$work/pv.img"
truncate -s 1M "$work/small.img"
# coreutils date (nanoseconds) under a name busybox does not take
ln -s "$(command -v date)" "$work/gdate"
cat >"$work/guest.sh" <<GUEST
set -e
mkdir -p /etc/lvm /run/lock/lvm /run/lvm /run/dmkit /tmp
ln -sf /bin/dmkit /bin/thin_check
cat > /etc/lvm/lvm.conf <<CONF
devices { scan = [ "/dev" ] obtain_device_list_from_udev = 0 external_device_info_source = "none" global_filter = [ "a|^/dev/vda\\\$|", "r|.*|" ] }
global { use_lvmpolld = 0 thin_check_executable = "/bin/thin_check" event_activation = 0 }
activation { udev_sync = 0 udev_rules = 0 monitoring = 0 }
CONF
export LVM_SUPPRESS_FD_WARNINGS=1 LC_ALL=C DM_DEV_DIR=/dev
cat > /side.sh <<'SIDE'
# one side's timings, run in one shell (with the door open, for dmkit: as
# dmkit exec -- bash makes it for a session), so no process start but the
# commands' own is counted
P=\$1
ms() { echo \$(( (\$(gdate +%s%N) - \$1) / 1000 )); }
median() { sort -n | awk '{a[NR]=\$1} END {print a[int((NR+1)/2)]}'; }
for i in \$(seq REPS); do
  t=\$(gdate +%s%N); dmsetup create z\$i --table "0 2048 linear /dev/vdb 0"; dmsetup remove z\$i; ms \$t
done | median | sed "s/^/BENCH \$P create+remove /"
for i in \$(seq 1000); do dmsetup create --notable "n\$i"; done
for i in \$(seq REPS); do t=\$(gdate +%s%N); dmsetup status > /dev/null; ms \$t; done | median | sed "s/^/BENCH \$P status-1000 /"
for i in \$(seq REPS); do ioctls status 300; done | median | sed "s/^/BENCH \$P status-ioctl /"
for i in \$(seq REPS); do ioctls pingpong 300; done | median | sed "s/^/BENCH \$P round-trip /"
dmsetup remove_all
lvm pvcreate -q /dev/vda
lvm vgcreate -q vg /dev/vda
lvm lvcreate -q -y --type thin-pool -L 64M -n pool vg > /dev/null
for i in \$(seq REPS); do
  t=\$(gdate +%s%N); lvm lvcreate -q -y -V 16M -T vg/pool -n t\$i > /dev/null; lvm lvremove -q -y vg/t\$i > /dev/null; ms \$t
done | median | sed "s/^/BENCH \$P lvcreate+lvremove /"
lvm vgremove -q -y vg
lvm pvremove -q -y /dev/vda
SIDE
sed -i "s/REPS/$REPS/" /side.sh
dmkit serve --run-dir /run/dmkit --attach > /tmp/dmkit.log 2>&1 &
D=\$!
i=0; while [ ! -S /run/dmkit/control.sock ] && [ \$i -lt 300 ]; do sleep 0.1; i=\$((i+1)); done
dmkit --run-dir /run/dmkit exec -- sh /side.sh dmkit
kill \$D; wait \$D || true
load_dm
sh /side.sh kernel
GUEST
cc -O2 -Wall -Werror -o "$work/ioctls" bench/door/ioctls.c
bins="$PWD/target/release/dmkit $(command -v lvm || echo /usr/sbin/lvm) $work/gdate $work/ioctls"
out=$(ORACLE_BINS="$bins" ORACLE_MODULES="drivers/block/ublk_drv.ko" ORACLE_DM_LATE=1 \
  DMKIT_ORACLE_KERNEL=6.12 DMKIT_ORACLE_TIMEOUT=1800 ORACLE_MEM=1024 \
  bash tests/oracle/run.sh "$work/guest.sh" "$work/pv.img" "$work/small.img")
echo "$out" > "${BENCH_SERIAL:-/dev/null}"
echo "$out" | grep "^BENCH" >"$work/bench" || { echo "$out" | tail -40; exit 1; }
echo "| operation (median of $REPS, µs in the emulated guest) | dmkit through the door | kernel dm | ratio |"
echo "|---|---|---|---|"
for op in create+remove status-1000 lvcreate+lvremove status-ioctl round-trip; do
  d=$(awk -v o="$op" '$2=="dmkit" && $3==o {print $4}' "$work/bench")
  k=$(awk -v o="$op" '$2=="kernel" && $3==o {print $4}' "$work/bench")
  echo "| $op | $d | $k | $(awk -v d="$d" -v k="$k" 'BEGIN {printf "%.2f×", d / k}') |"
done
