#!/usr/bin/env bash
# Installs the benchmark anchors and builds dmkit in release mode.
set -euo pipefail
cd "$(dirname "$0")/.."
sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
for pair in fio:fio nbdkit:nbdkit qemu-nbd:qemu-utils nbdfuse:nbdfuse thin_check:thin-provisioning-tools; do
  command -v "${pair%%:*}" >/dev/null || { $sudo apt-get update -qq; $sudo apt-get install -y -qq "${pair#*:}"; }
done
cargo build --release --examples
