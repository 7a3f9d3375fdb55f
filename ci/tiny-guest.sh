#!/usr/bin/env bash
# A throwaway guest to try dmkit's disks in a virtual machine: DIR/vmlinuz
# (Debian's kernel, fetched once with apt-get download and cached) and
# DIR/initrd.gz (busybox, the virtio modules) whose init runs SCRIPT with
# busybox sh, prints "ORACLE-EXIT <status>" and powers the machine off.
# The same guest the tests boot (tests/oracle/run.sh; ci/install.sh installs
# what it needs).
# Usage: ci/tiny-guest.sh DIR SCRIPT
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 DIR SCRIPT" >&2; exit 2; }
repo=$(dirname "$(readlink -f "$0")")/..
exec bash "$repo/tests/oracle/run.sh" --build "$1" "$2"
