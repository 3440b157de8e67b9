"""A gateway whose TLS files cannot work says so in its JSON log, exit 2, as every service does.

The gateway reads its certificate and key to dial its upstreams while it is built, before it
binds its port: a key that was not the certificate's (or a certificate it could not read)
escaped there as a SystemExit, whose message Python wrote to stderr as a bare line among the
service's JSON lines, exit 1. The other services say "cannot serve TLS" as one JSON line and
exit 2 (a setting that cannot work). Found by a logs probe: `hopline serve gateway` with
HOPLINE_TLS_KEY naming another role's key.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from harness import free_port, serve_refused
from hopline.cli.certs import make_certs
from hopline.runtime.service_table import SERVICES


@pytest.mark.parametrize(
    ("cert", "key"), [("gateway.crt", "cache.key"), ("nowhere.crt", "gateway.key")]
)
def test_tls_files_the_gateway_cannot_use_are_one_json_line_and_exit_2(
    tmp_path: Path, cert: str, key: str
) -> None:
    certs = make_certs(tmp_path / "tls", ["gateway", "cache"])
    env = {
        **os.environ,
        "HOPLINE_LOG_FORMAT": "json",
        "HOPLINE_TLS_CERT": str(certs / cert),
        "HOPLINE_TLS_KEY": str(certs / key),
        "HOPLINE_TLS_CA": str(certs / "ca.crt"),
        "HOPLINE_METRICS_PORT": "0",
        **{f"HOPLINE_{s.name.upper()}_ADDR": f"127.0.0.1:{free_port()}" for s in SERVICES},
    }
    said = serve_refused("gateway", env)
    lines = [json.loads(line) for line in said.splitlines() if line.strip()]  # each one JSON
    refusal = [line for line in lines if line["msg"] == "cannot serve TLS"]
    assert len(refusal) == 1, said
    assert refusal[0]["level"] == "error"
    assert "HOPLINE_TLS_CERT" in refusal[0]["error"], refusal[0]
    assert "PRIVATE KEY" not in said
