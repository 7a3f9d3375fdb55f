#!/usr/bin/env bash
# The test command: installs what the tests need on a fresh Debian machine (real NBD
# clients, fio, qemu-img, thin-provisioning-tools, ...), then runs the checks and
# the whole suite. Needs the Rust toolchain; root (or sudo) for apt-get.
set -euo pipefail
cd "$(dirname "$0")/.."

# tool -> Debian package
tools=(
  nbdinfo:libnbd-bin nbdcopy:libnbd-bin nbdfuse:nbdfuse fio:fio
  qemu-img:qemu-utils qemu-nbd:qemu-utils nbdkit:nbdkit
  thin_check:thin-provisioning-tools thin_dump:thin-provisioning-tools
  mkfs.ext4:e2fsprogs e2fsck:e2fsprogs
  # the kernel oracle (tests/oracle/run.sh): Debian's qemu-system-x86 replaces a
  # newer qemu-utils, so both are always installed in one transaction
  qemu-system-x86_64:qemu-system-x86 busybox:busybox-static cpio:cpio dmsetup:dmsetup
)
missing=()
for pair in "${tools[@]}"; do
  tool=${pair%%:*} pkg=${pair#*:}
  if ! command -v "$tool" >/dev/null 2>&1 && [[ " ${missing[*]-} " != *" $pkg "* ]]; then
    missing+=("$pkg")
  fi
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  [[ " ${missing[*]} " == *" qemu-system-x86 "* ]] && missing+=(qemu-utils)
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

cargo fmt --all -- --check
cargo clippy --release --all-targets -- -D warnings
cargo test --release -- --test-threads=2
