#!/usr/bin/env bash
# Shows that every rule of deploy/base/rbac.yaml is needed: removes each one
# in turn and runs the Kubernetes tests against the fake API server with the
# rest (MINIMESH_FAKE_RBAC), which must then fail with the fake's 403 for a
# call the control plane makes. Prints one line per rule: the rule, and the
# first 403 a test failed with (or NOT NEEDED). About a minute a rule (20
# minutes for the 19): a rule missing makes the tests wait for what never
# comes, so they run 16 at a time (RUST_TEST_THREADS).
#   bash scripts/rbac-rules-needed.sh
set -euo pipefail
export RUST_TEST_THREADS="${RUST_TEST_THREADS:-16}"
cd "$(dirname "$0")/.."
rbac=deploy/base/rbac.yaml
tests=(kubernetes:: admission:: replicas:: scope:: k8s_identity:: pod_security:: gateway_api::)
# Built once; the binary runs with each file (a rebuild between runs would
# measure another tree).
e2e="$(cargo test -q --test e2e --no-run --message-format=json 2>/dev/null |
  sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)"
[ -x "$e2e" ] || { echo "could not build the end-to-end tests" >&2; exit 1; }
work="$(mktemp -d -t minimesh-rbac.XXXXXX)"
trap 'rm -rf "$work"' EXIT
status=0
# Each rule starts with "- apiGroups:" at the start of a line and runs to the
# next rule, comment, document or top-level key.
grep -n '^- apiGroups:' "$rbac" | cut -d: -f1 > "$work/starts"
while read -r start; do
  end=$(awk -v s="$start" 'NR > s && /^(- |#|---|[a-zA-Z])/ { print NR - 1; exit }' "$rbac")
  end=${end:-$(wc -l < "$rbac")}
  rule="$(sed -n "${start},${end}p" "$rbac" | tr -s ' \n' ' ')"
  sed "${start},${end}d" "$rbac" > "$work/rbac.yaml"
  if MINIMESH_FAKE_RBAC="$work/rbac.yaml" "$e2e" -q "${tests[@]}" > "$work/out" 2>&1; then
    echo "NOT NEEDED (every test passed without it): $rule"
    status=1
  else
    echo "needed: $rule"
    echo "    $(grep -m1 -o '403 .*' "$work/out" || echo 'failed without a 403: see a run by hand')"
  fi
done < "$work/starts"
exit $status
