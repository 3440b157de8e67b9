"""CPU against CUDA (and TensorRT where its libraries load), FP32 against FP16 (and INT8):
`make bench`'s `gpu_providers` scenario on a machine whose ONNX Runtime runs CUDA, and
bench/scripts/gpu_providers.py anywhere.

It builds the default model as the README's commands do, into a scratch repository:

    version 1  FP32, providers ["cpu"]                    (what `make model` ships)
    version 2  FP32, providers ["cuda", "cpu"]            (`--providers cuda,cpu`: the fused graph)
    version 3  FP16, FP16's default providers             (`--precision fp16`: tensorrt, cuda, cpu;
                                                           its build check runs on what loads)
    version 4  INT8, CPU                                  (int8=True)

then reports:
- what each version asked for and what its session runs (a provider that cannot load falls
  back, with hopline's one log line);
- each version's answers against version 1's on the same texts: embedding cosine on the check
  sentences (the sentence-transformers reference file) and labels changed on the training
  texts;
- model compute alone (bench/compute.py: the inference service's backend, versions
  alternated call by call) at each batch size;
- with a mesh: the miss path through a co-located mesh on free ports (`hopline bench --models`
  over every version, in-process baseline beside it, rounds alternated), at each concurrency.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from hopline.bench.compute import compare_compute
from hopline.bench.report import model_ratios
from hopline.model.build import (
    DEFAULT_MODEL_NAME,
    DEFAULT_TRAIN_FILE,
    build_model,
    load_examples,
    load_sentences,
)
from hopline.model.providers import Provider, capi_folder, unloadable
from hopline.model.quantize import Precision, cosines
from hopline.model.repository import SENTENCE_EMBEDDING, ModelConfig, ModelRepository
from hopline.model.session import make_session, run_texts
from hopline.model.spin import Spin
from hopline.model.tokenizer import load_tokenizer


def gpu_name() -> str:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi failed: {exc}"
    return done.stdout.strip() or done.stderr.strip()


def build_versions(repo: Path, reference: Path | None, int8: bool) -> dict[str, float]:
    """The scratch repository's versions; seconds each build took."""
    took: dict[str, float] = {}
    name = DEFAULT_MODEL_NAME
    cuda: list[Any] = [{"name": "cuda", "device_id": 0}, "cpu"]
    builds: list[tuple[str, Precision, list[Any] | None]] = [
        ("1", Precision.FP32, None),
        ("2", Precision.FP32, cuda),
        ("3", Precision.FP16, None),
    ]
    for version, precision, providers in builds + ([("4", Precision.INT8, None)] if int8 else []):
        started = time.perf_counter()
        build_model(
            DEFAULT_TRAIN_FILE,
            name,
            repo,
            version=version,
            precision=precision,
            providers=providers,
            check_sentences=reference,
        )
        took[f"{name}/{version} ({precision.value})"] = time.perf_counter() - started
    return took


def agreement(
    configs: list[ModelConfig], texts: list[str], sentences: list[str]
) -> dict[str, dict[str, Any]]:
    """Each version against the first (FP32 on CPU): cosine and labels on the same texts."""
    tokenizer = load_tokenizer(configs[0].file("tokenizer"), configs[0].max_sequence_length)
    out: dict[str, dict[str, Any]] = {}
    base: tuple[np.ndarray, np.ndarray] | None = None
    for cfg in configs:
        session = make_session(cfg.file("model"), providers=cfg.providers)
        emb, logits = run_texts(
            session, tokenizer, sentences + texts, [SENTENCE_EMBEDDING, "logits"]
        )
        sent, labels = emb[: len(sentences)], logits[len(sentences) :].argmax(axis=1)
        row: dict[str, Any] = {
            "precision": cfg.precision.value,
            "asked": [p.provider.value for p in cfg.providers],
            "runs": session.get_providers(),
        }
        if base is None:
            base = (sent, labels)
        else:
            cos = cosines(sent, base[0])
            row |= {
                "cosine_mean": round(float(cos.mean()), 5),
                "cosine_min": round(float(cos.min()), 5),
                "labels_changed": int((labels != base[1]).sum()),
                "texts": len(texts),
                "sentences": len(sentences),
            }
        out[cfg.key] = row
    return out


def through_mesh(
    repo: Path, work: Path, versions: list[str], concurrency: list[int], duration_s: float
) -> dict[str, Any]:
    """`hopline bench --mix miss` over every version through one co-located mesh."""
    from hopline.bench.cli import bench_once
    from hopline.runtime.launcher import Mesh

    (work / "mesh").mkdir(parents=True, exist_ok=True)
    mesh = Mesh.on_free_ports(repo, work / "mesh")
    mesh.start(timeout_s=300.0)
    models = ",".join(f"{DEFAULT_MODEL_NAME}:{v}" for v in versions)
    out: dict[str, Any] = {}
    try:
        for c in concurrency:
            out[f"c{c}"] = bench_once(
                "--target", mesh.addrs["gateway"], "--model-repo", str(repo),
                "--models", models, "--baseline", "inprocess", "--mix", "miss",
                "--concurrency", str(c), "--rounds", "2", "--duration", str(duration_s),
                "--compute-iterations", "50",
            )  # fmt: skip
    finally:
        mesh.stop()
    return out


def cuda_unavailable() -> str:
    """Why this process cannot run the CUDA provider ("" when it can)."""
    if Provider.CUDA.value not in ort.get_available_providers():
        return f"no CUDA in this ONNX Runtime ({', '.join(ort.get_available_providers())})"
    return unloadable(Provider.CUDA, capi_folder())


def providers_scenario(
    work: Path,
    reference: Path | None,
    *,
    int8: bool = False,
    batches: Sequence[int] = (1, 32, 128),
    iterations: int = 200,
    concurrency: Sequence[int] = (),
    duration_s: float = 4.0,
) -> dict[str, Any]:
    """Every step above; `concurrency` empty: no mesh."""
    env = {
        "onnxruntime": ort.__version__,
        "available_providers": ort.get_available_providers(),
        "device": ort.get_device(),
        "gpu": gpu_name(),
    }
    repo = work / "models"
    shutil.rmtree(repo, ignore_errors=True)
    builds = build_versions(repo, reference, int8)
    models = ModelRepository(repo)
    versions = ["1", "2", "3"] + (["4"] if int8 else [])
    configs = [models.resolve(DEFAULT_MODEL_NAME, v) for v in versions]
    texts = [t for t, _ in load_examples(DEFAULT_TRAIN_FILE)]
    sentences = load_sentences(reference) if reference else texts[:64]
    doc: dict[str, Any] = {
        "environment": env,
        "builds_s": builds,
        "precision_checks": {c.key: c.build.get("precision_check", {}) for c in configs},
        "agreement": agreement(configs, texts, sentences),
        "compute": compare_compute(
            configs, texts, batches=list(batches), iterations=iterations, threads=0, spin=Spin.OFF
        ),
    }
    if concurrency:
        mesh = through_mesh(repo, work, versions, list(concurrency), duration_s)
        doc["mesh"] = mesh
        # `make bench`'s tables: each mesh run's targets, named by concurrency.
        doc["targets"] = {f"c{c} {n}": t for c, r in mesh.items() for n, t in r["targets"].items()}
        doc["ratios"] = {
            f"{c} {k}": v
            for c, r in mesh.items()
            for k, v in model_ratios(r["targets"], r.get("compute")).items()
        }
    return doc


def providers_targets(sc: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 16's mesh target for each version that runs on a GPU: through the mesh, the miss
    path's p50 (c=1) drops by at least the model's own saving at batch 1 (measured in the
    same `hopline bench` run, against CPU FP32)."""
    doc = sc.get("gpu_providers", {})
    run = doc.get("mesh", {}).get("c1")
    if not run:
        return []
    ratios = model_ratios(run["targets"], run.get("compute"))
    rows = []
    for key, row in doc["agreement"].items():
        if row["runs"][0] == Provider.CPU.value:
            continue
        name, _, version = key.partition("/")
        mesh = ratios.get(f"mesh@{name}:{version}_p50_saving_ms")
        model = ratios.get(f"compute {key} ({row['precision']}) batch_1 saving_ms")
        if mesh is None or model is None:
            continue
        rows.append(
            {
                "target": f"{key} ({row['precision']} on {row['runs'][0]}): mesh miss c=1 "
                "p50 saving >= the model's batch-1 saving",
                "value": mesh,
                "limit": model,
                "met": mesh >= model,
                "how": "ms",
            }
        )
    return rows
