"""`hopline predict` where no gateway answers: the status, then where it looked, over what,
and how to start one (the mesh's own answers through the command are in test_mesh_e2e.py and
test_tenancy_e2e.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import DEFAULT_MODEL
from harness import Mesh
from hopline.runtime.ports import free_ports


def test_no_gateway_says_where_it_looked() -> None:
    address = f"127.0.0.1:{free_ports(1)[0]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOPLINE_TLS_")}
    done = subprocess.run(
        [sys.executable, "-m", "hopline", "predict", "where is my order", "--gateway", address],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.startswith("error: UNAVAILABLE: "), done.stderr
    assert f"no gateway answered at {address} over plaintext" in done.stderr, done.stderr
    assert "make run" in done.stderr


def test_a_gateway_that_answers_unavailable_is_not_called_missing(
    default_repo: Path, tmp_path: Path
) -> None:
    """With its inference gone the gateway answers UNAVAILABLE itself: the command said "no
    gateway answered at ... `make run` starts the mesh" all the same."""
    repo = tmp_path / "models"
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    mesh = Mesh(repo, tmp_path).start(("tokenizer", "inference", "postprocess", "gateway"))
    try:
        mesh.terminate("inference", timeout_s=30)
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOPLINE_TLS_")}
        done = subprocess.run(
            [sys.executable, "-m", "hopline", "predict", "where is my order", "--cache",
             "bypass", "--gateway", mesh.gateway],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )  # fmt: skip
    finally:
        mesh.stop()
    assert done.returncode == 1
    assert done.stderr.startswith("error: UNAVAILABLE: inference"), done.stderr
    assert "no gateway answered" not in done.stderr, done.stderr
