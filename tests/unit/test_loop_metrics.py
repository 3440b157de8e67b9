"""The event loop's lock-free metrics (observability/loop_metrics.py) expose what
prometheus_client's own metrics expose for the same writes: the same series, bucket counts,
sums and exemplars, in the text and OpenMetrics formats a scrape asks for."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.openmetrics import exposition

from hopline.observability import metrics
from hopline.observability.loop_metrics import LoopCounter, LoopGauge, LoopHistogram

# Untyped upstream.
generate_openmetrics: Callable[[CollectorRegistry], bytes] = exposition.generate_latest

BUCKETS = (0.001, 0.01, 0.1, 1.0)
# Below, on and above each bound, and past the last one (+Inf).
AMOUNTS = (0.0, 0.0005, 0.001, 0.002, 0.01, 0.05, 0.1, 0.5, 1.0, 7.0, math.inf)


def _without_created(text: bytes) -> list[str]:
    """The exposition's lines, less prometheus_client's `_created` series (a loop metric has
    no creation time; Prometheus does not need one)."""
    return [line for line in text.decode().splitlines() if "_created" not in line]


def test_the_exposition_is_prometheus_clients_for_the_same_writes() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    hist = LoopHistogram("t_seconds", "help", ("method", "code"), BUCKETS, registry=ours)
    ref_hist = Histogram("t_seconds", "help", ("method", "code"), buckets=BUCKETS, registry=theirs)
    count = LoopCounter("t_calls_total", "calls", ("method",), registry=ours)
    ref_count = Counter("t_calls_total", "calls", ("method",), registry=theirs)
    plain = LoopCounter("t_plain_total", "no labels", registry=ours)
    ref_plain = Counter("t_plain_total", "no labels", registry=theirs)
    gauge = LoopGauge("t_in_flight", "now", ("method",), registry=ours)
    ref_gauge = Gauge("t_in_flight", "now", ("method",), registry=theirs)
    for i, amount in enumerate(AMOUNTS):
        code = "OK" if i % 3 else "NOT_FOUND"
        hist.labels("Predict", code).observe(amount)
        ref_hist.labels("Predict", code).observe(amount)
        count.labels("Predict").inc()
        ref_count.labels("Predict").inc()
        count.labels("Lookup").inc(2)
        ref_count.labels("Lookup").inc(2)
        plain.inc()
        ref_plain.inc()
        gauge.labels("Predict").inc()
        ref_gauge.labels("Predict").inc()
        if i % 2:
            gauge.labels("Predict").dec()
            ref_gauge.labels("Predict").dec()
    gauge.labels("Idle")
    ref_gauge.labels("Idle")
    assert _without_created(generate_latest(ours)) == _without_created(generate_latest(theirs))
    assert _without_created(generate_openmetrics(ours)) == _without_created(
        generate_openmetrics(theirs)
    )


def test_exemplars_are_the_latest_of_each_bucket() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    hist = LoopHistogram("t_seconds", "help", ("method",), BUCKETS, registry=ours)
    ref = Histogram("t_seconds", "help", ("method",), buckets=BUCKETS, registry=theirs)
    writes = [(0.005, "a" * 32), (0.006, None), (0.007, "b" * 32), (0.5, "c" * 32)]
    for amount, trace_id in writes:
        exemplar = {"trace_id": trace_id} if trace_id else None
        hist.labels("Predict").observe(amount, exemplar)
        ref.labels("Predict").observe(amount, exemplar)
    samples = {
        s.labels["le"]: s.exemplar
        for family in ours.collect()
        for s in family.samples
        if s.name.endswith("_bucket")
    }
    assert samples["0.01"] is not None
    assert samples["0.01"].labels == {"trace_id": "b" * 32}
    assert samples["1.0"] is not None
    assert samples["1.0"].labels == {"trace_id": "c" * 32}
    assert samples["0.001"] is None
    assert samples["+Inf"] is None

    def exemplars(registry: CollectorRegistry) -> list[str]:
        # Timestamps differ by the microseconds between the two writes.
        lines = generate_openmetrics(registry).decode().splitlines()
        return [line.rsplit(" ", 1)[0] for line in lines if " # {" in line]

    assert exemplars(ours) == exemplars(theirs)


def test_a_series_needs_every_label() -> None:
    hist = LoopHistogram("t_seconds", "help", ("method", "code"), BUCKETS, registry=None)
    with pytest.raises(ValueError, match=r"takes labels \('method', 'code'\)"):
        hist.labels("Predict")
    with pytest.raises(ValueError, match="takes labels"):
        LoopCounter("t_total", "help", ("a",), registry=None).labels()


def test_getstats_counts_read_loop_counters() -> None:
    """GetStats reads its counters through metrics.count, loop counters among them."""
    counter = LoopCounter("t_outcomes_total", "outcomes", ("model", "outcome"), registry=None)
    counter.labels("m", "exact").inc()
    counter.labels("m", "miss").inc(3)
    counter.labels("n", "miss").inc()
    assert metrics.count(counter) == 5
    assert metrics.count(counter, outcome="miss") == 4
    assert metrics.count(counter, model="m", outcome="exact") == 1
