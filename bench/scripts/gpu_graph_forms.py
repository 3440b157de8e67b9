"""Which form of the encoder graph runs fastest on CUDA, at FP32 and FP16, and does it agree?

A MiniLM-L6 run on a GPU is kernel launches more than arithmetic (stop 32 on an H100: CUDA FP32
1.70 / 1.64 / 1.60 ms at batch 1 / 32 / 128), so the graph's node count is what a GPU build
can cut. This builds the default model once and derives each form from its unfused encoder:

    fp32_raw         the encoder as build_encoder_graph writes it
    fp32_session     GraphForm.REWRITTEN: what a CPU version runs
    fp32_fused_cpu   ORT's offline BERT fusions, use_gpu=False
    fp32_fused_gpu   GraphForm.FUSED (use_gpu=True): what a GPU version runs
    fp16_raw         convert_fp16(fp32_raw): the unfused graph in FP16, as `--precision fp16`
                     built it before GraphForm (the H100 run used the plain float16 converter)
    fp16_fused_gpu   fp32_fused_gpu converted by ORT's OnnxModel.convert_float_to_float16

and reports, per form: its node count; model compute on the first provider that runs
(CUDA where it loads), forms alternated call by call at each batch size; embeddings on the
reference sentences against CPU FP32 (cosine) and labels on the training texts.

Usage: python bench/scripts/gpu_graph_forms.py --work DIR [--reference minilm_reference.json]
       [--iterations 200] [--batches 1,32,128] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from hopline.model.build import (
    DEFAULT_MODEL_NAME,
    DEFAULT_TRAIN_FILE,
    HEAD_FILE,
    build_model,
    default_weights_dir,
    load_examples,
    load_sentences,
)
from hopline.model.encoder import (
    ClassifierHead,
    GraphForm,
    build_encoder_graph,
    fuse_transformer,
    optimize_graph,
)
from hopline.model.quantize import convert_fp16, cosines
from hopline.model.session import make_session, run_texts
from hopline.model.spin import Spin
from hopline.model.tokenizer import encode, load_tokenizer

OUTPUTS = ["sentence_embedding", "logits"]


def build_forms(raw: onnx.ModelProto, folder: Path) -> dict[str, Any]:
    makers: dict[str, Callable[[Path], None]] = {
        "fp32_raw": lambda p: onnx.save(raw, str(p)),
        "fp32_session": lambda p: optimize_graph(raw, p, GraphForm.REWRITTEN),
        "fp32_fused_cpu": lambda p: fuse_transformer(raw, p, use_gpu=False),
        "fp32_fused_gpu": lambda p: optimize_graph(raw, p, GraphForm.FUSED),
        "fp16_raw": lambda p: convert_fp16(raw, p),
        "fp16_fused_gpu": lambda p: convert_fp16(onnx.load(str(folder / "fp32_fused_gpu.onnx")), p),
    }
    forms: dict[str, Any] = {}
    for name, make in makers.items():
        path = folder / f"{name}.onnx"
        started = time.perf_counter()
        try:
            make(path)
            nodes = onnx.load(str(path), load_external_data=False).graph.node
            ops: dict[str, int] = {}
            for n in nodes:
                ops[n.op_type] = ops.get(n.op_type, 0) + 1
            forms[name] = {
                "path": str(path),
                "nodes": len(nodes),
                "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1])),
                "build_s": round(time.perf_counter() - started, 1),
            }
        except Exception as exc:  # a form that fails is a finding, not the end of the run
            forms[name] = {"error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
    return forms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--reference", type=Path)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--provider", default="cuda")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    repo = args.work / "repo"
    started = time.perf_counter()
    target = repo / DEFAULT_MODEL_NAME / "1"
    if not target.is_dir():
        build_model(DEFAULT_TRAIN_FILE, DEFAULT_MODEL_NAME, repo, version="1")
    doc: dict[str, Any] = {
        "onnxruntime": ort.__version__,
        "available": ort.get_available_providers(),
        "build_s": round(time.perf_counter() - started, 1),
    }
    head_graph = onnx.load(str(target / HEAD_FILE))
    init = {t.name: onnx.numpy_helper.to_array(t) for t in head_graph.graph.initializer}
    head = ClassifierHead(init["head.weight"], init["head.bias"])
    raw = build_encoder_graph(default_weights_dir(), head)
    folder = args.work / "forms"
    folder.mkdir(parents=True, exist_ok=True)
    forms = build_forms(raw, folder)
    doc["forms"] = forms

    tokenizer = load_tokenizer(target / "tokenizer.json", 128)
    texts = [text for text, _ in load_examples(DEFAULT_TRAIN_FILE)]
    reference = load_sentences(args.reference) if args.reference else texts[:38]
    cpu = make_session(Path(forms["fp32_session"]["path"]), providers=["cpu"])
    want_emb = run_texts(cpu, tokenizer, reference, ["sentence_embedding"])[0]
    want_labels = run_texts(cpu, tokenizer, texts, ["logits"])[0].argmax(axis=1)
    sessions: dict[str, ort.InferenceSession] = {}
    for name, form in forms.items():
        if "error" in form:
            continue
        try:
            session = make_session(Path(form["path"]), providers=[args.provider], spin=Spin.RUN)
            emb = run_texts(session, tokenizer, reference, ["sentence_embedding"])[0]
            labels = run_texts(session, tokenizer, texts, ["logits"])[0].argmax(axis=1)
        except Exception as exc:
            form["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            continue
        cos = cosines(want_emb, emb)
        form["runs_on"] = session.get_providers()
        form["cosine_to_cpu_fp32"] = {"mean": float(cos.mean()), "worst": float(cos.min())}
        form["labels_changed"] = int((labels != want_labels).sum())
        sessions[name] = session
    doc["compute"] = time_forms(sessions, tokenizer, texts, args)
    print(json.dumps({k: v for k, v in doc.items() if k != "compute"}, indent=1))
    for batch, rows in doc["compute"].items():
        for name, row in rows.items():
            p50, p99 = row["p50_ms"], row["p99_ms"]
            print(f"{batch:<10} {name:<16} p50 {p50:7.3f} ms  p99 {p99:7.3f} ms")
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1), encoding="utf-8")


def time_forms(
    sessions: dict[str, ort.InferenceSession],
    tokenizer: Any,
    texts: list[str],
    args: argparse.Namespace,
) -> dict[str, dict[str, dict[str, float]]]:
    """p50/p99 per form and batch size, forms alternated call by call on the same inputs."""
    rng = np.random.default_rng(0)
    out: dict[str, dict[str, dict[str, float]]] = {}
    names = list(sessions)
    for batch in [int(b) for b in args.batches.split(",")]:
        feeds = []
        for _ in range(args.iterations):
            enc = encode(tokenizer, [texts[i] for i in rng.choice(len(texts), batch)])
            feeds.append({"input_ids": enc.input_ids, "attention_mask": enc.attention_mask})
        for name in names:
            for feed in feeds[:5]:
                sessions[name].run(["logits"], feed)
        times: dict[str, list[float]] = {n: [] for n in names}
        for i, feed in enumerate(feeds):
            for name in names if i % 2 == 0 else reversed(names):
                t0 = time.perf_counter_ns()
                sessions[name].run(["logits"], feed)
                times[name].append((time.perf_counter_ns() - t0) / 1e6)
        out[f"batch_{batch}"] = {
            n: {"p50_ms": float(np.median(t)), "p99_ms": float(np.percentile(t, 99))}
            for n, t in times.items()
        }
    return out


if __name__ == "__main__":
    main()
