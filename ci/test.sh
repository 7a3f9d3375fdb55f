#!/usr/bin/env bash
# The test command: installs what the tests need on a fresh Debian machine
# (ci/install.sh: real NBD clients, fio, qemu-img, nbdkit, thin-provisioning-tools,
# the kernel oracle's qemu and kernel, mkdocs), then runs fmt, the module structure
# check, the manual's build, clippy (the fuzz crate's too) and the whole suite.
# Needs the Rust toolchain; root (or sudo) for apt-get. Every test that needs a tool
# fails without it: nothing is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
# each stage's start, in seconds since this script began (where a run's time goes)
stage() { echo "ci/test.sh: $1 at ${SECONDS} s"; }

stage install
ci/install.sh
stage fmt
cargo fmt --all -- --check
# no import cycles among the modules of any directory, the top-level modules in
# layers, and no concrete target named outside src/targets
stage modules
python3 ci/modules.py
# no function over 100 lines without its reason above it ('Long: ...')
python3 ci/long_functions.py
# the manual and the design notes as a site (mkdocs.yml): a link under docs/ to a
# missing page or anchor fails the build
stage manual
python3 -m mkdocs build --strict --site-dir "$(mktemp -d)"
# clippy in the dev profile, and the fuzz crate's (a workspace of its own) in the
# same target directory, where it finds most of its dependencies checked
stage clippy
cargo clippy --all-targets -- -D warnings
stage fuzz-crate-checks
(cd fuzz && cargo fmt -- --check &&
    CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/../target}" cargo clippy --all-targets -- -D warnings)
# the whole suite with cargo nextest (on the machine with the toolchain): each
# test in its own process, two at a time across binaries, the slowest first,
# and a test past 15 minutes killed and named (.config/nextest.toml); the crate
# has no doc tests
stage suite
cargo nextest run --release
# No fuzzing here: building the targets costs 5 minutes in the dev profile, 17
# optimised with AddressSanitizer, where CI has 45 in all. Runs are made by hand
# with ci/fuzz.sh and recorded in RELIABILITY.md ("Fuzzing").
stage done
