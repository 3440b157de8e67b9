"""Model precisions: the FP32 graph converted to INT8 or FP16, and the check every converted
build must pass against FP32 before it is published.

INT8 is ONNX Runtime's dynamic quantization: weights of every MatMul/Gemm with a constant
weight quantized per output channel ahead of time, activations per tensor at run time, on a
graph first rewritten to keep MiniLM's outlier channels (hopline.model.outliers: plain
dynamic INT8 below left "" and "?" at cosine 0.9685; with the rewrites every reference
sentence is above 0.99).
Measured against static QDQ calibrated on the training texts (support-intents, the 38
reference sentences, 2 shared cores at load ~2; bench/scripts/int8_methods.py repeats it):

    method                               cosine to FP32 mean / min    speed-up b1 / b32
    dynamic, per channel                 0.9917 / 0.9685              2.2x / 2.0x
    the same after the outlier rewrites  0.9980 / 0.9916              1.6x / 1.9x  (shipped)
    dynamic, per tensor                  0.9540 / 0.8656              2.2x / 2.2x
    static QDQ u8/s8, per tensor         0.9038 / 0.7600              1.9x / 2.2x
    static QDQ u8/s8, per channel        0.9301 / 0.8048 (MinMax), 0.9371 / 0.8011 (Percentile)
    static QDQ s8/s8, per channel        0.8355 / 0.6895              0.4x / 0.8x

The shipped build then merges each layer's Q, K and V projections into one MatMul
(hopline.model.merge): the same figures, and in later alternated runs batch 1 went from 1.5x
to 1.6x FP32 (batch 32: 2.3x either way).

Static scales are fixed from calibration, and MiniLM's activations have a few outlier
channels that a fixed per-tensor scale cannot cover; dynamic scales follow each batch.

The figures above came from a CPU with VNNI and plain 8-bit weights. A stop on an AMD EPYC
(Zen 3, AVX2, no VNNI) found that build broken there: ONNX Runtime's u8s8 kernel on such
CPUs multiplies with vpmaddubsw, which adds each pair of u8 x s8 products along K into a
saturating int16, and 255 x 127 x 2 overflows it (cosine 0.9450 mean / 0.8921 worst, 16
held-out flips; VNNI's vpdpbusd adds in int32 and never saturates). A same-sign pair whose
magnitudes sum to at most 128 fits, so each channel's weights are requantized at the finest
scale that keeps every such pair within 128 (hopline.model.int8_kernels.pair_safe_int8):
the model computes the same on every x86 CPU, and its check holds wherever it is served. On
that AVX2 CPU (one build each; speed from 600 / 60 alternated runs at batch 1 / 32):

    weights                          cosine mean / worst    held-out flips   speed-up b1 / b32
    int8, 8-bit                      0.9450 / 0.8921        16               1.39x / 1.33x
    int8, 7-bit (every channel)      0.9968 / 0.9852        3                1.40x / 1.32x
    int8, pair-safe (shipped)        0.9978 / 0.9910        2                same kernels
    uint8, 8-bit (u8u8 kernels)      0.9980 / 0.9918        1 (smoothing 0.6) 1.36x / 1.13x

Pair-safe and 7-bit weights run the same kernels as 8-bit ones, so a VNNI CPU keeps its
speed-up; u8u8 gives the accuracy back too but runs slower kernels on both kinds of CPU. The
worst sentences are the shortest ("?" and ""), whose pooling averages two or three tokens;
keeping any one layer or projection in FP32 lifted "?" by at most 0.007 with 7-bit weights.

FP16 (ONNX Runtime's transformer model converter, inputs and outputs kept FP32) is for
accelerators: on the CPU provider ONNX Runtime inserts casts to FP32 around the kernels it lacks
in FP16, so the check runs here but its speed means nothing here. A GPU version converts the
fused graph (model/encoder.py:GraphForm).

Imported by every service through the repository (for `Precision`): ONNX and ONNX Runtime
are imported inside the functions that convert.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from hopline.model.int8_kernels import PAIR_LIMIT, pair_safe_int8
from hopline.model.limits import CheckLimits

if TYPE_CHECKING:
    import onnx

__all__ = ["CheckLimits", "Precision", "PrecisionCheck", "PrecisionCheckError", "convert"]

log = logging.getLogger("hopline.model.quantize")

F32 = npt.NDArray[np.float32]
Feed = Mapping[str, npt.NDArray[np.int64]]  # one encoded batch: input_ids, attention_mask


class Precision(enum.StrEnum):
    FP32 = "fp32"
    INT8 = "int8"
    FP16 = "fp16"


class PrecisionCheckError(RuntimeError):
    """A converted build that strays too far from FP32: refused, never published."""


def quantize_int8(model: onnx.ModelProto, out_path: Path, calibration: Iterable[Feed]) -> None:
    """Dynamic INT8 after the graph is rewritten to keep its outlier channels
    (hopline.model.outliers, ranges from `calibration`) and each layer's Q, K and V
    projections are merged into one (hopline.model.merge)."""
    from hopline.model.merge import merge_sibling_projections
    from hopline.model.outliers import prepare_for_int8

    rewritten, fp32_nodes = prepare_for_int8(model, calibration)
    # Merged after the rewrites, which find the value projection by its own MatMul and bias.
    merged, _ = merge_sibling_projections(rewritten)
    quantize_dynamic_int8(merged, out_path, keep_fp32=fp32_nodes)


def quantize_dynamic_int8(
    model: onnx.ModelProto, out_path: Path, keep_fp32: Sequence[str] = ()
) -> None:
    """ONNX Runtime's dynamic INT8 on constant-weight MatMuls, except the nodes named in
    `keep_fp32`, with each weight then requantized per channel by
    `hopline.model.int8_kernels.pair_safe_int8` (module doc: no int16 saturation on CPUs
    without VNNI). Alone (no rewrite) this is the plain INT8 the rewrites beat."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    weights = {init.name for init in model.graph.initializer}
    # Activation x activation products (attention scores, context) stay FP32: both sides change
    # per request, so there is no weight to quantize ahead of time.
    activation_only = [
        n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] not in weights
    ]
    # The quantizer logs a line per tensor it leaves alone on the root logger, and warns that
    # it was not given its pre-processing (symbolic shape inference, which needs sympy).
    logging.disable(logging.WARNING)
    try:
        quantize_dynamic(
            model,
            out_path,
            weight_type=QuantType.QInt8,
            op_types_to_quantize=["MatMul"],
            nodes_to_exclude=activation_only + list(keep_fp32),
            per_channel=True,
            # 7 bits: safe everywhere, and what a weight keeps if requantizing misses it.
            reduce_range=True,
        )
    finally:
        logging.disable(logging.NOTSET)
    _requantize_pair_safe(out_path, model)


def _requantize_pair_safe(path: Path, source: onnx.ModelProto) -> None:
    """Each MatMulInteger's int8 weight and its per-channel scale, recomputed from the FP32
    weight the quantizer read (`source`) with `pair_safe_int8`."""
    import onnx
    from onnx import numpy_helper

    quantized = onnx.load(str(path))
    fp32 = {init.name: init for init in source.graph.initializer}
    stored = {init.name: init for init in quantized.graph.initializer}
    for node in quantized.graph.node:
        if node.op_type != "MatMulInteger" or node.input[1] not in stored:
            continue
        name = node.input[1].removesuffix("_quantized")
        scale = stored.get(f"{name}_scale")
        q_init = stored[node.input[1]]
        w = None
        if scale is not None:
            dequantized = numpy_helper.to_array(q_init).astype(np.float32) * (
                numpy_helper.to_array(scale).astype(np.float32).reshape(1, -1)
            )
            w = _source_weight(fp32, name, dequantized)
        if w is None or scale is None:
            raise ValueError(f"cannot requantize {node.input[1]}: its FP32 weight is not found")
        q, scales = pair_safe_int8(w)
        q_init.CopyFrom(numpy_helper.from_array(q, q_init.name))
        scale.CopyFrom(numpy_helper.from_array(scales, scale.name))
    onnx.save(quantized, str(path))


def _source_weight(fp32: Mapping[str, onnx.TensorProto], name: str, quantized: F32) -> F32 | None:
    """The FP32 weight that `quantized` (dequantized, the quantizer's layout) came from. The
    quantizer stores a Gemm's transB weight transposed: under a `_Transposed` name (ONNX
    Runtime 1.32) or under its own name (1.30). So the layout is the one closer to what the
    quantizer stored, which also tells a square weight from its transpose."""
    from onnx import numpy_helper

    original = name.removesuffix("_Transposed")
    if original not in fp32:
        return None
    w = numpy_helper.to_array(fp32[original]).astype(np.float32)
    layouts = [c for c in (w, w.T) if c.shape == quantized.shape]
    if not layouts:
        return None
    best = min(layouts, key=lambda c: float(np.abs(c - quantized).max()))
    return np.ascontiguousarray(best)


def convert_fp16(model: onnx.ModelProto, out_path: Path) -> None:
    """FP16 weights and compute; the graph's inputs and outputs keep their FP32/INT64 types so
    callers and the cache see the same tensors at every precision. Through OnnxModel, whose
    converter infers every tensor's type first: the plain one left a fused graph's Max with
    one FP32 input, which ONNX Runtime 1.30's CUDA build refused to load (stop 32)."""
    import onnx
    from onnxruntime.transformers.onnx_model import OnnxModel

    converted = OnnxModel(onnx.ModelProto.FromString(model.SerializeToString()))
    converted.convert_float_to_float16(keep_io_types=True)
    converted.save_model_to_file(str(out_path))


# What each conversion stores, written into the version's config beside its check figures.
FORMATS = {
    Precision.INT8: (
        "weights int8 per output channel, each channel's scale the finest at which no two "
        f"same-sign neighbours along K sum past {PAIR_LIMIT} (no int16 saturation on CPUs "
        "without VNNI); activations uint8 per tensor, scaled at run time"
    ),
    Precision.FP16: "weights and compute float16; inputs and outputs float32",
}


def convert(
    model: onnx.ModelProto, precision: Precision, out_path: Path, calibration: Iterable[Feed] = ()
) -> None:
    """`calibration` (encoded texts in FP32's domain) is what INT8 sets its rewrites from."""
    if precision is Precision.INT8:
        quantize_int8(model, out_path, calibration)
    elif precision is Precision.FP16:
        convert_fp16(model, out_path)
    else:
        raise ValueError(f"{precision} is the reference, not a conversion")


@dataclasses.dataclass(frozen=True)
class PrecisionCheck:
    precision: Precision
    heldout_label_agreement: float  # cross-validated heads, FP32 vs candidate embeddings
    heldout_labels_changed: int
    heldout_accuracy_fp32: float  # against the true labels
    heldout_accuracy: float
    train_label_agreement: float  # the shipped head, FP32 graph vs candidate graph
    train_labels_changed: int
    texts: int
    cosine_mean: float  # the check sentences
    cosine_min: float
    cosine_worst_text: str
    sentences: int
    sentences_source: str
    train_cosine_mean: float
    train_cosine_min: float

    def failures(self, limits: CheckLimits) -> list[str]:
        out = []
        for what, got, limit in (
            ("held-out label agreement", self.heldout_label_agreement, limits.min_label_agreement),
            # The shipped head on the texts it was trained on: far from its boundaries.
            ("training-text label agreement", self.train_label_agreement, 0.99),
        ):
            if got < limit:
                out.append(f"{what} {got:.4f} < {limit}")
        drop = self.heldout_accuracy_fp32 - self.heldout_accuracy
        if drop > limits.max_accuracy_drop:
            out.append(
                f"held-out accuracy {self.heldout_accuracy:.4f} is {drop:.4f} below FP32's "
                f"{self.heldout_accuracy_fp32:.4f} (limit {limits.max_accuracy_drop})"
            )
        if self.cosine_mean < limits.min_cosine_mean:
            out.append(f"mean embedding cosine {self.cosine_mean:.4f} < {limits.min_cosine_mean}")
        if self.cosine_min < limits.min_cosine:
            out.append(
                f"embedding cosine {self.cosine_min:.4f} < {limits.min_cosine} for "
                f"{self.cosine_worst_text[:60]!r}"
            )
        return out

    def to_json(self, limits: CheckLimits) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        doc["precision"] = self.precision.value
        for key, value in doc.items():
            if isinstance(value, float):
                doc[key] = round(value, 5)
        doc["limits"] = dataclasses.asdict(limits)
        return doc


def cosines(a: F32, b: F32) -> F32:
    num = (a * b).sum(axis=1)
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    out: F32 = (num / np.maximum(den, 1e-12)).astype(np.float32)
    return out


@dataclasses.dataclass(frozen=True)
class Outputs:
    """One graph's answers on the check's texts."""

    train_embeddings: F32
    train_labels: npt.NDArray[np.int64]
    sentence_embeddings: F32


def compare(
    precision: Precision,
    reference: Outputs,
    candidate: Outputs,
    heldout: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]],
    truth: npt.NDArray[np.int64],
    sentences: Sequence[str],
    sentences_source: str,
) -> PrecisionCheck:
    """The candidate's answers against FP32's; `heldout` is (FP32, candidate) held-out labels."""
    sent_cos = cosines(candidate.sentence_embeddings, reference.sentence_embeddings)
    train_cos = cosines(candidate.train_embeddings, reference.train_embeddings)
    worst = int(sent_cos.argmin())
    held_changed = int((heldout[0] != heldout[1]).sum())
    train_changed = int((candidate.train_labels != reference.train_labels).sum())
    n = len(reference.train_labels)
    return PrecisionCheck(
        precision=precision,
        heldout_label_agreement=1.0 - held_changed / n,
        heldout_labels_changed=held_changed,
        heldout_accuracy_fp32=float((heldout[0] == truth).mean()),
        heldout_accuracy=float((heldout[1] == truth).mean()),
        train_label_agreement=1.0 - train_changed / n,
        train_labels_changed=train_changed,
        texts=n,
        cosine_mean=float(sent_cos.mean()),
        cosine_min=float(sent_cos[worst]),
        cosine_worst_text=sentences[worst][:80],
        sentences=len(sentences),
        sentences_source=sentences_source,
        train_cosine_mean=float(train_cos.mean()),
        train_cosine_min=float(train_cos.min()),
    )
