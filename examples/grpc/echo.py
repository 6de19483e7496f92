#!/usr/bin/env python3
"""A small gRPC demo service, mesh.Echo, and a proxyless client for it.

The server answers gRPC on HOST:PORT; the client is gRPC's own xDS client
(grpcio), which takes its balancing policy from minimesh's control plane and
reports its load back, with no sidecar. Needs only `pip install grpcio`; the
messages are raw bytes, so no protobuf compiler is involved.

Usage:
  echo.py server NAME HOST:PORT [DELAY_MS]   serve mesh.Echo as NAME
  echo.py call TARGET [N] [PAUSE_MS]         N calls of Who to xds:///TARGET
                                             (PAUSE_MS apart), printing how many
                                             each server got

The client reads GRPC_XDS_BOOTSTRAP (see xds-bootstrap.json beside this
file: it names the control plane's discovery address). The service:
  Who     unary: the server's name (after DELAY_MS)
  Fail    unary: NOT_FOUND "no such thing"
  Flaky   unary: UNAVAILABLE from servers whose name ends in -3, else the name
  Count   client streaming: the server's name and how many bytes it got
  Repeat  server streaming: three messages naming the server
and grpc.health.v1.Health/Check: SERVING, or NOT_SERVING from servers whose
name ends in -3.
"""

import sys
import time
from concurrent import futures


def identity(b):
    return b


def serve(grpc, name, addr, delay_ms=0):
    def who(request, context):
        if delay_ms:
            time.sleep(delay_ms / 1000)
        return name.encode()

    def fail(request, context):
        context.abort(grpc.StatusCode.NOT_FOUND, "no such thing")

    def flaky(request, context):
        if name.endswith("-3"):
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{name} is unavailable")
        return name.encode()

    def count(requests, context):
        total = sum(len(m) for m in requests)
        return f"{name} got {total} bytes".encode()

    def repeat(request, context):
        for i in range(3):
            yield f"{name} {i}".encode()

    def check(request, context):
        # HealthCheckResponse.status (field 1): 1 SERVING, 2 NOT_SERVING.
        return b"\x08\x02" if name.endswith("-3") else b"\x08\x01"

    def unary(f):
        return grpc.unary_unary_rpc_method_handler(
            f, request_deserializer=identity, response_serializer=identity)

    handlers = {
        "Who": unary(who),
        "Fail": unary(fail),
        "Flaky": unary(flaky),
        "Count": grpc.stream_unary_rpc_method_handler(
            count, request_deserializer=identity, response_serializer=identity),
        "Repeat": grpc.unary_stream_rpc_method_handler(
            repeat, request_deserializer=identity, response_serializer=identity),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    server.add_generic_rpc_handlers((
        grpc.method_handlers_generic_handler("mesh.Echo", handlers),
        grpc.method_handlers_generic_handler("grpc.health.v1.Health", {"Check": unary(check)}),
    ))
    server.add_insecure_port(addr)
    server.start()
    print(f"{name} serving on {addr}", flush=True)
    server.wait_for_termination()


def call(grpc, target, n, pause_ms=0):
    channel = grpc.insecure_channel(f"xds:///{target}")
    who = channel.unary_unary("/mesh.Echo/Who", request_serializer=identity,
                              response_deserializer=identity)
    counts = {}
    for _ in range(n):
        try:
            server = who(b"", timeout=10).decode()
        except grpc.RpcError as e:
            server = f"failed ({e.code().name})"
        counts[server] = counts.get(server, 0) + 1
        if pause_ms:
            time.sleep(pause_ms / 1000)
    for server, k in sorted(counts.items()):
        print(f"{server}: {k}")


def main():
    try:
        import grpc
    except ImportError:
        sys.exit("echo.py needs grpcio: pip install grpcio")
    match sys.argv[1:]:
        case ["server", name, addr]:
            serve(grpc, name, addr)
        case ["server", name, addr, delay_ms]:
            serve(grpc, name, addr, int(delay_ms))
        case ["call", target]:
            call(grpc, target, 10)
        case ["call", target, n]:
            call(grpc, target, int(n))
        case ["call", target, n, pause_ms]:
            call(grpc, target, int(n), int(pause_ms))
        case _:
            sys.exit(__doc__)


if __name__ == "__main__":
    main()
