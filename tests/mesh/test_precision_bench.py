"""`hopline bench --models A,B`: every model-bearing target once per model version, windows
alternated over rounds, and each model's compute alone; the JSON scripts compare them from.

The second version is a copy of the first (published as test_new_model_version.py does): this
is about the bench's plumbing; the FP32 vs INT8 figures come from bench/scripts/precision_ab.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import DEFAULT_MODEL
from harness import Mesh


def test_bench_measures_each_model_version_in_one_run(mesh: Mesh, tmp_path: Path) -> None:
    staging = mesh.repo / DEFAULT_MODEL / ".staging-bench-2"
    if not (mesh.repo / DEFAULT_MODEL / "2").exists():
        shutil.copytree(mesh.repo / DEFAULT_MODEL / "1", staging)
        config = json.loads((staging / "config.json").read_text())
        config["version"] = "2"
        (staging / "config.json").write_text(json.dumps(config))
        staging.rename(mesh.repo / DEFAULT_MODEL / "2")
    a, b = f"{DEFAULT_MODEL}:1", f"{DEFAULT_MODEL}:2"
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "hopline", "bench", "--target", mesh.gateway,
         "--concurrency", "1", "--duration", "0.5", "--warmup", "0.2", "--mix", "miss",
         "--baseline", "echo,inprocess", "--model-repo", str(mesh.repo), "--models", f"{a},{b}",
         "--rounds", "2", "--compute-batches", "1,4", "--compute-iterations", "6",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    doc = json.loads(out.read_text())
    assert list(doc["targets"]) == [
        "echo",
        f"inprocess@{a}",
        f"inprocess@{b}",
        f"mesh@{a}",
        f"mesh@{b}",
    ]
    # Two rounds of each target, pooled: the measuring order shows both rounds ran.
    order = [line.split()[1] for line in run.stderr.splitlines() if line.startswith("measuring")]
    assert order.count(f"mesh@{b}") == 2
    for name, target in doc["targets"].items():
        assert target["errors"] == 0, (name, target["errors_by_status"])
        assert target["requests"] > 0
    assert doc["targets"][f"mesh@{b}"]["hops_ms"]["inference.compute"]["p50"] > 0
    for key in (f"mesh@{b}_p50_over_first_model", f"inprocess@{b}_p50_over_first_model"):
        assert doc["ratios"][key] > 0
    # Each target's saving is set beside what the model saved inside the same requests (the
    # in-process targets time their runs too); the two versions are copies here, so only its
    # presence is asserted, not its sign.
    assert f"mesh@{b}_inference_compute_saving_ms" in doc["ratios"]
    assert f"inprocess@{b}_inference_compute_saving_ms" in doc["ratios"]
    # Run as the inference service runs them: its thread and spin settings, from the env.
    assert doc["compute"]["spin"] == "run"
    models = doc["compute"]["models"]
    assert list(models) == [f"{DEFAULT_MODEL}/1 (fp32)", f"{DEFAULT_MODEL}/2 (fp32)"]
    for by_batch in models.values():
        assert set(by_batch) == {"batch_1", "batch_4"}
        for v in by_batch.values():
            assert 0 < v["p50_ms"] <= v["p99_ms"]
    assert models[f"{DEFAULT_MODEL}/1 (fp32)"]["batch_1"]["speedup_over_first"] == 1.0
    assert "model compute alone" in run.stdout
