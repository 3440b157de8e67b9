"""A client built from the previous version of the protos still works against this gateway.

"Previous version" is the newest commit whose gateway or common proto differs from the current
files, found in git history (so the test needs a clone with history, as `make test`'s
`buf breaking` does). Its protos are compiled to Python stubs in a temporary folder and used
from a separate process, where they stand in for the current ones, as an old client would.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import grpc
import pytest

from conftest import ROOT
from harness import Mesh
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc

PROTOS = ("protos/hopline/common/v1/common.proto", "protos/hopline/gateway/v1/gateway.proto")
BUF = ROOT / ".tools/node_modules/.bin/buf"


def git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        pytest.fail(f"git {' '.join(args)} failed (a clone without history?): {out.stderr}")
    return out.stdout


def previous_version() -> str:
    """The newest commit whose client-facing protos differ from the working tree's."""
    current = [(ROOT / p).read_text() for p in PROTOS]
    for commit in git("log", "--format=%H", "--", *PROTOS).split():
        old = [git("show", f"{commit}:{p}") for p in PROTOS]
        if old != current:
            return commit
    pytest.fail("no earlier version of the gateway protos in this clone's history")


def test_a_client_built_from_the_previous_protos_still_works(mesh: Mesh, tmp_path: Path) -> None:
    commit = previous_version()
    protos, stubs = tmp_path / "protos", tmp_path / "stubs"
    for path in PROTOS:
        target = protos / Path(path).relative_to("protos")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(git("show", f"{commit}:{path}"))
    stubs.mkdir()
    generated = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{protos}", f"--python_out={stubs}"]
        + [f"--grpc_python_out={stubs}"]
        + [str(protos / Path(p).relative_to("protos")) for p in PROTOS],
        capture_output=True,
        text=True,
        check=False,
    )
    assert generated.returncode == 0, generated.stderr
    for package in ("hopline", "hopline/common", "hopline/common/v1", "hopline/gateway"):
        (stubs / package / "__init__.py").touch()
    (stubs / "hopline/gateway/v1/__init__.py").touch()

    # The schema check first: buf's FILE rules between that version and this one.
    breaking = subprocess.run(
        [str(BUF), "breaking", "--against", f"../.git#ref={commit},subdir=protos"],
        cwd=ROOT / "protos",
        capture_output=True,
        text=True,
        check=False,
    )
    assert breaking.returncode == 0, breaking.stdout + breaking.stderr

    text = f"I want a refund for my purchase {uuid.uuid4().hex[:8]}"
    client = textwrap.dedent(
        f"""
        import grpc
        from hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
        assert gateway_pb2.__file__.startswith({str(stubs)!r}), gateway_pb2.__file__
        with grpc.insecure_channel({mesh.gateway!r}) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            reply = stub.Predict(gateway_pb2.PredictRequest(text={text!r}), timeout=30)
        print(reply.prediction.label, reply.model, reply.trace_id)
        """
    )
    old = subprocess.run(
        [sys.executable, "-c", client],
        env={"PYTHONPATH": str(stubs), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert old.returncode == 0, old.stderr
    label, model, trace_id = old.stdout.split()
    with grpc.insecure_channel(mesh.gateway) as channel:
        now = gateway_pb2_grpc.GatewayServiceStub(channel).Predict(
            gateway_pb2.PredictRequest(text=text), timeout=30
        )
    assert (label, model) == (now.prediction.label, now.model)
    assert len(trace_id) == 32
