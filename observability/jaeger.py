"""A local Jaeger v2 (`make jaeger`'s binary) on free loopback ports, keeping traces in memory.

The tests that read traces back, `make bench`'s tracing scenario and
bench/scripts/tracing_overhead.py start the same one: OTLP/gRPC in, the api_v3 query API out,
and the remote sampling endpoint (`sampling`, HTTP) serving the strategies `serve_strategies`
writes (observability/remote_sampling.py reads them).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from hopline.observability.tracing import EXPORT_SAMPLE_RATIO
from hopline.runtime.ports import free_ports

ROOT = Path(__file__).resolve().parents[1]
BINARY = ROOT / ".tools" / "bin" / "jaeger"
# The collector's batch timeout is short so that a test reading a trace back waits little.
# The query extension's own tracing is off: it exported to the OTLP default, 127.0.0.1:4317,
# where nothing of ours listens, and its exporter's 10 s timeout held every stop that long.
CONFIG = """
service:
  extensions: [jaeger_storage, jaeger_query, remote_sampling]
  pipelines:
    traces: {{receivers: [otlp], processors: [batch], exporters: [jaeger_storage_exporter]}}
  telemetry: {{metrics: {{level: none}}, logs: {{level: warn}}}}
extensions:
  jaeger_query:
    storage: {{traces: mem}}
    enable_tracing: false
    http: {{endpoint: "127.0.0.1:{query}"}}
    grpc: {{endpoint: "127.0.0.1:{query_grpc}"}}
  jaeger_storage:
    backends: {{mem: {{memory: {{max_traces: {max_traces}}}}}}}
  remote_sampling:
    file: {{path: "{strategies}", reload_interval: {reload_s}s}}
    http: {{endpoint: "127.0.0.1:{sampling}"}}
receivers:
  otlp: {{protocols: {{grpc: {{endpoint: "127.0.0.1:{otlp}"}}}}}}
processors:
  batch: {{timeout: 100ms}}
exporters:
  jaeger_storage_exporter: {{trace_storage: mem}}
"""


# hopline's own export default until a test or bench says else.
DEFAULT_STRATEGIES: dict[str, Any] = {
    "default_strategy": {"type": "probabilistic", "param": EXPORT_SAMPLE_RATIO}
}


class JaegerError(RuntimeError):
    pass


def get_json(url: str, timeout_s: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return json.loads(reply.read())


class LocalJaeger:
    """`with LocalJaeger(workdir) as j:` sends spans to `j.otlp` and reads them at `j.query`.

    Its config and log are written to `workdir`; it answers its query API before the `with`
    body runs and is stopped after it."""

    def __init__(
        self,
        workdir: Path,
        *,
        binary: Path = BINARY,
        max_traces: int = 200_000,
        strategies_reload_s: float = 1.0,
    ) -> None:
        if not binary.is_file():
            raise JaegerError(f"{binary} is missing: `make jaeger` builds it")
        self.workdir = workdir
        self.binary = binary
        names = ("query", "query_grpc", "otlp", "sampling")
        self.ports = dict(zip(names, free_ports(len(names)), strict=True))
        self.max_traces = max_traces
        self.reload_s = strategies_reload_s
        self.query = f"http://127.0.0.1:{self.ports['query']}"
        self.otlp = f"http://127.0.0.1:{self.ports['otlp']}"
        self.sampling = f"http://127.0.0.1:{self.ports['sampling']}"
        self.strategies = workdir / "sampling-strategies.json"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.workdir / "jaeger.log"

    def start(self, timeout_s: float = 60.0) -> Self:
        config = self.workdir / "jaeger.yaml"
        if not self.strategies.exists():
            self.serve_strategies(DEFAULT_STRATEGIES)
        config.write_text(
            CONFIG.format(
                **self.ports,
                max_traces=self.max_traces,
                strategies=self.strategies,
                reload_s=self.reload_s,
            )
        )
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [str(self.binary), "--config", str(config)], stdout=log, stderr=log
            )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.services()
                return self
            except (urllib.error.URLError, ConnectionError):
                if self.proc.poll() is not None:
                    tail = self.log_path.read_text()[-2000:]
                    raise JaegerError(f"Jaeger exited: {tail}") from None
                if time.monotonic() > deadline:
                    self.stop()
                    raise JaegerError(f"Jaeger did not answer within {timeout_s:g} s") from None
                time.sleep(0.2)

    def serve_strategies(self, strategies: dict[str, Any]) -> None:
        """Sampling strategies in Jaeger's file format; a running Jaeger serves them within
        its reload interval. Written whole and renamed into place, so it never reads half."""
        part = self.strategies.with_suffix(".part")
        part.write_text(json.dumps(strategies))
        part.replace(self.strategies)

    def strategy(self, service: str) -> Any:
        """What Jaeger serves `service` now, as remote_sampling.py reads it."""
        return get_json(f"{self.sampling}/api/sampling?service={service}")

    def services(self) -> list[str]:
        """The service names Jaeger has spans from."""
        return sorted(get_json(f"{self.query}/api/v3/services").get("services", []))

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:  # seen once on a loaded machine; Jaeger's, not ours
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
