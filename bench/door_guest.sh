#!/usr/bin/env bash
# The dm ioctl door against the kernel's own device-mapper, in one boot of the
# 6.12 guest (tests/oracle/run.sh, qemu TCG): first dmkit (`serve --attach`, no
# dm-mod loaded; every command through `dmkit exec`), then the kernel (dm-mod
# loaded by load_dm), the same commands, each timed alone, medians:
#   - `dmsetup create` + `dmsetup remove` of a zero device (with --attach dmkit
#     makes it a ublk block device, as the kernel makes a disk);
#   - `dmsetup status` with 1,000 devices present (made without tables);
#   - `lvcreate` + `lvremove` of a thin in a pool (LVM on a virtio disk).
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
ms() { echo \$(( (\$(date +%s%N) - \$1) / 1000 )); }
median() { sort -n | awk '{a[NR]=\$1} END {print a[int((NR+1)/2)]}'; }
side() {
  P=\$1
  for i in \$(seq $REPS); do
    t=\$(date +%s%N); \$X dmsetup create z\$i --table "0 8 zero"; \$X dmsetup remove z\$i; ms \$t
  done | median | sed "s/^/BENCH \$P create+remove /"
  for i in \$(seq 1000); do echo "z\$i"; done > /tmp/names
  \$X sh -c 'while read n; do dmsetup create --notable "\$n"; done < /tmp/names'
  for i in \$(seq $REPS); do t=\$(date +%s%N); \$X dmsetup status > /dev/null; ms \$t; done | median | sed "s/^/BENCH \$P status-1000 /"
  \$X dmsetup remove_all
  \$X lvm pvcreate -q /dev/vda
  \$X lvm vgcreate -q vg /dev/vda
  \$X lvm lvcreate -q -y --type thin-pool -L 64M -n pool vg
  for i in \$(seq $REPS); do
    t=\$(date +%s%N); \$X lvm lvcreate -q -y -V 16M -T vg/pool -n t\$i; \$X lvm lvremove -q -y vg/t\$i; ms \$t
  done | median | sed "s/^/BENCH \$P lvcreate+lvremove /"
  \$X lvm vgremove -q -y vg
  \$X lvm pvremove -q -y /dev/vda
}
dmkit serve --run-dir /run/dmkit --attach > /tmp/dmkit.log 2>&1 &
D=\$!
i=0; while [ ! -S /run/dmkit/control.sock ] && [ \$i -lt 300 ]; do sleep 0.1; i=\$((i+1)); done
X="dmkit --run-dir /run/dmkit exec --" side dmkit
kill \$D; wait \$D || true
load_dm
X= side kernel
GUEST
bins="$PWD/target/release/dmkit $(command -v lvm || echo /usr/sbin/lvm) $(command -v date)"
out=$(ORACLE_BINS="$bins" ORACLE_MODULES="drivers/block/ublk_drv.ko" ORACLE_DM_LATE=1 \
  DMKIT_ORACLE_KERNEL=6.12 DMKIT_ORACLE_TIMEOUT=1800 ORACLE_MEM=1024 \
  bash tests/oracle/run.sh "$work/guest.sh" "$work/pv.img")
echo "$out" | grep '^BENCH' >"$work/bench" || { echo "$out" | tail -40; exit 1; }
echo "| operation (median of $REPS, µs in the emulated guest) | dmkit through the door | kernel dm | ratio |"
echo "|---|---|---|---|"
for op in create+remove status-1000 lvcreate+lvremove; do
  d=$(awk -v o="$op" '$2=="dmkit" && $3==o {print $4}' "$work/bench")
  k=$(awk -v o="$op" '$2=="kernel" && $3==o {print $4}' "$work/bench")
  echo "| $op | $d | $k | $(awk -v d="$d" -v k="$k" 'BEGIN {printf "%.2f×", d / k}') |"
done
