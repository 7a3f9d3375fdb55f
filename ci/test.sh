#!/usr/bin/env bash
# The test command: installs what the tests need on a fresh Debian machine
# (ci/install.sh: real NBD clients, fio, qemu-img, nbdkit, thin-provisioning-tools,
# the kernel oracle's qemu and kernel), then runs fmt, the module structure check,
# clippy and the whole suite.
# Needs the Rust toolchain; root (or sudo) for apt-get. Every test that needs a tool
# fails without it: nothing is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."

ci/install.sh
cargo fmt --all -- --check
# no import cycles among modules, and no concrete target named outside src/targets
python3 ci/modules.py
cargo clippy --release --all-targets -- -D warnings
cargo test --release -- --test-threads=2
# every fuzz target for a short time (fuzz/README.md)
ci/fuzz.sh 20
