"""Where a mesh request's time goes, hop by hop: the gateway's view against each server's own.

For each hop: the mean time the gateway spent on it (its client side,
`hopline_hop_duration_seconds`), the mean time the server spent on the same RPCs (its
wrapper, `hopline_rpc_duration_seconds`, in whichever process the service runs: a co-located
service's is in the gateway's registry), and what lies between (for a remote hop the network,
serialisation and both stubs; in process the call's own wrappers). Then the request as a
whole: the client's latency against the gateway's own Predict handler, which leaves the
time outside the gateway (the client's stub, the transport both ways, the gateway's server
before and after the handler), to read against the echo baselines' round trip.

And where a request's CPU goes: each process's CPU time over the window
(`process_cpu_seconds_total`, which every hopline process exports) per request answered. Under
a closed loop the cores are the limit, so a throughput ratio against the in-process pipeline
is a ratio of CPU per request, and this says which process holds the difference. A process
is named by the services whose RPCs its registry counts (`gateway+tokenizer+inference+
postprocess` for a co-located gateway). A process's children are not its own: the cache's
milvus-lite server is left out here and counted in the machine's figure
(`bench/report.py:cpu_per_request`).

Read from the mesh's Prometheus endpoints just before and just after the measured window
(`hopline bench --metrics TARGET=HOST:PORT,...`), summed over the target's rounds. Only
calls that ended OK count. Means, not percentiles: a histogram's p50 is no finer than its
buckets. A batched hop's server figure is per RPC, which may carry several requests' rows;
the gateway figure is per request, so under load the two count different things (both
counts are kept).
"""

from __future__ import annotations

import dataclasses
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from hopline.observability import schema

HOP_METRIC = "hopline_hop_duration_seconds"
RPC_METRIC = "hopline_rpc_duration_seconds"
CPU_SAMPLE = "process_cpu_seconds_total"  # prometheus_client's process collector
# A process's name: the services it answers for, in the order a request meets them.
SERVICE_ORDER = ("gateway", "tokenizer", "cache", "inference", "postprocess")
GATEWAY_RPC = ("hopline.gateway.v1.GatewayService", "Predict")
# Each hop and the server methods its calls arrive as (a store goes as StoreBatch, or as
# Store to a cache from before it).
HOP_RPCS: dict[str, tuple[tuple[str, str], ...]] = {
    schema.SPAN_TOKENIZE: (("hopline.tokenizer.v1.TokenizerService", "Tokenize"),),
    schema.SPAN_CACHE_LOOKUP: (("hopline.cache.v1.CacheService", "Lookup"),),
    schema.SPAN_INFERENCE: (("hopline.inference.v1.InferenceService", "Infer"),),
    schema.SPAN_POSTPROCESS: (("hopline.postprocess.v1.PostprocessService", "Postprocess"),),
    schema.SPAN_CACHE_STORE: (
        ("hopline.cache.v1.CacheService", "StoreBatch"),
        ("hopline.cache.v1.CacheService", "Store"),
    ),
}
# Hops no reply waits for: a store is sent after the reply, one call per StoreBatch of the
# stores of a linger window (gateway/store_queue.py), so its calls are not requests.
OFF_REPLY_PATH = {schema.SPAN_CACHE_STORE: "after the reply; a call per StoreBatch"}
SCRAPE_TIMEOUT_S = 5.0
_KEPT_LABELS = {HOP_METRIC: ("hop",), RPC_METRIC: ("method", "service")}

Key = tuple[str, tuple[tuple[str, str], ...]]  # metric, its _KEPT_LABELS in that order


@dataclasses.dataclass(frozen=True)
class Totals:
    """Sum (seconds) and count of OK calls per histogram child, over every endpoint."""

    sums: Mapping[Key, float]
    counts: Mapping[Key, float]
    # Per endpoint: its process's CPU seconds, and its name (`process_name`).
    cpu_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
    names: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def minus(self, before: Totals) -> Totals:
        return Totals(
            {k: v - before.sums.get(k, 0.0) for k, v in self.sums.items()},
            {k: v - before.counts.get(k, 0.0) for k, v in self.counts.items()},
            {k: v - before.cpu_s.get(k, 0.0) for k, v in self.cpu_s.items()},
            self.names,
        )

    def plus(self, other: Totals) -> Totals:
        keys = set(self.sums) | set(other.sums)
        return Totals(
            {k: self.sums.get(k, 0.0) + other.sums.get(k, 0.0) for k in keys},
            {k: self.counts.get(k, 0.0) + other.counts.get(k, 0.0) for k in keys},
            {
                k: self.cpu_s.get(k, 0.0) + other.cpu_s.get(k, 0.0)
                for k in set(self.cpu_s) | set(other.cpu_s)
            },
            {**self.names, **other.names},
        )

    def cpu_by_name(self) -> dict[str, float]:
        """CPU seconds per process name (replicas of one name added), in a request's order."""
        out: dict[str, float] = {}
        for endpoint, seconds in self.cpu_s.items():
            name = self.names.get(endpoint, endpoint)
            out[name] = out.get(name, 0.0) + seconds
        return dict(sorted(out.items(), key=lambda item: _order(item[0])))

    def mean_ms(self, keys: Iterable[Key]) -> tuple[float, int]:
        """The mean (ms) and count of the calls under `keys` together (nan, 0: none)."""
        total = count = 0.0
        for key in keys:
            total += self.sums.get(key, 0.0)
            count += self.counts.get(key, 0.0)
        return (total / count * 1e3 if count else float("nan")), int(count)


EMPTY = Totals({}, {})


def parse(text: str, endpoint: str = "") -> Totals:
    """The OK calls of the hop and RPC histograms in one Prometheus text exposition, and the
    CPU seconds and name of the process behind `endpoint`."""
    sums: dict[Key, float] = {}
    counts: dict[Key, float] = {}
    cpu_s = 0.0  # a supervisor's workers are summed, as the histograms are
    cpu_found = False
    services: set[str] = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == CPU_SAMPLE:
                cpu_s += sample.value
                cpu_found = True
        if family.name not in (HOP_METRIC, RPC_METRIC):
            continue
        if family.name == RPC_METRIC:
            services.update(s.labels["service"] for s in family.samples if "service" in s.labels)
        kept = _KEPT_LABELS[family.name]
        for sample in family.samples:
            labels = sample.labels
            if labels.get("code") != "OK":
                continue
            # Other labels (a gateway's `worker`, under its supervisor) are summed over.
            key = (family.name, tuple((k, labels[k]) for k in kept))
            if sample.name == f"{family.name}_sum":
                sums[key] = sums.get(key, 0.0) + sample.value
            elif sample.name == f"{family.name}_count":
                counts[key] = counts.get(key, 0.0) + sample.value
    # A process that exports no CPU figure (not prometheus_client's, not Linux) is left out.
    cpus = {endpoint: cpu_s} if cpu_found else {}
    return Totals(sums, counts, cpus, {endpoint: process_name(services)})


def process_name(services: Iterable[str]) -> str:
    """`hopline.tokenizer.v1.TokenizerService` and the like as `tokenizer`, joined in a
    request's order; a process answering for none of hopline's services is `other`."""
    short = {s.split(".")[1] for s in services if s.startswith("hopline.") and s.count(".") >= 2}
    known = [s for s in SERVICE_ORDER if s in short]
    return "+".join(known + sorted(short - set(known))) or "other"


def _order(name: str) -> tuple[int, str]:
    first = name.split("+", 1)[0]
    return (SERVICE_ORDER.index(first) if first in SERVICE_ORDER else len(SERVICE_ORDER), name)


def scrape(endpoints: Iterable[str]) -> Totals:
    """Every endpoint's totals, added (`HOST:PORT` or a URL; `/metrics` is the path)."""
    totals = EMPTY
    for endpoint in endpoints:
        url = endpoint if "://" in endpoint else f"http://{endpoint}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as reply:
                totals = totals.plus(parse(reply.read().decode("utf-8"), endpoint))
        except OSError as exc:  # refused, timed out, not HTTP: the flag names a wrong port
            raise SystemExit(
                f"--metrics: cannot read {url} ({exc}); give each process's HOPLINE_METRICS_PORT"
            ) from None
    return totals


class Windows:
    """Each target's totals over its measured windows alone (warm-ups left out), for the
    targets that have endpoints (by the target's base name: `mesh`, `peer_ray`)."""

    def __init__(self, endpoints: Mapping[str, Sequence[str]]) -> None:
        self.endpoints = endpoints
        self.totals: dict[str, Totals] = {}
        self._start: Totals | None = None  # read as the current window opened

    def at_window(self, base: str) -> Callable[[], None] | None:
        """What the load loop calls as the window opens (None: nothing to read)."""
        endpoints = self.endpoints.get(base)
        if endpoints is None:
            return None

        def start() -> None:
            self._start = scrape(endpoints)

        return start

    def ended(self, name: str, base: str) -> None:
        """After the window (nothing counted if it never opened: the load failed first)."""
        endpoints, start, self._start = self.endpoints.get(base), self._start, None
        if endpoints is not None and start is not None:
            window = scrape(endpoints).minus(start)
            self.totals[name] = self.totals.get(name, EMPTY).plus(window)


def _rpc_keys(rpcs: Iterable[tuple[str, str]]) -> list[Key]:
    return [(RPC_METRIC, (("method", m), ("service", s))) for s, m in rpcs]


def split(window: Totals, client_mean_ms: float) -> dict[str, Any]:
    """Per hop the gateway's and the server's means and their gap; per request the client's
    mean against the gateway's handler. Hops the window never called are left out."""
    hops: dict[str, dict[str, float]] = {}
    for hop, rpcs in HOP_RPCS.items():
        at_gateway, calls = window.mean_ms([(HOP_METRIC, (("hop", hop),))])
        if not calls:
            continue
        server, server_calls = window.mean_ms(_rpc_keys(rpcs))
        hops[hop] = {
            "at_gateway_ms": at_gateway,
            "calls": calls,
            "server_ms": server,
            "server_calls": server_calls,
            "gap_ms": at_gateway - server,
        }
    gateway, requests = window.mean_ms(_rpc_keys([GATEWAY_RPC]))
    return {
        "hops": hops,
        "request": {
            "client_ms": client_mean_ms,
            "gateway_ms": gateway,
            "gateway_calls": requests,
            "outside_gateway_ms": client_mean_ms - gateway,
        },
        # Each process's CPU per request the gateway answered (none answered: left out).
        "cpu_ms_per_request": {
            name: seconds / requests * 1e3 for name, seconds in window.cpu_by_name().items()
        }
        if requests
        else {},
    }


def hop_label(hop: str) -> str:
    """The hop's name in a table, saying where no reply waits for it."""
    note = OFF_REPLY_PATH.get(hop)
    return f"{hop} ({note})" if note else hop


def split_table(name: str, figures: Mapping[str, Any], echo_ms: Mapping[str, float]) -> str:
    """`figures` (from `split`) as text; `echo_ms`: the echo baselines' mean round trips."""
    header = "at the gateway   server's own   between   (calls, server calls)"
    lines = [f"{name}: mean ms per call   {header}"]
    for hop, h in figures["hops"].items():
        lines.append(
            f"  {hop:<22}{h['at_gateway_ms']:>16.3f}{h['server_ms']:>15.3f}"
            f"{h['gap_ms']:>10.3f}   ({h['calls']}, {h['server_calls']})"
            + (f"  {OFF_REPLY_PATH[hop]}" if hop in OFF_REPLY_PATH else "")
        )
    r = figures["request"]
    echoes = "".join(f", {n} {ms:.3f}" for n, ms in echo_ms.items())
    lines.append(
        f"  request: client {r['client_ms']:.3f}, gateway handler {r['gateway_ms']:.3f}, "
        f"outside the gateway {r['outside_gateway_ms']:.3f}{echoes}"
    )
    cpu = figures.get("cpu_ms_per_request")
    if cpu:
        each = ", ".join(f"{name} {ms:.3f}" for name, ms in cpu.items())
        lines.append(f"  CPU ms per request: {each}")
    return "\n".join(lines)
