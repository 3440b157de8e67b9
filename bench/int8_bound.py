"""How fast INT8 can be on this CPU at all: the bound its GEMMs put on INT8's speed-up.

Issue 16 asks INT8 model compute for 1.6x over FP32 at batch 1 and 32. What an INT8 build can
reach is bounded by two things this module measures on the machine it runs on, with the
inference service's thread count:

1. **The integer GEMM kernel against the FP32 one.** For every weight MatMul of the FP32
   version (its [K, N] initializer, M = batch x padded length), ONNX Runtime's `MatMulInteger`
   on uint8 activations x int8 weights (the kernel an INT8 version's `DynamicQuantizeMatMul`
   runs; MLAS picks kernels by signedness, not values) against FP32 `MatMul`, alternated call
   by call, summed over the model's weight GEMMs. Quantizing the activations is left out:
   free quantization is what makes this a bound.
2. **How much of the FP32 run those GEMMs are.** ONNX Runtime's profiler on the FP32 version
   (its optimised graph, the same texts): kernel time of the GEMM operators (`MatMul`,
   `FusedMatMul`, `Gemm`, the attention's activation products included) against everything
   else (GELU, layer norms, softmax, transposes, adds), which INT8 does not make faster.

The bound is Amdahl's: 1 / (gemm_share / kernel_speedup + (1 - gemm_share)), what INT8's
GEMMs can give with the rest of the run as it is. On an x86 CPU without VNNI (AVX2:
`vpmaddubsw` into int16, then widening) the integer kernel is far from 4x the FP32 one, and
the bound says whether a target is out of reach of quantized GEMMs on ONNX Runtime's kernels
there, rather than of this project's build. It is a bound for large batches, where the GEMMs
are the run; at batch 1 a run is as much per-operator overhead as arithmetic, and an INT8
version's graph has fewer operators (Q, K and V merged into one GEMM, model/merge.py), so its
measured speed-up can pass the bound there.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from hopline.bench.compute import batch_feeds
from hopline.model.repository import ModelConfig
from hopline.model.session import session_options
from hopline.model.spin import Spin
from hopline.model.tokenizer import load_tokenizer

# Operators whose time INT8 quantization can shorten (products of matrices).
GEMM_OPS = frozenset({"MatMul", "FusedMatMul", "Gemm", "MatMulInteger", "DynamicQuantizeMatMul"})
OPSETS = [helper.make_opsetid("", 17)]
WARM_RUNS = 3  # runs of each session before any is counted


def weight_gemms(model_path: Path) -> Counter[tuple[int, int]]:
    """The [K, N] of every MatMul whose second input is a 2-D initializer, with its count."""
    model = onnx.load(str(model_path), load_external_data=False)
    shapes = {init.name: tuple(init.dims) for init in model.graph.initializer}
    found: Counter[tuple[int, int]] = Counter()
    for node in model.graph.node:
        if node.op_type == "MatMul" and len(shapes.get(node.input[1], ())) == 2:
            k, n = shapes[node.input[1]]
            found[(k, n)] += 1
    return found


def amdahl(gemm_share: float, kernel_speedup: float) -> float:
    """The whole run's speed-up when only its GEMM share gets `kernel_speedup` faster."""
    return 1.0 / (gemm_share / kernel_speedup + (1.0 - gemm_share))


def _session(
    model: onnx.ModelProto | Path, threads: int, spin: Spin, **options: Any
) -> ort.InferenceSession:
    """A CPU session with the inference service's thread setting (a session left spinning
    after its run would slow the next one's: the two are timed turn by turn)."""
    so = session_options(threads, spin)
    for name, value in options.items():
        setattr(so, name, value)
    source = str(model) if isinstance(model, Path) else model.SerializeToString()
    return ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])


def _gemm_pair(
    m: int, k: int, n: int, threads: int, spin: Spin
) -> tuple[
    tuple[ort.InferenceSession, dict[str, Any]], tuple[ort.InferenceSession, dict[str, Any]]
]:
    """One-node FP32 MatMul and uint8 x int8 MatMulInteger sessions of shape [m, k] x [k, n]."""
    rng = np.random.default_rng(k * 7919 + n)
    weights = rng.standard_normal((k, n)).astype(np.float32)
    fp32 = helper.make_model(
        helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"])],
            "fp32",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
            [numpy_helper.from_array(weights, "w")],
        ),
        opset_imports=OPSETS,
    )
    quantized = np.clip(np.round(weights * 20), -64, 64).astype(np.int8)
    int8 = helper.make_model(
        helper.make_graph(
            [helper.make_node("MatMulInteger", ["a", "w", "az", "wz"], ["y"])],
            "int8",
            [helper.make_tensor_value_info("a", TensorProto.UINT8, [m, k])],
            [helper.make_tensor_value_info("y", TensorProto.INT32, [m, n])],
            [
                numpy_helper.from_array(quantized, "w"),
                numpy_helper.from_array(np.array(128, np.uint8), "az"),
                numpy_helper.from_array(np.zeros(n, np.int8), "wz"),
            ],
        ),
        opset_imports=OPSETS,
    )
    x = rng.standard_normal((m, k)).astype(np.float32)
    a = rng.integers(0, 256, (m, k), dtype=np.uint8)
    return (_session(fp32, threads, spin), {"x": x}), (_session(int8, threads, spin), {"a": a})


def kernel_speedup(
    gemms: Counter[tuple[int, int]], m: int, threads: int, spin: Spin, iterations: int
) -> dict[str, Any]:
    """FP32 against integer GEMM time over the model's weight GEMMs at M = m, alternated."""
    fp32_ms = int8_ms = 0.0
    shapes = {}
    for (k, n), count in sorted(gemms.items()):
        pair = _gemm_pair(m, k, n, threads, spin)
        times: list[list[float]] = [[], []]
        for i in range(iterations + WARM_RUNS):
            for which in (0, 1) if i % 2 == 0 else (1, 0):
                session, feed = pair[which]
                started = time.perf_counter()
                session.run(None, feed)
                if i >= WARM_RUNS:  # the first runs of a shape allocate
                    times[which].append((time.perf_counter() - started) * 1e3)
        f, q = float(np.median(times[0])), float(np.median(times[1]))
        shapes[f"{m}x{k}x{n}"] = {"count": count, "fp32_ms": f, "int8_ms": q, "speedup": f / q}
        fp32_ms += count * f
        int8_ms += count * q
    return {"shapes": shapes, "fp32_ms": fp32_ms, "int8_ms": int8_ms, "speedup": fp32_ms / int8_ms}


def gemm_share(
    model_path: Path, feeds: Sequence[dict[str, Any]], threads: int, spin: Spin
) -> dict[str, Any]:
    """ONNX Runtime's profile of the FP32 version over `feeds`: kernel time per operator
    type, and the GEMM operators' share of it."""
    by_op: Counter[str] = Counter()
    with tempfile.TemporaryDirectory(prefix="hopline-ort-profile-") as tmp:
        session = _session(
            model_path,
            threads,
            spin,
            enable_profiling=True,
            profile_file_prefix=str(Path(tmp) / "profile"),
        )
        for feed in [*feeds[:WARM_RUNS], *feeds]:
            session.run(["logits"], feed)
        events = json.loads(Path(session.end_profiling()).read_text())
    # The profile covers the session's whole life: count only the runs after the warm ones
    # (a shape's first runs allocate).
    starts = sorted(e["ts"] for e in events if e.get("name") == "model_run")
    for event in _kernel_events(events):
        if event["ts"] >= starts[WARM_RUNS]:
            by_op[event["args"]["op_name"]] += event["dur"]
    total = sum(by_op.values())
    gemm = sum(us for op, us in by_op.items() if op in GEMM_OPS)
    per_run = len(feeds)
    return {
        "kernel_ms_per_run": total / per_run / 1e3,
        "gemm_ms_per_run": gemm / per_run / 1e3,
        "gemm_share": gemm / total,
        "by_op_ms_per_run": {op: us / per_run / 1e3 for op, us in by_op.most_common()},
    }


def _kernel_events(events: Iterable[dict[str, Any]]) -> Iterable[dict[str, Any]]:
    for event in events:
        if event.get("cat") == "Node" and str(event.get("name", "")).endswith("_kernel_time"):
            yield event


def int8_bound(
    fp32: ModelConfig,
    texts: Sequence[str],
    *,
    threads: int,
    spin: Spin,
    batches: Sequence[int] = (1, 32),
    iterations: int = 30,
    measured: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Per batch size: the GEMM share of FP32's run, the integer kernel's speed-up on the
    model's GEMM shapes, and the INT8 speed-up they bound (beside `measured`, the INT8
    version's measured speed-up by batch key, where given)."""
    model_path = fp32.file("model")
    gemms = weight_gemms(model_path)
    tokenizer = load_tokenizer(fp32.file("tokenizer"), fp32.max_sequence_length)
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {
        "threads": threads,
        "spin": spin.value,
        "weight_gemms": sum(gemms.values()),
    }
    for batch in batches:
        feeds = batch_feeds(tokenizer, texts, batch, iterations, rng)
        m = batch * int(np.median([f["input_ids"].shape[1] for f in feeds]))
        profile = gemm_share(model_path, feeds, threads, spin)
        kernel = kernel_speedup(gemms, m, threads, spin, iterations)
        row = {
            "m": m,
            "gemm_share": profile["gemm_share"],
            "kernel_speedup": kernel["speedup"],
            "bound": amdahl(profile["gemm_share"], kernel["speedup"]),
            "profile": profile,
            "kernel": kernel,
        }
        if measured and f"batch_{batch}" in measured:
            row["measured"] = measured[f"batch_{batch}"]
        out[f"batch_{batch}"] = row
    return out


def bound_ratios(result: dict[str, Any]) -> dict[str, float]:
    """The report's figures, per batch size."""
    out: dict[str, float] = {}
    for key, row in result.items():
        if key.startswith("batch_"):
            out[f"int8 {key} bound from its gemms"] = row["bound"]
            out[f"int8 {key} integer gemm speedup"] = row["kernel_speedup"]
            out[f"fp32 {key} gemm share"] = row["gemm_share"]
    return out
