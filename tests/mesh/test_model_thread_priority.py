"""The inference service runs its models on threads nicer than its event loop
(runtime/priority.py), ONNX Runtime's own pool threads included; read from /proc (Linux)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import grpc
import pytest

from harness import Mesh
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.runtime.service_table import ServiceName

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's"
)

DEFAULT_NICE = 5  # services/inference/service.py:InferenceConfig.nice


def _threads(pid: int) -> dict[int, tuple[int, int]]:
    """Each thread of `pid`: (niceness, CPU clock ticks so far), from /proc/PID/task/TID/stat."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        # Fields 14 and 15 of stat (user and system time) and 19 (nice), counted from 1.
        found[int(task.name)] = (int(fields[16]), int(fields[11]) + int(fields[12]))
    return found


def _predict(mesh: Mesh, texts: list[str]) -> None:
    with grpc.insecure_channel(mesh.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for text in texts:
            stub.Predict(gateway_pb2.PredictRequest(text=text), timeout=30)


def test_the_model_runs_on_threads_nicer_than_the_event_loop(mesh: Mesh) -> None:
    pid = mesh.procs[ServiceName.INFERENCE].pid
    _predict(mesh, ["a first request starts the executor's threads"])
    before = _threads(pid)
    # Every text new: each one is a miss, and runs the model.
    _predict(mesh, [f"priority probe number {i} about a parcel" for i in range(40)])
    after = _threads(pid)
    assert after[pid][0] == 0, after  # the main thread, the event loop's, keeps its priority
    assert {nice for nice, _ in after.values()} <= {0, DEFAULT_NICE}, after
    spent = {0: 0, DEFAULT_NICE: 0}
    for tid, (nice, ticks) in after.items():
        spent[nice] += ticks - before.get(tid, (nice, 0))[1]
    # The model's runs (milliseconds each) outweigh the loop's work per request, so the
    # nicer threads, the runners and ONNX Runtime's pool, did most of the CPU work.
    assert spent[DEFAULT_NICE] > spent[0], spent
    if len(os.sched_getaffinity(0)) > 1:
        # The every-core session's pool threads were started on a nicer thread too.
        nicer = [tid for tid, (nice, _) in after.items() if nice == DEFAULT_NICE]
        assert len(nicer) >= 2, after
