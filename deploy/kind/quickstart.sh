#!/usr/bin/env bash
# minimesh on kind, end to end: create the cluster, build and load the image,
# install the CRD and the control plane, deploy simple-web / simple-backend
# with sidecars and the ingress gateway, apply a DestinationRule, and run
# fortio against the ingress.
#
# Needs docker, kind and kubectl. Run from anywhere:
#   deploy/kind/quickstart.sh                      # RANDOM rule, 60 s of fortio
#   RULE=examples/rules/simple-backend-dr-rr.yaml DURATION=30s deploy/kind/quickstart.sh
#   deploy/kind/quickstart.sh delete               # remove the cluster
set -euo pipefail

CLUSTER="${CLUSTER:-minimesh}"
IMAGE="${IMAGE:-minimesh:dev}"
# The capture init step's image (deploy/Dockerfile's `init` target).
INIT_IMAGE="${INIT_IMAGE:-minimesh-init:dev}"
RULE="${RULE:-examples/rules/simple-backend-dr-random.yaml}"
DURATION="${DURATION:-60s}"
QPS="${QPS:-1000}"
CONNECTIONS="${CONNECTIONS:-10}"
NS=istioinaction

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"

step() { printf '\n==> %s\n' "$*"; }
need() {
  command -v "$1" >/dev/null 2>&1 || {
    echo "quickstart: '$1' is not installed ($2)" >&2
    exit 1
  }
}

if [[ "${1:-}" == "delete" ]]; then
  kind delete cluster --name "$CLUSTER"
  exit 0
fi

need docker "https://docs.docker.com/engine/install/"
need kind "https://kind.sigs.k8s.io/docs/user/quick-start/#installation"
need kubectl "https://kubernetes.io/docs/tasks/tools/"
need curl "https://curl.se/download.html"

# The manifests name the image minimesh:dev; a different IMAGE takes its place.
apply_kustomization() {
  kubectl kustomize "$1" |
    sed -e "s|image: minimesh:dev|image: $IMAGE|" -e "s|--sidecar-image=minimesh:dev|--sidecar-image=$IMAGE|" \
        -e "s|--init-image=minimesh-init:dev|--init-image=$INIT_IMAGE|" |
    kubectl apply -f -
}

step "kind cluster '$CLUSTER' (control-plane node + 2 workers, NodePort 30000 on localhost:30000)"
if kind get clusters | grep -qx "$CLUSTER"; then
  echo "cluster '$CLUSTER' exists; reusing it"
else
  kind create cluster --config deploy/kind/cluster.yaml --name "$CLUSTER" --wait 120s
fi
kubectl config use-context "kind-$CLUSTER" >/dev/null
# Injected sidecars are native sidecars (init containers that keep running).
minor="$(kubectl get --raw /version | sed -n 's/.*"minor": *"\([0-9]*\).*/\1/p')"
if [ "${minor:-0}" -lt 29 ]; then
  echo "quickstart: the cluster runs Kubernetes 1.${minor:-?}; injected sidecars are native sidecars, which need 1.29 or later (kind 0.22 or later)" >&2
  exit 1
fi

step "building $IMAGE and $INIT_IMAGE (deploy/Dockerfile) and loading them into the cluster"
# Docker's containerd image store adds provenance attestations that kind
# cannot import: build without them where buildx is there, and load the images
# as an archive.
build() {
  if docker buildx version >/dev/null 2>&1; then
    docker buildx build --provenance=false --load -f deploy/Dockerfile "$@" .
  else
    docker build -f deploy/Dockerfile "$@" .
  fi
}
build -t "$IMAGE"
build --target init -t "$INIT_IMAGE"
archive="$(mktemp -t minimesh-image.XXXXXX)"
docker save "$IMAGE" "$INIT_IMAGE" -o "$archive"
kind load image-archive "$archive" --name "$CLUSTER"
rm -f "$archive"

step "installing the CRD, RBAC and the control plane (deploy/base)"
apply_kustomization deploy/base
kubectl wait --for condition=established --timeout=60s crd/destinationrules.minimesh.io crd/virtualservices.minimesh.io crd/authorizationpolicies.minimesh.io
kubectl -n minimesh-system rollout status deployment/minimesh-control-plane --timeout=180s

step "deploying simple-web, simple-backend-1, simple-backend-2 and the ingress gateway (deploy/examples/demo)"
apply_kustomization deploy/examples/demo
for d in simple-web simple-backend-1 simple-backend-2 ingress-gateway; do
  kubectl -n "$NS" rollout status "deployment/$d" --timeout=180s
done

step "applying $RULE"
kubectl apply -n "$NS" -f "$RULE"
rule_name="$(kubectl apply -n "$NS" -f "$RULE" --dry-run=client -o jsonpath='{.metadata.name}')"
kubectl -n "$NS" wait --for=condition=Accepted \
  "destinationrule.minimesh.io/$rule_name" --timeout=60s
kubectl -n "$NS" get destinationrules.minimesh.io

step "one request through the ingress"
curl -fsS -H "Host: simple-web.istioinaction.io" http://localhost:30000/
echo

step "fortio load -c $CONNECTIONS -qps $QPS -t $DURATION -jitter against the ingress"
fortio_out="$(mktemp -t minimesh-fortio.XXXXXX)"
if ! docker run --rm --network host fortio/fortio load \
  -c "$CONNECTIONS" -qps "$QPS" -t "$DURATION" -jitter \
  -H "Host: simple-web.istioinaction.io" http://localhost:30000/ >"$fortio_out" 2>&1; then
  cat "$fortio_out" >&2
  echo "quickstart: fortio failed (its output is above)" >&2
  exit 1
fi
grep -E '^(# target|Aggregated Function Time|All done|Code|Sockets used)' "$fortio_out" || true
# Any answer but 2xx (or -1: no answer at all) is a failed request.
if grep -qE '^Code (-1|[013-9][0-9][0-9]) ' "$fortio_out"; then
  echo "quickstart: some requests failed (the Code lines above)" >&2
  exit 1
fi
rm -f "$fortio_out"

step "done"
cat <<EOF
Try another policy:  kubectl apply -n $NS -f examples/rules/simple-backend-dr-least-request.yaml
Rule status:         kubectl -n $NS get mdr
Control plane view:  kubectl -n minimesh-system port-forward deploy/minimesh-control-plane 15014 &
                     curl localhost:15014/debug/config
Remove the cluster:  deploy/kind/quickstart.sh delete
EOF
