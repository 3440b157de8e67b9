"""Metrics written on every request by one event loop's thread: plain numbers, no locks.

prometheus_client's counters, gauges and histograms may be written from any thread, so each
write takes a lock, and each checks that no label is left unset; measured inside a serving
gateway (perf_counter around the calls, exact repeats at c=1 on the 2-core Xeon VM), a gauge's
`inc` cost 3.1-3.6 us and the RPC wrapper's histogram, gauge and status bookkeeping 9-10 us,
several times what the same calls cost in a loop on their own, as everything on a request's
path does there. The metrics written on every RPC, hop or request are written only by the
event loop serving it (the RPC wrapper, the gateway's hop calls and per-request counters, the
cache's lookup counts), so they need neither the lock nor the check: these keep plain
numbers that the loop's thread adds to, and a scrape, from the metrics server's thread, reads
as they stand. A scrape may see a histogram's sum a request ahead of its buckets.

Each metric is a collector in the registry under the name, help and labels it had as a
prometheus_client metric, so /metrics, GetStats (metrics.count) and the worker merge read
them the same way. Written from another thread, a write could be lost: keep them to the loop.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar


class _Value:
    """One labelled series of a counter or gauge."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class _Buckets:
    """One labelled series of a histogram: a count per bucket (not cumulative), the sum, and
    the latest exemplar of each bucket."""

    __slots__ = ("bounds", "counts", "exemplars", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.exemplars: list[Exemplar | None] = [None] * len(bounds)
        self.sum = 0.0

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        # The first bound not below the amount: buckets are "less than or equal".
        index = bisect.bisect_left(self.bounds, amount)
        self.counts[index] += 1
        self.sum += amount
        if exemplar:
            self.exemplars[index] = Exemplar(exemplar, amount, time.time())


S = TypeVar("S", _Value, _Buckets)


class _Family(Collector, Generic[S]):
    """Series by label values, created on first use (at once without labels, as
    prometheus_client's are exposed from the start) and kept for the process's life."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        registry: CollectorRegistry | None = REGISTRY,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._series: dict[tuple[str, ...], S] = {}
        if not self.labelnames:
            self.labels()
        if registry is not None:
            registry.register(self)

    def _new_series(self) -> S:
        raise NotImplementedError

    def labels(self, *values: str) -> S:
        series = self._series.get(values)
        if series is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            series = self._series[values] = self._new_series()
        return series


class _ValueFamily(_Family[_Value]):
    """A counter's or gauge's series: one number each."""

    exposed_as: type[CounterMetricFamily | GaugeMetricFamily]

    def _new_series(self) -> _Value:
        return _Value()

    def collect(self) -> Iterator[Metric]:
        family = self.exposed_as(self.name, self.documentation, labels=self.labelnames)
        for values, series in list(self._series.items()):
            family.add_metric(values, series.value)
        yield family


class LoopCounter(_ValueFamily):
    """A counter (`name` without `_total`, which the exposition adds)."""

    exposed_as = CounterMetricFamily

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        registry: CollectorRegistry | None = REGISTRY,
    ) -> None:
        super().__init__(name.removesuffix("_total"), documentation, labelnames, registry)

    def inc(self, amount: float = 1.0) -> None:
        """For a counter without labels."""
        self.labels().inc(amount)


class LoopGauge(_ValueFamily):
    """A gauge; its series read 0 from their first use."""

    exposed_as = GaugeMetricFamily

    def set(self, value: float) -> None:
        """For a gauge without labels."""
        self.labels().set(value)


class LoopHistogram(_Family[_Buckets]):
    """A histogram with prometheus_client's bucket semantics (`le`, a +Inf bucket added) and
    exemplars (the latest per bucket)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry | None = REGISTRY,
    ) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.bounds = tuple(bounds)
        # The `le` labels as prometheus_client writes them (Go's float format for these).
        self._les = tuple("+Inf" if b == math.inf else repr(b) for b in bounds)
        super().__init__(name, documentation, labelnames, registry)

    def _new_series(self) -> _Buckets:
        return _Buckets(self.bounds)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, series in list(self._series.items()):
            cumulative = 0
            buckets: list[tuple[str, float, Exemplar | None]] = []
            for le, count, exemplar in zip(
                self._les, list(series.counts), list(series.exemplars), strict=True
            ):
                cumulative += count
                buckets.append((le, cumulative, exemplar))
            family.add_metric(values, buckets, series.sum)  # type: ignore[arg-type]
        yield family
