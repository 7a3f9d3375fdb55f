#!/usr/bin/env bash
# Run every fuzz target for SECONDS (default 20) on a copy of its seed corpus; a
# crash, panic, timeout or out-of-memory fails. Uses the nightly toolchain, or the
# stable one with RUSTC_BOOTSTRAP=1 where no nightly is installed (cargo-fuzz
# needs nightly-only flags only for its sanitizers), and installs cargo-fuzz if
# it is missing.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${1:-20}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    fz=(cargo +nightly fuzz)
else
    echo "fuzz: no nightly toolchain; stable with RUSTC_BOOTSTRAP=1"
    export RUSTC_BOOTSTRAP=1
    fz=(cargo fuzz)
fi
python3 make_corpus.py
"${fz[@]}" build -O -a
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for t in $("${fz[@]}" list); do
    mkdir -p "$work/$t"
    cp -r "corpus/$t/." "$work/$t/"
    if ! "${fz[@]}" run -O -a "$t" "$work/$t" -- -max_total_time="$secs" -rss_limit_mb=4096 -timeout=20 \
        >"$work/$t.log" 2>&1; then
        echo "fuzz: $t FAILED"
        grep -v '^#' "$work/$t.log" | tail -60
        exit 1
    fi
    echo "fuzz: $t: $(grep -E '^Done' "$work/$t.log" || echo 'no summary')"
done
