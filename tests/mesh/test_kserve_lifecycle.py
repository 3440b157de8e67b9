"""The KServe v2 front door's readiness over a gateway's life: live but not ready while it
starts, not ready while it drains (tritonclient against real processes)."""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

import tritonclient.grpc as triton
from triton_calls import rejection, text_input
from tritonclient.utils import InferenceServerException

from conftest import DEFAULT_MODEL
from harness import Mesh


def test_live_but_not_ready_while_the_gateway_starts(default_repo: Path, tmp_path: Path) -> None:
    """A gateway whose inference service never answers stays not-ready, yet is live."""
    alone = Mesh(default_repo, tmp_path)
    alone.spawn(("gateway",))
    try:
        c = triton.InferenceServerClient(url=alone.gateway)
        deadline = time.monotonic() + 60
        while True:
            try:
                assert c.is_server_live(client_timeout=2) is True
                break
            except InferenceServerException:
                assert alone.procs["gateway"].poll() is None, alone.log("gateway")
                assert time.monotonic() < deadline, alone.log("gateway")
                time.sleep(0.2)
        assert c.is_server_ready() is False
        status, message = rejection(c.infer, DEFAULT_MODEL, [text_input(["hi"])])
        assert status == "StatusCode.UNAVAILABLE"
        assert "not ready" in message
        c.close()
    finally:
        alone.stop()


def test_not_ready_while_the_gateway_drains(default_repo: Path, tmp_path: Path) -> None:
    """SIGTERM: ServerReady and ModelReady turn false with health, while the gateway still
    answers calls for its drain delay; then it exits 0."""
    repo = tmp_path / "models"
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    mesh = Mesh(repo, tmp_path, HOPLINE_DRAIN_DELAY_S="3.0")
    mesh.start()
    c = triton.InferenceServerClient(url=mesh.gateway)
    try:
        assert c.is_server_ready() is True
        assert c.is_model_ready(DEFAULT_MODEL) is True
        gateway = mesh.procs["gateway"]
        gateway.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 2.0
        while c.is_server_ready() is True:
            assert time.monotonic() < deadline, mesh.log("gateway")
            time.sleep(0.05)
        assert c.is_server_live() is True
        assert c.is_model_ready(DEFAULT_MODEL) is False
        # Still in the delay: a call is answered, not refused.
        answer = c.infer(DEFAULT_MODEL, [text_input(["please cancel my subscription"])])
        assert answer.as_numpy("label") is not None
        assert gateway.wait(timeout=30) == 0, mesh.log("gateway")
    finally:
        c.close()
        mesh.stop()
