#!/usr/bin/env python3
"""gRPC through the mesh: grpcio (gRPC's C core) servers behind minimesh
sidecars, and a grpcio client calling them through its own sidecar. Run by
tests/e2e/grpc_interop.rs, which starts the processes and compares what the
client prints.

Usage:
  grpc_mesh.py install                      install grpcio if it is missing
  grpc_mesh.py server NAME HOST:PORT [MS]   serve mesh.Echo until killed
                                            (Who answers after MS milliseconds)
  grpc_mesh.py client PROXY AUTHORITY N     call every method through PROXY
  grpc_mesh.py who PROXY AUTHORITY N        only the N calls of Who

The server is the demo service of examples/grpc/echo.py (mesh.Echo, raw-bytes
messages, so no protobuf compiler is needed; its methods are listed there).
"""

import os
import sys

from grpcio_client import ROOT, ensure_grpc


def identity(b):
    return b


def serve(name, addr, delay_ms=0):
    """The demo service of examples/grpc/echo.py."""
    grpc = ensure_grpc()
    sys.path.insert(0, os.path.join(ROOT, "examples", "grpc"))
    import echo

    echo.serve(grpc, name, addr, delay_ms)


def client(proxy, authority, n, who_only=False):
    grpc = ensure_grpc()
    # One channel: one HTTP/2 connection to the sidecar, which must still
    # spread the calls over every replica.
    channel = grpc.insecure_channel(proxy, options=[
        ("grpc.default_authority", authority),
        ("grpc.enable_http_proxy", 0),
    ])

    def method(kind, name):
        return getattr(channel, kind)(
            f"/mesh.Echo/{name}", request_serializer=identity, response_deserializer=identity)

    who = method("unary_unary", "Who")
    counts = {}
    for _ in range(n):
        server = who(b"", timeout=10).decode()
        counts[server] = counts.get(server, 0) + 1
    print("who: " + " ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    if who_only:
        return

    try:
        method("unary_unary", "Fail")(b"", timeout=10)
        print("fail: answered")
    except grpc.RpcError as e:
        print(f"fail: {e.code().name} {e.details()}")

    flaky = method("unary_unary", "Flaky")
    served, failed = set(), 0
    for _ in range(30):
        try:
            served.add(flaky(b"", timeout=10).decode())
        except grpc.RpcError:
            failed += 1
    print(f"flaky: {failed} failed, served by {','.join(sorted(served))}")

    # 3 x 100 KB: more than the sidecar buffers for retries, so the request
    # body streams through.
    got = method("stream_unary", "Count")(iter([b"x" * 100_000] * 3), timeout=10).decode()
    print("count: " + got.split(" ", 1)[1])

    replies = [m.decode() for m in method("unary_stream", "Repeat")(b"", timeout=10)]
    servers = {r.rsplit(" ", 1)[0] for r in replies}
    print(f"repeat: {len(replies)} messages from {len(servers)} server")
    channel.close()


def main():
    match sys.argv[1:]:
        case ["install"]:
            ensure_grpc()
        case ["server", name, addr]:
            serve(name, addr)
        case ["server", name, addr, delay_ms]:
            serve(name, addr, int(delay_ms))
        case ["client", proxy, authority, n]:
            client(proxy, authority, int(n))
        case ["who", proxy, authority, n]:
            client(proxy, authority, int(n), who_only=True)
        case _:
            sys.exit(__doc__)


if __name__ == "__main__":
    main()
