"""Bad input and broken upstreams: clear statuses, nothing crashes, the next call works."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from conftest import DEFAULT_MODEL
from harness import NOT_SERVING, SERVING, Mesh, eventually, free_port, health, serve_refused
from hopline.gateway.upstream import MAX_RECONNECT_BACKOFF_MS, RECONNECT_JITTER
from hopline.observability.logs import QUIET_S, SUMMARY_S
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.runtime.service_table import spec


@pytest.fixture(scope="module")
def stub(mesh: Mesh) -> Iterator[gateway_pb2_grpc.GatewayServiceStub]:
    with grpc.insecure_channel(mesh.gateway) as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)


def expect(
    stub: gateway_pb2_grpc.GatewayServiceStub,
    code: grpc.StatusCode,
    timeout: float = 10.0,
    **fields: object,
) -> str:
    with pytest.raises(grpc.RpcError) as info:
        stub.Predict(gateway_pb2.PredictRequest(**fields), timeout=timeout)  # type: ignore[arg-type]
    assert info.value.code() == code, info.value.details()
    details: str = info.value.details() or ""
    # The service survives and answers the next request.
    ok = stub.Predict(gateway_pb2.PredictRequest(text="hello there"), timeout=10)
    assert ok.prediction.label
    return details


def test_empty_text(stub: gateway_pb2_grpc.GatewayServiceStub) -> None:
    assert "empty" in expect(stub, grpc.StatusCode.INVALID_ARGUMENT, text="")
    expect(stub, grpc.StatusCode.INVALID_ARGUMENT, text="   \n\t ")
    # Nothing the model reads (its tokenizer drops control and zero-width characters): not a
    # prediction of an empty input.
    for unreadable in ("\x01\x02", "\u200b", "\x00 \x7f"):
        details = expect(stub, grpc.StatusCode.INVALID_ARGUMENT, text=unreadable)
        assert "no character the model reads" in details


def test_unknown_model_and_version(stub: gateway_pb2_grpc.GatewayServiceStub) -> None:
    details = expect(stub, grpc.StatusCode.NOT_FOUND, text="hi", model="no-such-model")
    assert "no-such-model" in details
    assert DEFAULT_MODEL in details
    expect(stub, grpc.StatusCode.NOT_FOUND, text="hi", model=DEFAULT_MODEL, model_version="9")


def test_over_the_size_limit(stub: gateway_pb2_grpc.GatewayServiceStub) -> None:
    details = expect(stub, grpc.StatusCode.RESOURCE_EXHAUSTED, text="a" * 20_000)
    assert "HOPLINE_MAX_TEXT_BYTES" in details
    # Over the gRPC message limit itself (4 MiB): refused by the transport, same status.
    expect(stub, grpc.StatusCode.RESOURCE_EXHAUSTED, text="b" * (5 * 1024 * 1024))


def test_bad_top_k(stub: gateway_pb2_grpc.GatewayServiceStub) -> None:
    expect(stub, grpc.StatusCode.INVALID_ARGUMENT, text="hi", top_k=1000)


def test_deadline_shorter_than_the_work(stub: gateway_pb2_grpc.GatewayServiceStub) -> None:
    expect(
        stub,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        timeout=0.003,
        text=f"where is my order {uuid.uuid4()}",
    )


def reconnect_bound_s() -> float:
    """The longest a gateway connection waits before it tries a restarted upstream again,
    with gRPC's jitter, and a second for the attempt itself on a busy machine."""
    return MAX_RECONNECT_BACKOFF_MS * (1 + RECONNECT_JITTER) / 1000 + 1.0


def recovered(
    stub: gateway_pb2_grpc.GatewayServiceStub, within_s: float
) -> gateway_pb2.PredictResponse:
    """The first answer after postprocess is back; every failure before it must be the hop's
    own UNAVAILABLE, and there must be an answer within `within_s`."""
    until = time.monotonic() + within_s
    failures: list[tuple[grpc.StatusCode, str]] = []
    while True:
        try:
            return stub.Predict(gateway_pb2.PredictRequest(text="track my order"), timeout=10)
        except grpc.RpcError as error:
            failures.append((error.code(), error.details() or ""))
        assert all(
            code == grpc.StatusCode.UNAVAILABLE and "postprocess" in details
            for code, details in failures
        ), failures
        assert time.monotonic() < until, f"postprocess not reached again: {failures}"
        time.sleep(0.02)


def test_upstream_down_is_unavailable_with_the_hop_named(
    default_repo: Path, tmp_path: Path
) -> None:
    """A mesh of its own, since this test stops one of its services."""
    repo = tmp_path / "models"
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    mesh = Mesh(repo, tmp_path).start()
    try:
        assert mesh.terminate("postprocess") == 0
        with grpc.insecure_channel(mesh.gateway) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.Predict(gateway_pb2.PredictRequest(text="track my order"), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "postprocess" in (info.value.details() or "")
            # The hop is named; its address goes to the gateway's log and span, not to clients.
            assert mesh.addrs["postprocess"] not in (info.value.details() or "")
            # The gateway itself is fine, and recovers once the hop is back: at the latest when
            # its connection's reconnect backoff next fires; until then the hop still fails
            # fast, named, as UNAVAILABLE.
            assert health(mesh.gateway) == SERVING
            mesh.start(("postprocess",))
            assert recovered(stub, within_s=reconnect_bound_s()).prediction.label == "order_status"
    finally:
        mesh.stop()


def test_an_upstream_down_is_logged_once_not_once_a_request(
    default_repo: Path, tmp_path: Path
) -> None:
    """While postprocess is down every request fails on its hop; the gateway says so once
    (observability/logs.py:Episodes), not once a request (hundreds of lines a second under
    load), and once more when it is over, with every failure counted."""
    repo = tmp_path / "models"
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    mesh = Mesh(repo, tmp_path).start()
    try:
        assert mesh.terminate("postprocess") == 0
        failed = 0
        down_since = time.monotonic()
        with grpc.insecure_channel(mesh.gateway) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            for _ in range(40):
                expect_unavailable(stub)
                failed += 1
            mesh.start(("postprocess",))
            while not answered(stub, "track my order"):
                failed += 1
            summaries = 1 + int((time.monotonic() - down_since) / SUMMARY_S)  # at most
            # A miss (the text above is cached now) after the quiet time ends the episode;
            # an answer sooner could be another replica's.
            time.sleep(QUIET_S + 0.2)
            assert answered(stub, "where is my parcel")

            said = [
                ln
                for ln in mesh.log("gateway").splitlines()
                if " W gateway " in ln and " hop failed " in ln and "hop=postprocess" in ln
            ]
            assert len([ln for ln in said if "more_failures=" not in ln]) == 1, said
            assert len(said) <= 1 + summaries, said

            def over() -> list[str]:
                return [ln for ln in mesh.log("gateway").splitlines() if "hop failed: over" in ln]

            eventually(lambda: bool(over()), timeout_s=10, what="the episode's end logged")
        assert len(over()) == 1
        assert f"failures={failed} " in over()[0], (failed, over())
    finally:
        mesh.stop()


@pytest.mark.parametrize(
    ("named", "serving"), [("inference", "tokenizer"), ("tokenizer", "postprocess")]
)
def test_an_upstream_address_that_names_another_service_is_said(
    default_repo: Path, tmp_path: Path, named: str, serving: str
) -> None:
    """An upstream's address setting pointing at another service (a slip in a manifest):
    each remote address is asked in the background whether it serves its service (by name,
    of its health service), and the one that does not is said once, naming the setting and
    the service; the others (the right service there, nothing at all at the rest) are not.
    The gateway, with no inference service to list its models, stays NOT_SERVING."""
    shared = f"127.0.0.1:{free_port()}"
    mesh = Mesh(default_repo, tmp_path, addrs={named: shared, serving: shared})
    mesh.spawn((serving, "gateway"))
    try:
        said = "does not serve"

        def warned() -> bool:
            assert mesh.procs["gateway"].poll() is None, mesh.log("gateway")
            return said in mesh.log("gateway")

        eventually(warned, timeout_s=60, what=f"the misdirected {named} address said")
        assert health(mesh.gateway) == NOT_SERVING
        time.sleep(1.5)  # more tries of the model list and of the other addresses
        lines = [ln for ln in mesh.log("gateway").splitlines() if said in ln]
        assert len(lines) == 1, lines
        assert f"HOPLINE_{named.upper()}_ADDR" in lines[0]
        assert f"hopline.{named}.v1." in lines[0]
    finally:
        mesh.stop()


def expect_unavailable(stub: gateway_pb2_grpc.GatewayServiceStub) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.Predict(gateway_pb2.PredictRequest(text="track my order"), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()


def answered(stub: gateway_pb2_grpc.GatewayServiceStub, text: str) -> bool:
    """One request: answered, or failed as the down hop's UNAVAILABLE (anything else fails)."""
    try:
        stub.Predict(gateway_pb2.PredictRequest(text=text), timeout=10)
    except grpc.RpcError as error:
        code = error.code()
    else:
        return True
    assert code == grpc.StatusCode.UNAVAILABLE, code
    time.sleep(0.02)
    return False


def test_a_taken_port_is_refused_not_shared(mesh: Mesh) -> None:
    """grpc enables SO_REUSEPORT by default: a second server would bind the same port and take
    part of the first one's connections. Ours refuse to start instead, and say why."""
    env = {
        **mesh.env,
        "HOPLINE_POSTPROCESS_ADDR": mesh.addrs["tokenizer"],
        "HOPLINE_METRICS_PORT": "0",
    }
    said = serve_refused("postprocess", env)
    assert "cannot bind" in said
    assert mesh.addrs["tokenizer"] in said
    assert health(mesh.addrs["tokenizer"]) == SERVING


def test_a_keys_file_no_caller_could_use_stops_the_gateway_saying_why(
    mesh: Mesh, tmp_path: Path
) -> None:
    """HOPLINE_API_KEYS naming a file whose key has spaces around it: no caller could send
    it (the gateway strips what it is sent), and the launcher's own calls send the file's
    first key; the gateway refuses to start in one line, exit 2, never echoing the key."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({" secret-acme-key ": "acme"}), encoding="utf-8")
    env = {
        **mesh.env,
        "HOPLINE_API_KEYS": str(keys),
        "HOPLINE_GATEWAY_ADDR": f"127.0.0.1:{free_port()}",
        "HOPLINE_METRICS_PORT": "0",
    }
    said = serve_refused("gateway", env)
    assert "cannot start" in said
    assert f"invalid HOPLINE_API_KEYS: {keys}: the key of tenant 'acme'" in said, said
    assert "Traceback" not in said
    assert "secret-acme-key" not in said


def test_a_port_past_65535_is_refused_not_wrapped(mesh: Mesh) -> None:
    """gRPC takes a port modulo 65536 (127.0.0.1:99999 binds 34463): a typo would start a
    service where nobody dials it, or a gateway waiting for an upstream forever. Both refuse
    at start-up and name the variable."""
    typo = "127.0.0.1:99999"
    env = {**mesh.env, "HOPLINE_POSTPROCESS_ADDR": typo, "HOPLINE_METRICS_PORT": "0"}
    said = serve_refused("postprocess", env)
    assert f"{typo!r}: the port must be a number from 0 to 65535" in said, said
    gateway = subprocess.run(
        [sys.executable, "-m", "hopline", "serve", "gateway"],
        env={**env, "HOPLINE_GATEWAY_ADDR": "127.0.0.1:0"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    said = gateway.stdout + gateway.stderr
    assert gateway.returncode == 2, said  # a setting refused (it was 1, as for an outage)
    assert f"HOPLINE_POSTPROCESS_ADDR={typo!r}: the port must be" in said, said


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ({"HOPLINE_CACHE_URI": "ftp://milvus:19530"}, "a Milvus server's URI starts http://"),
        (
            {"HOPLINE_CACHE_URI": "http://127.0.0.1:9", "HOPLINE_CACHE_MAX_TOTAL_ENTRIES": "10"},
            "HOPLINE_CACHE_MAX_TOTAL_ENTRIES bounds a milvus-lite file",
        ),
        (
            {
                "HOPLINE_CACHE_URI": "http://127.0.0.1:9",
                "HOPLINE_CACHE_MILVUS_TOKEN_FILE": "/nonexistent",
            },
            "cannot read HOPLINE_CACHE_MILVUS_TOKEN_FILE '/nonexistent'",
        ),
        # Path("") is the working folder: the encoder was built wherever the cache started.
        ({"HOPLINE_CACHE_DIR": ""}, "HOPLINE_CACHE_DIR is empty"),
        (
            {
                "HOPLINE_CACHE_URI": "http://127.0.0.1:9",  # a server's: peers are polled
                "HOPLINE_CACHE_PEER_STALE_S": "0.1",
                "HOPLINE_CACHE_PEER_POLL_MS": "100",
            },
            "HOPLINE_CACHE_PEER_STALE_S=0.1 must exceed two polls",
        ),
    ],
)
def test_a_cache_setting_that_cannot_work_exits_2(
    mesh: Mesh, setting: dict[str, str], says: str
) -> None:
    """A typo in the cache's settings is refused as every setting is, exit 2 (it was 1, the
    status of an outage, so an operator's tooling could not tell them apart), in one line."""
    env = {
        **mesh.env,
        "HOPLINE_CACHE_ADDR": f"127.0.0.1:{free_port()}",
        "HOPLINE_METRICS_PORT": "0",
        **setting,
    }
    said = serve_refused("cache", env)
    assert says in said, said
    assert "Traceback" not in said


@pytest.mark.parametrize(
    ("service", "setting", "says"),
    [
        # Path("") is the working folder: models served from wherever the service started.
        ("tokenizer", {"HOPLINE_MODEL_REPO": ""}, "HOPLINE_MODEL_REPO is empty"),
        # Every request naming no model got NOT_FOUND "unknown model ''".
        (
            "gateway",
            {"HOPLINE_DEFAULT_MODEL": ""},
            "HOPLINE_DEFAULT_MODEL: model name '' must be 1-63 chars",
        ),
        (
            "gateway",
            {"HOPLINE_DEFAULT_MODEL": "Support-Intents"},
            "HOPLINE_DEFAULT_MODEL: model name 'Support-Intents' must be 1-63 chars",
        ),
        # gRPC takes the age in whole milliseconds: 0.0001 s became 0 ms, and every
        # connection was sent GOAWAY before its calls could finish (health checks
        # DEADLINE_EXCEEDED after 10-25 s).
        (
            "postprocess",
            {"HOPLINE_MAX_CONNECTION_AGE_S": "0.0001"},
            "HOPLINE_MAX_CONNECTION_AGE_S=0.0001: 0 (never) or at least 1 s",
        ),
    ],
)
def test_a_setting_no_service_can_run_on_is_refused_in_one_line(
    mesh: Mesh, service: str, setting: dict[str, str], says: str
) -> None:
    """Each of these started and served on it (a settings probe); exit 2 now, naming it."""
    env = {
        **mesh.env,
        spec(service).addr_env: f"127.0.0.1:{free_port()}",
        "HOPLINE_METRICS_PORT": "0",
        **setting,
    }
    said = serve_refused(service, env)
    assert says in said, said
    assert "Traceback" not in said


def run_refused(env: dict[str, str], code: int = 2) -> str:
    """What `hopline run` says refusing `env`'s settings (exit `code`, checked here)."""
    done = subprocess.run(
        [sys.executable, "-m", "hopline", "run", "--model-repo", env["HOPLINE_MODEL_REPO"]],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    said = done.stdout + done.stderr
    assert done.returncode == code, said
    assert "Traceback" not in said
    return said


def test_hopline_run_refuses_a_port_past_65535_naming_it(mesh: Mesh) -> None:
    """`hopline run` probed the address before checking it: an OverflowError traceback."""
    env = {**mesh.env, "HOPLINE_GATEWAY_ADDR": "127.0.0.1:99999", "HOPLINE_METRICS_PORT": "0"}
    said = run_refused(env)
    assert "HOPLINE_GATEWAY_ADDR='127.0.0.1:99999': the port must be a number" in said, said


@pytest.mark.parametrize(
    ("variable", "port", "says"),
    [
        ("HOPLINE_METRICS_PORT", "65534", "(cache 65536): set at most 65533"),
        ("HOPLINE_HEALTH_PORT", "65535", "(cache 65537): set at most 65533"),
    ],
)
def test_hopline_run_refuses_a_spread_port_past_65535_naming_its_variable(
    mesh: Mesh, variable: str, port: str, says: str
) -> None:
    """`hopline run` spreads the metrics and health ports from the one given; near the top
    the cache was handed 65536 and refused it, naming a port the user never wrote."""
    said = run_refused({**mesh.env, "HOPLINE_METRICS_PORT": "0", variable: port})
    assert f"{variable}={port}: `hopline run` gives the gateway this port" in said, said
    assert says in said, said


def test_hopline_run_refuses_a_metrics_port_another_program_holds(mesh: Mesh) -> None:
    """A service goes on without /metrics when its port is taken, so a second mesh on the
    same HOPLINE_METRICS_PORT said "up" and named the first mesh's /metrics as its own (an
    operator's probe). `hopline run` refuses to start, naming the port and the variable."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        said = run_refused({**mesh.env, "HOPLINE_METRICS_PORT": str(port)}, code=1)
    assert f"HOPLINE_METRICS_PORT: port {port}, gateway's, cannot be bound" in said, said
    assert "hopline is up" not in said


def test_a_failed_prediction_carries_its_trace_id(mesh: Mesh) -> None:
    """A failure has no reply to carry `trace_id` in, and the failed requests are the ones a
    user wants to find: its trailing metadata carries it, and `hopline predict` prints it."""
    trace_id = "5e2a" + "0" * 27 + "7"
    with grpc.insecure_channel(mesh.gateway) as channel, pytest.raises(grpc.RpcError) as info:
        gateway_pb2_grpc.GatewayServiceStub(channel).Predict(
            gateway_pb2.PredictRequest(text="hello", model="no-such-model"),
            timeout=30,
            metadata=(("traceparent", f"00-{trace_id}-{'2' * 16}-01"),),
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    trailing = {m.key: str(m.value) for m in info.value.trailing_metadata() or ()}
    assert trailing["x-hopline-trace-id"] == trace_id
    said = subprocess.run(
        [
            sys.executable,
            "-m",
            "hopline",
            "predict",
            "--gateway",
            mesh.gateway,
            "--model",
            "nope",
            "hi",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert said.returncode == 1
    assert said.stderr.startswith("error: NOT_FOUND: unknown model 'nope'")
    assert re.search(r"\(trace [0-9a-f]{32}\)", said.stderr), said.stderr
