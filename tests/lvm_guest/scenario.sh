# The guest half of tests/lvm_guest.rs: one LVM script, run twice in one boot of
# the 6.12 kernel, first against dmkit through the door (no device-mapper in the
# kernel: dm-mod is not loaded), then against the kernel's own device-mapper
# (dm-mod loaded by `load_dm`). Each run prints `ORACLE <side>-<what> <value>`
# (side d: dmkit, k: the kernel); the test compares the two sides and the data
# with what the host wrote. Disks: vda, vdb the PVs; vdc 16 MiB of a pattern.
set -e
mkdir -p /etc/lvm /run/lock/lvm /run/lvm /mnt /tmp /run/dmkit /sbin
ln -sf /bin/dmeventd /sbin/dmeventd
ln -sf /bin/mke2fs /bin/mkfs.ext4
ln -sf /bin/dmkit /bin/thin_check
cat > /etc/lvm/lvm.conf <<CONF
devices { scan = [ "/dev" ] obtain_device_list_from_udev = 0 external_device_info_source = "none" global_filter = [ "a|^/dev/vd[ab]\$|", "r|.*|" ] }
global { use_lvmpolld = 0 thin_check_executable = "/bin/thin_check" event_activation = 0 }
activation { udev_sync = 0 udev_rules = 0 monitoring = 1 thin_pool_autoextend_threshold = 60 thin_pool_autoextend_percent = 50 }
CONF
export LC_ALL=C DM_DEV_DIR=/dev
MIB8=8388608
sum8() { echo 3 > /proc/sys/vm/drop_caches; head -c $MIB8 "$1" | md5sum | cut -d' ' -f1; }
line() { tr -s ' ' | sed 's/^ //' | sort | tr '\n' ';' | tr ' ' '_'; }

scenario() {
  P=$1
  lv() { $LVM "$@"; }
  lv pvcreate -q /dev/vda /dev/vdb
  lv vgcreate -q vg /dev/vda /dev/vdb
  lv lvcreate -q -y -L 16M -n lin vg
  lv lvcreate -q -y -L 16M -i2 -I64 -n str vg
  lv lvcreate -q -y --type thin-pool -L 48M -n pool vg
  lv lvcreate -q -y -V 64M -T vg/pool -n th
  for v in lin str th; do
    dd if=/dev/vdc of=/dev/vg/$v bs=1M count=8 conv=fsync 2>/dev/null
    echo "ORACLE $P-md5-$v $(sum8 /dev/vg/$v)"
  done
  # a thin snapshot keeps the data its origin had
  lv lvcreate -q -y -s vg/th -n thsnap
  dd if=/dev/zero of=/dev/vg/th bs=1M count=1 conv=fsync 2>/dev/null
  lv lvchange -q -ay -K vg/thsnap
  echo "ORACLE $P-md5-thsnap $(sum8 /dev/vg/thsnap)"
  # a classic snapshot, then its merge back into the origin
  lv lvcreate -q -y -s -L 8M -n csnap vg/lin
  dd if=/dev/zero of=/dev/vg/lin bs=1M count=1 conv=fsync 2>/dev/null
  echo "ORACLE $P-md5-csnap $(sum8 /dev/vg/csnap)"
  lv lvconvert -q -y --merge vg/csnap > /tmp/merge 2>&1 || { cat /tmp/merge; false; }
  echo "ORACLE $P-md5-merged $(sum8 /dev/vg/lin)"
  # ext4 on the thin, mounted without the lazy inode-table zeroing (a kernel
  # thread that zeroes at its own pace, so the usage read below would depend
  # on when it ran)
  mkfs.ext4 -q -F /dev/vg/th
  mount -t ext4 -o noinit_itable /dev/vg/th /mnt
  dd if=/dev/vdc of=/mnt/f bs=1M count=8 2>/dev/null
  umount /mnt
  mount -t ext4 -o noinit_itable /dev/vg/th /mnt
  echo "ORACLE $P-md5-thfile $(md5sum < /mnt/f | cut -d' ' -f1)"
  echo "ORACLE $P-lvs $(lv lvs -a --noheadings -o lv_name,lv_attr,lv_size,segtype,devices,seg_monitor vg | line)"
  echo "ORACLE $P-usage $(lv lvs --noheadings -o data_percent vg/pool vg/th vg/thsnap | tr -s ' \n' '  ')"
  echo "ORACLE $P-tables $($DMSETUP table | sed -E 's/[0-9]+:[0-9]+/M:m/g' | line)"
  umount /mnt
  e2fsck -fn /dev/vg/th > /tmp/fsck 2>&1 && echo "ORACLE $P-fsck-th clean" || { echo "ORACLE $P-fsck-th dirty"; cat /tmp/fsck; }
  # a writecache attached to an LV with ext4, files written through it, split off
  lv lvcreate -q -y -L 32M -n wlv vg /dev/vda
  lv lvcreate -q -y -an -Zn -L 16M -n wcvol vg /dev/vdb 2>&1 | grep -v 'not zeroed' || true
  mkfs.ext4 -q -F /dev/vg/wlv
  lv lvconvert -q -y --type writecache --cachevol wcvol vg/wlv
  echo "ORACLE $P-wc-table $($DMSETUP table vg-wlv | sed -E 's/[0-9]+:[0-9]+/M:m/g' | line)"
  mount -t ext4 /dev/vg/wlv /mnt
  dd if=/dev/vdc of=/mnt/f bs=1M count=8 2>/dev/null
  umount /mnt
  lv lvconvert -q -y --splitcache vg/wlv
  mount -t ext4 /dev/vg/wlv /mnt
  echo "ORACLE $P-md5-wcfile $(md5sum < /mnt/f | cut -d' ' -f1)"
  umount /mnt
  e2fsck -fn /dev/vg/wlv > /tmp/fsck 2>&1 && echo "ORACLE $P-fsck-wlv clean" || { echo "ORACLE $P-fsck-wlv dirty"; cat /tmp/fsck; }
  # deactivated and activated again: the data is still there
  lv vgchange -q -an vg
  echo "ORACLE $P-inactive $($DMSETUP ls | line)"
  lv vgchange -q -ay vg
  mount -t ext4 -o noinit_itable /dev/vg/th /mnt
  echo "ORACLE $P-md5-thfile-again $(md5sum < /mnt/f | cut -d' ' -f1)"
  umount /mnt
  echo "ORACLE $P-md5-str-again $(sum8 /dev/vg/str)"
  # a pool filled past its autoextend threshold grows by itself (dmeventd)
  lv lvcreate -q -y --type thin-pool -L 32M -n pool2 vg
  lv lvcreate -q -y -V 64M -T vg/pool2 -n t2
  echo "ORACLE $P-monitor $(lv lvs --noheadings -o seg_monitor vg/pool2 | tr -d ' ')"
  # 24 MiB of the pool's 32 (75%), written while dmeventd watches
  dd if=/dev/zero of=/dev/vg/t2 bs=1M count=24 oflag=direct 2>/dev/null &
  W=$!
  i=0
  while [ "$(lv lvs --noheadings --units m -o lv_size vg/pool2 | tr -d ' ')" = "32.00m" ] && [ $i -lt 120 ]; do sleep 1; i=$((i+1)); done
  wait $W && echo "ORACLE $P-autoextend-writer ok" || echo "ORACLE $P-autoextend-writer failed"
  echo "ORACLE $P-autoextend $(lv lvs --noheadings --units m -o lv_size,data_percent vg/pool2 | line)"
  echo "ORACLE $P-autoextend-secs $i"
  # and away
  lv vgchange -q -an vg
  lv vgremove -q -y vg
  lv pvremove -q -y /dev/vda /dev/vdb
  echo "ORACLE $P-left $($DMSETUP ls | line)"
  killall dmeventd 2>/dev/null || true
  sleep 1
}

echo "ORACLE dm-before $(grep -c device-mapper /proc/devices || true) $(ls /dev/mapper 2>/dev/null | wc -l)"
dmkit serve --run-dir /run/dmkit --attach > /tmp/dmkit.log 2>&1 &
DAEMON=$!
i=0; while [ ! -S /run/dmkit/control.sock ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
LVM="dmkit --run-dir /run/dmkit exec -- lvm" DMSETUP="dmkit --run-dir /run/dmkit exec -- dmsetup" scenario d
echo "ORACLE dm-during $(grep -c device-mapper /proc/devices || true)"
echo "ORACLE d-log-errors $(grep -c "ERROR\|WARN\|panic" /tmp/dmkit.log || true)"
grep 'ERROR\|WARN\|panic' /tmp/dmkit.log | head -20 || true
kill $DAEMON; wait $DAEMON || true
dd if=/dev/zero of=/dev/vda bs=1M count=128 2>/dev/null
dd if=/dev/zero of=/dev/vdb bs=1M count=128 2>/dev/null
load_dm
LVM=lvm DMSETUP=dmsetup scenario k

# Side by side (issue 45): the kernel's device-mapper loaded, a kernel linear
# device `kd` over the pattern disk's first 8 MiB, and a dmkit daemon with a
# device `dz` over a copy of its second 8 MiB (a ublk block device). Behind the
# door the kernel's node opens the kernel's device, dmkit's name opens dmkit's;
# each side lists only its own devices.
dmkit serve --run-dir /run/dmkit2 --attach > /tmp/dmkit2.log 2>&1 &
D2=$!
i=0; while [ ! -S /run/dmkit2/control.sock ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
dd if=/dev/vdc of=/tmp/dz.img bs=1M count=8 skip=8 2>/dev/null
dmsetup create kd --table "0 16384 linear /dev/vdc 0"
dmkit --run-dir /run/dmkit2 create dz --table "0 16384 linear /tmp/dz.img 0"
DOOR="dmkit --run-dir /run/dmkit2 exec --"
# the guest's own tools are busybox, static: the door reaches dynamic programs
# only, so Debian's dd and cat are brought (ORACLE_FILES) and used on both sides
# (its block device answers once ublk has started it)
i=0; while [ "$(/usr/bin/dd if=/dev/mapper/dz bs=4096 count=1 status=none 2>/dev/null | wc -c)" != 4096 ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
echo "ORACLE side-kernel-ls $(dmsetup ls | cut -f1 | line)"
echo "ORACLE side-door-ls $($DOOR dmsetup ls | cut -f1 | line)"
echo "ORACLE side-kd-plain $(/usr/bin/dd if=/dev/mapper/kd bs=1M count=8 status=none | md5sum | cut -d' ' -f1)"
echo "ORACLE side-kd-door $($DOOR /usr/bin/dd if=/dev/mapper/kd bs=1M count=8 status=none | md5sum | cut -d' ' -f1)"
echo "ORACLE side-dz-door $($DOOR /usr/bin/dd if=/dev/mapper/dz bs=1M count=8 status=none | md5sum | cut -d' ' -f1)"
echo "ORACLE side-dm-lines $(/usr/bin/cat /proc/devices | grep -c device-mapper) $($DOOR /usr/bin/cat /proc/devices | grep device-mapper | line)"
dmkit --run-dir /run/dmkit2 remove dz 2>/dev/null || dmkit --run-dir /run/dmkit2 detach dz
dmkit --run-dir /run/dmkit2 remove dz 2>/dev/null || true
dmsetup remove kd
kill $D2; wait $D2 || true
