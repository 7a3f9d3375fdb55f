#!/usr/bin/env bash
# Kernel oracle: boot a stock Debian kernel under qemu (TCG) with the real
# device-mapper modules, run a caller's test script inside, print the serial
# console. See shared/specs/kernel-oracle.md.
#
# Debian packages this script needs (ci/install.sh installs them):
#   qemu-system-x86 busybox-static cpio dmsetup
# The kernel package is fetched with `apt-get download`, never installed:
#   linux-image-6.1.0-<N>-amd64 (the one `apt-cache depends linux-image-amd64` names)
#
# Usage: run.sh TEST_SCRIPT [DISK_IMAGE...]
#        run.sh --prepare          (install + download only)
#        run.sh --build DIR TEST_SCRIPT   (DIR/vmlinuz and DIR/initrd.gz, to boot
#                                          elsewhere; no qemu run here)
#   TEST_SCRIPT is a busybox sh script run inside the guest after the modules
#   are loaded; disks appear as /dev/vda, /dev/vdb, ... in the order given.
#   The guest prints "ORACLE-EXIT <rc>" after the script, then powers off.
# Environment:
#   DMKIT_ORACLE_CACHE   kernel cache dir (default /var/tmp/dmkit-oracle)
#   DMKIT_ORACLE_TIMEOUT seconds before qemu is killed (default 300)
#   DMKIT_ORACLE_KERNEL  another kernel series, by its meta package: 6.12 boots
#                        what linux-image-6.12-amd64 names (bookworm-security;
#                        it has ublk_drv), instead of linux-image-amd64's 6.1
#   ORACLE_BINS          more host binaries for the guest's /bin (with their
#                        shared libraries), space-separated absolute paths
#   ORACLE_MODULES       more modules to load, paths under kernel/ (before the
#                        modules that need them)
#   ORACLE_FILES         more host files for the guest, at the same paths (with
#                        the shared libraries of those that are ELF objects)
#   ORACLE_DM_LATE=1     the device-mapper modules (drivers/md/) are not loaded at
#                        boot: the script loads them with `load_dm` when it wants
#                        the kernel's device-mapper (until then the guest has none)
#   ORACLE_SMP, ORACLE_MEM  the guest's CPUs (default 1) and MiB (default 512)
#   ORACLE_QEMU_ARGS     more qemu arguments, space-separated (a vhost-user disk:
#                        its chardev and device; the guest's memory is then
#                        shared, as vhost-user needs)
#   ORACLE_SERIAL        where the serial console is written as the guest runs
#                        (for a test that acts on what the guest prints)
# Exit status: qemu's (0 normally), 124 on timeout, 77 when a prerequisite
# (package, kernel download) could not be had.
set -euo pipefail

CACHE=${DMKIT_ORACLE_CACHE:-/var/tmp/dmkit-oracle}
TIMEOUT=${DMKIT_ORACLE_TIMEOUT:-300}
UNAVAILABLE=77

die_unavailable() {
  echo "oracle: unavailable: $*" >&2
  exit $UNAVAILABLE
}

sudo=""
[ "$(id -u)" -eq 0 ] || sudo=sudo

apt_updated=0
apt_update() {
  if [ $apt_updated -eq 0 ]; then
    nice -n 19 $sudo apt-get update -qq >&2 || true
    apt_updated=1
  fi
}

# The test command (ci/install.sh) installs these; here a missing one is reported.
for tool in qemu-system-x86_64 cpio dmsetup; do
  command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || die_unavailable "$tool missing (run ci/install.sh)"
done
dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q "ok installed" ||
  die_unavailable "busybox-static missing (run ci/install.sh)"
BUSYBOX=/bin/busybox
DMSETUP=$(command -v dmsetup || echo /usr/sbin/dmsetup)
QEMU=$(command -v qemu-system-x86_64) || die_unavailable "qemu-system-x86_64 missing"

# --- kernel (cached, serialised between concurrent runs) --------------------
mkdir -p "$CACHE" || die_unavailable "cannot create $CACHE"
exec 9>"$CACHE/.lock"
flock 9
META=linux-image-${DMKIT_ORACLE_KERNEL:+$DMKIT_ORACLE_KERNEL-}amd64
# the versioned package the meta package names today
resolve() { apt-cache depends "$META" 2>/dev/null | sed -n 's/.*Depends: \(linux-image-[^ ]*\)$/\1/p' | head -1; }
kpkg=$(resolve)
if [ -z "$kpkg" ]; then
  apt_update
  kpkg=$(resolve)
fi
[ -n "$kpkg" ] || die_unavailable "apt-cache depends $META names no kernel"
KDIR=$CACHE/$kpkg
if [ ! -f "$KDIR/.done" ]; then
  echo "oracle: downloading $kpkg" >&2
  rm -rf "$KDIR" "$CACHE/dl"
  mkdir -p "$CACHE/dl"
  if ! (cd "$CACHE/dl" && nice -n 19 apt-get download -qq "$kpkg" >&2); then
    apt_update
    (cd "$CACHE/dl" && nice -n 19 apt-get download -qq "$kpkg" >&2) || die_unavailable "apt-get download $kpkg failed"
  fi
  nice -n 19 dpkg -x "$CACHE"/dl/"$kpkg"_*.deb "$KDIR.tmp" || die_unavailable "dpkg -x failed"
  rm -rf "$CACHE/dl"
  mv "$KDIR.tmp" "$KDIR"
  touch "$KDIR/.done"
fi
flock -u 9
VMLINUZ=$(ls "$KDIR"/boot/vmlinuz-* | head -1)
KVER=${VMLINUZ##*/vmlinuz-}
MODDIR=$KDIR/lib/modules/$KVER/kernel

if [ "${1:-}" = "--prepare" ]; then
  echo "oracle: ready: $VMLINUZ"
  exit 0
fi
BUILD=""
if [ "${1:-}" = "--build" ]; then
  [ $# -eq 3 ] || { echo "usage: $0 --build DIR TEST_SCRIPT" >&2; exit 2; }
  BUILD=$2
  shift 2
fi
[ $# -ge 1 ] || { echo "usage: $0 TEST_SCRIPT [DISK_IMAGE...]" >&2; exit 2; }
SCRIPT=$1
shift

# --- initramfs ----------------------------------------------------------------
WORK=$(mktemp -d "${TMPDIR:-/tmp}/dmkit-oracle.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
ROOT=$WORK/root
mkdir -p "$ROOT"/{bin,sbin,proc,sys,dev,tmp,mod}
cp "$BUSYBOX" "$ROOT/bin/busybox"
cp -L "$DMSETUP" "$ROOT/sbin/dmsetup"
# each binary with the shared libraries it loads
for f in ${ORACLE_FILES:-}; do
  [ -e "$f" ] || { echo "oracle: $f missing" >&2; exit 1; }
  mkdir -p "$ROOT$(dirname "$f")"
  cp -L "$f" "$ROOT$f"
done
for bin in "$DMSETUP" ${ORACLE_BINS:-} ${ORACLE_FILES:-}; do
  [ -x "$bin" ] || [ -f "$bin" ] || { echo "oracle: $bin missing" >&2; exit 1; }
  case " ${ORACLE_FILES:-} " in
    *" $bin "*) ;; # at its own path already
    *) [ "$bin" = "$DMSETUP" ] || cp -L "$bin" "$ROOT/bin/${bin##*/}" ;;
  esac
  for lib in $(ldd "$bin" 2>/dev/null | grep -o '/[^ ]*' || true); do
    mkdir -p "$ROOT$(dirname "$lib")"
    cp -L "$lib" "$ROOT$lib"
  done
done
MODULES="
drivers/virtio/virtio_ring.ko
drivers/virtio/virtio.ko
drivers/virtio/virtio_pci_modern_dev.ko
drivers/virtio/virtio_pci_legacy_dev.ko
drivers/virtio/virtio_pci.ko
drivers/block/virtio_blk.ko
crypto/crc32c_generic.ko
lib/libcrc32c.ko
drivers/md/dm-mod.ko
drivers/md/dm-bufio.ko
drivers/md/dm-bio-prison.ko
drivers/md/persistent-data/dm-persistent-data.ko
drivers/md/dm-thin-pool.ko
drivers/md/dm-writecache.ko
drivers/md/dm-snapshot.ko
${ORACLE_MODULES:-}
"
list=""
late=""
for m in $MODULES; do
  src=$MODDIR/$m
  if [ -f "$src.xz" ]; then
    xz -dc "$src.xz" >"$ROOT/mod/${m##*/}" # newer kernels ship modules compressed
  elif [ -f "$src" ]; then
    cp "$src" "$ROOT/mod/"
  else
    for ext in .zst .gz; do [ -f "$src$ext" ] && { echo "oracle: compressed module $src$ext not supported" >&2; exit 1; }; done
    continue # built in
  fi
  case "${ORACLE_DM_LATE:-}:$m" in
    1:drivers/md/*) late="$late ${m##*/}" ;;
    *) list="$list ${m##*/}" ;;
  esac
done
cat >"$ROOT/bin/load_dm" <<LATE
#!/bin/busybox sh
for m in $late; do insmod /mod/\$m || echo "ORACLE-INSMOD-FAILED \$m"; done
LATE
chmod +x "$ROOT/bin/load_dm"
cp "$SCRIPT" "$ROOT/oracle-test.sh"
cat >"$ROOT/init" <<EOF
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/sbin:/bin DM_DISABLE_UDEV=1
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $list; do
  insmod /mod/\$m || echo "ORACLE-INSMOD-FAILED \$m"
done
i=0
while [ ! -b /dev/vda ] && [ \$i -lt 50 ]; do sleep 0.1; i=\$((i+1)); done
echo ORACLE-BEGIN
sh /oracle-test.sh
echo "ORACLE-EXIT \$?"
sync
poweroff -f
EOF
chmod +x "$ROOT/init"
(cd "$ROOT" && find . | cpio -o -H newc --quiet | gzip -1) >"$WORK/initrd.gz"
if [ -n "$BUILD" ]; then
  mkdir -p "$BUILD"
  cp "$VMLINUZ" "$BUILD/vmlinuz"
  cp "$WORK/initrd.gz" "$BUILD/initrd.gz"
  exit 0
fi

drives=()
for d in "$@"; do
  drives+=(-drive "file=$d,format=raw,if=virtio,cache=unsafe")
done
extra=()
if [ -n "${ORACLE_QEMU_ARGS:-}" ]; then
  read -r -a extra <<<"$ORACLE_QEMU_ARGS"
  extra+=(-object "memory-backend-memfd,id=mem,size=${ORACLE_MEM:-512}M,share=on" -machine memory-backend=mem)
fi
set +e
nice -n 19 timeout "$TIMEOUT" "$QEMU" -accel tcg -cpu max -m "${ORACLE_MEM:-512}" -smp "${ORACLE_SMP:-1}" \
  -nodefaults -display none -no-reboot -monitor none \
  -serial "file:${ORACLE_SERIAL:-$WORK/serial.log}" \
  -kernel "$VMLINUZ" -initrd "$WORK/initrd.gz" \
  -append "console=ttyS0 quiet panic=-1 loglevel=4 no_timer_check" \
  "${drives[@]}" "${extra[@]}" </dev/null
rc=$?
set -e
tr -d '\r' <"${ORACLE_SERIAL:-$WORK/serial.log}"
exit $rc
