#!/usr/bin/env bash
# Installs the benchmark anchors (the test command's install step) and builds dmkit.
set -euo pipefail
cd "$(dirname "$0")/.."
ci/install.sh
cargo build --release --examples
