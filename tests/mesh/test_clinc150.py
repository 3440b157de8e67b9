"""CLINC150: a model built with `hopline model build --train` on the train split, then the
4500 in-scope test queries sent through a running gateway."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from conftest import CLINC
from harness import Mesh
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc

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


# The threshold `hopline cache calibrate --target-false-hit-rate 0.01` (90% confidence, 5-fold
# cross-validated) chose on CLINC150 train/val pairs labelled by this model's answers
# (`hopline cache pairs --model clinc150`, stores at the semantic default min_score 0.3), with
# the code of issue 14. The eval checks it on test.
CACHE_THRESHOLD = "0.8537"
VERIFY_TARGET = 0.01  # the verified model's wrong-hit target (share of semantic hits)


@pytest.fixture(scope="module")
def clinc_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    if not CLINC.is_file():
        pytest.skip(f"CLINC150 not found at {CLINC} (../shared/data is absent)")
    work = tmp_path_factory.mktemp("clinc")
    repo = work / "models"
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
            "--cache-mode",
            "semantic",
            "--cache-threshold",
            CACHE_THRESHOLD,
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
        env=dict(os.environ),
    )
    assert build.returncode == 0, build.stderr
    _verified_copy(repo, "clinc150", "clinc150-verified")
    mesh = Mesh(
        repo, work, HOPLINE_DEFAULT_MODEL="clinc150", HOPLINE_CACHE_BUDGET_MS="2000"
    ).start()
    try:
        yield mesh
    finally:
        mesh.stop()


def _verified_copy(repo: Path, name: str, copy: str) -> None:
    """The same model under another name, its cache policy verified (docs/cache.md)."""
    version = repo / copy / "1"
    shutil.copytree(repo / name / "1", version)
    config = json.loads((version / "config.json").read_text())
    config["name"] = copy
    config["cache"].update(verify_target=VERIFY_TARGET, verify_confidence=0.9)
    (version / "config.json").write_text(json.dumps(config, indent=2))


def test_clinc150_accuracy_through_the_gateway(
    clinc_mesh: Mesh, capsys: pytest.CaptureFixture[str]
) -> None:
    test = json.loads(CLINC.read_text(encoding="utf-8"))["test"]
    assert len(test) == 4500
    predicted = asyncio.run(_classify(clinc_mesh.gateway, [t for t, _ in test]))
    accuracy = sum(p == gold for p, (_, gold) in zip(predicted, test, strict=True)) / len(test)
    with capsys.disabled():  # the figure belongs in CI's log
        print(
            f"\nCLINC150 in-scope test accuracy through the gateway: {accuracy:.4f} "
            f"({len(test)} queries; out_of_scope answers count as wrong)"
        )
    assert accuracy >= 0.93


def test_cache_eval_on_a_clinc150_subset(
    clinc_mesh: Mesh, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hopline cache eval` as a user runs it, static and verified modes in one run, on 15 of
    the 150 intents to fit CI's time; the full run's figures are in docs/cache.md."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hopline",
            "cache",
            "eval",
            "--clinc",
            str(CLINC),
            "--model",
            "clinc150",
            "--verified-model",
            "clinc150-verified",
            "--model-repo",
            str(clinc_mesh.repo),
            "--max-intents",
            "15",
            "--exact-repeats",
            "40",
            "--out",
            str(tmp_path),
        ],
        env=dict(
            os.environ,
            HOPLINE_GATEWAY_ADDR=clinc_mesh.gateway,
            HOPLINE_CACHE_ADDR=clinc_mesh.addrs["cache"],
        ),
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "cache-eval.json").read_text())
    assert (tmp_path / "cache-eval.md").read_text() in out.stdout
    with capsys.disabled():
        print("\n" + out.stdout)
    assert report["threshold"] == pytest.approx(float(CACHE_THRESHOLD))
    config = json.loads((clinc_mesh.repo / "clinc150" / "1" / "config.json").read_text())
    assert config["cache"]["min_score"] == 0.3  # the build's default for a semantic cache
    assert report["queries"] == 15 * 30 + report["oos_queries"]
    assert report["hit_rate_by_tier"]["fail_open"] == 0
    assert report["hits_from_warmup"] > 0
    assert report["hit_rate"] > 0.1
    # A small sample: allow 3% here; the full run must show <= 1%.
    assert report["cache_induced_error_rate"] <= 0.03
    assert report["oos_false_hit_rate"] <= 0.05
    lat = report["latency"]
    assert lat["cache_lookup_hop"]["semantic"]["n"] > 0
    assert lat["model_only_end_to_end"]["n"] == report["queries"]
    # Stored misses sent again are exact hits, timed apart from the hit rate.
    assert lat["exact_repeats"]["sent"] == 40
    assert lat["exact_repeats"]["exact"] == 40
    assert lat["exact_repeats"]["cache_lookup_hop"]["n"] == 40
    # The verified pass: the same texts, each candidate decided by the learned rule, the
    # model's answers reported back (before the reply for candidates it did not trust yet,
    # after it for a share of the served ones).
    verified = report["verified"]
    assert verified["queries"] == report["queries"]
    assert verified["hit_rate_by_tier"]["fail_open"] == 0
    assert verified["hit_rate"] > 0.1
    assert verified["cache_induced_error_rate"] <= 0.03
    check = verified["verification"]
    assert check["target"] == pytest.approx(VERIFY_TARGET)
    assert check["warm_up"]["candidates"] > 0
    assert check["warm_up"]["verified"] > 0
    assert check["queries"]["candidates"] > 0
    assert 0 < check["queries"]["verified_after_reply"] < verified["queries"]
    assert check["rule"]["observations"] > 0
    assert "Static threshold against verified hits" in out.stdout
