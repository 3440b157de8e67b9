"""The OTLP exporter's TLS settings checked at start (observability/export_tls.py): the
combinations the SDK would accept and then lose spans with, or send them in the clear, are
refused with the variable's name. Real certificates from `make certs`' code (the `openssl`
command); the handshake with a collector is proven in tests/mesh/test_tracing_tls.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hopline.cli.certs import make_certs
from hopline.observability.export_tls import check_export_tls

CA = "OTEL_EXPORTER_OTLP_CERTIFICATE"
KEY = "OTEL_EXPORTER_OTLP_CLIENT_KEY"
CERT = "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"
HTTPS = "https://collector:4317"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("tls"), ("gateway", "cache"))


def mutual(certs: Path, prefix: str = "OTEL_EXPORTER_OTLP_") -> dict[str, str]:
    return {
        f"{prefix}CERTIFICATE": str(certs / "ca.crt"),
        f"{prefix}CLIENT_KEY": str(certs / "gateway.key"),
        f"{prefix}CLIENT_CERTIFICATE": str(certs / "gateway.crt"),
    }


def test_the_modes_the_start_up_log_names(certs: Path) -> None:
    assert check_export_tls({}, "http://collector:4317").mode == "off"
    assert check_export_tls({}, HTTPS).mode == "on"  # the system's roots
    assert check_export_tls({}, "collector:4317").mode == "on"  # no scheme: TLS, as the SDK
    assert check_export_tls({CA: str(certs / "ca.crt")}, HTTPS).mode == "on"
    assert check_export_tls(mutual(certs), HTTPS).mode == "mutual"
    insecure = {"OTEL_EXPORTER_OTLP_INSECURE": "true"}
    assert check_export_tls(insecure, "collector:4317").mode == "off"


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({CA: "/nowhere/ca.crt"}, f"cannot read {CA}='/nowhere/ca.crt': No such file"),
        ({CERT: ""}, f"{KEY} is set without OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"),
        ({KEY: ""}, f"{CERT} is set without OTEL_EXPORTER_OTLP_CLIENT_KEY"),
        ({KEY: "{certs}/cache.key"}, "are not a certificate and its key"),
        ({CA: "{certs}/gateway.key"}, "holds no PEM certificate"),
    ],
)
def test_a_setting_that_cannot_work_is_refused_by_name(
    certs: Path, change: dict[str, str], says: str
) -> None:
    environ = mutual(certs) | {k: v.format(certs=certs) for k, v in change.items()}
    with pytest.raises(ValueError, match=re.escape(says)):
        check_export_tls(environ, HTTPS)


def test_certificates_beside_a_plaintext_endpoint_are_refused(certs: Path) -> None:
    with pytest.raises(ValueError, match=f"^{CA} is set but spans go to 'http://c:4317'"):
        check_export_tls(mutual(certs), "http://c:4317")
    with pytest.raises(ValueError, match="use an https:// endpoint"):
        check_export_tls(mutual(certs) | {"OTEL_EXPORTER_OTLP_INSECURE": "true"}, "c:4317")


def test_the_traces_settings_replace_the_generic_ones_as_the_sdk_reads_them(
    certs: Path,
) -> None:
    """The SDK's span exporter takes the TRACES_ trio when its CERTIFICATE is set, and then
    never reads the generic one: a broken generic file does not matter, a broken traces one
    does."""
    traces = mutual(certs, "OTEL_EXPORTER_OTLP_TRACES_")
    assert check_export_tls(traces | {CA: "/nowhere"}, HTTPS).mode == "mutual"
    broken = traces | {"OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY": "/nowhere/k"}
    with pytest.raises(ValueError, match=r"^cannot read OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY"):
        check_export_tls(broken, HTTPS)
