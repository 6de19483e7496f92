#!/usr/bin/env python3
"""Interop check: gRPC's C core (the grpcio package, its own HTTP/2 and HPACK)
against minimesh's control plane, whose discovery port is served by tonic
(Rust's h2). Run by tests/e2e/grpc_interop.rs, which starts the control
plane and compares what this prints.

Usage: grpcio_client.py XDS_ADDR ADMIN_ADDR

Installs grpcio into target/python-deps when it is missing (as
deploy/validate.py does). Messages are encoded by hand from
proto/minimesh/v1/discovery.proto's field numbers, so no protobuf compiler is
needed.
"""

import importlib
import os
import queue
import subprocess
import sys
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPS = os.path.join(ROOT, "target", "python-deps")

CLUSTER = "type.googleapis.com/minimesh.v1.Cluster"
ENDPOINTS = "type.googleapis.com/minimesh.v1.ClusterLoadAssignment"


def ensure_grpc():
    sys.path.insert(0, DEPS)
    try:
        return importlib.import_module("grpc")
    except ImportError:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet",
             "--disable-pip-version-check", "--target", DEPS, "grpcio"],
            check=True,
        )
        importlib.invalidate_caches()
        return importlib.import_module("grpc")


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field(number, value):
    """A length-delimited field (strings and messages)."""
    if isinstance(value, str):
        value = value.encode()
    return varint(number << 3 | 2) + varint(len(value)) + value


def parse(data):
    """Field number -> list of values (bytes or int)."""
    fields, i = {}, 0
    while i < len(data):
        key, i = read_varint(data, i)
        number, kind = key >> 3, key & 7
        if kind == 0:
            value, i = read_varint(data, i)
        elif kind == 2:
            n, i = read_varint(data, i)
            value, i = data[i:i + n], i + n
        else:
            raise ValueError(f"wire type {kind}")
        fields.setdefault(number, []).append(value)
    return fields


def read_varint(data, i):
    value, shift = 0, 0
    while True:
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def request(type_url, version="", nonce=""):
    node = field(1, "grpcio.default") + field(2, "grpcio") + field(3, "default")
    msg = field(2, node) + field(4, type_url)
    if version:
        msg += field(1, version)
    if nonce:
        msg += field(5, nonce)
    return msg


def connected(admin):
    body = urllib.request.urlopen(f"http://{admin}/metrics", timeout=5).read().decode()
    for line in body.splitlines():
        if line.startswith("minimesh_xds_connected_proxies "):
            return line.split()[1]
    return "?"


def main():
    xds, admin = sys.argv[1], sys.argv[2]
    grpc = ensure_grpc()
    # A 16 KiB stream window, fixed: the endpoint response must wait for the
    # client's WINDOW_UPDATEs.
    channel = grpc.insecure_channel(
        xds, options=[("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)]
    )
    identity = lambda b: b  # noqa: E731
    stream_call = channel.stream_stream(
        "/minimesh.v1.AggregatedDiscoveryService/StreamAggregatedResources",
        request_serializer=identity,
        response_deserializer=identity,
    )
    outbox = queue.Queue()

    def requests():
        while True:
            item = outbox.get()
            if item is None:
                return
            yield item

    outbox.put(request(CLUSTER))
    outbox.put(request(ENDPOINTS))
    responses = stream_call(requests(), timeout=30)
    for _ in range(2):
        response = parse(next(responses))
        type_url = response[4][0].decode()
        version, nonce = response[1][0].decode(), response[5][0].decode()
        resources = [parse(a)[2][0] for a in response.get(2, [])]
        if type_url == CLUSTER:
            print(f"clusters: {len(resources)}")
        else:
            endpoints = sum(len(parse(r).get(2, [])) for r in resources)
            size = sum(len(r) for r in resources)
            print(f"endpoints: {endpoints} in {'more' if size > 65535 else 'less'} than one window")
        outbox.put(request(type_url, version, nonce))
    print(f"connected streams: {connected(admin)}")

    unary = channel.unary_unary(
        "/minimesh.v1.Nope/Call", request_serializer=identity, response_deserializer=identity
    )
    try:
        unary(b"", timeout=5)
        print("unknown service: answered")
    except grpc.RpcError as e:
        print(f"unknown service: {e.code().name} {e.details()}")

    outbox.put(None)
    responses.cancel()
    channel.close()


if __name__ == "__main__":
    main()
