"""FP32 against INT8 in one run (`make bench`'s `precision_ab`, bench/scripts/precision_ab.py).

The default model's FP32 version 1 is copied into a scratch repository and its INT8 version
built beside it (`hopline model build --default --precision int8 --version 2`: checked against
FP32 before it is published); a mesh of its own on free ports serves both. Then `hopline bench
--models support-intents:1,support-intents:2` with rounds: model compute alone at batch 1 and
32, in-process and through the mesh on the miss path (cache USE, every text new), the two
versions' windows alternating so a busy neighbour slows both alike. Model compute is measured
twice: with the inference service's thread setting (HOPLINE_INFERENCE_SPIN, `run` by
default: threads spin briefly within a run) and with the other of sleeping and spinning,
because at batch 1 waking the second thread for each operator costs INT8 much of its lead.
Last, the bound this CPU puts on INT8 (bench/int8_bound.py): the integer GEMM
kernel's speed-up on the model's GEMM shapes and the GEMMs' share of the FP32 run.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from hopline.bench.cli import bench_once
from hopline.bench.compute import compare_compute
from hopline.bench.int8_bound import bound_ratios, int8_bound
from hopline.bench.mixes import make_mix
from hopline.bench.report import model_ratios
from hopline.model.repository import ModelRepository
from hopline.model.run_width import cores
from hopline.model.spin import Spin
from hopline.runtime import config as cfg
from hopline.runtime.launcher import Mesh
from hopline.services.inference.service import InferenceConfig

MODEL = "support-intents"


def scratch_repo(source: Path, work: Path) -> Path:
    """`source`'s FP32 version 1 and an INT8 version 2 built from the same texts."""
    repo = work / "models"
    if not (repo / MODEL / "2").is_dir():
        shutil.rmtree(repo, ignore_errors=True)
        shutil.copytree(source / MODEL / "1", repo / MODEL / "1")
        subprocess.run(
            [sys.executable, "-m", "hopline", "model", "build", "--default", "--precision",
             "int8", "--repo", str(repo), "--version", "2"],
            check=True,
        )  # fmt: skip
    return repo


def precision_scenario(
    source: Path, work: Path, *, rounds: int = 3, duration_s: float = 8.0, iterations: int = 200
) -> dict[str, Any]:
    repo = scratch_repo(source, work)
    (work / "mesh").mkdir(parents=True, exist_ok=True)
    mesh = Mesh.on_free_ports(repo, work / "mesh")
    mesh.start(timeout_s=180.0)
    try:
        result = bench_once(
            "--target", mesh.addrs["gateway"], "--model-repo", str(repo),
            "--models", f"{MODEL}:1,{MODEL}:2", "--baseline", "inprocess", "--mix", "miss",
            "--concurrency", "1", "--rounds", str(rounds), "--duration", str(duration_s),
            "--compute-iterations", str(iterations),
        )  # fmt: skip
    finally:
        mesh.stop()
    service = cfg.load(InferenceConfig, [])
    other = _other_spin(service.spin)
    contrast = _compute_with(repo, iterations, other)
    bound = int8_bound(
        ModelRepository(repo).resolve(MODEL, "1"),
        _texts(),
        # A run alone gets every core unless the service is told otherwise (backend.py).
        threads=service.threads or cores(),
        spin=service.spin,
        measured=_speedups(result.get("compute")),
    )
    return {
        **result,
        f"compute_spin_{other}": contrast,
        "int8_bound": bound,
        "ratios": {
            **model_ratios(result["targets"], result.get("compute")),
            **{f"{k} (spin {other})": v for k, v in model_ratios({}, contrast).items()},
            **bound_ratios(bound),
        },
    }


def _texts() -> list[str]:
    mix = make_mix("miss", None)
    return [mix.text(i) for i in range(512)]


def _speedups(compute: dict[str, Any] | None) -> dict[str, float]:
    """The second model's (INT8's) compute speed-up over the first's, by batch key."""
    if not compute:
        return {}
    by_batch = list(compute["models"].values())[-1]
    return {batch: v["speedup_over_first"] for batch, v in by_batch.items()}


def _other_spin(spin: Spin) -> Spin:
    """The thread setting the compute rows are contrasted with: sleeping against spinning
    within a run (stops before 35 ran sleeping by default, so both stay comparable)."""
    return Spin.OFF if spin is not Spin.OFF else Spin.RUN


def _compute_with(repo: Path, iterations: int, spin: Spin) -> dict[str, Any]:
    models = ModelRepository(repo)
    return compare_compute(
        [models.resolve(MODEL, "1"), models.resolve(MODEL, "2")],
        _texts(),
        iterations=iterations,
        threads=cfg.load(InferenceConfig, []).threads,
        spin=spin,
    )
