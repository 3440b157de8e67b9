"""The span exporter takes up TLS files renewed in place (observability/otlp.py).

A real OTLP/gRPC collector on a loopback port over mutual TLS, certificates from `make
certs`' code, and the exporter configured by the standard OTEL_EXPORTER_OTLP_* variables, as
a service's is. The collector's CA is replaced (its certificate, and the exporter's client
certificate, now signed by another CA) and the files the variables name are rewritten in
place: spans reach the collector again without a new exporter. The redial goes through the
SDK exporter's private `_credentials` and `_initialize_channel_and_stub`: an upgrade that
renames them fails here (the old CA's channel cannot reach the new collector)."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

from hopline.cli.certs import make_certs
from hopline.observability.export_tls import check_export_tls
from hopline.observability.otlp import OtlpSpanExporter
from hopline.observability.spans import RecordedSpan, SpanTracer
from hopline.runtime.ports import free_ports

RECHECK_S = 0.05
FILES = {
    "OTEL_EXPORTER_OTLP_CERTIFICATE": "ca.crt",
    "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": "exporter.crt",
    "OTEL_EXPORTER_OTLP_CLIENT_KEY": "exporter.key",
}


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = 0
        self.lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self.lock:
            self.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def _serve(servicer: _Collector, port: int, certs: Path) -> grpc.Server:
    """The collector on `port`, showing `certs`' collector certificate and taking only
    clients whose certificate `certs`' CA signed."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    credentials = grpc.ssl_server_credentials(
        [((certs / "collector.key").read_bytes(), (certs / "collector.crt").read_bytes())],
        root_certificates=(certs / "ca.crt").read_bytes(),
        require_client_auth=True,
    )
    server.add_secure_port(f"127.0.0.1:{port}", credentials)
    server.start()
    return server


def _install(certs: Path, mounted: Path) -> None:
    """`certs`' files copied over the mounted ones in place, as a Secret volume's update
    lands (a later mtime even where the clock's step is coarse)."""
    later = time.time_ns() + 1_000_000_000
    for name in FILES.values():
        shutil.copyfile(certs / name, mounted / name)
        os.utime(mounted / name, ns=(later, later))


def _span() -> RecordedSpan:
    spans: list[RecordedSpan] = []
    with SpanTracer(ALWAYS_ON, spans.append).start_as_current_span("probe"):
        pass
    return spans[0]


@pytest.fixture
def mounted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The exporter's TLS files where the variables name them, first from one CA."""
    folder = tmp_path / "mounted"
    folder.mkdir()
    _install(make_certs(tmp_path / "first", roles=("collector", "exporter")), folder)
    for variable, name in FILES.items():
        monkeypatch.setenv(variable, str(folder / name))
    return folder


def test_renewed_tls_files_are_dialled_with_without_a_new_exporter(
    mounted: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = free_ports(1)[0]
    endpoint = f"https://127.0.0.1:{port}"
    collector = _Collector()
    server = _serve(collector, port, tmp_path / "first")
    tls = check_export_tls(os.environ, endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint)
    exporter = OtlpSpanExporter(
        Resource.create({"service.name": "gateway"}), tls, endpoint, RECHECK_S
    )
    try:
        assert exporter.export([_span()]) is SpanExportResult.SUCCESS
        assert collector.spans == 1

        # The collector's CA is replaced: its certificate and the exporter's are the new
        # CA's, the files behind the variables rewritten in place.
        second = make_certs(tmp_path / "second", roles=("collector", "exporter"))
        server.stop(grace=None).wait()
        server = _serve(collector, port, second)
        _install(second, mounted)
        time.sleep(RECHECK_S * 2)
        assert exporter.export([_span()]) is SpanExportResult.SUCCESS
        assert collector.spans == 2
        assert exporter.redials == 1

        # A half-written file leaves the channel in use, with one warning.
        (mounted / "ca.crt").write_text("")
        time.sleep(RECHECK_S * 2)
        with caplog.at_level(logging.WARNING, "hopline.observability.otlp"):
            assert exporter.export([_span()]) is SpanExportResult.SUCCESS
        assert collector.spans == 3
        assert exporter.redials == 1
        assert "holds no PEM certificate" in str(getattr(caplog.records[-1], "reason", ""))
    finally:
        exporter.shutdown()
        server.stop(grace=None)
