#!/usr/bin/env python3
"""A proxyless gRPC client: grpcio (gRPC's C core and its own xDS client)
dialling xds:///TARGET, with GRPC_XDS_BOOTSTRAP naming minimesh's discovery
port. Run by tests/e2e/xds_v3.rs, which starts the control plane and the
backends (grpc_mesh.py server) and reads what this prints.

The bootstrap is examples/grpc/xds-bootstrap.json with its server_uri set to
XDS (and the node id to NODE), so the example is what the test runs.

Usage:
  xds_client.py spread XDS NODE TARGET N [HDR VALUE]
                                                  N calls of Who, one at a time
                                                  (with header HDR = VALUE)
  xds_client.py hash XDS NODE TARGET N KEYS HDR   N calls, header HDR = k0..k(KEYS-1)
  xds_client.py flow XDS NODE TARGET RATE SECS [HDR VALUE]
                                                  RATE calls/s for SECS seconds
  xds_client.py busy XDS NODE TARGET THREADS SECS THREADS callers back to back

Output: spread and hash print one JSON object at the end; flow and busy print
one line per call as it completes: "<epoch ms> <server>" or
"<epoch ms> ERROR <status>", then "done".

spread counts from the call after the client has reached every backend
(EXPECT_BACKENDS, default 3): until then, round robin has only the backends
already connected to choose from.

Environment: XDS_CLIENT_METHOD (default Who) is the mesh.Echo method called;
XDS_CLIENT_LINGER keeps the channel open that many seconds after the calls
(so that a last load report is sent).
"""

import json
import os
import sys
import tempfile
import threading
import time

from grpcio_client import ROOT, ensure_grpc


def identity(b):
    return b


def channel(xds, node, target):
    with open(os.path.join(ROOT, "examples", "grpc", "xds-bootstrap.json")) as f:
        bootstrap = json.load(f)
    bootstrap["xds_servers"][0]["server_uri"] = xds
    bootstrap["node"]["id"] = node
    fd, path = tempfile.mkstemp(suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(bootstrap, f)
    os.environ["GRPC_XDS_BOOTSTRAP"] = path
    grpc = ensure_grpc()
    ch = grpc.insecure_channel(f"xds:///{target}")
    method = os.environ.get("XDS_CLIENT_METHOD", "Who")
    who = ch.unary_unary(f"/mesh.Echo/{method}", request_serializer=identity,
                         response_deserializer=identity)
    return grpc, who


def call(grpc, who, metadata=None):
    try:
        return who(b"", timeout=10, metadata=metadata).decode()
    except grpc.RpcError as e:
        return "ERROR " + e.code().name


def out(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main():
    args = sys.argv[1:]
    if len(args) < 4:
        sys.exit(__doc__)
    mode, xds, node, target, rest = args[0], args[1], args[2], args[3], args[4:]
    grpc, who = channel(xds, node, target)
    if mode == "spread":
        metadata = ((rest[1], rest[2]),) if len(rest) >= 3 else None
        seen = set()
        for _ in range(100):
            seen.add(call(grpc, who, metadata))
            if len(seen) >= int(os.environ.get("EXPECT_BACKENDS", "3")):
                break
        counts = {}
        for _ in range(int(rest[0])):
            r = call(grpc, who, metadata)
            counts[r] = counts.get(r, 0) + 1
        out(json.dumps(counts, sort_keys=True))
    elif mode == "hash":
        n, keys, header = int(rest[0]), int(rest[1]), rest[2]
        seen = {}
        for i in range(n):
            key = f"k{i % keys}"
            r = call(grpc, who, metadata=((header, key),))
            seen.setdefault(key, {})
            seen[key][r] = seen[key].get(r, 0) + 1
        out(json.dumps(seen, sort_keys=True))
    elif mode == "flow":
        rate, secs = float(rest[0]), float(rest[1])
        metadata = ((rest[2], rest[3]),) if len(rest) >= 4 else None
        start = time.time()
        i = 0
        while time.time() - start < secs:
            r = call(grpc, who, metadata)
            out(f"{int(time.time() * 1000)} {r}")
            i += 1
            pause = start + i / rate - time.time()
            if pause > 0:
                time.sleep(pause)
        out("done")
    elif mode == "busy":
        threads, secs = int(rest[0]), float(rest[1])
        end = time.time() + secs
        lock = threading.Lock()

        def caller():
            while time.time() < end:
                r = call(grpc, who)
                with lock:
                    out(f"{int(time.time() * 1000)} {r}")

        ts = [threading.Thread(target=caller) for _ in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        out("done")
    else:
        sys.exit(__doc__)
    time.sleep(float(os.environ.get("XDS_CLIENT_LINGER", "0")))


if __name__ == "__main__":
    main()
