#!/usr/bin/env bash
# Installs the Debian packages the tests and benchmarks need, when missing: the real
# NBD clients, fio, qemu-img, nbdkit, thin-provisioning-tools, e2fsprogs, for the
# kernel oracle (tests/oracle/run.sh) qemu-system-x86, busybox-static, cpio, dmsetup
# (also the real dmsetup that tests/dmsetup_door.rs drives through the dm ioctl door), lvm2
# (the real lvm that tests/lvm_door.rs drives through the same door),
# a C compiler and libc headers (gcc, libc6-dev: build.rs builds the door's preload library),
# the kernel's NBD client (nbd-client, run in the oracle's guest),
# openssl (tests/crypt.rs decrypts what dm-crypt wrote with it; tests/nbd_tls.rs makes
# certificates with it), GnuTLS's psktool and certtool (gnutls-bin: the PSK file and an
# expired certificate of tests/nbd_tls.rs), OpenSSL's headers and pkg-config (libssl-dev,
# pkg-config: the openssl crate links the system's OpenSSL 3) and cryptsetup
# (cryptsetup-bin: tests/crypt_oracle.rs formats a LUKS2 image, the guest opens it;
# its integritysetup: tests/integrity.rs), socat (tests/lvmd_guest.rs bridges lvmd's socket in
# the guest to a virtio-serial port with it) and e2fsprogs' resize2fs (same test),
# and for the RBD tests and benchmarks a single-node Ceph (ceph-mon, ceph-osd,
# ceph-common, librbd, rbd-nbd) and qemu's rbd driver (qemu-block-extra); from PyPI,
# mkdocs 1.6+ (ci/test.sh builds the manual with it, failing on dead links).
# Then fetches the oracle's kernel. Idempotent: with everything present it only checks.
#
# qemu: a machine may carry a newer qemu-utils (a backport) than the distribution's
# qemu-system-x86, whose qemu-system-common refuses it. Both are then installed in one
# transaction at the version apt offers for qemu-system-x86, downgrading qemu-utils.
set -euo pipefail
cd "$(dirname "$0")/.."

# tool -> Debian package
tools=(
  nbdinfo:libnbd-bin nbdcopy:libnbd-bin nbdfuse:nbdfuse fio:fio
  qemu-img:qemu-utils qemu-nbd:qemu-utils nbdkit:nbdkit
  thin_check:thin-provisioning-tools thin_dump:thin-provisioning-tools
  thin_restore:thin-provisioning-tools
  mkfs.ext4:e2fsprogs e2fsck:e2fsprogs fusermount3:fuse3
  losetup:mount fsfreeze:util-linux fstrim:util-linux mount:mount
  qemu-system-x86_64:qemu-system-x86 cpio:cpio dmsetup:dmsetup lvm:lvm2
  ceph-mon:ceph-mon ceph-osd:ceph-osd ceph:ceph-common rbd:ceph-common
  rados:ceph-common monmaptool:ceph-base rbd-nbd:rbd-nbd
  nbd-client:nbd-client cc:gcc openssl:openssl cryptsetup:cryptsetup-bin integritysetup:cryptsetup-bin
  psktool:gnutls-bin certtool:gnutls-bin pkg-config:pkg-config socat:socat resize2fs:e2fsprogs
)
has() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/sbin/$1" ]; }
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "ok installed"; }

missing=()
for pair in "${tools[@]}"; do
  tool=${pair%%:*} pkg=${pair#*:}
  if ! has "$tool" && [[ " ${missing[*]-} " != *" $pkg "* ]]; then
    missing+=("$pkg")
  fi
done
installed busybox-static || missing+=(busybox-static) # busybox alone is not static
installed librbd-dev || missing+=(librbd-dev)
installed libc6-dev || missing+=(libc6-dev) # the door's preload library (build.rs)
installed libssl-dev || missing+=(libssl-dev) # the openssl crate (NBD over TLS)
# qemu's rbd driver, at the version of the qemu installed (or about to be)
installed qemu-block-extra || missing+=(qemu-block-extra)

sudo=""
[ "$(id -u)" -eq 0 ] || sudo=sudo
apt_install() {
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@"
}

if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  $sudo apt-get update -qq
  plain=()
  qemu=0
  for pkg in "${missing[@]}"; do
    case $pkg in
      qemu-utils | qemu-system-x86 | qemu-block-extra) qemu=1 ;;
      *) plain+=("$pkg") ;;
    esac
  done
  ((${#plain[@]})) && apt_install "${plain[@]}"
  if ((qemu)); then
    # The version qemu-system-x86 will be (installed or candidate); qemu-utils must match.
    v=$(dpkg-query -W -f='${Version}' qemu-system-x86 2>/dev/null || true)
    [ -n "$v" ] || v=$(apt-cache policy qemu-system-x86 | sed -n 's/^ *Candidate: *//p')
    if [ -z "$v" ] || [ "$v" = "(none)" ]; then
      echo "ci/install.sh: apt offers no qemu-system-x86" >&2
      exit 1
    fi
    echo "qemu-system-x86 and qemu-utils at $v"
    apt_install --allow-downgrades "qemu-system-x86=$v" "qemu-utils=$v" "qemu-block-extra=$v"
  fi
fi

for pair in "${tools[@]}"; do
  has "${pair%%:*}" || { echo "ci/install.sh: ${pair%%:*} still missing after install" >&2; exit 1; }
done
for pkg in busybox-static librbd-dev libssl-dev qemu-block-extra; do
  installed "$pkg" || { echo "ci/install.sh: $pkg still missing" >&2; exit 1; }
done

# mkdocs from PyPI: 1.6 is the first whose --strict fails on a missing anchor.
# Run as `python3 -m mkdocs` (ci/test.sh too): the module is there as soon as pip
# installed it, where a `mkdocs` command may wait for a shim (pyenv) or land
# outside PATH (~/.local/bin).
mkdocs_ok() { python3 -m mkdocs --version 2>/dev/null | grep -Eq 'version 1\.([6-9]|[1-9][0-9])\.'; }
if ! mkdocs_ok; then
  echo "installing: mkdocs (pip)"
  python3 -m pip install --quiet 'mkdocs>=1.6,<2'
fi
mkdocs_ok || { echo "ci/install.sh: mkdocs 1.6 or later still missing after install" >&2; exit 1; }

# gRPC for tests/lvmd.rs: its client is generated from proto/ by grpcio-tools
# (independently of dmkit's server code) and run with grpcio.
grpc_ok() { python3 -c 'import grpc, grpc_tools.protoc' 2>/dev/null; }
if ! grpc_ok; then
  echo "installing: grpcio, grpcio-tools (pip)"
  python3 -m pip install --quiet 'grpcio>=1.60' 'grpcio-tools>=1.60'
fi
grpc_ok || { echo "ci/install.sh: grpcio and grpcio-tools still missing after install" >&2; exit 1; }

# The thin-provisioning-tools 1.x reference (Debian trixie's build; bookworm has 0.9),
# unpacked beside the system without touching its apt sources: the tests run each
# `dmkit thin` tool and the reference of the same name on the same metadata.
ci/fetch-tpt-ref.sh

# The kernels the oracle boots (downloaded once, cached): Debian's default (6.1)
# and the 6.12 series from bookworm-security, which has ublk_drv.
tests/oracle/run.sh --prepare
DMKIT_ORACLE_KERNEL=6.12 tests/oracle/run.sh --prepare

# cargo-nextest runs the suite (ci/test.sh); the Rust machines have it, this
# builds it where one does not
command -v cargo-nextest >/dev/null || cargo install cargo-nextest --locked
