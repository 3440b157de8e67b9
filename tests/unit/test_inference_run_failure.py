"""A model run that fails answers a status that says whose fault it was, never UNKNOWN (what
grpc answers for an exception a servicer lets escape): services/inference/service.py."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import pytest
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

from conftest import DEFAULT_MODEL
from hopline.model.repository import load_config
from hopline.observability.logs import Episodes
from hopline.services.inference import service
from hopline.services.inference.service import _run_failure


def test_onnx_runtimes_invalid_argument_is_the_requests(default_repo: Path) -> None:
    cfg = load_config(default_repo / DEFAULT_MODEL / "1")
    code, details = _run_failure(cfg, InvalidArgument("indices element out of data bounds"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == (
        f"{DEFAULT_MODEL}/1 cannot run these inputs: indices element out of data bounds"
    )


def test_any_other_failure_is_the_services_and_logged_once_with_its_traceback(
    default_repo: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each request of a failed batch hears the failure; the log says it once (and not
    again for the next runs that fail the same way) with the traceback."""
    monkeypatch.setattr(
        service,
        "RUN_FAILURES",
        Episodes(logging.getLogger("hopline.inference"), "model run failed", level=logging.ERROR),
    )
    cfg = load_config(default_repo / DEFAULT_MODEL / "1")
    with caplog.at_level(logging.ERROR, logger="hopline.inference"):
        for _ in range(12):  # a batch of 12 rows
            code, details = _run_failure(cfg, MemoryError("out of device memory"))
    assert code == grpc.StatusCode.INTERNAL
    assert details == f"{DEFAULT_MODEL}/1's run failed: MemoryError: out of device memory"
    assert [r.getMessage() for r in caplog.records] == ["model run failed"]
    assert caplog.records[0].levelno == logging.ERROR
    assert caplog.records[0].exc_info is not None


def test_inputs_onnx_runtime_refuses_are_said_once_an_episode(
    default_repo: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ONNX Runtime's own lines silenced (tests/unit/test_ort_session_logs.py), a graph
    that fails on ids `_validate` passed (a logs probe's model version: every real text
    failed) would leave nothing in the log: one warning an episode, not one a row."""
    monkeypatch.setattr(
        service,
        "REFUSED_RUNS",
        Episodes(logging.getLogger("hopline.inference"), "model refused a run's inputs"),
        raising=False,  # the code before had none
    )
    cfg = load_config(default_repo / DEFAULT_MODEL / "1")
    with caplog.at_level(logging.WARNING, logger="hopline.inference"):
        for _ in range(12):
            code, _details = _run_failure(cfg, InvalidArgument("indices element out of bounds"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert [r.getMessage() for r in caplog.records] == ["model refused a run's inputs"]
    assert caplog.records[0].levelno == logging.WARNING
    assert caplog.records[0].__dict__["model"] == f"{DEFAULT_MODEL}/1"
