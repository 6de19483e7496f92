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

The service mesh.Echo is defined by hand with raw-bytes messages, so no
protobuf compiler is needed:
  Who     unary: the server's name
  Fail    unary: NOT_FOUND "no such thing" (a trailers-only response)
  Flaky   unary: UNAVAILABLE from servers whose name ends in -3, else the name
  Count   client streaming: the server's name and how many bytes it got
  Repeat  server streaming: three messages naming the server
and grpc.health.v1.Health/Check (gRPC's health checking protocol): SERVING,
or NOT_SERVING from servers whose name ends in -3.
"""

import sys

from grpcio_client import ensure_grpc


def identity(b):
    return b


def serve(name, addr, delay_ms=0):
    grpc = ensure_grpc()
    import time
    from concurrent import futures

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

    unary = lambda f: grpc.unary_unary_rpc_method_handler(
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
    def check(request, context):
        # HealthCheckResponse.status (field 1): 1 SERVING, 2 NOT_SERVING.
        return b"\x08\x02" if name.endswith("-3") else b"\x08\x01"

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    server.add_generic_rpc_handlers((
        grpc.method_handlers_generic_handler("mesh.Echo", handlers),
        grpc.method_handlers_generic_handler("grpc.health.v1.Health", {"Check": unary(check)}),
    ))
    server.add_insecure_port(addr)
    server.start()
    print(f"{name} serving on {addr}", flush=True)
    server.wait_for_termination()


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
