"""CLINC150: a model built with `hopline model build --train` on the train split, then the
4500 in-scope test queries sent through a running gateway."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from conftest import CLINC
from hopline.common.v1 import common_pb2
from hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from mesh import Mesh

pytestmark = pytest.mark.slow


async def _classify(target: str, texts: list[str], concurrency: int = 16) -> list[str]:
    labels = [""] * len(texts)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        queue = list(enumerate(texts))

        async def worker() -> None:
            while queue:
                i, text = queue.pop()
                reply = await stub.Predict(
                    gateway_pb2.PredictRequest(
                        text=text, model="clinc150", cache_mode=common_pb2.CACHE_MODE_BYPASS
                    ),
                    timeout=60,
                )
                labels[i] = reply.prediction.label

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return labels


def test_clinc150_accuracy_through_the_gateway(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if not CLINC.is_file():
        pytest.skip(f"CLINC150 not found at {CLINC} (../shared/data is absent)")
    repo = tmp_path / "models"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "hopline",
            "model",
            "build",
            "--train",
            str(CLINC),
            "--split",
            "train",
            "--name",
            "clinc150",
            "--repo",
            str(repo),
            # CLINC150 is judged on in-scope queries only: let the calibrated out-of-scope
            # threshold reject at most 1% of held-out in-scope texts (the default is 2%).
            "--reject-rate",
            "0.01",
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
        env=dict(os.environ),
    )
    assert build.returncode == 0, build.stderr
    test = json.loads(CLINC.read_text(encoding="utf-8"))["test"]
    assert len(test) == 4500
    mesh = Mesh(repo, tmp_path, HOPLINE_DEFAULT_MODEL="clinc150").start()
    try:
        predicted = asyncio.run(_classify(mesh.gateway, [t for t, _ in test]))
    finally:
        mesh.stop()
    accuracy = sum(p == gold for p, (_, gold) in zip(predicted, test, strict=True)) / len(test)
    with capsys.disabled():  # the figure belongs in CI's log
        print(
            f"\nCLINC150 in-scope test accuracy through the gateway: {accuracy:.4f} "
            f"({len(test)} queries; out_of_scope answers count as wrong)"
        )
    assert accuracy >= 0.93
