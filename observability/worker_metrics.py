"""One /metrics for a service run as several worker processes (runtime/workers.py).

Each worker keeps its own registry and serves it on a port of its own; the supervisor serves
the service's metrics port and, on every scrape, reads each worker's endpoint and answers
their families merged, each sample labelled with its `worker`. So one scrape target sees the
whole gateway, as it does a single process, and sums over `worker` give the same series a
single process would export. Exemplars (trace ids) come through in the OpenMetrics format;
prometheus_client's multiprocess mode would have dropped them.

`hopline_worker_up{worker}` says which workers answered this scrape (1) or not (0), as
Prometheus's own `up` does for targets.
"""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from hopline.observability.metrics import start_metrics_server

log = logging.getLogger("hopline.observability.worker_metrics")

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
WORKER_LABEL = "worker"
SCRAPE_TIMEOUT_S = 2.0


def read_worker(host: str, port: int, timeout_s: float = SCRAPE_TIMEOUT_S) -> list[Metric]:
    """The families a worker serves on host:port, in OpenMetrics (exemplars kept)."""
    request = urllib.request.Request(
        f"http://{host}:{port}/metrics", headers={"Accept": OPENMETRICS}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        return parse_openmetrics(reply.read().decode())


def parse_openmetrics(text: str) -> list[Metric]:
    """The metric families in an OpenMetrics exposition."""
    # prometheus_client's parser has no annotations.
    families: list[Metric] = list(text_string_to_metric_families(text))  # type: ignore[no-untyped-call]
    return families


class WorkersCollector(Collector):
    """A prometheus_client collector over the workers' endpoints (`ports[i]` is worker i's)."""

    def __init__(
        self,
        host: str,
        ports: Sequence[int],
        read: Callable[[str, int], list[Metric]] = read_worker,
    ) -> None:
        # Workers bind the metrics host the supervisor was given; a wildcard is reached on
        # loopback.
        self.host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
        self.ports = tuple(ports)
        self.read = read

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        up = GaugeMetricFamily(
            "hopline_worker_up", "Whether the worker answered this scrape", labels=[WORKER_LABEL]
        )
        for index, port in enumerate(self.ports):
            worker = str(index)
            try:
                families = self.read(self.host, port)
            except (OSError, ValueError) as exc:  # down, starting, or a torn reply
                log.debug("worker metrics unreadable", extra={"worker": index, "error": str(exc)})
                up.add_metric([worker], 0)
                continue
            up.add_metric([worker], 1)
            for family in families:
                into = merged.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type, family.unit)
                )
                into.samples.extend(_labelled(s, worker) for s in family.samples)
        yield up
        yield from merged.values()


def _labelled(sample: Sample, worker: str) -> Sample:
    return sample._replace(labels={**sample.labels, WORKER_LABEL: worker})


def serve_workers_metrics(host: str, port: int, worker_ports: Sequence[int]) -> int | None:
    """Serve the workers' merged metrics on host:port (0 disables it). Returns the port."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkersCollector(host, worker_ports))
    return start_metrics_server(host, port, registry)
