#!/usr/bin/env bash
# Runs every fuzz target for SECONDS (default 60) from a copy of its seed
# corpus (the seeds in corpus/ stay as they are; what a run finds is thrown
# away unless it crashes). A crash fails the run and leaves the input under
# artifacts/<target>/; add it to corpus/<target>/ once fixed, and `cargo
# test` replays it from then on.
#   bash fuzz/run.sh [SECONDS]
# Needs a nightly toolchain and a C++ compiler (libfuzzer-sys builds
# libFuzzer); not cargo-fuzz. The targets are built as `cargo fuzz build
# --sanitizer none` builds them (libFuzzer's coverage instrumentation,
# `--cfg fuzzing`, debug assertions and overflow checks in a release build,
# for the target triple so that build scripts are not instrumented): the code
# under test is safe Rust, where AddressSanitizer finds nothing the
# assertions do not, and builds in less than half the time. `cargo fuzz run
# <target>` (AddressSanitizer) still works by hand: see README.md.
set -euo pipefail
cd "$(dirname "$0")"
secs="${1:-60}"
triple="$(rustc +nightly -vV | sed -n 's/^host: //p')"
export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module \
-Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
-Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares \
-Cdebug-assertions -Coverflow-checks"
build_log="$(mktemp -t minimesh-fuzz-build.XXXXXX)"
cargo +nightly build --release --target "$triple" --bins >"$build_log" 2>&1 ||
  { tail -40 "$build_log"; exit 1; }
rm -f "$build_log"
for source in fuzz_targets/*.rs; do
  target="$(basename "$source" .rs)"
  work="$(mktemp -d -t "minimesh-fuzz-$target.XXXXXX")"
  log="$work.log"
  cp -r "corpus/$target/." "$work/"
  mkdir -p "artifacts/$target"
  if "target/$triple/release/$target" "$work" -max_total_time="$secs" \
       -artifact_prefix="artifacts/$target/" >"$log" 2>&1; then
    echo "fuzz: $target: $(grep -E '^Done [0-9]+ runs' "$log" | tail -1) without a failure"
  else
    tail -40 "$log"
    echo "fuzz: $target failed; the input is under fuzz/artifacts/$target/" >&2
    exit 1
  fi
  rm -rf "$work" "$log"
done
