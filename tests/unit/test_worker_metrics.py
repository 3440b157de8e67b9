"""The supervisor's merged /metrics over its workers' (observability/worker_metrics.py): each
worker's families, labelled with the worker, exemplars kept, and `hopline_worker_up` saying
which workers answered; the ports workers announce in their supervisor's folder. The workers'
endpoints are read through a stand-in here (the unit lane opens no socket);
tests/mesh/test_gateway_workers.py reads real ones."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest as prometheus_text
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition

from hopline.observability.worker_metrics import (
    AnnouncedPorts,
    WorkersCollector,
    parse_openmetrics,
    workers_registry,
)


def openmetrics(registry: CollectorRegistry) -> str:
    text: bytes = exposition.generate_latest(registry)  # type: ignore[no-untyped-call]
    return text.decode()


def worker_registry(served: int, trace_id: str) -> CollectorRegistry:
    registry = CollectorRegistry()
    calls = Counter("calls", "Calls served", ["method"], registry=registry)
    calls.labels("Predict").inc(served)
    latency = Histogram("latency_seconds", "Latency", registry=registry, buckets=(0.01, 1.0))
    latency.observe(0.005, {"trace_id": trace_id})
    return registry


def merged(registries: dict[int, CollectorRegistry]) -> CollectorRegistry:
    def read(host: str, port: int) -> list[Metric]:
        assert host == "127.0.0.1"  # workers serve their own metrics on loopback only
        if port not in registries:
            raise ConnectionRefusedError(f"nothing on {port}")
        return parse_openmetrics(openmetrics(registries[port]))

    return workers_registry(WorkersCollector(lambda: [9101, 9102, 9103, None], read=read))


def test_families_merge_with_a_worker_label_and_exemplars() -> None:
    registry = merged({9101: worker_registry(3, "a" * 32), 9102: worker_registry(5, "b" * 32)})
    assert registry.get_sample_value("calls_total", {"method": "Predict", "worker": "0"}) == 3
    assert registry.get_sample_value("calls_total", {"method": "Predict", "worker": "1"}) == 5
    assert registry.get_sample_value("latency_seconds_count", {"worker": "1"}) == 1
    # The third worker did not answer: its series are absent, and `up` says so.
    assert registry.get_sample_value("hopline_worker_up", {"worker": "0"}) == 1
    assert registry.get_sample_value("hopline_worker_up", {"worker": "2"}) == 0
    assert registry.get_sample_value("calls_total", {"method": "Predict", "worker": "2"}) is None
    # The fourth has announced no port yet: down too, and nothing read.
    assert registry.get_sample_value("hopline_worker_up", {"worker": "3"}) == 0
    text = openmetrics(registry)
    # One family per name (one HELP/TYPE), the two workers' samples under it.
    assert text.count("# TYPE calls counter") == 1
    assert '# {trace_id="' + "b" * 32 + '"} 0.005' in text
    # Prometheus's own text format (what a scraper gets unless it asks for OpenMetrics).
    plain = prometheus_text(registry).decode()
    assert 'calls_total{method="Predict",worker="1"} 5.0' in plain
    assert plain.count("# TYPE calls_total counter") == 1


def test_a_filtered_scrape_gets_the_families_it_names() -> None:
    """`?name[]=...` (a Prometheus scrape config's `params`, a dashboard's probe): answered
    from the workers' families, where it was an empty 200."""
    registry = merged({9101: worker_registry(3, "a" * 32), 9102: worker_registry(5, "b" * 32)})
    only = registry.restricted_registry(["calls_total", "hopline_worker_up"])
    text = prometheus_text(only).decode()
    assert 'calls_total{method="Predict",worker="1"} 5.0' in text
    assert 'hopline_worker_up{worker="0"} 1.0' in text
    assert "latency_seconds" not in text


def test_ports_are_read_as_workers_announce_them(tmp_path: Path) -> None:
    ports = AnnouncedPorts(tmp_path, 3)
    assert ports() == [None, None, None]
    (tmp_path / "1").write_text("40123")
    (tmp_path / "2").write_text("")  # torn or empty: not a port
    assert ports() == [None, 40123, None]
    (tmp_path / "0").write_text("40999")
    assert ports() == [40999, 40123, None]
