"""SIGTERM under load: NOT_SERVING first, in-flight work finishes, callers are refused with
UNAVAILABLE (never CANCELLED), exit 0."""

from __future__ import annotations

import shutil
import signal
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from conftest import DEFAULT_MODEL
from harness import NOT_SERVING, SERVING, Mesh, health
from hopline.gateway.client import predict
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.inference.v1 import inference_pb2, inference_pb2_grpc
from hopline.runtime.errors import TRACE_ID_METADATA
from hopline.runtime.server import CUT, DRAINING
from hopline.runtime.tensors import to_tensor


def _request(batch: int, seq: int) -> inference_pb2.InferRequest:
    ids = np.full((batch, seq), 2000, dtype=np.int64)
    return inference_pb2.InferRequest(
        model=DEFAULT_MODEL,
        inputs=[to_tensor("input_ids", ids), to_tensor("attention_mask", np.ones_like(ids))],
    )


Outcome = tuple[grpc.StatusCode, str]


def _keep_calling(
    target: str, stop: threading.Event, outcomes: list[Outcome], pause_s: float
) -> None:
    """Infer on a connection of its own until `stop`, ignoring health as a naive client does;
    records each call's status and details."""
    with grpc.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        while not stop.is_set():
            try:
                stub.Infer(_request(1, 12), timeout=30)
                outcomes.append((grpc.StatusCode.OK, ""))
            except grpc.RpcError as err:
                outcomes.append((err.code(), err.details() or ""))
            time.sleep(pause_s)


def _inference_alone(default_repo: Path, tmp_path: Path, drain_delay_s: float) -> tuple[Mesh, str]:
    """An inference service on the default model, and its address."""
    repo = tmp_path / "models"
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    # A generous grace: the 64x256 batch must finish, however loaded the machine is.
    mesh = Mesh(
        repo, tmp_path, HOPLINE_DRAIN_DELAY_S=str(drain_delay_s), HOPLINE_DRAIN_GRACE_S="60"
    )
    mesh.start(("inference",))
    return mesh, mesh.addrs["inference"]


def test_sigterm_drains_in_flight_requests(default_repo: Path, tmp_path: Path) -> None:
    mesh, target = _inference_alone(default_repo, tmp_path, drain_delay_s=1.0)
    outcomes: list[Outcome] = []
    statuses: list[int | None] = []
    stop = threading.Event()

    def trickle() -> None:
        _keep_calling(target, stop, outcomes, pause_s=0.02)

    def watch() -> None:
        while not stop.is_set():
            statuses.append(health(target, timeout_s=0.5))
            time.sleep(0.05)

    slow_result: list[inference_pb2.InferResponse] = []

    def slow_call() -> None:
        with grpc.insecure_channel(target) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            slow_result.append(stub.Infer(_request(64, 256), timeout=60))

    threads = [threading.Thread(target=f) for f in (trickle, watch)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    slow = threading.Thread(target=slow_call)
    slow.start()
    time.sleep(0.1)  # the big batch is now running
    code = mesh.terminate("inference", timeout_s=30)
    slow.join(timeout=60)
    stop.set()
    for t in threads:
        t.join(timeout=10)

    assert code == 0, mesh.log("inference")
    # The in-flight batch that was running when SIGTERM arrived finished normally.
    assert len(slow_result) == 1
    assert len(slow_result[0].outputs) == 2
    # Health went SERVING -> NOT_SERVING while the process still answered, then away.
    assert statuses[0] == SERVING
    first_not_serving = statuses.index(NOT_SERVING)
    assert all(s == SERVING for s in statuses[:first_not_serving])
    # Requests succeeded before and during the drain; afterwards they are refused, never
    # cut off half-way (no CANCELLED/INTERNAL/UNKNOWN).
    codes = [code for code, _ in outcomes]
    assert codes.count(grpc.StatusCode.OK) >= 5
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, set(codes)
    assert "draining" in mesh.log("inference")
    assert "stopped" in mesh.log("inference")


def test_callers_that_ignore_health_are_refused_never_cancelled(
    default_repo: Path, tmp_path: Path
) -> None:
    """Eight callers call back to back on their own connections through a drain, as clients
    behind an L4 balancer keep doing on an open connection. grpc's server shutdown fails the
    calls that have arrived but that no handler has taken with CANCELLED (grpc/grpc#41785),
    and with callers this busy some always have: before the drain refused calls itself and
    the process ended without that shutdown, 3 of 5 such drains cancelled calls (10 in all)."""
    mesh, target = _inference_alone(default_repo, tmp_path, drain_delay_s=0.5)
    outcomes: list[Outcome] = []
    stop = threading.Event()
    callers = [
        threading.Thread(target=_keep_calling, args=(target, stop, outcomes, 0.0)) for _ in range(8)
    ]
    for t in callers:
        t.start()
    time.sleep(0.5)
    with grpc.insecure_channel(target) as channel:
        big = inference_pb2_grpc.InferenceServiceStub(channel).Infer.future(
            _request(64, 256), timeout=60
        )
        time.sleep(0.1)  # the big batch is now running
        code = mesh.terminate("inference", timeout_s=60)
        assert len(big.result(timeout=60).outputs) == 2
    time.sleep(0.3)  # and the callers meet the closed port for a while
    stop.set()
    for t in callers:
        t.join(timeout=30)

    assert code == 0, mesh.log("inference")
    codes = {c for c, _ in outcomes}
    assert codes <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, codes
    assert sum(c == grpc.StatusCode.OK for c, _ in outcomes) >= 8
    # The drain refused calls itself, telling the caller what to do.
    assert any(DRAINING in details for _, details in outcomes)


def test_a_miss_answered_just_before_the_mesh_stops_is_cached(
    default_repo: Path, tmp_path: Path
) -> None:
    """The launcher stops the gateway before the services it calls: the store a miss leaves
    lingering in the gateway (a 3 s linger here, so it is still there when the stop comes)
    goes out in the gateway's drain to a cache that still serves, and the mesh started again
    over the same milvus-lite file answers the repeat EXACT. Stopped all at once, the cache
    went NOT_SERVING first and the gateway logged `cache store failed`."""
    repo = tmp_path / "models"
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    text = "my parcel never arrived and the tracking page has not moved in a week"
    for name in ("first", "again"):
        (tmp_path / name).mkdir()
    first = Mesh(repo, tmp_path / "first", HOPLINE_GATEWAY_STORE_LINGER_MS="3000")
    first.start()
    try:
        reply = predict(text, gateway=first.gateway, timeout_s=30)
        assert reply.cache.outcome == common_pb2.CACHE_OUTCOME_MISS
    finally:
        first.stop()
    assert "cache store failed" not in first.log("gateway"), first.log("gateway")[-2000:]
    assert first.exited() == dict.fromkeys(first.procs, 0)
    again = Mesh(repo, tmp_path / "again", HOPLINE_CACHE_URI=str(tmp_path / "first" / "cache.db"))
    again.start()
    try:
        reply = predict(text, gateway=again.gateway, timeout_s=30)
        assert reply.cache.outcome == common_pb2.CACHE_OUTCOME_EXACT
    finally:
        again.stop()


def test_a_call_that_outlives_the_grace_is_ended_unavailable_saying_so(
    default_repo: Path, tmp_path: Path
) -> None:
    """A call still running when the drain's grace runs out (an upstream hung, a model far
    slower than the grace) is ended UNAVAILABLE, retryable, with a message that says why:
    grpc's server stop ended it with its own "Cancelling all calls"."""
    repo = tmp_path / "models"
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    mesh = Mesh(
        repo,
        tmp_path,
        service_env={"inference": {"HOPLINE_TEST_DELAY_MS": "30000"}},  # past any grace
        HOPLINE_DRAIN_DELAY_S="0.1",
        HOPLINE_DRAIN_GRACE_S="1",
    )
    mesh.start(("inference",))
    outcome: list[Outcome] = []

    def slow_call() -> None:
        with grpc.insecure_channel(mesh.addrs["inference"]) as channel:
            try:
                inference_pb2_grpc.InferenceServiceStub(channel).Infer(_request(1, 12), timeout=60)
                outcome.append((grpc.StatusCode.OK, ""))
            except grpc.RpcError as err:
                outcome.append((err.code(), err.details() or ""))
                # A server's answer (`hopline predict` tells it from "no server answered").
                trailing = {m.key for m in err.trailing_metadata() or ()}
                outcome.append((err.code(), "traced" if TRACE_ID_METADATA in trailing else ""))

    caller = threading.Thread(target=slow_call)
    try:
        caller.start()
        time.sleep(1.0)  # the call is in flight, held by the delay
        code = mesh.terminate("inference", timeout_s=30)
        caller.join(timeout=30)
    finally:
        mesh.stop()
    assert code == 0, mesh.log("inference")
    unavailable = grpc.StatusCode.UNAVAILABLE
    assert outcome == [(unavailable, CUT), (unavailable, "traced")], outcome


def test_sighup_drains_as_sigterm_does(default_repo: Path, tmp_path: Path) -> None:
    """A closed terminal or SSH session sends SIGHUP: left to its default, it ended a service
    at once, undrained and unlogged (exit 129; an operator's probe). It drains now, exit 0."""
    repo = tmp_path / "models"
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    mesh = Mesh(repo, tmp_path, HOPLINE_DRAIN_DELAY_S="0.1")
    mesh.start(("postprocess",))
    try:
        proc = mesh.procs["postprocess"]
        proc.send_signal(signal.SIGHUP)
        code = proc.wait(timeout=30)
    finally:
        mesh.stop()
    assert code == 0, mesh.log("postprocess")
    assert " draining " in mesh.log("postprocess")
