"""Prometheus metrics: one endpoint per service, latency histograms with trace-id exemplars.

Every metric hopline exports is declared here, so their names and labels live in one place
(docs/observability.md lists them). Exemplars carry the trace id of an observation, so a
spike on a latency panel links to the trace that caused it; Prometheus only sees them when it
scrapes in the OpenMetrics format, which the endpoint serves to clients that ask for it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Collection, Iterable, Iterator
from typing import Any

from opentelemetry import trace
from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client.metrics_core import Metric

from hopline.observability.loop_metrics import LoopCounter, LoopGauge, LoopHistogram
from hopline.observability.metrics_server import serve_metrics
from hopline.runtime.service_table import ServiceName

log = logging.getLogger("hopline.metrics")

# From 0.25 ms to 30 s: a cache exact hit sits at the bottom, a cold model load and the
# upstream timeout (HOPLINE_UPSTREAM_TIMEOUT_S, 10 s) at the top. No step above 2x past
# 50 ms: with 0.1 -> 0.25 -> 0.5 a c=32 p99 of 137-144 ms read 238 ms from the histogram
# (an SRE's probe; histogram_quantile interpolates within a bucket).
LATENCY_BUCKETS = (
    0.00025,
    0.0005,
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    5.0,
    7.5,
    10.0,
    15.0,
    30.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# Written on every RPC, hop or request by the serving event loop only: loop_metrics.py says
# why these are not prometheus_client's own.
RPC_DURATION = LoopHistogram(
    "hopline_rpc_duration_seconds",
    "Server-side time of each RPC, by service, method and status code",
    ("service", "method", "code"),
    buckets=LATENCY_BUCKETS,
)
RPC_IN_FLIGHT = LoopGauge(
    "hopline_rpc_in_flight", "RPCs being served right now", ("service", "method")
)
TRACE_SAMPLING = Gauge(
    "hopline_trace_sampling",
    "The sampling strategy Jaeger last served this process (observability/remote_sampling.py): "
    "share of traces kept, or traces a second at most / at least; operation '' is the default",
    ("operation", "bound"),
)
TRACE_SAMPLING_UPDATES = Counter(
    "hopline_trace_sampling_updates_total",
    "Sampling strategies Jaeger served that changed this process's sampling",
)
UNDECODABLE_REQUESTS = Counter(
    "hopline_undecodable_requests_total",
    "Requests refused with INVALID_ARGUMENT because their bytes are not the method's request "
    "message (corrupt protobuf, a string field that is not UTF-8)",
    ("service", "method"),
)
HOP_DURATION = LoopHistogram(
    "hopline_hop_duration_seconds",
    "The gateway's view of each upstream call (network, queueing and the hop's own work)",
    ("hop", "code"),
    buckets=LATENCY_BUCKETS,
)


@functools.cache
def hop_duration(hop: str, code: str) -> Any:
    """HOP_DURATION's child for one hop and status code (a dict lookup, not labels())."""
    return HOP_DURATION.labels(hop, code)


HEDGES = LoopCounter(
    "hopline_gateway_hedges_total",
    "Stage calls sent again on the next replica because the first attempt was unanswered past "
    "the hedging delay (sent), and those whose hedge answered first (answered)",
    ("hop", "result"),
)


@functools.cache
def hedges(hop: str, result: str) -> Any:
    """HEDGES' child for one hop and result."""
    return HEDGES.labels(hop, result)


CACHE_OUTCOMES = LoopCounter(
    "hopline_cache_outcomes_total",
    "Gateway requests by cache outcome (exact, semantic, miss, fail_open, skipped)",
    ("model", "outcome"),
)
CACHE_FAIL_OPEN = Counter(
    "hopline_cache_fail_open_total",
    "Requests that went to inference because the cache failed, overran its budget or was "
    "circuit-broken",
    ("reason",),
)
CACHE_LOOKUPS_SKIPPED = Counter(
    "hopline_cache_lookups_skipped_total",
    "Cache lookups the gateway skipped (gateway/admission.py): the deadline left no time for "
    "one (deadline), or most recent lookups overran their budget (overloaded)",
    ("reason",),
)
GATEWAY_REFUSED = Counter(
    "hopline_gateway_refused_total",
    "Requests the gateway refused at once: past its in-flight limit (in_flight, "
    "RESOURCE_EXHAUSTED), past their tenant's share of it while other tenants send "
    "(tenant_share, RESOURCE_EXHAUSTED) or with too little deadline left for a model answer "
    "(deadline, DEADLINE_EXCEEDED)",
    ("reason",),
)
GATEWAY_IN_FLIGHT = LoopGauge(
    "hopline_gateway_in_flight",
    "Requests the gateway is working on, local-tier repeats aside (what its limit counts)",
    (),
)
COALESCED = LoopCounter(
    "hopline_coalesced_total", "Cache misses that shared another request's inference", ()
)
COALESCED_RERUN = LoopCounter(
    "hopline_coalesced_reruns_total",
    "Misses that joined another request's inference, saw its deadline end it and ran again "
    "within their own",
    (),
)
STAGES_ASKED_AGAIN = LoopCounter(
    "hopline_stages_asked_again_total",
    "Misses whose stages answered from different files of one model version (changed in "
    "place, not yet reloaded everywhere) and were asked again expecting one build",
    (),
)
# The gateway's GetStats counters are read from these (and the three above): Prometheus is
# the one place a gateway count is kept, so a scrape and GetStats cannot disagree.
GATEWAY_REQUESTS = LoopCounter(
    "hopline_gateway_requests_total",
    "Texts the gateway was asked to classify: one per Predict or PredictStream message, one "
    "per text of a ModelInfer (one for a ModelInfer refused before its texts are accepted)",
    (),
)
GATEWAY_CALLS = Counter(
    "hopline_gateway_calls_total",
    "Gateway calls that carry several requests, by method (PredictStream, ModelInfer)",
    ("method",),
)
SPECULATIVE = LoopCounter(
    "hopline_gateway_speculative_inferences_total",
    "Inferences started beside a cache lookup: used (a miss) or wasted (a hit cancelled it)",
    ("result",),
)
INFERENCES = LoopCounter(
    "hopline_gateway_inferences_total",
    "Inferences the gateway ran (tokenize, inference, postprocess); coalesced misses share one",
    (),
)
LOCAL_EXACT_HITS = LoopCounter(
    "hopline_local_exact_hits_total",
    "Exact hits the gateway's local tier answered, with no hop to the cache",
    (),
)
CACHE_CIRCUIT_OPEN = Gauge(
    "hopline_cache_circuit_open",
    "1 while the gateway's circuit to the cache is open or half-open (lookups skipped, answers "
    "failing open and not stored; GetStats' cache_circuit says which), else 0",
)
STREAM_MESSAGES = LoopCounter(
    "hopline_stream_messages_total",
    "Messages answered on a PredictStream or ModelStreamInfer stream, by the status each reply "
    "carries (the stream's own, in hopline_rpc_duration_seconds, is OK while its messages fail)",
    ("method", "code"),
)

# STREAM_MESSAGES' child for one stream method and status code (a dict lookup, not labels()).
stream_messages = functools.cache(STREAM_MESSAGES.labels)


CACHE_STORES = LoopCounter(
    "hopline_cache_stores_total",
    "The gateway's cache writes after an inference, by result (stored, error, skipped_policy, "
    "skipped_files_differ: a stage answered from other model files than the scope names, "
    "skipped_circuit_open: the cache's circuit was open)",
    ("result",),
)
LOCAL_EXACT_ENTRIES = LoopGauge(  # set on every store the gateway keeps: the loop's alone
    "hopline_local_exact_entries",
    "Exact entries in the gateway's local tier (0 while its cache watch is not live)",
    (),
)
KEY_MIRROR_KEYS = Gauge(
    "hopline_key_mirror_keys",
    "Exact keys the gateway mirrors from the cache (0 while its cache watch is not live)",
    (),
)
KNOWN_MISSES = LoopCounter(
    "hopline_known_misses_total",
    "Exact-only misses the gateway's key mirror answered, with no Lookup to the cache",
    (),
)
CACHE_LOOKUPS = LoopCounter(
    "hopline_cache_lookups_total",
    "Cache service lookups by tier answered (exact, semantic, miss)",
    ("tier",),
)
CACHE_EVENTS = LoopCounter(
    "hopline_cache_events_total",
    "The cache service's work by event (cache/counts.py:CacheCount): lookups taken, stores, "
    "store errors, evictions, expirations, write retries, searches in memory or in Milvus, ...",
    ("event",),
)
CACHE_VERIFY_CANDIDATES = Counter(
    "hopline_cache_verify_candidates_total",
    "Semantic candidates decided by a verified-hit rule, by decision (serve, "
    "serve_and_verify, verify_first, miss)",
    ("model", "decision"),
)
CACHE_VERIFIED = Counter(
    "hopline_cache_verified_total",
    "Model answers reported for verified candidates, by result (agreed, disagreed)",
    ("model", "result"),
)
CACHE_VERIFY_EVIDENCE = Counter(
    "hopline_cache_verify_evidence_total",
    "Verified-hit observations through the evidence store, by event (read_from_peers: another "
    "replica's, taken into this one's rules; not_kept: this replica's, dropped past the bound "
    "held while the store could not be written)",
    ("event",),
)
CACHE_VERIFY_THRESHOLD = Gauge(
    "hopline_cache_verify_threshold",
    "The lowest similarity the verified-hit rules of a model version's scopes serve from now "
    "(held-back answers need more); each tenant's in `hopline cache stats`",
    ("model", "model_version"),
)
BATCH_SIZE = Histogram(
    "hopline_batch_size",
    "Texts per model or embedder run",
    ("component", "model"),
    buckets=BATCH_BUCKETS,
)
CACHE_SEARCH_ROWS = Histogram(
    "hopline_cache_search_rows",
    "Semantic searches answered by one call, to Milvus or in memory (cache/search_batching.py): "
    "the count is the calls, the sum the searches",
    buckets=BATCH_BUCKETS,
)
QUEUE_DEPTH = LoopGauge(  # set by the batchers on every request and run: their loop's alone
    "hopline_queue_depth",
    "Requests waiting for a model or embedder run",
    ("component", "model"),
)


def trace_exemplar() -> dict[str, str] | None:
    """The current trace id as an exemplar, when a sampled span is active."""
    return span_exemplar(trace.get_current_span())


def span_exemplar(span: trace.Span) -> dict[str, str] | None:
    """`span`'s trace id as an exemplar, when its trace is sampled."""
    ctx = span.get_span_context()
    if not ctx.is_valid or not ctx.trace_flags.sampled:
        return None
    return {"trace_id": format(ctx.trace_id, "032x")}


def count(metric: Counter | LoopCounter | LoopHistogram, **labels: str) -> int:
    """A counter's value, or how many observations a histogram holds, summed over every label
    not given (this process's count)."""
    suffix = "_count" if isinstance(metric, LoopHistogram) else "_total"
    total = 0.0
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith(suffix) and all(
                sample.labels.get(k) == v for k, v in labels.items()
            ):
                total += sample.value
    return int(total)


# Families without labels are exposed (at 0) by every process that imports this module; these
# belong to one service, and a process that runs none of them leaves them out of its
# endpoint (a tokenizer's /metrics said hopline_gateway_in_flight 0 for ever). Families with
# labels show no sample until one is written, so only the label-less ones are listed.
OWNED_BY: dict[str, ServiceName] = {
    **dict.fromkeys(
        (
            "hopline_gateway_in_flight",
            "hopline_coalesced",
            "hopline_coalesced_reruns",
            "hopline_stages_asked_again",
            "hopline_gateway_requests",
            "hopline_gateway_inferences",
            "hopline_local_exact_hits",
            "hopline_local_exact_entries",
            "hopline_key_mirror_keys",
            "hopline_known_misses",
            "hopline_cache_circuit_open",  # the gateway's breaker, though named for the cache
        ),
        ServiceName.GATEWAY,
    ),
    "hopline_cache_search_rows": ServiceName.CACHE,
}


class ProcessView:
    """The registry as one process's endpoint shows it: every family but those owned by a
    service the process does not run (`runs`: its own, and any co-located in it)."""

    def __init__(self, runs: Collection[ServiceName], registry: CollectorRegistry = REGISTRY):
        self._registry = registry
        self._leave_out = {name for name, owner in OWNED_BY.items() if owner not in runs}

    def collect(self) -> Iterator[Metric]:
        return (f for f in self._registry.collect() if f.name not in self._leave_out)

    def restricted_registry(self, names: Iterable[str]) -> Any:
        """What prometheus_client's handler asks of a registry for `?name[]=` scrapes."""
        return self._registry.restricted_registry(
            n for n in names if not any(n == f or n.startswith(f + "_") for f in self._leave_out)
        )


def start_metrics_server(
    host: str, port: int, registry: CollectorRegistry | ProcessView = REGISTRY
) -> int | None:
    """Serve /metrics on host:port from a daemon thread (`hopline.observability.
    metrics_server`); 0 disables it. Returns the port."""
    if port <= 0:
        return None
    try:
        bound = serve_metrics(host, port, registry).port
    except OSError as exc:
        # A taken metrics port must not take the service down with it: say so and go on.
        log.error("cannot serve metrics", extra={"host": host, "port": port, "error": str(exc)})
        return None
    shown = f"[{host}]" if ":" in host else host  # an IPv6 address, as a URL writes it
    log.info("metrics", extra={"url": f"http://{shown}:{bound}/metrics"})
    return bound
