"""all-MiniLM-L6-v2 as an ONNX graph built straight from model.safetensors, without torch.

The graph is written node by node in the shape a PyTorch BERT export has, so ONNX Runtime's
transformer fusions recognise it (Attention, SkipLayerNormalization, BiasGelu, ...). Pooling,
L2 normalisation and an optional linear head live in the same graph, so a service needs one
session run per batch and no numpy post-processing.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import load_file

from hopline.model.providers import Provider, ProviderSpec
from hopline.model.repository import SENTENCE_EMBEDDING

OPSET = 17
IR_VERSION = 8  # the IR that goes with opset 17; older runtimes refuse newer IR numbers
MASK_BIAS = -10000.0  # the additive mask value of the original BERT export
META_HEADS = "hopline.num_attention_heads"
META_HIDDEN = "hopline.hidden_size"
ENCODER_NAME = "all-MiniLM-L6-v2"


@dataclass(frozen=True)
class ClassifierHead:
    """A linear layer on the normalised embedding, baked into the graph as `logits`."""

    weight: npt.NDArray[np.float32]  # [num_classes, hidden]
    bias: npt.NDArray[np.float32]  # [num_classes]


class _Graph:
    """Collects nodes and initialisers so each layer reads like the maths it implements."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def _name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def const(self, value: npt.ArrayLike, hint: str, dtype: Any = np.float32) -> str:
        name = self._name(hint)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, *inputs: str, hint: str = "", **attrs: Any) -> str:
        out = self._name(hint or op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def linear(
        self, x: str, w: npt.NDArray[np.float32], b: npt.NDArray[np.float32], hint: str
    ) -> str:
        """MatMul then Add with the bias, as torch exports nn.Linear (the fusions expect it)."""
        mm = self.op("MatMul", x, self.const(w.T, f"{hint}.weight"), hint=f"{hint}.matmul")
        return self.op("Add", self.const(b, f"{hint}.bias"), mm, hint=f"{hint}.add")


def _load_weights(model_dir: Path) -> dict[str, npt.NDArray[np.float32]]:
    """Strip whatever prefix (`bert.`, `0.auto_model.`) the checkpoint puts before the names."""
    raw = load_file(str(model_dir / "model.safetensors"))
    anchor = "embeddings.word_embeddings.weight"
    prefix = next((k[: -len(anchor)] for k in raw if k.endswith(anchor)), None)
    if prefix is None:
        raise ValueError(f"{model_dir}: no {anchor} in model.safetensors")
    return {
        k[len(prefix) :]: np.asarray(v, dtype=np.float32)
        for k, v in raw.items()
        if k.startswith(prefix) and v.dtype.kind == "f"
    }


def build_encoder_graph(model_dir: Path, head: ClassifierHead | None = None) -> onnx.ModelProto:
    """Pooling and normalisation run inside the graph, matching sentence-transformers, so every
    caller gets the same unit-length embedding (and head logits) from one session run."""
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}: only exact gelu is built")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim, eps = hidden // heads, float(cfg.get("layer_norm_eps", 1e-12))
    w = _load_weights(model_dir)
    g = _Graph()

    def layer_norm(x: str, name: str) -> str:
        scale, bias = g.const(w[f"{name}.weight"], name), g.const(w[f"{name}.bias"], name)
        return g.op("LayerNormalization", x, scale, bias, hint=name, axis=-1, epsilon=eps)

    # Embeddings. Single sentences only ever use token type 0, so that row is folded into the
    # position table. Position ids follow the export pattern ORT's embedding fusion looks for.
    i64 = np.int64
    ids_shape = g.op("Shape", "input_ids")
    seq_len = g.op("Gather", ids_shape, g.const(1, "one", i64), axis=0)
    positions = g.op("Range", g.const(0, "zero", i64), seq_len, g.const(1, "one", i64))
    positions = g.op("Unsqueeze", positions, g.const([0], "axes0", i64))
    positions = g.op("Expand", positions, g.op("Shape", "input_ids"))
    pos_table = w["embeddings.position_embeddings.weight"]
    pos_table = pos_table + w["embeddings.token_type_embeddings.weight"][0]
    words = g.op("Gather", g.const(w["embeddings.word_embeddings.weight"], "word_emb"), "input_ids")
    pos = g.op("Gather", g.const(pos_table, "pos_type0_emb"), positions)
    x = layer_norm(g.op("Add", words, pos), "embeddings.LayerNorm")

    # Additive attention bias [batch, 1, 1, seq]: 0 where attended, MASK_BIAS where padded.
    mask = g.op("Unsqueeze", "attention_mask", g.const([1], "axes1", i64))
    mask = g.op("Cast", g.op("Unsqueeze", mask, g.const([2], "axes2", i64)), to=TensorProto.FLOAT)
    mask_bias = g.op(
        "Mul", g.op("Sub", g.const(1.0, "one_f"), mask), g.const(MASK_BIAS, "mask_value")
    )

    split_heads = g.const([0, 0, heads, head_dim], "split_heads", i64)
    merge_heads = g.const([0, 0, hidden], "merge_heads", i64)
    scale = g.const(math.sqrt(head_dim), "sqrt_head_dim")
    for n in range(int(cfg["num_hidden_layers"])):
        p = f"encoder.layer.{n}"

        def project(which: str, perm: list[int], x: str = x, p: str = p) -> str:
            name = f"{p}.attention.self.{which}"
            y = g.linear(x, w[f"{name}.weight"], w[f"{name}.bias"], name)
            return g.op("Transpose", g.op("Reshape", y, split_heads), perm=perm)

        q, k = project("query", [0, 2, 1, 3]), project("key", [0, 2, 3, 1])
        v = project("value", [0, 2, 1, 3])
        scores = g.op("Add", g.op("Div", g.op("MatMul", q, k), scale), mask_bias)
        ctx = g.op("MatMul", g.op("Softmax", scores, axis=-1), v)
        ctx = g.op("Reshape", g.op("Transpose", ctx, perm=[0, 2, 1, 3]), merge_heads)
        o = f"{p}.attention.output"
        attn = g.linear(ctx, w[f"{o}.dense.weight"], w[f"{o}.dense.bias"], f"{o}.dense")
        x = layer_norm(g.op("Add", attn, x), f"{o}.LayerNorm")

        i = f"{p}.intermediate.dense"
        h = g.linear(x, w[f"{i}.weight"], w[f"{i}.bias"], i)
        erf = g.op("Erf", g.op("Div", h, g.const(math.sqrt(2.0), "sqrt2")))
        h = g.op(
            "Mul", g.op("Mul", h, g.op("Add", erf, g.const(1.0, "one_f"))), g.const(0.5, "half")
        )
        out = f"{p}.output"
        h = g.linear(h, w[f"{out}.dense.weight"], w[f"{out}.dense.bias"], f"{out}.dense")
        x = layer_norm(g.op("Add", h, x), f"{out}.LayerNorm")

    # Mean pooling over real tokens, then x / max(|x|, 1e-12) like torch's F.normalize.
    token_w = g.op(
        "Unsqueeze",
        g.op("Cast", "attention_mask", to=TensorProto.FLOAT),
        g.const([2], "axes2", i64),
    )
    axis1 = g.const([1], "axes1", i64)
    summed = g.op("ReduceSum", g.op("Mul", x, token_w), axis1, keepdims=0)
    count = g.op("Clip", g.op("ReduceSum", token_w, axis1, keepdims=0), g.const(1e-9, "min_count"))
    mean = g.op("Div", summed, count)
    norm = g.op("Sqrt", g.op("ReduceSumSquare", mean, axes=[1], keepdims=1))
    norm = g.op("Max", norm, g.const(1e-12, "min_norm"))
    g.nodes.append(helper.make_node("Div", [mean, norm], [SENTENCE_EMBEDDING], name="l2_normalise"))

    batch_seq = ["batch", "sequence"]
    outputs = [
        helper.make_tensor_value_info(SENTENCE_EMBEDDING, TensorProto.FLOAT, ["batch", hidden])
    ]
    if head is not None:
        weight = np.asarray(head.weight, dtype=np.float32)
        bias = np.asarray(head.bias, dtype=np.float32)
        if weight.ndim != 2 or weight.shape[1] != hidden or bias.shape != (weight.shape[0],):
            raise ValueError(
                f"head must be [C, {hidden}] and [C], got {weight.shape}, {bias.shape}"
            )
        head_w, head_b = g.const(weight, "head.weight"), g.const(bias, "head.bias")
        g.nodes.append(
            helper.make_node(
                "Gemm", [SENTENCE_EMBEDDING, head_w, head_b], ["logits"], name="head", transB=1
            )
        )
        outputs.append(
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", weight.shape[0]])
        )
    graph = helper.make_graph(
        g.nodes,
        ENCODER_NAME,
        [
            helper.make_tensor_value_info(n, TensorProto.INT64, batch_seq)
            for n in ("input_ids", "attention_mask")
        ],
        outputs,
        g.inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="hopline.model.encoder"
    )
    model.ir_version = IR_VERSION
    helper.set_model_props(model, {META_HEADS: str(heads), META_HIDDEN: str(hidden)})
    onnx.checker.check_model(model)
    return model


class GraphForm(enum.StrEnum):
    """How a version's encoder graph is optimised before it is saved: by where it runs.

    Measured on an H100 (ONNX Runtime 1.31.1 CUDA, support-intents, forms alternated call by
    call; bench/results/2026-11-26-h100-graph-forms.json): a MiniLM run on a GPU is kernel
    launches more than arithmetic, so fewer nodes is faster at every batch size. FP32 p50 at
    batch 1 / 32 / 128: rewritten 1.39 / 1.67 / 1.88 ms, fused 0.86 / 0.99 / 1.23 ms; FP16
    converted from the unfused graph 1.28 / 1.69 / 1.68 ms, from the fused one 0.77 / 1.01 /
    1.00 ms. On this project's 2-core CPU (the service's spinning threads, alternated, two
    runs) the fused graph is faster at batch 1 and slower from batch 16 on: 2 threads b1
    4.13 -> 3.85 and 4.48 -> 4.02 ms, b32 114.4 -> 117.6 and 114.0 -> 115.7 ms; 1 thread (the
    side-by-side sessions under load) b1 6.25 -> 6.12, b16 92.5 -> 97.1, b32 195.6 -> 210.7 ms.
    Load is where the CPU is short, so CPU versions keep the rewritten form."""

    REWRITTEN = "rewritten"  # ORT's extended rewrites from a CPU session: 194 nodes
    FUSED = "fused"  # ORT's offline BERT fusions into its own contrib ops: 64 nodes


def graph_form(providers: Sequence[ProviderSpec]) -> GraphForm:
    """FUSED when the version asks for a GPU first. TensorRT's ONNX parser does not take ORT's
    contrib ops, so under TensorRT those nodes would run on CUDA beside its engines: not
    measured, since TensorRT's libraries are out of reach of every machine this was built on."""
    first = providers[0].provider if providers else Provider.CPU
    return GraphForm.FUSED if first in (Provider.CUDA, Provider.TENSORRT) else GraphForm.REWRITTEN


def fuse_transformer(model: onnx.ModelProto, out_path: Path, *, use_gpu: bool = True) -> None:
    """ORT's offline BERT fusions (Attention, SkipLayerNormalization, EmbedLayerNormalization,
    BiasGelu): 64 nodes where the rewritten graph has 194. `use_gpu` picks ORT's GPU variants
    of some fusions; for this model both give the same 64 nodes and times on an H100."""
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    props = {p.key: p.value for p in model.metadata_props}
    options = FusionOptions("bert")
    # A raw 2-D mask keeps any padding layout correct; the default mask index assumes right padding.
    options.use_raw_attention_mask(True)
    quiet = logging.getLogger("onnxruntime.transformers.optimizer")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # it warns that the producer is not "pytorch"
    try:
        # opt_level=0: Python fusions only. ORT's own passes here would import torch and could
        # save CPU-specific layouts; the serving session applies them when it loads the file.
        fused = optimize_model(
            onnx.ModelProto.FromString(model.SerializeToString()),  # it edits its input in place
            model_type="bert",
            num_heads=int(props.get(META_HEADS, 0)),
            hidden_size=int(props.get(META_HIDDEN, 0)),
            optimization_options=options,
            opt_level=0,
            use_gpu=use_gpu,
        )
    finally:
        quiet.setLevel(level)
    fused.save_model_to_file(str(out_path))


def _optimise_with_session(model: onnx.ModelProto, out_path: Path) -> None:
    """ORT's extended rewrites saved from a throwaway session. Extended, not all: the `all`
    level adds layout transforms chosen for this machine's CPU."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "model.onnx"
        onnx.save(model, str(src))
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = str(out_path)
        options.log_severity_level = 3
        ort.InferenceSession(str(src), options, providers=["CPUExecutionProvider"])
    # ORT stamps every domain it knows (training, nchwc, aten...); keep only those in use.
    saved = onnx.load(str(out_path))
    used = {n.domain for n in saved.graph.node} | {""}
    kept = [o for o in saved.opset_import if o.domain in used]
    del saved.opset_import[:]
    saved.opset_import.extend(kept)
    onnx.save(saved, str(out_path))


def _run(model: str | bytes, feed: dict[str, npt.NDArray[np.int64]]) -> list[Any]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    outputs: list[Any] = session.run(None, feed)
    return outputs


def optimize_graph(
    model: onnx.ModelProto, out_path: Path, form: GraphForm = GraphForm.REWRITTEN
) -> None:
    """Save the graph in `form`. A padded probe batch must agree with the unoptimised graph,
    so a bad rewrite fails the build rather than the first request."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    ids = np.array([[101, 7592, 2088, 102, 0, 0], [101, 2023, 2003, 1037, 3231, 102]], np.int64)
    feed = {"input_ids": ids, "attention_mask": (ids != 0).astype(np.int64)}
    want = _run(model.SerializeToString(), feed)
    if form is GraphForm.FUSED:
        fuse_transformer(model, out_path)
    else:
        _optimise_with_session(model, out_path)
    got = _run(str(out_path), feed)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(want, got, strict=True))
    if worst > 1e-4:
        out_path.unlink(missing_ok=True)
        raise RuntimeError(f"{form.value} encoder disagrees with the unoptimised one by {worst}")


def encoder_identity(digest: str) -> str:
    """Names the vector space of this builder's unit-length embeddings for weights whose
    model.safetensors has this sha256: the cache's embedder and a model's head meet on it."""
    return f"{ENCODER_NAME}@sha256:{digest}"


def build_head_graph(head: ClassifierHead) -> onnx.ModelProto:
    """The classifier head alone: `sentence_embedding` [batch, hidden] -> `logits`, the same
    Gemm the full graph ends with, so a caller that already holds a text's embedding (the
    cache computed it for its lookup) pays for the head, not a second encoder run."""
    weight = np.asarray(head.weight, dtype=np.float32)
    bias = np.asarray(head.bias, dtype=np.float32)
    classes, hidden = weight.shape
    graph = helper.make_graph(
        [
            helper.make_node(
                "Gemm", [SENTENCE_EMBEDDING, "head.weight", "head.bias"], ["logits"], transB=1
            )
        ],
        "classifier-head",
        [helper.make_tensor_value_info(SENTENCE_EMBEDDING, TensorProto.FLOAT, ["batch", hidden])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
        [
            numpy_helper.from_array(weight, "head.weight"),
            numpy_helper.from_array(bias, "head.bias"),
        ],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="hopline.model.encoder"
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def build_encoder(model_dir: Path, out_path: Path, head: ClassifierHead | None = None) -> None:
    """The one call the model build needs: an optimised ONNX file straight from the weights."""
    optimize_graph(build_encoder_graph(model_dir, head), out_path)
