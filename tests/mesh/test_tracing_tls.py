"""The production tracing pipeline over mutual TLS, with deploy/observability's own configs.

Real processes: the five services export to a tail-sampling collector running
`tail-sampling-collector.yaml`, which exports to a Jaeger running `jaeger.yaml`, both in the
Jaeger v2 binary `make` builds (an OpenTelemetry Collector distribution) with only their
addresses and file paths changed (`--set`), and certificates from `make certs`' code. Each
service shows its own certificate, as each pod does with the production overlay's settings.
The first tier, `loadbalancer-collector.yaml`, needs otelcol-contrib's `loadbalancing`
exporter, which is not built here: its TLS settings are read from the file instead.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from conftest import DEFAULT_MODEL
from harness import Mesh, fetch_trace, serve_refused
from hopline.cli.certs import make_certs
from hopline.gateway.client import predict
from hopline.observability.jaeger import BINARY, get_json
from hopline.runtime.ports import free_ports
from hopline.runtime.service_table import SERVICES

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "deploy" / "observability"
SERVICE_NAMES = tuple(str(s.name) for s in SERVICES)
DELAY_MS = 80  # on postprocess: every trace is over the tail sampler's 50 ms "slow" policy
MOUNT = "/etc/otel/tls/"  # where the configs read their certificates (deploy/observability)


class Tier:
    """The Jaeger binary on one of deploy/observability's configs, its OTLP receiver on a free
    loopback port and every /etc/otel/tls path replaced by `role`'s files in `certs`."""

    def __init__(
        self, config: str, role: str, certs: Path, workdir: Path, sets: dict[str, str]
    ) -> None:
        if not BINARY.is_file():
            pytest.fail(f"{BINARY} is missing (`make test` builds it)")
        self.port = free_ports(1)[0]
        self.log = workdir / f"{role}.log"
        files = {"tls.crt": f"{role}.crt", "tls.key": f"{role}.key", "ca.crt": "ca.crt"}
        raw = (CONFIGS / config).read_text()
        paths = {
            key: str(certs / files[value.removeprefix(MOUNT)])
            for key, value in _leaves(yaml.safe_load(raw))
            if isinstance(value, str) and value.startswith(MOUNT)
        }
        assert paths, f"{config} reads no certificate from {MOUNT}"
        options = {
            "receivers::otlp::protocols::grpc::endpoint": f"127.0.0.1:{self.port}",
            "service::telemetry::metrics::level": "none",
            **paths,
            **sets,
        }
        args = [f"--set={key}={value}" for key, value in options.items()]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [str(BINARY), "--config", str(CONFIGS / config), *args], stdout=log, stderr=log
            )
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"{config} did not start: {self.log.read_text()[-2000:]}")
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(`a::b::c`, value) for every leaf of a YAML document, the keys as `--set` names them."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}{key}::")
    else:
        yield prefix.removesuffix("::"), node


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    roles = (*SERVICE_NAMES, "otel-tail-sampling", "jaeger-collector")
    return make_certs(tmp_path_factory.mktemp("tls"), roles)


@pytest.fixture(scope="module")
def pipeline(certs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("pipeline")
    query, query_grpc = free_ports(2)
    jaeger = Tier(
        "jaeger.yaml",
        "jaeger-collector",
        certs,
        work,
        {
            "extensions::jaeger_query::http::endpoint": f"127.0.0.1:{query}",
            "extensions::jaeger_query::grpc::endpoint": f"127.0.0.1:{query_grpc}",
        },
    )
    try:
        sampling = Tier(
            "tail-sampling-collector.yaml",
            "otel-tail-sampling",
            certs,
            work,
            {
                # The name jaeger-collector would resolve to in the cluster; its certificate
                # also names 127.0.0.1, so the exporter's check still runs.
                "exporters::otlp/jaeger::endpoint": f"127.0.0.1:{jaeger.port}",
                "processors::tail_sampling::decision_wait": "1s",
            },
        )
    except BaseException:
        jaeger.stop()
        raise
    try:
        yield {"sampling": sampling, "jaeger": jaeger, "query": f"http://127.0.0.1:{query}"}
    finally:
        sampling.stop()
        jaeger.stop()


@pytest.fixture(scope="module")
def traced(
    pipeline: dict[str, Any],
    certs: Path,
    default_repo: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Mesh]:
    work = tmp_path_factory.mktemp("traced")
    repo = work / "models"
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    own = {
        name: {
            "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": str(certs / f"{name}.crt"),
            "OTEL_EXPORTER_OTLP_CLIENT_KEY": str(certs / f"{name}.key"),
        }
        for name in SERVICE_NAMES
    }
    own["postprocess"]["HOPLINE_TEST_DELAY_MS"] = str(DELAY_MS)
    mesh = Mesh(
        repo,
        work,
        service_env=own,
        OTEL_EXPORTER_OTLP_ENDPOINT=f"https://127.0.0.1:{pipeline['sampling'].port}",
        OTEL_EXPORTER_OTLP_CERTIFICATE=str(certs / "ca.crt"),
        OTEL_BSP_SCHEDULE_DELAY="100",
        OTEL_TRACES_SAMPLER="parentbased_always_on",
        HOPLINE_GATEWAY_BATCH_MAX_ROWS="1",
        # Every miss sends its lookup, so the trace holds all five services.
        HOPLINE_GATEWAY_KEY_MIRROR="0",
    )
    try:
        yield mesh.start()
    finally:
        mesh.stop()


def test_every_service_exports_over_mutual_tls_through_the_deployed_tiers(
    traced: Mesh, pipeline: dict[str, Any]
) -> None:
    """A slow request's trace, kept by the tail sampler, reaches Jaeger whole: every service's
    spans crossed both TLS links, and each service logged that it exports over mutual TLS."""
    reply = predict("where is my parcel, tracked over TLS", gateway=traced.gateway, timeout_s=30)
    spans = fetch_trace(pipeline["query"], reply.trace_id, want_services=5, timeout_s=60)
    assert {s.service for s in spans} == set(SERVICE_NAMES)
    assert max(s.end - s.start for s in spans) >= DELAY_MS * 1e6
    for name in SERVICE_NAMES:
        log = (traced.workdir / f"{name}.log").read_text()
        lines = [line for line in log.splitlines() if "exporting spans" in line]
        assert len(lines) == 1, f"{name}: {log[-1500:]}"
        assert "tls=mutual" in lines[0], lines[0]


def _export(port: int, certs: Path, role: str | None) -> grpc.StatusCode:
    """One empty OTLP export to a tier, showing `role`'s certificate (None: none)."""
    key = (certs / f"{role}.key").read_bytes() if role else None
    chain = (certs / f"{role}.crt").read_bytes() if role else None
    credentials = grpc.ssl_channel_credentials((certs / "ca.crt").read_bytes(), key, chain)
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)  # type: ignore[no-untyped-call]
        try:
            stub.Export(trace_service_pb2.ExportTraceServiceRequest(), timeout=10)
        except grpc.RpcError as err:
            code: grpc.StatusCode = err.code()
            return code
    return grpc.StatusCode.OK


def _request_trace(trace: int, request_ms: int, store_ms: int) -> Any:
    """A gateway's request trace as the gateway exports it: its server span, and the cache
    store's client span under it, which ends after the reply (its linger)."""
    start = time.time_ns() - 10**9
    attributes = [
        common_pb2.KeyValue(
            key="rpc.service",
            value=common_pb2.AnyValue(string_value="hopline.gateway.v1.GatewayService"),
        )
    ]
    root = trace_pb2.Span(
        trace_id=trace.to_bytes(16, "big"),
        span_id=(1).to_bytes(8, "big"),
        name="hopline.gateway.v1.GatewayService/Predict",
        kind=trace_pb2.Span.SPAN_KIND_SERVER,
        start_time_unix_nano=start,
        end_time_unix_nano=start + request_ms * 10**6,
        attributes=attributes,
    )
    store = trace_pb2.Span(
        trace_id=root.trace_id,
        span_id=(2).to_bytes(8, "big"),
        parent_span_id=root.span_id,
        name="cache_store",
        kind=trace_pb2.Span.SPAN_KIND_CLIENT,
        start_time_unix_nano=start + 10**6,
        end_time_unix_nano=start + store_ms * 10**6,
    )
    resource = resource_pb2.Resource(
        attributes=[
            common_pb2.KeyValue(
                key="service.name", value=common_pb2.AnyValue(string_value="gateway")
            )
        ]
    )
    return trace_pb2.ResourceSpans(
        resource=resource, scope_spans=[trace_pb2.ScopeSpans(spans=[root, store])]
    )


def test_the_slow_policy_judges_the_request_not_the_store_after_it(
    pipeline: dict[str, Any], certs: Path
) -> None:
    """The tail sampler's "slow" policy measured the trace's extent, which the cache store
    stretches to its linger (500 ms) after the reply: every stored miss was kept as slow (an
    observability probe: 45 of 100 misses of under 50 ms). It now judges the request's own
    span. 20 fast stored requests (the 5% baseline, by trace id, may keep one or two) and one
    slow one, sent as the gateway exports them."""
    fast = [0xFA57 << 64 | i for i in range(20)]
    slow = 0x5104 << 64
    request = trace_service_pb2.ExportTraceServiceRequest(
        resource_spans=[*(_request_trace(t, 5, 600) for t in fast), _request_trace(slow, 80, 600)]
    )
    key, chain = ((certs / f"gateway.{k}").read_bytes() for k in ("key", "crt"))
    credentials = grpc.ssl_channel_credentials((certs / "ca.crt").read_bytes(), key, chain)
    with grpc.secure_channel(f"127.0.0.1:{pipeline['sampling'].port}", credentials) as channel:
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)  # type: ignore[no-untyped-call]
        stub.Export(request, timeout=10)
    fetch_trace(pipeline["query"], f"{slow:032x}", want_services=1, timeout_s=60)
    time.sleep(2)  # the fast ones were decided with it; their spans, if kept, stored too
    kept = [t for t in fast if _in_jaeger(pipeline["query"], f"{t:032x}")]
    assert len(kept) <= 5, f"{len(kept)} of 20 fast requests kept as slow"


def _in_jaeger(query: str, trace_id: str) -> bool:
    try:
        get_json(f"{query}/api/v3/traces/{trace_id}")
    except urllib.error.HTTPError as err:
        if err.code != 404:
            raise
        return False
    return True


def test_each_tier_takes_only_clients_with_a_certificate_from_the_ca(
    pipeline: dict[str, Any], certs: Path, tmp_path: Path
) -> None:
    rogue = make_certs(tmp_path / "rogue", ("gateway",))
    for tier in (pipeline["sampling"], pipeline["jaeger"]):
        assert _export(tier.port, certs, "gateway") is grpc.StatusCode.OK
        assert _export(tier.port, certs, None) is grpc.StatusCode.UNAVAILABLE
        shutil.copy(rogue / "gateway.crt", tmp_path / "rogue.crt")
        shutil.copy(rogue / "gateway.key", tmp_path / "rogue.key")
        shutil.copy(certs / "ca.crt", tmp_path / "ca.crt")
        assert _export(tier.port, tmp_path, "rogue") is grpc.StatusCode.UNAVAILABLE


def _install(certs: Path, mounted: Path, role: str) -> None:
    """`role`'s certificate and key and the CA from `certs` written over `mounted`'s, in
    place, as a renewed Secret's volume is updated."""
    mounted.mkdir(exist_ok=True)
    for name in (f"{role}.crt", f"{role}.key", "ca.crt"):
        shutil.copyfile(certs / name, mounted / name)


def test_a_tier_takes_up_renewed_certificates_without_a_restart(tmp_path: Path) -> None:
    """cert-manager renews a tier's Secret in place. Here the CA itself is replaced (the
    tier's certificate and its clients' now signed by another), so neither the old
    certificate nor the old CA would do: the Jaeger tier, on deploy/observability's own
    config with only its reload interval shortened, serves the new clients within seconds
    and the old ones no more. Every tier's config reloads the same way."""
    for name in ("jaeger.yaml", "tail-sampling-collector.yaml", "loadbalancer-collector.yaml"):
        config = yaml.safe_load((CONFIGS / name).read_text())
        receiver = config["receivers"]["otlp"]["protocols"]["grpc"]["tls"]
        assert receiver.get("client_ca_file_reload") is True, name
        assert receiver.get("reload_interval") == "1m", name
    roles = ("jaeger-collector", "gateway")
    first = make_certs(tmp_path / "first", roles)
    mounted = tmp_path / "mounted"
    _install(first, mounted, "jaeger-collector")
    query, query_grpc = free_ports(2)
    tier = Tier(
        "jaeger.yaml",
        "jaeger-collector",
        mounted,
        tmp_path,
        {
            "extensions::jaeger_query::http::endpoint": f"127.0.0.1:{query}",
            "extensions::jaeger_query::grpc::endpoint": f"127.0.0.1:{query_grpc}",
            "receivers::otlp::protocols::grpc::tls::reload_interval": "1s",
        },
    )
    try:
        assert _export(tier.port, first, "gateway") is grpc.StatusCode.OK
        second = make_certs(tmp_path / "second", roles)
        _install(second, mounted, "jaeger-collector")
        deadline = time.monotonic() + 30
        while (code := _export(tier.port, second, "gateway")) is not grpc.StatusCode.OK:
            assert time.monotonic() < deadline, f"the renewed certificates are not used: {code}"
            time.sleep(0.5)
        assert _export(tier.port, first, "gateway") is grpc.StatusCode.UNAVAILABLE
    finally:
        tier.stop()


def test_the_first_tier_config_checks_both_sides() -> None:
    """loadbalancer-collector.yaml (not run here: see the module's docstring) as the tiers
    above: a client certificate required, and its exporter checking the tail-sampling tier's
    name (it dials pod addresses) and showing its own certificate."""
    config = yaml.safe_load((CONFIGS / "loadbalancer-collector.yaml").read_text())
    receiver = config["receivers"]["otlp"]["protocols"]["grpc"]["tls"]
    assert {"cert_file", "key_file", "client_ca_file"} <= set(receiver)
    exporter = config["exporters"]["loadbalancing"]["protocol"]["otlp"]["tls"]
    assert exporter.get("insecure") is not True
    assert {"ca_file", "cert_file", "key_file"} <= set(exporter)
    assert exporter["server_name_override"] == "otel-tail-sampling"


@pytest.mark.parametrize(
    ("env", "says"),
    [
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "https://127.0.0.1:4317",
                "OTEL_EXPORTER_OTLP_CERTIFICATE": "/nowhere/ca.crt",
            },
            "cannot read OTEL_EXPORTER_OTLP_CERTIFICATE='/nowhere/ca.crt'",
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
                "OTEL_EXPORTER_OTLP_CERTIFICATE": "{certs}/ca.crt",
            },
            "use an https:// endpoint",
        ),
    ],
)
def test_an_export_tls_setting_that_cannot_work_stops_the_start(
    certs: Path, env: dict[str, str], says: str
) -> None:
    """Not a service that runs and loses every span: `hopline serve` exits 2, saying why."""
    environ = {k: v.format(certs=certs) for k, v in env.items()}
    said = serve_refused("postprocess", environ)
    assert "cannot set up tracing" in said, said
    assert says in said, said
