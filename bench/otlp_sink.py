"""An OTLP/gRPC trace collector that takes every export and keeps nothing, in its own process.

`make bench`'s tracing scenario exports to it beside Jaeger: Jaeger on the mesh's own cores
costs what Jaeger costs (its Go threads and collector wake on both cores while the model
runs), which production would not pay; against this sink, what remains is hopline's own cost
of exporting (recording spans, encoding, sending). The export is answered without parsing it
(the request arrives as bytes), so the sink costs one gRPC call per batch and nothing per span.

`python -m hopline.bench.otlp_sink` prints `READY <port>`; on SIGTERM it prints
`EXPORTS <calls> <bytes>` and exits.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from concurrent import futures
from types import TracebackType
from typing import Any

import grpc

SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"


class Counts:
    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0
        self.lock = threading.Lock()

    def export(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        with self.lock:
            self.calls += 1
            self.bytes += len(request)
        return b""  # an empty ExportTraceServiceResponse: everything accepted


def serve() -> None:
    counts = Counts()
    handler = grpc.method_handlers_generic_handler(
        SERVICE, {"Export": grpc.unary_unary_rpc_method_handler(counts.export)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"READY {port}", flush=True)
    stop.wait()
    server.stop(grace=None)
    print(f"EXPORTS {counts.calls} {counts.bytes}", flush=True)


class DiscardingCollector:
    """`with DiscardingCollector() as sink:` exports go to `sink.otlp`; after the `with`,
    `sink.calls` and `sink.bytes` say what arrived."""

    def __init__(self) -> None:
        self.otlp = ""
        self.calls = 0
        self.bytes = 0
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> DiscardingCollector:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hopline.bench.otlp_sink"], stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        if line[:1] != ["READY"]:
            self.proc.kill()
            raise RuntimeError(f"the OTLP sink did not start: {line}")
        self.otlp = f"http://127.0.0.1:{line[1]}"
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self.proc is not None
        self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        for line in out.splitlines():
            if line.startswith("EXPORTS "):
                _, calls, size = line.split()
                self.calls, self.bytes = int(calls), int(size)

    def summary(self) -> dict[str, Any]:
        return {"export_calls": self.calls, "export_bytes": self.bytes}


if __name__ == "__main__":
    serve()
