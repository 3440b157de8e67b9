"""The mesh over TLS: mTLS between services, TLS at the front door, and a cache no one but the
gateway (or an operator) can read or write.

Real processes, real certificates (`make certs`'s code: a local CA from the `openssl`
command), real gRPC on loopback ports. The cache is attacked directly the way an intruder
on the network would: plaintext, TLS without a client certificate, a certificate the mesh's
CA signed for another role, and a certificate for the gateway's name from another CA.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from conftest import DEFAULT_MODEL
from harness import NOT_SERVING, SERVING, Mesh, answer_scope, health, serve_refused
from hopline.cli.certs import ROLES, env_for, make_certs
from hopline.cli.main import main as cli_main
from hopline.gateway.client import predict as cli_predict
from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.protos.hopline.postprocess.v1 import postprocess_pb2, postprocess_pb2_grpc
from hopline.runtime.launcher import MeshError
from hopline.runtime.ports import free_ports
from hopline.runtime.tls import ClientTls, TlsFiles, channel, client_tls

EXACT = common_pb2.CACHE_OUTCOME_EXACT
MISS = common_pb2.CACHE_OUTCOME_MISS
ACME_KEY = "acme-tls-test-key-7f1d2c"
TEXT = "I forgot my password and cannot log in"
POISON = common_pb2.Prediction(label="poisoned", score=1.0)
DENIED, UNAVAILABLE = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAVAILABLE


class TlsMesh(Mesh):
    tls: Path  # the mesh's CA and certificates
    rogue: Path  # another CA, with a certificate that names the gateway


@pytest.fixture(scope="module")
def tmesh(default_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsMesh]:
    work = tmp_path_factory.mktemp("tlsmesh")
    repo = work / "models"
    repo.mkdir()
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    certs = make_certs(work / "tls", (*ROLES, "intruder"))
    tls = env_for(certs)
    keys = work / "api-keys.json"
    keys.write_text(json.dumps({ACME_KEY: "acme"}), encoding="utf-8")
    m = TlsMesh(
        repo,
        work,
        HOPLINE_API_KEYS=str(keys),
        HOPLINE_CACHE_FLUSH_MS="2",
        HOPLINE_CACHE_BUDGET_MS="2000",  # a slow CI machine must not turn hits into fail-opens
        HOPLINE_TLS_CA=tls["HOPLINE_TLS_CA"],
        HOPLINE_TLS_CERT=tls["HOPLINE_TLS_CERT"],  # `{name}`: each process its own
        HOPLINE_TLS_KEY=tls["HOPLINE_TLS_KEY"],
    )
    m.tls, m.rogue = certs, make_certs(work / "rogue", ("gateway",))
    try:
        yield m.start()  # the launcher's probes already dial every service over mTLS
    finally:
        m.stop()


def as_role(folder: Path, role: str | None, server: str) -> ClientTls:
    """Dial `server` trusting `folder`'s CA, presenting `role`'s certificate (None: none)."""
    cert = str(folder / f"{role}.crt") if role else ""
    key = str(folder / f"{role}.key") if role else ""
    tls = client_tls(TlsFiles(cert, key, str(folder / "ca.crt")), server)
    assert tls is not None
    return tls


def predict(
    mesh: TlsMesh, tls: ClientTls | None, key: str = ACME_KEY
) -> gateway_pb2.PredictResponse:
    with channel(mesh.gateway, tls) as chan:
        reply: gateway_pb2.PredictResponse = gateway_pb2_grpc.GatewayServiceStub(chan).Predict(
            gateway_pb2.PredictRequest(text=TEXT),
            metadata=(("authorization", f"Bearer {key}"),),
            timeout=30,
        )
        return reply


def acme_scope(mesh: TlsMesh) -> common_pb2.Scope:
    """The scope the gateway files acme's answers under (gateway/call.py:PredictCall.new)."""
    return answer_scope(mesh.repo, "acme", DEFAULT_MODEL, "1")


def lookup(mesh: TlsMesh, tls: ClientTls | None) -> cache_pb2.LookupResponse:
    with channel(mesh.addrs["cache"], tls) as chan:
        reply: cache_pb2.LookupResponse = cache_pb2_grpc.CacheServiceStub(chan).Lookup(
            cache_pb2.LookupRequest(scope=acme_scope(mesh), text=TEXT, mode="exact"), timeout=10
        )
        return reply


def store(mesh: TlsMesh, tls: ClientTls | None) -> None:
    with channel(mesh.addrs["cache"], tls) as chan:
        cache_pb2_grpc.CacheServiceStub(chan).Store(
            cache_pb2.StoreRequest(
                scope=acme_scope(mesh), text=TEXT, prediction=POISON, mode="exact"
            ),
            timeout=10,
        )


def watch(mesh: TlsMesh, tls: ClientTls | None) -> None:
    with channel(mesh.addrs["cache"], tls) as chan:
        stream = cache_pb2_grpc.CacheServiceStub(chan).WatchInvalidations(
            cache_pb2.WatchInvalidationsRequest(), timeout=10
        )
        next(iter(stream))


def refused(call: object, *args: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as caught:
        call(*args)  # type: ignore[operator]
    code: grpc.StatusCode = caught.value.code()
    return code


def test_a_predict_goes_through_the_tls_gateway_with_tenants_from_api_keys(
    tmesh: TlsMesh,
) -> None:
    # A client with only the CA (no certificate of its own) gets answers at the front door.
    front_door = as_role(tmesh.tls, None, "gateway")
    first = predict(tmesh, front_door)
    assert first.prediction.label == "password_reset"
    assert first.tenant == "acme"
    assert first.cache.outcome == MISS
    assert "tokenize" in {t.hop for t in first.timings}  # the hops ran, over mTLS
    # Tenants still come from API keys: TLS identifies no tenant.
    assert refused(predict, tmesh, front_door, "not-a-key") == grpc.StatusCode.UNAUTHENTICATED
    # Plaintext to a TLS port fails the handshake.
    assert refused(predict, tmesh, None) == UNAVAILABLE
    # The client checks the server is the gateway: another CA's "gateway" is not trusted.
    assert refused(predict, tmesh, as_role(tmesh.rogue, None, "gateway")) == UNAVAILABLE


def test_no_one_but_the_gateway_or_an_operator_can_read_or_write_the_cache(
    tmesh: TlsMesh,
) -> None:
    genuine = predict(tmesh, as_role(tmesh.tls, None, "gateway")).prediction
    operator = as_role(tmesh.tls, "operator", "cache")
    deadline = time.monotonic() + 20
    while lookup(tmesh, operator).outcome != EXACT:  # the gateway's store lands off-path
        assert time.monotonic() < deadline, "acme's answer was never stored"
        time.sleep(0.05)

    attackers = {
        "plaintext": (None, UNAVAILABLE),
        "TLS without a client certificate": (as_role(tmesh.tls, None, "cache"), UNAVAILABLE),
        "another CA's gateway certificate": (as_role(tmesh.rogue, "gateway", "cache"), UNAVAILABLE),
        "the CA's certificate for another role": (as_role(tmesh.tls, "intruder", "cache"), DENIED),
        "the tokenizer's own certificate": (as_role(tmesh.tls, "tokenizer", "cache"), DENIED),
    }
    for name, (tls, expected) in attackers.items():
        assert refused(lookup, tmesh, tls) == expected, f"Lookup with {name}"
        assert refused(store, tmesh, tls) == expected, f"Store with {name}"
        assert refused(watch, tmesh, tls) == expected, f"WatchInvalidations with {name}"

    # Nothing was written: the entry is the gateway's, and acme still gets the real answer.
    assert lookup(tmesh, operator).prediction.label == genuine.label
    again = predict(tmesh, as_role(tmesh.tls, None, "gateway"))
    assert again.cache.outcome == EXACT
    assert again.prediction.label == genuine.label != POISON.label


def reflected(mesh: TlsMesh, service: str, tls: ClientTls | None) -> list[str]:
    """The services `service`'s reflection lists to a caller dialling with `tls`."""
    with channel(mesh.addrs[service], tls) as chan:
        stub = reflection_pb2_grpc.ServerReflectionStub(chan)
        asked = iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        reply = next(iter(stub.ServerReflectionInfo(asked, timeout=10)))
        return [s.name for s in reply.list_services_response.service]


def garbage(address: str, method: str, tls: ClientTls | None) -> grpc.RpcError:
    """What `address` answers to bytes that are no request of `method`'s."""
    with channel(address, tls) as chan:
        call = chan.unary_unary(method, None, None)
        with pytest.raises(grpc.RpcError) as caught:
            call(b"\xff\xff\xff", timeout=10)
        error: grpc.RpcError = caught.value
        return error


def test_reflection_is_served_only_to_the_peers_and_probes_refuse_garbage_quietly(
    tmesh: TlsMesh,
) -> None:
    """A security probe: reflection and health were registered on the server directly, past
    the peer check and the request decoding. A certificate the cache refuses every RPC read
    its whole API by reflection (4 KB of descriptors), and bytes that do not parse got
    UNKNOWN "Unexpected <class DecodeError>" and a traceback in the log, for anyone, with no
    key; on the gateway's port, its health port and the internal ones."""
    operator = as_role(tmesh.tls, "operator", "cache")
    assert "hopline.cache.v1.CacheService" in reflected(tmesh, "cache", operator)
    intruder = as_role(tmesh.tls, "intruder", "cache")
    assert refused(reflected, tmesh, "cache", intruder) == DENIED
    tokenizer = as_role(tmesh.tls, "tokenizer", "tokenizer")
    assert refused(reflected, tmesh, "tokenizer", tokenizer) == DENIED
    for service, tls in (("cache", intruder), ("gateway", as_role(tmesh.tls, None, "gateway"))):
        for method in ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"):
            error = garbage(tmesh.addrs[service], method, tls)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (service, method, error)
            assert "HealthCheckRequest" in (error.details() or ""), error
    for service in ("cache", "gateway"):
        said = (tmesh.workdir / f"{service}.log").read_text()
        assert "Traceback" not in said, said
        assert "Unexpected" not in said, said


def test_handshakes_naming_another_server_write_nothing_to_the_log(tmesh: TlsMesh) -> None:
    """Any client (no key, no certificate) made the gateway log gRPC core's "E1206 ...
    ssl_transport_security.cc:3238] No match found for server name: attacker.example", its own
    format and the client's string, a line for every handshake (a security probe: 200 in a
    second); hopline's GRPC_VERBOSITY default is NONE now."""
    context = ssl.create_default_context(cafile=str(tmesh.tls / "ca.crt"))
    context.check_hostname = False
    context.set_alpn_protocols(["h2"])
    host, port = tmesh.gateway.rsplit(":", 1)
    for _ in range(5):
        with (
            socket.create_connection((host, int(port)), timeout=10) as raw,
            context.wrap_socket(raw, server_hostname="attacker.example") as tls,
        ):
            assert tls.version() is not None
    time.sleep(0.5)  # what core would write, written
    said = (tmesh.workdir / "gateway.log").read_text()
    assert "attacker.example" not in said


def test_hopline_predict_dials_tls_from_the_environment(
    tmesh: TlsMesh, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hopline predict` (gateway/client.py) with HOPLINE_TLS_* set: the handshake works (the
    gateway answers, UNAUTHENTICATED since the client sends no API key); unset, plaintext
    cannot reach it."""

    def ask() -> None:
        cli_predict(TEXT, gateway=tmesh.gateway)

    assert refused(ask) == UNAVAILABLE
    # The command says a TLS server closed the plaintext call, not "no gateway answered" (a
    # security probe: that sent the user looking for a mesh that was running).
    monkeypatch.delenv("HOPLINE_TLS_CA", raising=False)
    assert cli_main(["predict", TEXT, "--gateway", tmesh.gateway]) == 1
    said = capsys.readouterr().err
    assert "closed the plaintext connection before HTTP/2 began" in said, said
    assert "set HOPLINE_TLS_CA to its CA file" in said, said
    for key, value in env_for(tmesh.tls).items():
        monkeypatch.setenv(key, value)
    assert refused(ask) == grpc.StatusCode.UNAUTHENTICATED


def test_a_tls_service_answers_plaintext_probes_on_its_health_port(
    tmesh: TlsMesh, tmp_path: Path
) -> None:
    """Kubernetes' gRPC probes cannot speak TLS. With HOPLINE_HEALTH_PORT a TLS-only service
    also serves grpc.health.v1 alone in plaintext there: SERVING once ready, nothing else
    reachable on it, NOT_SERVING from the moment it drains; its own port still refuses
    plaintext."""
    port, probe_port, metrics = free_ports(3)
    address, probe = f"127.0.0.1:{port}", f"127.0.0.1:{probe_port}"
    log = (tmp_path / "postprocess-probed.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hopline", "serve", "postprocess"],
        env={
            **tmesh.env,
            "HOPLINE_POSTPROCESS_ADDR": address,
            "HOPLINE_HEALTH_PORT": str(probe_port),
            "HOPLINE_METRICS_PORT": str(metrics),
            "HOPLINE_DRAIN_DELAY_S": "3",
        },
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while health(probe) != SERVING:
            assert proc.poll() is None, (tmp_path / "postprocess-probed.log").read_text()
            assert time.monotonic() < deadline, "the probe port never said SERVING"
            time.sleep(0.1)
        with grpc.insecure_channel(probe) as chan:
            stub = postprocess_pb2_grpc.PostprocessServiceStub(chan)
            code = refused(stub.Postprocess, postprocess_pb2.PostprocessRequest(), 5)
            assert code == grpc.StatusCode.UNIMPLEMENTED
        noise = garbage(probe, "/grpc.health.v1.Health/Check", None)
        assert noise.code() == grpc.StatusCode.INVALID_ARGUMENT, noise
        assert health(address) is None  # plaintext on the service's own port: no answer
        assert health(address, tls=as_role(tmesh.tls, "operator", "postprocess")) == SERVING
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 2.5  # within the drain delay: still up, not serving
        while health(probe) == SERVING:
            assert time.monotonic() < deadline, "the probe port did not follow the drain"
            time.sleep(0.05)
        assert health(probe) == NOT_SERVING
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_a_key_that_is_not_the_certificates_is_named(tmesh: TlsMesh) -> None:
    """gRPC's own bind error says only "Failed to bind to address": a service given another
    role's key says which two files do not belong together, and does not start."""
    env = {
        **tmesh.env,
        "HOPLINE_TLS_CERT": str(tmesh.tls / "postprocess.crt"),
        "HOPLINE_TLS_KEY": str(tmesh.tls / "gateway.key"),
        "HOPLINE_POSTPROCESS_ADDR": f"127.0.0.1:{free_ports(1)[0]}",
        "HOPLINE_METRICS_PORT": "0",
    }
    said = serve_refused("postprocess", env)
    assert "cannot serve TLS" in said, said  # not "cannot bind": the port was never the matter
    assert "are not a certificate and its private key" in said, said
    assert "gateway.key" in said


def test_a_ca_without_a_certificate_is_refused(tmesh: TlsMesh) -> None:
    """HOPLINE_TLS_CA alone (the certificate's variable forgotten) served plaintext without a
    word, to an operator who had set TLS up: the service names what is missing and exits."""
    env = {k: v for k, v in tmesh.env.items() if k not in ("HOPLINE_TLS_CERT", "HOPLINE_TLS_KEY")}
    env["HOPLINE_POSTPROCESS_ADDR"] = f"127.0.0.1:{free_ports(1)[0]}"
    env["HOPLINE_METRICS_PORT"] = "0"
    said = serve_refused("postprocess", env)
    assert "cannot serve TLS" in said, said
    assert "HOPLINE_TLS_CA is set without HOPLINE_TLS_CERT" in said, said


def test_peers_asked_for_on_a_port_without_a_certificate_are_refused(tmesh: TlsMesh) -> None:
    """HOPLINE_GATEWAY_TLS_PEERS=operator with no certificate served plaintext Predict to
    anyone, without a word: the operator asked for client certificates."""
    plain = {k: v for k, v in tmesh.env.items() if not k.startswith("HOPLINE_TLS_")}
    env = {
        **plain,
        "HOPLINE_GATEWAY_TLS_PEERS": "operator",
        "HOPLINE_GATEWAY_ADDR": f"127.0.0.1:{free_ports(1)[0]}",
        "HOPLINE_METRICS_PORT": "0",
    }
    said = serve_refused("gateway", env)
    assert "cannot serve TLS" in said, said
    assert "HOPLINE_GATEWAY_TLS_PEERS='operator' asks callers for a client certificate" in said
    # An internal service's peers other than its default, likewise.
    env = {**plain, "HOPLINE_TLS_PEERS": "gateway", "HOPLINE_METRICS_PORT": "0"}
    env["HOPLINE_POSTPROCESS_ADDR"] = f"127.0.0.1:{free_ports(1)[0]}"
    assert "HOPLINE_TLS_PEERS='gateway'" in serve_refused("postprocess", env)


def test_a_gateway_that_refuses_the_operator_fails_the_start_at_once(tmesh: TlsMesh) -> None:
    """With HOPLINE_GATEWAY_TLS_PEERS leaving out `operator`, the launcher's GetStats (is the
    local tier live?) is refused: `hopline run` waited out its whole start limit, then said
    "not ready in time: the gateway's local exact tier"."""
    port, metrics_port = free_ports(2)
    env = {
        **tmesh.env,
        "HOPLINE_GATEWAY_TLS_PEERS": "gateway",
        "HOPLINE_GATEWAY_ADDR": f"127.0.0.1:{port}",
        "HOPLINE_METRICS_PORT": str(metrics_port),
        **{f"HOPLINE_{n.upper()}_ADDR": a for n, a in tmesh.addrs.items() if n != "gateway"},
    }
    log = (tmesh.workdir / "gateway-no-operator.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hopline", "serve", "gateway"], env=env, stdout=log, stderr=log
    )
    probe = Mesh(tmesh.repo, tmesh.workdir, addrs={"gateway": f"127.0.0.1:{port}"})
    probe.env = dict(tmesh.env)  # the mesh's certificates and keys: the launcher's calls
    try:
        started = time.monotonic()
        with pytest.raises(MeshError, match="PERMISSION_DENIED") as failed:
            probe.wait_until("the local tier", probe.local_tier_live, started + 90)
        assert "name operator in it" in str(failed.value)
        assert time.monotonic() - started < 60, "it waited for the deadline"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
