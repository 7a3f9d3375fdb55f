#!/usr/bin/env bash
# ci/fuzz.sh [--dev] [SECONDS]
# Run every fuzz target for SECONDS (default 20) on a copy of its seed corpus; a
# crash, panic, timeout or out-of-memory fails. Installs cargo-fuzz if it is missing.
#
# By default the targets are optimised and built with AddressSanitizer (the long runs
# RELIABILITY.md records): that needs the nightly toolchain, or the stable one with
# RUSTC_BOOTSTRAP=1 where no nightly is installed, and cargo-fuzz builds them with one
# codegen unit (about 17 minutes from nothing on two cores).
# --dev: the dev profile, coverage-guided but without a sanitizer, on
# the stable toolchain, with debug assertions and overflow checks as the default
# build has them: about 5 minutes from nothing, and slower to run.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
mode=(-O -a)
if [ "${1-}" = --dev ]; then
    mode=(--dev -s none)
    shift
fi
secs=${1:-20}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
if [ "${mode[0]}" = --dev ]; then
    fz=(cargo fuzz)
elif rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    fz=(cargo +nightly fuzz)
else
    echo "fuzz: no nightly toolchain; stable with RUSTC_BOOTSTRAP=1"
    export RUSTC_BOOTSTRAP=1
    fz=(cargo fuzz)
fi
python3 make_corpus.py
"${fz[@]}" build "${mode[@]}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# two targets at a time (the machine's two cores), each on its own copy of its
# corpus; the verdicts are printed in the targets' order once all have run
one() {
    local t=$1
    mkdir -p "$work/$t"
    cp -r "corpus/$t/." "$work/$t/"
    if "${fz[@]}" run "${mode[@]}" "$t" "$work/$t" -- -max_total_time="$secs" -rss_limit_mb=4096 -timeout=20 \
        >"$work/$t.log" 2>&1; then
        echo ok >"$work/$t.verdict"
    else
        echo failed >"$work/$t.verdict"
    fi
}
targets=$("${fz[@]}" list)
for t in $targets; do
    while [ "$(jobs -rp | wc -l)" -ge 2 ]; do wait -n || true; done
    one "$t" &
done
wait
failed=0
for t in $targets; do
    if [ "$(cat "$work/$t.verdict" 2>/dev/null)" != ok ]; then
        echo "fuzz: $t FAILED"
        grep -v '^#' "$work/$t.log" | tail -60
        failed=1
    else
        echo "fuzz: $t: $(grep -E '^Done' "$work/$t.log" || echo 'no summary')"
    fi
done
exit "$failed"
