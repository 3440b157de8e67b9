"""The /metrics endpoint's server (hopline.observability.metrics_server), on a real socket in
this process: what a scrape answers, and what idle and stalled connections cost it."""

from __future__ import annotations

import gzip
import logging
import socket
import threading
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter

from hopline.observability import metrics_server
from hopline.observability.metrics import start_metrics_server
from hopline.observability.metrics_server import MetricsServer
from hopline.runtime.ports import free_ports

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


@pytest.fixture
def registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("probe_calls", "calls", registry=registry).inc(3)
    Counter("other_calls", "other calls", registry=registry).inc()
    return registry


@pytest.fixture
def server(registry: CollectorRegistry) -> Iterator[MetricsServer]:
    server = MetricsServer(registry, max_connections=8)
    server.start("127.0.0.1", 0)
    yield server
    server.stop()


def scrape(port: int, path: str = "/metrics", **headers: str) -> tuple[dict[str, str], bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers)
    with urllib.request.urlopen(request, timeout=5) as reply:
        return dict(reply.headers.items()), reply.read()


def raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_a_scrape_answers_prometheus_text_and_openmetrics(server: MetricsServer) -> None:
    headers, body = scrape(server.port)
    assert headers["Content-Type"].startswith("text/plain")
    assert b"probe_calls_total 3.0" in body
    assert b"other_calls_total 1.0" in body

    headers, body = scrape(server.port, Accept=OPENMETRICS)
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")


def test_filters_and_gzip_are_prometheus_clients(server: MetricsServer) -> None:
    headers, body = scrape(
        server.port, "/metrics?name[]=probe_calls_total", **{"Accept-Encoding": "gzip"}
    )
    assert headers["Content-Encoding"] == "gzip"
    text = gzip.decompress(body)
    assert b"probe_calls_total 3.0" in text
    assert b"other_calls" not in text


def test_methods_but_get_are_refused_as_prometheus_client_does(server: MetricsServer) -> None:
    reply = raw(server.port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 405")
    assert b"Allow: OPTIONS,GET" in head
    assert body == b""
    assert raw(server.port, b"POST /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405")


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"hello\r\n\r\n", b"400"),
        (b"GET /metrics SPDY/3\r\n\r\n", b"400"),
        (b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n", b"400"),
        (b"GET http://[::1/metrics HTTP/1.1\r\n\r\n", b"400"),
        (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20_000 + b"\r\n\r\n", b"431"),
    ],
)
def test_what_is_not_a_request_is_answered_so(
    server: MetricsServer, data: bytes, status: bytes
) -> None:
    assert raw(server.port, data).startswith(b"HTTP/1.1 " + status)
    assert scrape(server.port)[1]  # and the server serves on


def test_idle_connections_hold_no_thread_and_do_not_stop_a_scrape(
    registry: CollectorRegistry,
) -> None:
    """prometheus_client's own server started a thread a connection and waited on an idle one
    for ever (1,500 held: 1,510 threads in a gateway)."""
    (port,) = free_ports(1)
    assert start_metrics_server("127.0.0.1", port, registry) == port
    threads = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
    try:
        # More than MAX_CONNECTIONS held: a new scrape takes the place of the oldest idle one.
        assert b"probe_calls_total 3.0" in scrape(port)[1]
        assert threading.active_count() <= threads + metrics_server.COLLECTORS
    finally:
        for sock in idle:
            sock.close()


def test_the_connection_idle_longest_gives_its_place(server: MetricsServer) -> None:
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(8)]
    try:
        assert scrape(server.port)[1]
        assert idle[0].recv(1) == b""  # closed by the server for the scrape
    finally:
        for sock in idle:
            sock.close()


def test_a_head_that_never_ends_is_given_up(
    server: MetricsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metrics_server, "HEAD_TIMEOUT_S", 0.2)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\n")  # and nothing more
        assert sock.recv(1) == b""  # closed by the server (the socket's own timeout raises)


def test_a_taken_port_is_said_and_the_service_goes_on(
    server: MetricsServer, caplog: pytest.LogCaptureFixture
) -> None:
    assert start_metrics_server("127.0.0.1", server.port, CollectorRegistry()) is None
    assert "cannot serve metrics" in caplog.text


def test_a_failing_collector_fails_its_scrape_only() -> None:
    class Broken:
        def collect(self) -> Iterator[object]:
            raise RuntimeError("a collector's bug")

    broken = MetricsServer(Broken())
    broken.start("127.0.0.1", 0)
    try:
        assert raw(broken.port, b"GET /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 500")
        assert raw(broken.port, b"GET /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 500")
    finally:
        broken.stop()


def test_accept_failing_for_want_of_descriptors_is_said_once_a_minute(
    server: MetricsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Out of descriptors, asyncio's loop logged its failed accept() with a traceback up to a
    hundred times a tick: 20,200 connections that never spoke wrote 226,578 tracebacks, 98 MB,
    in a minute (a hostile client's probe). The server's loop says it once a minute; its
    other errors still reach the loop's default handler."""
    loop = server._loop
    done = threading.Event()

    def fail_accepts() -> None:
        for _ in range(1000):
            loop.call_exception_handler(
                {
                    "message": metrics_server.ACCEPT_OUT_OF_RESOURCE,
                    "exception": OSError(24, "Too many open files"),
                }
            )
        loop.call_exception_handler({"message": "something else went wrong"})
        done.set()

    with caplog.at_level(logging.WARNING):
        loop.call_soon_threadsafe(fail_accepts)
        assert done.wait(10)
    said = [r.getMessage() for r in caplog.records]
    assert sum("cannot accept a connection" in m for m in said) == 1
    assert sum("something else went wrong" in m for m in said) == 1
