#!/usr/bin/env bash
# Installs the benchmark anchors (the test command's install step) and builds dmkit.
set -euo pipefail
cd "$(dirname "$0")/.."
ci/install.sh
# bench/writecache.py's disk-head model is an nbdkit cc plugin: it needs the header
DEBIAN_FRONTEND=noninteractive apt-get install -y -q nbdkit-plugin-dev fuse3 >/dev/null
cargo build --release --examples
