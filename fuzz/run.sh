#!/usr/bin/env bash
# Runs every fuzz target for SECONDS (default 60) from a copy of its seed
# corpus (the seeds in corpus/ stay as they are; what a run finds is thrown
# away unless it crashes). A crash fails the run and leaves the input under
# artifacts/<target>/; add it to corpus/<target>/ once fixed, and `cargo
# test` replays it from then on.
#   bash fuzz/run.sh [SECONDS]
# Needs a nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`).
set -euo pipefail
cd "$(dirname "$0")"
secs="${1:-60}"
build_log="$(mktemp -t minimesh-fuzz-build.XXXXXX)"
cargo +nightly fuzz build >"$build_log" 2>&1 || { tail -40 "$build_log"; exit 1; }
rm -f "$build_log"
for target in $(cargo +nightly fuzz list); do
  work="$(mktemp -d -t "minimesh-fuzz-$target.XXXXXX")"
  log="$work.log"
  cp -r "corpus/$target/." "$work/"
  if cargo +nightly fuzz run "$target" "$work" -- -max_total_time="$secs" >"$log" 2>&1; then
    echo "fuzz: $target: $(grep -E '^Done [0-9]+ runs' "$log" | tail -1) without a failure"
  else
    tail -40 "$log"
    echo "fuzz: $target failed; the input is under fuzz/artifacts/$target/" >&2
    exit 1
  fi
  rm -rf "$work" "$log"
done
