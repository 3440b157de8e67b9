"""bench/hop_split.py: per hop, the gateway's time against the server's own, from the
processes' Prometheus endpoints (here real ones: prometheus_client's HTTP server on loopback,
serving registries with the mesh's two histograms)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import pytest
from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    start_http_server,
)

from hopline.bench import hop_split
from hopline.bench.cli import _metrics_endpoints
from hopline.bench.load import Run
from hopline.bench.report import cpu_per_request
from hopline.bench.suite_report import cpu_markdown, hop_split_markdown
from hopline.observability import schema
from hopline.runtime.ports import free_ports


class Process:
    """One mesh process's metrics: its hop and RPC histograms on a port of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.hops = Histogram(hop_split.HOP_METRIC, "hops", ("hop", "code"), registry=self.registry)
        self.rpcs = Histogram(
            hop_split.RPC_METRIC, "rpcs", ("service", "method", "code"), registry=self.registry
        )
        (self.port,) = free_ports(1)
        self.server, self.thread = start_http_server(self.port, "127.0.0.1", registry=self.registry)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def processes() -> Iterator[tuple[Process, Process]]:
    gateway, tokenizer = Process(), Process()
    try:
        yield gateway, tokenizer
    finally:
        gateway.close()
        tokenizer.close()


TOKENIZE = ("hopline.tokenizer.v1.TokenizerService", "Tokenize")


def test_only_the_window_counts_and_every_endpoint_adds_up(
    processes: tuple[Process, Process],
) -> None:
    gateway, tokenizer = processes
    windows = hop_split.Windows({"mesh": [gateway.endpoint, tokenizer.endpoint]})
    # Before the window (a warm-up): left out.
    gateway.hops.labels("tokenize", "OK").observe(1.0)
    tokenizer.rpcs.labels(*TOKENIZE, "OK").observe(1.0)
    start = windows.at_window("mesh")
    assert start is not None
    start()
    for at_gateway, own in ((0.004, 0.001), (0.006, 0.003)):
        gateway.hops.labels("tokenize", "OK").observe(at_gateway)
        tokenizer.rpcs.labels(*TOKENIZE, "OK").observe(own)
    # A failed call is not a hop's cost: left out too.
    gateway.hops.labels("tokenize", "UNAVAILABLE").observe(5.0)
    gateway.rpcs.labels(*hop_split.GATEWAY_RPC, "OK").observe(0.010)
    gateway.rpcs.labels(*hop_split.GATEWAY_RPC, "OK").observe(0.012)
    windows.ended("mesh", "mesh")

    got = hop_split.split(windows.totals["mesh"], client_mean_ms=12.5)

    assert set(got["hops"]) == {"tokenize"}  # hops the window never called are not listed
    tokenize = got["hops"]["tokenize"]
    assert tokenize["calls"] == 2
    assert tokenize["server_calls"] == 2
    assert tokenize["at_gateway_ms"] == pytest.approx(5.0)
    assert tokenize["server_ms"] == pytest.approx(2.0)
    assert tokenize["gap_ms"] == pytest.approx(3.0)
    request = got["request"]
    assert request["gateway_calls"] == 2
    assert request["gateway_ms"] == pytest.approx(11.0)
    assert request["outside_gateway_ms"] == pytest.approx(1.5)


def test_rounds_add_up_and_a_store_counts_both_methods(processes: tuple[Process, Process]) -> None:
    """A target measured in rounds sums its windows; stores arrive as StoreBatch or, at a
    cache from before it, as Store, and both are the cache_store hop's server side."""
    gateway, cache = processes
    windows = hop_split.Windows({"peer_colocated": [gateway.endpoint, cache.endpoint]})
    for seconds in (0.002, 0.004):
        start = windows.at_window("peer_colocated")
        assert start is not None
        start()
        gateway.hops.labels("cache_store", "OK").observe(0.250 + seconds)
        cache.rpcs.labels("hopline.cache.v1.CacheService", "StoreBatch", "OK").observe(seconds)
        windows.ended("peer_colocated", "peer_colocated")
    cache.rpcs.labels("hopline.cache.v1.CacheService", "Store", "OK").observe(0.009)
    windows.ended("peer_colocated", "peer_colocated")  # no window opened: nothing counted
    start = windows.at_window("peer_colocated")
    assert start is not None
    start()
    cache.rpcs.labels("hopline.cache.v1.CacheService", "Store", "OK").observe(0.012)
    windows.ended("peer_colocated", "peer_colocated")  # a third window: only a Store

    store = hop_split.split(windows.totals["peer_colocated"], 0.0)["hops"]["cache_store"]

    assert store["calls"] == 2
    assert store["server_calls"] == 3
    assert store["server_ms"] == pytest.approx((2 + 4 + 12) / 3)
    assert store["at_gateway_ms"] == pytest.approx(253.0)


def test_a_target_without_endpoints_reads_nothing() -> None:
    windows = hop_split.Windows({"mesh": ["127.0.0.1:1"]})
    assert windows.at_window("echo") is None
    windows.ended("echo", "echo")
    assert windows.totals == {}


def test_an_endpoint_that_does_not_answer_stops_the_bench_with_its_address() -> None:
    (closed,) = free_ports(1)  # nothing listens there
    windows = hop_split.Windows({"mesh": [f"127.0.0.1:{closed}"]})
    start = windows.at_window("mesh")
    assert start is not None
    with pytest.raises(SystemExit, match=f"cannot read http://127.0.0.1:{closed}/metrics"):
        start()


def test_metrics_flags_name_the_mesh_and_peers_as_the_results_do() -> None:
    got = _metrics_endpoints(["mesh=a:1,b:2", "colocated=c:3", "mesh=d:4"])
    assert got == {"mesh": ["a:1", "b:2", "d:4"], "peer_colocated": ["c:3"]}
    for bad in ("mesh", "mesh=", "a:1"):
        with pytest.raises(SystemExit, match="TARGET=HOST:PORT"):
            _metrics_endpoints([bad])


def test_the_table_names_every_hop_and_the_time_outside_the_gateway() -> None:
    figures = {
        "hops": {
            "inference": {
                "at_gateway_ms": 9.0,
                "calls": 10,
                "server_ms": 8.5,
                "server_calls": 10,
                "gap_ms": 0.5,
            }
        },
        "request": {
            "client_ms": 13.0,
            "gateway_ms": 11.0,
            "gateway_calls": 10,
            "outside_gateway_ms": 2.0,
        },
    }
    text = hop_split.split_table("mesh", figures, {"echo": 0.8, "echo_idle": 2.3})
    assert "inference" in text
    assert "8.500" in text
    assert "0.500" in text
    assert "outside the gateway 2.000, echo 0.800, echo_idle 2.300" in text
    # Only the store is marked as after the reply: the inference line carries no such note.
    (inference_line,) = (line for line in text.splitlines() if "inference" in line)
    assert hop_split.OFF_REPLY_PATH[schema.SPAN_CACHE_STORE] not in inference_line


def test_the_store_is_said_to_be_after_the_reply_with_a_call_per_batch() -> None:
    """A store goes after the reply, a call per StoreBatch: its calls are not the window's
    requests, and its time is no part of theirs."""
    store = {"at_gateway_ms": 260.0, "calls": 50, "server_ms": 3.5, "server_calls": 1}
    figures = {
        "hops": {schema.SPAN_CACHE_STORE: store | {"gap_ms": 256.5}},
        "request": {
            "client_ms": 9.0,
            "gateway_ms": 7.5,
            "gateway_calls": 50,
            "outside_gateway_ms": 1.5,
        },
    }
    note = hop_split.OFF_REPLY_PATH[schema.SPAN_CACHE_STORE]
    (line,) = (x for x in hop_split.split_table("mesh", figures, {}).splitlines() if "256.500" in x)
    assert line.endswith(note)
    scenarios = {"miss_c1": {"targets": {"mesh": {"hop_split": figures}}}}
    assert f"| mesh | cache_store ({note}) | 260.00 | 3.50 | 256.50 | 50 | 1 |" in (
        hop_split_markdown(scenarios)
    )


def test_the_suite_report_has_a_per_hop_table_per_scenario() -> None:
    hop = {"at_gateway_ms": 3.4, "calls": 7, "server_ms": 0.6, "server_calls": 7, "gap_ms": 2.8}
    request = {"client_ms": 24.0, "gateway_ms": 21.5, "gateway_calls": 7, "outside_gateway_ms": 2.5}
    scenarios = {
        "miss_c1": {
            "targets": {
                "echo": {"mean_ms": 0.8},
                "echo_idle": {"mean_ms": 2.7},
                "mesh": {"hop_split": {"hops": {"tokenize": hop}, "request": request}},
            }
        },
        "exact_c1": {"targets": {"mesh": {}}},  # not split: no table
    }
    lines = hop_split_markdown(scenarios)
    assert "miss_c1, mean ms per call (round trip: echo 0.80 ms, echo_idle 2.70 ms):" in lines
    assert "| mesh | tokenize | 3.40 | 0.60 | 2.80 | 7 | 7 |" in lines
    assert any(line.startswith("| mesh | the request") and "| 2.50 |" in line for line in lines)
    assert not any("exact_c1" in line for line in lines)


def test_a_gateways_workers_are_summed() -> None:
    """Under its worker supervisor the gateway's series carry a `worker` label
    (observability/worker_metrics.py): the split adds the workers up."""
    registry = CollectorRegistry()
    hops = Histogram(hop_split.HOP_METRIC, "hops", ("hop", "code", "worker"), registry=registry)
    rpcs = Histogram(
        hop_split.RPC_METRIC, "rpcs", ("service", "method", "code", "worker"), registry=registry
    )
    for worker, seconds in (("0", 0.002), ("1", 0.004)):
        hops.labels("postprocess", "OK", worker).observe(seconds)
        rpcs.labels(
            "hopline.postprocess.v1.PostprocessService", "Postprocess", "OK", worker
        ).observe(seconds / 2)
    totals = hop_split.parse(generate_latest(registry).decode())

    postprocess = hop_split.split(totals, 0.0)["hops"]["postprocess"]

    assert postprocess["calls"] == 2
    assert postprocess["server_calls"] == 2
    assert postprocess["at_gateway_ms"] == pytest.approx(3.0)
    assert postprocess["server_ms"] == pytest.approx(1.5)


def test_each_process_cpu_per_request_over_the_window_alone(
    processes: tuple[Process, Process],
) -> None:
    """process_cpu_seconds_total (here a counter of that name, standing in for the process
    collector, so the figures are known) read around the window, per request the gateway
    answered, under the name of the services each process answers for."""
    gateway, cache = processes
    cpu = {p: Counter("process_cpu_seconds", "cpu", registry=p.registry) for p in (gateway, cache)}
    for service, process in (("gateway.v1.GatewayService", gateway), ("cache.v1.Cache", cache)):
        process.rpcs.labels(f"hopline.{service}", "X", "OK").observe(0.001)
    gateway.rpcs.labels("hopline.tokenizer.v1.TokenizerService", "Tokenize", "OK").observe(0.001)
    cpu[gateway].inc(7.0)  # before the window: left out
    cpu[cache].inc(3.0)
    windows = hop_split.Windows({"mesh": [gateway.endpoint, cache.endpoint]})
    start = windows.at_window("mesh")
    assert start is not None
    start()
    cpu[gateway].inc(0.012)
    cpu[cache].inc(0.002)
    for _ in range(4):
        gateway.rpcs.labels(*hop_split.GATEWAY_RPC, "OK").observe(0.003)
    windows.ended("mesh", "mesh")

    got = hop_split.split(windows.totals["mesh"], client_mean_ms=4.0)["cpu_ms_per_request"]

    assert list(got) == ["gateway+tokenizer", "cache"]  # a request's order
    assert got["gateway+tokenizer"] == pytest.approx(3.0)
    assert got["cache"] == pytest.approx(0.5)
    text = hop_split.split_table("mesh", hop_split.split(windows.totals["mesh"], 4.0), {})
    assert "CPU ms per request: gateway+tokenizer 3.000, cache 0.500" in text


def test_the_process_collectors_figure_is_the_one_read() -> None:
    """The sample prometheus_client's own process collector exports (every hopline process
    serves the default registry) is the one parsed: this process's CPU, so far."""
    totals = hop_split.parse(generate_latest(REGISTRY).decode(), "here")
    assert totals.cpu_s["here"] > 0
    # Named after the services whose RPCs this process has counted: none unless a test
    # before this one called a co-located servicer (tests/unit/test_direct_hop.py does).
    counted = {
        sample.labels["service"]
        for family in REGISTRY.collect()
        if family.name == hop_split.RPC_METRIC
        for sample in family.samples
        if "service" in sample.labels
    }
    assert totals.names == {"here": hop_split.process_name(counted)}


def test_a_process_without_a_cpu_figure_is_left_out_and_names_follow_a_request() -> None:
    registry = CollectorRegistry()
    Histogram(hop_split.RPC_METRIC, "rpcs", ("service", "method", "code"), registry=registry)
    assert hop_split.parse(generate_latest(registry).decode(), "x").cpu_s == {}
    assert (
        hop_split.process_name(
            [
                "hopline.postprocess.v1.PostprocessService",
                "hopline.inference.v1.InferenceService",
                "hopline.gateway.v1.GatewayService",
                "hopline.tokenizer.v1.TokenizerService",
                "grpc.health.v1.Health",
            ]
        )
        == "gateway+tokenizer+inference+postprocess"
    )
    assert hop_split.process_name(["hopline.cache.v1.CacheService"]) == "cache"
    assert hop_split.process_name([]) == "other"


def test_cpu_per_request_of_a_window_and_the_suite_table() -> None:
    """The machine's figure is every core's busy time over the window (/proc/stat's share
    times the cores) per answered request; the load generator's its own process's."""
    run = Run(
        latencies_ns=[1_000_000] * 400,
        statuses=["OK"] * 400,
        responses=[],
        duration_s=2.0,
        loadgen_cpu_s=0.2,
        machine_busy=0.5,
    )
    cores = os.cpu_count() or 1
    got = cpu_per_request(run)
    assert got["machine"] == pytest.approx(0.5 * cores * 2.0 / 400 * 1e3)
    assert got["load_generator"] == pytest.approx(0.5)
    assert cpu_per_request(dataclasses.replace(run, latencies_ns=[], statuses=[])) == {}
    scenarios = {
        "miss_c32": {
            "targets": {
                "inprocess_batched": {
                    "throughput_rps": 500.0,
                    "cpu_ms_per_request": {"machine": 4.0, "load_generator": 3.9},
                },
                "mesh": {
                    "throughput_rps": 300.0,
                    "cpu_ms_per_request": {"machine": 6.5, "load_generator": 0.3},
                    "hop_split": {"cpu_ms_per_request": {"gateway": 1.2, "inference": 3.8}},
                },
            }
        },
        "exact_c1": {"targets": {"mesh": {"cpu_ms_per_request": {"machine": 1.0}}}},
    }
    lines = cpu_markdown(scenarios)
    assert "| inprocess_batched | 500.0 | 4.00 | 3.90 |  |" in lines
    assert "| mesh | 300.0 | 6.50 | 0.30 | gateway 1.20, inference 3.80 |" in lines
    assert not any(line.startswith("exact_c1") for line in lines)  # no process was read
