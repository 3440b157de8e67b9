"""ONNX Runtime's telemetry is off in every hopline process: its library reads
ORT_DISABLE_TELEMETRY, and hopline's package sets it (where unset) before onnxruntime loads.
A deploy probe counted DNS queries for Microsoft's telemetry host from `hopline serve
inference` (2 in 10 s) and the cache (4), none with the variable set."""

from __future__ import annotations

import os
from pathlib import Path

import onnxruntime

import hopline


def test_onnx_runtime_telemetry_is_off_where_the_operator_did_not_say() -> None:
    assert hopline.__version__
    assert os.environ.get("ORT_DISABLE_TELEMETRY") == "1"
    # The variable is the one this ONNX Runtime reads (a rename would leave it on unsaid).
    library = next(Path(onnxruntime.__file__).parent.glob("capi/onnxruntime_pybind11_state*.so"))
    assert b"ORT_DISABLE_TELEMETRY" in library.read_bytes()
