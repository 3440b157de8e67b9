"""CPU against CUDA (and TensorRT where its libraries load), FP32 against FP16, on a GPU machine.

Run where the `gpu` extra is installed (onnxruntime-gpu; tensorrt for the TensorRT provider).
It builds the default model as the README's commands do, into a scratch repository:

    version 1  FP32, providers ["cpu"]                    (what `make model` ships)
    version 2  FP32, providers ["cuda", "cpu"]            (version 1's files, config re-pointed)
    version 3  FP16, FP16's default providers             (`--precision fp16`: tensorrt, cuda, cpu;
                                                           its build check runs on what loads)
    version 4  INT8, CPU                                  (with --int8)

then reports, in one JSON document and a table:
- what each version asked for and what its session runs (a provider that cannot load falls
  back, with hopline's one log line);
- each version's answers against version 1's on the same texts: embedding cosine on the check
  sentences (the sentence-transformers reference file) and labels changed on the training
  texts;
- model compute alone (bench/compute.py: the inference service's backend, versions
  alternated call by call) at batch 1, 32 and 128;
- with --mesh: the miss path through a co-located mesh on free ports (`hopline bench --models`
  over every version, in-process baseline beside it, rounds alternated), at each --concurrency.

Usage: python bench/scripts/gpu_providers.py --work DIR --reference minilm_reference.json
       [--iterations 200] [--int8] [--mesh] [--concurrency 1,32] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from hopline.bench.compute import compare_compute, compute_table
from hopline.bench.report import model_ratios
from hopline.model.build import (
    DEFAULT_MODEL_NAME,
    DEFAULT_TRAIN_FILE,
    build_model,
    load_examples,
    load_sentences,
)
from hopline.model.quantize import Precision, cosines
from hopline.model.repository import ModelConfig, ModelRepository
from hopline.model.session import Spin, make_session, run_texts
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


def build_versions(repo: Path, reference: Path, int8: bool) -> dict[str, float]:
    """The scratch repository's versions; seconds each build took."""
    took: dict[str, float] = {}
    name = DEFAULT_MODEL_NAME
    for version, precision in [("1", Precision.FP32), ("3", Precision.FP16)] + (
        [("4", Precision.INT8)] if int8 else []
    ):
        started = time.perf_counter()
        build_model(
            DEFAULT_TRAIN_FILE,
            name,
            repo,
            version=version,
            precision=precision,
            check_sentences=reference,
        )
        took[f"{name}/{version} ({precision.value})"] = time.perf_counter() - started
    cuda = repo / name / "2"
    shutil.copytree(repo / name / "1", cuda)
    config = json.loads((cuda / "config.json").read_text(encoding="utf-8"))
    config["version"] = "2"
    config["providers"] = [{"name": "cuda", "device_id": 0}, "cpu"]
    (cuda / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
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
            session, tokenizer, sentences + texts, ["sentence_embedding", "logits"]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--reference", type=Path, required=True)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--int8", action="store_true")
    parser.add_argument("--mesh", action="store_true")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    env = {
        "onnxruntime": ort.__version__,
        "available_providers": ort.get_available_providers(),
        "device": ort.get_device(),
        "gpu": gpu_name(),
    }
    print(json.dumps(env), flush=True)
    repo = args.work / "models"
    shutil.rmtree(repo, ignore_errors=True)
    builds = build_versions(repo, args.reference, args.int8)
    print("builds (s):", json.dumps(builds), flush=True)

    models = ModelRepository(repo)
    versions = ["1", "2", "3"] + (["4"] if args.int8 else [])
    configs = [models.resolve(DEFAULT_MODEL_NAME, v) for v in versions]
    checks = {c.key: c.build.get("precision_check", {}) for c in configs}
    texts = [t for t, _ in load_examples(DEFAULT_TRAIN_FILE)]
    agree = agreement(configs, texts, load_sentences(args.reference))
    print(json.dumps(agree, indent=1), flush=True)

    compute = compare_compute(
        configs,
        texts,
        batches=[int(b) for b in args.batches.split(",")],
        iterations=args.iterations,
        threads=0,
        spin=Spin.OFF,
    )
    print(compute_table(compute), flush=True)
    doc: dict[str, Any] = {
        "environment": env,
        "builds_s": builds,
        "precision_checks": checks,
        "agreement": agree,
        "compute": compute,
    }
    if args.out:  # kept if the mesh part fails
        args.out.write_text(json.dumps(doc, indent=1), encoding="utf-8")
    if args.mesh:
        concurrency = [int(c) for c in args.concurrency.split(",")]
        doc["mesh"] = through_mesh(repo, args.work, versions, concurrency, args.duration)
        for c, result in doc["mesh"].items():
            for name, t in result["targets"].items():
                print(
                    f"{c} {name:<32} p50 {t['p50_ms']:.2f} p99 {t['p99_ms']:.2f} ms "
                    f"{t['throughput_rps']:.1f} rps errors {t['errors']}",
                    flush=True,
                )
            ratios = model_ratios(result["targets"], result.get("compute"))
            print(c, json.dumps(ratios, indent=1), flush=True)
        if args.out:
            args.out.write_text(json.dumps(doc, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
