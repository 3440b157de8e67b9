"""Certificates renewed in place, as cert-manager rewrites a Secret volume, are used without a
restart: by every port for its next connections, and by the gateway for its calls upstream.

Real processes and certificates (`make certs`'s code). To see which certificate the gateway
presents to the cache, the cache here serves only the identity `gateway-v2`: the gateway's
first certificate names only `gateway`, so its cache calls are refused (the cache fails
open); the renewed one names `gateway-v2` too, so once the gateway dials with it, its lookups
are answered. Before, every process kept the certificates it started with until a restart,
and a renewal only showed once the old certificates expired: every new connection failed.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
from pathlib import Path

from conftest import DEFAULT_MODEL
from harness import Mesh, eventually
from hopline.cli.certs import ROLES, env_for, make_certs, make_leaf
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.runtime.tls import TlsFiles, channel, client_tls

FAIL_OPEN = common_pb2.CACHE_OUTCOME_FAIL_OPEN


def serial(address: str, ca: Path, server: str) -> str:
    """The serial number of the certificate a new TLS connection to `address` is shown."""
    host, port = address.rsplit(":", 1)
    context = ssl.create_default_context(cafile=str(ca))
    context.check_hostname = False
    context.set_alpn_protocols(["h2"])
    context.load_cert_chain(ca.parent / "operator.crt", ca.parent / "operator.key")
    with (
        socket.create_connection((host, int(port)), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=server) as tls,
    ):
        shown = tls.getpeercert()
        assert shown is not None
        return str(shown["serialNumber"])


def renew(live: Path, role: str, *names: str) -> None:
    """A new certificate and key for `role` from the same CA, moved into place file by file
    (the key first: for a moment the two do not match, which must not break anything)."""
    staging = live.parent / f"staging-{role}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    for name in ("ca.crt", "ca.key"):
        shutil.copy(live / name, staging / name)
    make_leaf(staging, role, names=names)
    for name in (f"{role}.key", f"{role}.crt"):
        os.replace(staging / name, live / name)


def ask(mesh: Mesh, ca: Path, text: str) -> gateway_pb2.PredictResponse:
    tls = client_tls(TlsFiles(ca=str(ca)), "gateway")
    with channel(mesh.gateway, tls) as chan:
        reply: gateway_pb2.PredictResponse = gateway_pb2_grpc.GatewayServiceStub(chan).Predict(
            gateway_pb2.PredictRequest(text=text), timeout=30
        )
        return reply


def test_renewed_certificates_are_served_and_presented_without_a_restart(
    default_repo: Path, tmp_path: Path
) -> None:
    repo = tmp_path / "models"
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    live = make_certs(tmp_path / "tls", ROLES)
    ca, tls = live / "ca.crt", env_for(live)
    mesh = Mesh(
        repo,
        tmp_path,
        # The launcher waits for the local exact tier's watch, which the cache refuses here.
        service_env={
            "cache": {"HOPLINE_TLS_PEERS": "gateway-v2,operator"},
            "gateway": {"HOPLINE_GATEWAY_EXACT_ENTRIES": "0"},
        },
        HOPLINE_CACHE_BREAKER_COOLDOWN_S="1",
        HOPLINE_TLS_CA=tls["HOPLINE_TLS_CA"],
        HOPLINE_TLS_CERT=tls["HOPLINE_TLS_CERT"],  # `{name}`: each process its own
        HOPLINE_TLS_KEY=tls["HOPLINE_TLS_KEY"],
    )
    mesh.start()
    try:
        first = ask(mesh, ca, "where is my parcel")
        assert first.cache.outcome == FAIL_OPEN, first.cache
        assert "PERMISSION_DENIED" in first.cache.detail or "circuit" in first.cache.detail
        before = {name: serial(mesh.addrs[name], ca, name) for name in ("gateway", "cache")}

        renew(live, "gateway", "gateway-v2")
        renew(live, "cache")

        after = {name: serial(mesh.addrs[name], ca, name) for name in ("gateway", "cache")}
        assert all(after[name] != before[name] for name in before), (before, after)
        texts = iter(f"where is my parcel number {i}" for i in range(1000))
        eventually(
            lambda: ask(mesh, ca, next(texts)).cache.outcome != FAIL_OPEN,
            "the gateway's cache calls answered with its renewed certificate",
        )
        reply = ask(mesh, ca, "my card was charged twice")
    finally:
        mesh.stop()
    assert reply.cache.outcome == common_pb2.CACHE_OUTCOME_MISS
    assert reply.prediction.label
