"""One /metrics for a service run as several worker processes (runtime/workers.py).

Each worker keeps its own registry and serves it on a loopback port the kernel picks, which it
writes to a file named by its index in a folder the supervisor made (`serve_worker_metrics`):
fixed ports after the service's would run into the next service's ports on one host (the 9th
gateway worker of `make run` was on the tokenizer's 8011). The supervisor serves the
service's metrics port and, on every scrape, reads each worker's endpoint and answers
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
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from hopline.observability.metrics import start_metrics_server
from hopline.observability.metrics_server import serve_metrics

log = logging.getLogger("hopline.observability.worker_metrics")

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
WORKER_LABEL = "worker"
SCRAPE_TIMEOUT_S = 2.0
# Workers' endpoints are for their supervisor only, on the same host.
LOOPBACK = "127.0.0.1"


def serve_worker_metrics(directory: Path, index: int, registry: Any = None) -> int | None:
    """Serve this worker's registry (or `registry`, a view of it) on a loopback port the
    kernel picks and announce it in `directory/<index>`; the port, or None when it could not
    bind (said in the log)."""
    try:
        port = serve_metrics(LOOPBACK, 0, registry or REGISTRY).port
    except OSError as exc:
        log.error("cannot serve worker metrics", extra={"worker": index, "error": str(exc)})
        return None
    # Written whole, then renamed: a scrape never reads half a port number.
    partial = directory / f".{index}.partial"
    partial.write_text(str(port))
    partial.replace(directory / str(index))
    return port


class AnnouncedPorts:
    """The ports workers 0..count-1 announced in `directory` (None: not yet, or not at all)."""

    def __init__(self, directory: Path, count: int) -> None:
        self.directory = directory
        self.count = count

    def __call__(self) -> list[int | None]:
        ports: list[int | None] = []
        for index in range(self.count):
            try:
                ports.append(int((self.directory / str(index)).read_text()))
            except (OSError, ValueError):
                ports.append(None)
        return ports


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
    """A prometheus_client collector over the workers' loopback endpoints (`ports()[i]` is
    worker i's, None where it has none yet)."""

    def __init__(
        self,
        ports: Callable[[], Sequence[int | None]],
        read: Callable[[str, int], list[Metric]] = read_worker,
    ) -> None:
        self.ports = ports
        self.read = read

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        up = GaugeMetricFamily(
            "hopline_worker_up", "Whether the worker answered this scrape", labels=[WORKER_LABEL]
        )
        for index, port in enumerate(self.ports()):
            worker = str(index)
            try:
                if port is None:
                    raise ConnectionRefusedError("no port announced yet")
                families = self.read(LOOPBACK, port)
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


def workers_registry(collector: WorkersCollector) -> CollectorRegistry:
    """The supervisor's registry over its workers' endpoints."""
    # The workers' names are known only by scraping them: without this, a filtered scrape
    # (`?name[]=...`) dropped the collector and answered an empty 200 (an SRE's probe).
    registry = CollectorRegistry(auto_describe=False, support_collectors_without_names=True)
    registry.register(collector)
    return registry


def serve_workers_metrics(
    host: str, port: int, worker_ports: Callable[[], Sequence[int | None]]
) -> int | None:
    """Serve the workers' merged metrics on host:port (0 disables it). Returns the port."""
    return start_metrics_server(host, port, workers_registry(WorkersCollector(worker_ports)))
