"""A light tenant's latency beside another tenant's flood, on two gateways in alternated windows.

Light tenants (one closed-loop caller each) and a flood tenant (`--flood` callers) send
unique texts (misses) through the gateway's Predict, each with its own API key, first to one
gateway and then to the other, the order swapped every round; the first second of a window is
not counted. Each window prints, for the light tenants and the flood apart: requests
answered, p50 and p99 at the client, errors by status, and the median of each hop timing the
gateway reported (`inference.queue` is the wait in the model's batcher). docs/performance.md,
"Tenants' turns at the model", has what stop 98 measured with it: two meshes, one running the
code before a change, started with `HOPLINE_API_KEYS` naming the keys given here.

Usage: .venv/bin/python bench/scripts/tenant_fairness_ab.py HOST:PORT HOST:PORT
       [--light-keys key-a] [--flood-key key-flood] [--flood 110] [--seconds 8] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import statistics
import time
import uuid

import grpc

from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc

WARM_S = 1.0


@dataclasses.dataclass
class Tally:
    latencies_s: list[float] = dataclasses.field(default_factory=list)
    errors: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    hops_ms: dict[str, list[float]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(list)
    )

    def clear(self) -> None:
        self.latencies_s.clear()
        self.errors.clear()
        self.hops_ms.clear()

    def line(self, seconds: float) -> str:
        lat = sorted(self.latencies_s)
        if not lat:
            return f"none answered, errors {dict(self.errors)}"

        def pct(q: float) -> float:
            return lat[min(len(lat) - 1, int(len(lat) * q))] * 1e3

        hops = " ".join(
            f"{h}={statistics.median(v):.0f}" for h, v in sorted(self.hops_ms.items()) if v
        )
        return (
            f"{len(lat)} ok, {len(lat) / seconds:.1f} rps, p50 {pct(0.5):.1f} ms, p99 "
            f"{pct(0.99):.1f} ms, errors {dict(self.errors)}, hop medians ms [{hops}]"
        )


async def caller(
    stub: gateway_pb2_grpc.GatewayServiceStub, key: str, tally: Tally, stop: asyncio.Event
) -> None:
    metadata = (("authorization", f"Bearer {key}"),)
    while not stop.is_set():
        text = f"I forgot my password please help {uuid.uuid4().hex[:8]}"
        started = time.perf_counter()
        try:
            reply = await stub.Predict(
                gateway_pb2.PredictRequest(text=text), metadata=metadata, timeout=10
            )
        except grpc.aio.AioRpcError as err:
            tally.errors[err.code().name] += 1
            await asyncio.sleep(0.001)
            continue
        tally.latencies_s.append(time.perf_counter() - started)
        for timing in reply.timings:
            tally.hops_ms[timing.hop].append(timing.ms)


async def window(address: str, args: argparse.Namespace) -> str:
    channels = [grpc.aio.insecure_channel(address) for _ in range(4)]
    stubs = [gateway_pb2_grpc.GatewayServiceStub(c) for c in channels]
    light, flood, stop = Tally(), Tally(), asyncio.Event()
    tasks = [asyncio.create_task(caller(stubs[0], k, light, stop)) for k in args.light_keys]
    tasks += [
        asyncio.create_task(caller(stubs[1 + i % 3], args.flood_key, flood, stop))
        for i in range(args.flood)
    ]
    await asyncio.sleep(WARM_S)
    light.clear()
    flood.clear()
    await asyncio.sleep(args.seconds)
    stop.set()
    await asyncio.gather(*tasks)
    for channel in channels:
        await channel.close()
    return f"light: {light.line(args.seconds)}\n    flood: {flood.line(args.seconds)}"


async def main(args: argparse.Namespace) -> None:
    for n in range(args.rounds):
        order = args.gateways if n % 2 == 0 else args.gateways[::-1]
        for address in order:
            print(f"round {n} {address}\n    {await window(address, args)}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("gateways", nargs=2)
    parser.add_argument("--light-keys", nargs="+", default=["key-a"])
    parser.add_argument("--flood-key", default="key-flood")
    parser.add_argument("--flood", type=int, default=110)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=4)
    asyncio.run(main(parser.parse_args()))
