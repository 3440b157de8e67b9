"""What TLS adds to one gRPC hop, without the rest of the mesh's noise around it.

A grpc.aio server echoing bytes on two ports, one plaintext and one with mTLS (the mesh's
settings: `make certs`'s certificates, a client certificate required), and one caller per
port sending one request at a time; blocks of `--block` calls alternate between the two, so
drift on a shared machine hits both alike. Reported: p50 and p99 per variant, and the
difference, which times the hops of a request (the front door and four upstream calls on a
miss) bounds what TLS adds to the mesh's latency.

Usage: .venv/bin/python bench/scripts/tls_hop_cost.py [--calls 5000] [--size 2048]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from hopline.cli.certs import make_certs
from hopline.runtime.tls import TlsFiles, aio_channel, client_tls, server_credentials

METHOD = "/hopline.bench.Echo/Echo"


async def echo(request: bytes, context: Any) -> bytes:
    return request


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--block", type=int, default=250)
    parser.add_argument("--size", type=int, default=2048, help="request bytes (a Tensor-ish)")
    args = parser.parse_args()
    certs = make_certs(Path(tempfile.mkdtemp(prefix="hopline-tls-hop-")) / "tls")
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "hopline.bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    plain_port = server.add_insecure_port("127.0.0.1:0")
    credentials = server_credentials(
        TlsFiles(str(certs / "cache.crt"), str(certs / "cache.key"), str(certs / "ca.crt")),
        "gateway",
    )
    assert credentials is not None
    tls_port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    gateway = TlsFiles(
        str(certs / "gateway.crt"), str(certs / "gateway.key"), str(certs / "ca.crt")
    )
    channels = {
        "plain": aio_channel(f"127.0.0.1:{plain_port}", None),
        "tls": aio_channel(f"127.0.0.1:{tls_port}", client_tls(gateway, "cache")),
    }
    calls = {name: ch.unary_unary(METHOD) for name, ch in channels.items()}
    payload = bytes(args.size)
    latencies: dict[str, list[int]] = {"plain": [], "tls": []}
    for call in calls.values():  # connect and warm both
        for _ in range(200):
            await call(payload)
    for block in range(args.calls // args.block):
        for name in ("plain", "tls") if block % 2 == 0 else ("tls", "plain"):
            for _ in range(args.block):
                started = time.perf_counter_ns()
                await calls[name](payload)
                latencies[name].append(time.perf_counter_ns() - started)
    for name, values in latencies.items():
        ns = np.array(values)
        print(
            f"{name:<5} p50 {np.percentile(ns, 50) / 1e3:7.1f} us  "
            f"p99 {np.percentile(ns, 99) / 1e3:7.1f} us  n={len(ns)}"
        )
    plain, tls = (np.array(latencies[n]) for n in ("plain", "tls"))
    for q in (50, 99):
        diff = (np.percentile(tls, q) - np.percentile(plain, q)) / 1e3
        print(f"tls - plain p{q}: {diff:+.1f} us per hop")
    for ch in channels.values():
        await ch.close()
    await server.stop(0)


if __name__ == "__main__":
    asyncio.run(main())
