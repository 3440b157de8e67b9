"""ONNX Runtime writes nothing of its own into a service's log: its sessions log only FATAL.

At ERROR (log_severity_level 3) ONNX Runtime wrote a line of its own format to stderr for every
failed run, coloured with terminal escapes ("\\x1b[1;31m2026-12-07 ... [E:onnxruntime:,
sequential_executor.cc:677 ExecuteKernel] Non-zero status code returned while running Gather
node ... idx=26927 ...\\x1b[m"), amid the inference service's JSON lines: 380 such lines for 300
requests to a model version whose graph failed on real token ids (a logs probe). The same text
comes back as the run's exception, which the service reports itself (its status, and the
'model run failed' episode), so nothing is lost by silencing the runtime's copy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from hopline.model.session import make_session


def _gather_model(path: Path) -> Path:
    """A graph that fails at run time for an id past its 4-row table."""
    table = numpy_helper.from_array(np.ones((4, 2), dtype=np.float32), "table")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["out"], axis=0)],
        "gather",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["N", "S"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", "S", 2])],
        [table],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_a_failed_run_is_the_exception_alone_not_a_line_on_stderr(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    session = make_session(_gather_model(tmp_path / "gather.onnx"), threads=1)
    ok = session.run(None, {"input_ids": np.array([[1, 3]], dtype=np.int64)})
    assert np.asarray(ok[0]).shape == (1, 2, 2)
    capfd.readouterr()
    with pytest.raises(Exception, match="out of data bounds"):
        session.run(None, {"input_ids": np.array([[1, 26927]], dtype=np.int64)})
    assert capfd.readouterr().err == ""
