#!/usr/bin/env bash
# Builds the sidecar with profile-guided optimisation (PGO), for production.
#
#   bash scripts/pgo-build.sh [--out DIR] [--network A.B.C.0]
#
# 1. `cargo build --release`: the binaries that run the training mesh.
# 2. The sidecar built again, instrumented (`-Cprofile-generate`).
# 3. Training, with the instrumented sidecar in every pod and in the
#    ingress gateway: `minimesh bench overhead --mtls` (one short round, no
#    peers: plaintext and mutual-TLS HTTP/1.1 GETs through one sidecar, a
#    pair and the gateway, at 1,000 req/s and saturated), then
#    `minimesh up scripts/pgo-train.yaml` with curl sending POSTs with a
#    1 KiB body and larger headers through the gateway and a sidecar pair
#    over mutual TLS. A mesh stops its processes with SIGTERM, and each
#    writes its counts as it exits.
# 4. `llvm-profdata merge`, then the sidecar built with `-Cprofile-use`.
#
# The result is DIR/release (default target/pgo/release): the PGO sidecar
# beside copies of `minimesh`, `control-plane` and `fake-service`, so that
# `DIR/release/minimesh up` and `DIR/release/minimesh bench` run it. The
# source is the same; the counts decide what the compiler inlines and how
# it lays the code out (hot paths together, cold ones apart), which is
# what a request pays for at a low rate, when the caches are cold
# (BENCHMARKS.md, "The sidecar built with profile-guided optimisation").
# Code the training does not run (HTTP/2 from clients, gRPC, xDS v3) is
# treated as cold: correct, and no faster than in the default build.
#
# Needs curl, and `llvm-profdata` of the LLVM that rustc is built with:
# rustup's `llvm-tools` component, or the distribution's llvm-N (Debian: llvm-N).
set -euo pipefail
cd "$(dirname "$0")/.."

out=target/pgo
network=127.0.14.0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    --network) network=${2:?--network needs an address such as 127.0.14.0}; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "pgo-build: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
out=$(cd "$out" && pwd)

command -v curl >/dev/null || { echo "pgo-build: needs curl (the training sends requests with it)" >&2; exit 1; }
major=$(rustc -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')
host=$(rustc -vV | sed -n 's/^host: //p')
profdata=""
for c in "$(rustc --print sysroot)/lib/rustlib/$host/bin/llvm-profdata" \
         "$(command -v "llvm-profdata-$major" || true)" \
         "/usr/lib/llvm-$major/bin/llvm-profdata" \
         "$(command -v llvm-profdata || true)"; do
  if [ -n "$c" ] && [ -x "$c" ] && "$c" --version 2>/dev/null | grep -q "LLVM version $major\."; then
    profdata=$c
    break
  fi
done
if [ -z "$profdata" ]; then
  echo "pgo-build: no llvm-profdata for LLVM $major (the LLVM of $(rustc -V)); install rustup's llvm-tools (rustup component add llvm-tools) or your distribution's llvm-$major (Debian: apt-get install llvm-$major)" >&2
  exit 1
fi

echo "pgo-build: 1/4 the release binaries"
cargo build --release

# `--target`: RUSTFLAGS then reach the sidecar's code only, not the build
# scripts and proc-macros that run while it is built.
echo "pgo-build: 2/4 the sidecar, instrumented"
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-generate=$out/profiles" \
  cargo build --release --bin sidecar --target "$host" --target-dir "$out/instrumented"
rm -rf "$out/profiles" "$out/train"

echo "pgo-build: 3/4 training, part 1 (minimesh bench overhead --mtls, one round)"
mkdir -p "$out/train"
cp target/release/minimesh target/release/control-plane target/release/fake-service "$out/train/"
cp "$out/instrumented/$host/release/sidecar" "$out/train/"
"$out/train/minimesh" bench overhead --mtls --no-peers --rounds 1 --scale 0.3 \
  --network "$network" --home "$out/train/home" --out "$out/train/run"

# Part 2: POSTs with a body. Each curl sends 50,000 requests over 10
# keep-alive connections, and every answer must be a 200.
echo "pgo-build: 3/4 training, part 2 (minimesh up scripts/pgo-train.yaml, curl POSTs)"
prefix=${network%.0}
"$out/train/minimesh" up --home "$out/train/mesh" --network "$network" \
  --sidecar-worker-threads 2 --restart-after never scripts/pgo-train.yaml \
  >"$out/train/mesh.log" 2>&1 &
mesh=$!
trap 'kill -INT "$mesh" 2>/dev/null || true' EXIT
ready=0
for _ in $(seq 60); do
  if curl -fso /dev/null -H "Host: echo" "http://$prefix.252:30000/"; then ready=1; break; fi
  kill -0 "$mesh" 2>/dev/null || { echo "pgo-build: the training mesh exited (see $out/train/mesh.log)" >&2; exit 1; }
  sleep 1
done
if [ "$ready" != 1 ]; then
  echo "pgo-build: the training mesh's ingress did not answer 200 within 60 s (see $out/train/mesh.log)" >&2
  exit 1
fi
head -c 768 /dev/urandom | base64 -w0 >"$out/train/body.json"
post() { # URL: 50,000 POSTs, failing unless each is answered 200
  local ok
  ok=$(curl -s --no-progress-meter -o /dev/null -w '%{http_code}\n' --parallel --parallel-max 10 \
    -X POST --data-binary "@$out/train/body.json" -H "Host: echo" \
    -H "Content-Type: application/json" -H "Accept: application/json" \
    -H "Authorization: Bearer $(head -c 600 /dev/zero | tr '\0' a)" \
    -H "Cookie: session=$(head -c 200 /dev/zero | tr '\0' b)" \
    -H "X-Request-Id: 4f1c2a9e-77d0-4b1e-9d6a-3c5f0e2b8a11" \
    "$1?page=[1-50000]" | grep -c '^200$' || true)
  if [ "$ok" != 50000 ]; then
    echo "pgo-build: $((50000 - ok)) of 50,000 POSTs to $1 were not answered 200 (see $out/train/mesh)" >&2
    exit 1
  fi
}
post "http://$prefix.252:30000/api/items" # the ingress gateway, then the echo pod's sidecar
post "http://$prefix.2:15001/api/items"   # the client pod's sidecar, then the echo pod's
kill -INT "$mesh"
wait "$mesh" || true
trap - EXIT

if ! ls "$out/profiles"/*.profraw >/dev/null 2>&1; then
  echo "pgo-build: the training wrote no profile in $out/profiles (did the sidecars exit cleanly? see $out/train/home)" >&2
  exit 1
fi
"$profdata" merge -o "$out/sidecar.profdata" "$out/profiles"

echo "pgo-build: 4/4 the sidecar, optimised with the profile"
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-use=$out/sidecar.profdata" \
  cargo build --release --bin sidecar --target "$host" --target-dir "$out/optimised"
# Copied, then renamed into place: a binary of an earlier build may be running.
mkdir -p "$out/release"
for bin in target/release/minimesh target/release/control-plane target/release/fake-service \
           "$out/optimised/$host/release/sidecar"; do
  cp "$bin" "$out/release/.$(basename "$bin").new"
  mv -f "$out/release/.$(basename "$bin").new" "$out/release/$(basename "$bin")"
done
echo "pgo-build: done: $out/release/sidecar"
echo "  compare it with the default build: $out/release/minimesh bench overhead --baseline-sidecar target/release/sidecar"
