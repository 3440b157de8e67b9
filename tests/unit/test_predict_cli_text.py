"""`hopline predict`'s text output. A gateway running with OTEL_SDK_DISABLED makes no trace
ids, and the command printed an empty `trace id` line, read as something lost (an
observability probe). The gateway is stood in for by its reply: the call itself is the mesh
tests' (tests/mesh/test_mesh_e2e.py)."""

from __future__ import annotations

from typing import Any

import pytest

from hopline.cli.main import main
from hopline.gateway import client
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2


def _reply(trace_id: str) -> gateway_pb2.PredictResponse:
    return gateway_pb2.PredictResponse(
        prediction=common_pb2.Prediction(label="password_reset", score=0.9),
        model="support-intents",
        model_version="1",
        tenant="default",
        trace_id=trace_id,
    )


@pytest.mark.parametrize(
    ("trace_id", "line"),
    [
        ("ab" * 16, "trace id     " + "ab" * 16),
        ("", "trace id     (none: the gateway runs with tracing off)"),
    ],
)
def test_the_trace_id_line(
    trace_id: str, line: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def answered(text: str, **_: Any) -> gateway_pb2.PredictResponse:
        return _reply(trace_id)

    monkeypatch.setattr(client, "predict", answered)
    assert main(["predict", "I forgot my password"]) == 0
    assert line in capsys.readouterr().out.splitlines()
