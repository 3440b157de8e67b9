"""INT8 that holds MiniLM's outlier channels: smoothing, and an FP32 path for the worst few.

Dynamic quantization gives each activation tensor one scale, set by its largest value. A few
of MiniLM's channels run far above the rest (support-intents training texts, max |x| per
channel, layer 0): the LayerNorm outputs that feed the projections reach 28.5 in one channel
against a median of 1.8, and the FFN's GELU output 24.6 against 1.5. One scale for all
channels then leaves the ordinary ones a handful of INT8 steps, and short texts, whose mean
pooling averages few tokens, carry the error into the embedding: plain dynamic INT8 gave
"" and "?" a cosine of 0.9685 to FP32.

Two rewrites of the FP32 graph, both exact in FP32, run before `quantize_dynamic`:

- **Smoothing** (SmoothQuant, Xiao et al. 2022) for projections that read a LayerNorm output or
  the attention context: the input is divided per channel by s and the weight rows multiplied
  by it, s_j = max|x_j|^a / max|W_j|^(1-a), so the activations' range moves into the weights,
  which are quantized per output channel ahead of time. The context's division is folded into
  the value projection's columns; a LayerNorm output, also the residual, needs a Mul.
- **An FP32 path for outlier channels** (LLM.int8(), Dettmers et al. 2022) for the FFN's down
  projection, in the layers where its input has outliers: the SPLIT_CHANNELS widest input
  channels go through a small FP32 MatMul and the rest through the quantized one. Smoothing
  did worse there.

Measured on the 38 reference sentences (cosine to FP32: mean / worst / how many below 0.99)
and on support-intents' 624 held-out texts (labels that differ from FP32's), one build each;
encoder speed-up over FP32 at batch 1 / 32, alternated call by call on 2 cores:

    plain dynamic per channel                  0.9917 / 0.9685 / 8    9    1.92x / 1.99x
    smoothing everywhere, a=0.5                0.9850 / 0.9606 / 24
    FP32 path everywhere, 16 channels          0.9979 / 0.9908 / 0         1.36x / 1.51x
    smoothing a=0.7 + FP32 path, 16            0.9981 / 0.9921 / 0    1    1.58x / 1.83x
    the same, FP32 path in layers 0-3 (ship)   0.9980 / 0.9916 / 0    1    1.63x / 1.87x

With the shipped rewrites, smoothing strengths from 0.5 to 0.8 and 8 to 32 FP32 channels all
keep every reference sentence at 0.989 or above and change 1 to 4 held-out labels of 624:
what is left is the noise of one activation scale per tensor, spread evenly over the layers
(keeping any single layer or projection in FP32 moves the worst sentence by under 0.003).
In one run with every variant alternated, the shipped rewrites cost 15% of plain INT8's time
at batch 1 and 6% at batch 32 (another run, FP32 path in every layer: 7% and 9%, of which
smoothing's multiplies 2%).

The ranges come from the FP32 graph run on calibration texts (the build's training texts).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from tokenizers import Tokenizer

from hopline.model.tokenizer import encode

F32 = npt.NDArray[np.float32]
Feed = Mapping[str, npt.NDArray[np.int64]]

SMOOTH_ALPHA = 0.7  # 0.5-0.8 measured (module doc); 0.85 collapses (worst sentence 0.79)
SPLIT_CHANNELS = 16  # 8-32 measured; the FP32 MatMul's size hardly shows in the time
# The FP32 path only where the widest channel is this many times the median: MiniLM's FFN
# inputs run 15, 11, 9 and 8x in layers 0-3 and 4.5x in 4-5, where splitting bought nothing
# measurable (worst sentence 0.9921 -> 0.9916) for 3% of the time at batch 1.
SPLIT_MIN_RATIO = 6.0
CALIBRATION_TEXTS = 2048  # spread over the training texts; ranges settle long before
CALIBRATION_BATCH = 32


# What reads a projection's input decides its rewrite. LayerNorm outputs (also the residual
# stream) and the attention context are smoothed; anything else, the GELU's output, is split.
SMOOTHED_PRODUCERS = frozenset({"LayerNormalization", "Reshape"})
CHANNEL_WISE = frozenset({"Add", "Mul", "Div", "Sub", "Erf", "Tanh", "Sigmoid", "Relu"})


def has_outliers(x_max: F32) -> bool:
    return float(x_max.max()) >= SPLIT_MIN_RATIO * float(np.median(x_max))


def projections(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    """MatMuls with a constant weight, grouped by the tensor they read (Q, K and V share one)."""
    weights = {init.name for init in model.graph.initializer}
    groups: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        if node.op_type == "MatMul" and node.input[1] in weights:
            groups.setdefault(node.input[0], []).append(node)
    return groups


def calibration_feeds(tokenizer: Tokenizer, texts: Sequence[str]) -> list[Feed]:
    step = max(1, len(texts) // CALIBRATION_TEXTS)
    chosen = list(texts[::step])
    feeds: list[Feed] = []
    for start in range(0, len(chosen), CALIBRATION_BATCH):
        batch = encode(tokenizer, chosen[start : start + CALIBRATION_BATCH])
        feeds.append({"input_ids": batch.input_ids, "attention_mask": batch.attention_mask})
    return feeds


def activation_ranges(model: onnx.ModelProto, feeds: Iterable[Feed]) -> dict[str, F32]:
    """max |x| per channel of every projection's input, over the real (unpadded) tokens."""
    names = list(projections(model))
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for name in names:
        probe.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(
        probe.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    ranges: dict[str, F32] = {}
    for feed in feeds:
        real = feed["attention_mask"].astype(bool)
        for name, value in zip(names, session.run(names, dict(feed)), strict=True):
            top = np.abs(value[real]).max(axis=0).astype(np.float32)
            ranges[name] = np.maximum(ranges[name], top) if name in ranges else top
    if not ranges:
        raise ValueError(
            "INT8 sets its rewrites from calibration texts (a build passes its training texts): "
            "none were given"
        )
    return ranges


class _Editor:
    """Rewrites projections in a copy of the graph; new nodes go right after their inputs'
    producers, so the node list stays in topological order."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = onnx.ModelProto()
        self.model.CopyFrom(model)
        self.weights = {init.name: init for init in self.model.graph.initializer}
        self.producer = {o: n for n in self.model.graph.node for o in n.output}
        self.after: dict[str, list[onnx.NodeProto]] = {}  # node name -> nodes to insert after
        self.fp32_nodes: list[str] = []

    def weight(self, name: str) -> F32:
        out: F32 = numpy_helper.to_array(self.weights[name]).astype(np.float32)
        return out

    def set_weight(self, name: str, value: F32) -> None:
        self.weights[name].CopyFrom(numpy_helper.from_array(value.astype(np.float32), name))

    def const(self, name: str, value: npt.NDArray[np.generic]) -> str:
        self.model.graph.initializer.append(numpy_helper.from_array(value, name))
        return name

    def insert_after(self, anchor: onnx.NodeProto, *nodes: onnx.NodeProto) -> None:
        self.after.setdefault(anchor.name, []).extend(nodes)

    def smooth(self, x: str, matmuls: list[onnx.NodeProto], x_max: F32) -> None:
        """x / s feeds the projections, whose weight rows take s. For the attention context the
        division goes into the value projection that made its channels, so no Mul is added:
        an operator fewer per layer, which at batch 1 is worth more than its arithmetic."""
        rows = [self.weight(m.input[1]) for m in matmuls]
        w_max = np.max([np.abs(w).max(axis=1) for w in rows], axis=0)
        s = (x_max**SMOOTH_ALPHA / np.maximum(w_max, 1e-5) ** (1 - SMOOTH_ALPHA)).clip(1e-5)
        for m, w in zip(matmuls, rows, strict=True):
            self.set_weight(m.input[1], w * s[:, None])
        value = self.value_projection(x)
        if value is not None:
            weight, bias = value
            self.set_weight(weight, self.weight(weight) / s[None, :])
            self.set_weight(bias, self.weight(bias) / s)
            return
        scaled = f"{x}.smoothed"
        inverse = self.const(f"{x}.smooth_inverse", (1.0 / s).astype(np.float32))
        self.insert_after(self.producer[x], helper.make_node("Mul", [x, inverse], [scaled], scaled))
        for m in matmuls:
            m.input[0] = scaled

    def readers(self) -> dict[str, list[onnx.NodeProto]]:
        """The nodes reading each tensor, as the graph stands now."""
        found: dict[str, list[onnx.NodeProto]] = {}
        for node in self.model.graph.node:
            for name in node.input:
                found.setdefault(name, []).append(node)
        return found

    def value_projection(self, x: str) -> tuple[str, str] | None:
        """(weight, bias) of the value projection when `x` is an attention context: channel j
        of the context is the attention-weighted sum of channel j of V (the heads are split
        and merged by the same reshape), so scaling V's column j scales the context's. None
        for anything else, or when some other node reads a tensor on the way."""
        readers = self.readers()
        # From the context back to V: merge heads, weights x V, split heads, bias, projection.
        steps = [("Reshape", 0), ("Transpose", 0), ("MatMul", 1), ("Transpose", 0), ("Reshape", 0)]
        name = x
        for op_type, follow in steps:
            step = self.producer.get(name)
            if step is None or step.op_type != op_type:
                return None
            name = step.input[follow]
            if len(readers.get(name, [])) != 1:
                return None
        add = self.producer.get(name)
        if add is None or add.op_type != "Add":
            return None
        bias = [i for i in add.input if i in self.weights]
        made = [i for i in add.input if i not in self.weights]
        if len(bias) != 1 or len(made) != 1 or len(readers.get(made[0], [])) != 1:
            return None
        matmul = self.producer.get(made[0])
        if matmul is None or matmul.op_type != "MatMul" or matmul.input[1] not in self.weights:
            return None
        return matmul.input[1], bias[0]

    def split(self, x: str, matmuls: list[onnx.NodeProto], x_max: F32) -> None:
        """The widest channels are moved to the end of `x` (the projection that makes them is
        permuted, and the channel-wise ops after it follow), so one Split hands the INT8
        MatMul the rest and a small FP32 MatMul the widest. Exact; and the INT8 weights lose
        the widest channels' rows, so their per-column scales tighten (zeroing those channels
        instead left the training texts' worst cosine at 0.9871, against 0.9897)."""
        width = len(x_max)
        wide = np.sort(np.argsort(x_max)[-SPLIT_CHANNELS:])
        order = np.concatenate([np.setdiff1d(np.arange(width), wide), wide])
        source, bias = self.channel_source(x)
        self.set_weight(source.input[1], self.weight(source.input[1])[:, order])
        self.set_weight(bias, self.weight(bias)[order])
        inliers, outliers = f"{x}.inliers", f"{x}.outliers"
        sizes = self.const(f"{x}.split", np.array([width - SPLIT_CHANNELS, SPLIT_CHANNELS]))
        self.insert_after(
            self.producer[x],
            helper.make_node("Split", [x, sizes], [inliers, outliers], f"{x}.split", axis=-1),
        )
        for m in matmuls:
            out, w = m.output[0], self.weight(m.input[1])[order]
            quantized, exact = f"{out}.int8_part", f"{out}.fp32_part"
            self.set_weight(m.input[1], w[: width - SPLIT_CHANNELS])
            rows = self.const(f"{m.input[1]}.wide_rows", w[width - SPLIT_CHANNELS :])
            m.input[0], m.output[0] = inliers, quantized
            self.insert_after(
                m,
                helper.make_node("MatMul", [outliers, rows], [exact], exact),
                helper.make_node("Add", [quantized, exact], [out], f"{out}.sum"),
            )
            self.fp32_nodes.append(exact)

    def channel_source(self, x: str) -> tuple[onnx.NodeProto, str]:
        """The constant-weight MatMul and its bias whose output channels become `x`'s through
        channel-wise ops only (the FFN's up projection and its GELU), and nothing else reads
        in between: then permuting its columns permutes `x`'s channels and nothing else."""
        readers = self.readers()
        chain: list[onnx.NodeProto] = []
        frontier = [x]
        while frontier:
            found = self.producer.get(frontier.pop())
            if found is None or any(found.name == n.name for n in chain):
                continue
            node = found
            chain.append(node)
            if node.op_type == "MatMul" and node.input[1] in self.weights:
                continue
            if node.op_type not in CHANNEL_WISE:
                raise ValueError(f"{x}: {node.op_type} {node.name!r} is not channel-wise")
            for name in node.input:
                if name not in self.weights:
                    frontier.append(name)
                elif self.weight(name).size != 1 and node.op_type != "Add":
                    raise ValueError(f"{x}: {node.name!r} scales channels by a vector")
        sources = [n for n in chain if n.op_type == "MatMul"]
        biases = [
            name
            for n in chain
            if n.op_type == "Add"
            for name in n.input
            if name in self.weights and self.weight(name).size != 1
        ]
        inside = {n.name for n in chain}
        leaks = [
            r.name
            for n in chain
            for out in n.output
            if out != x
            for r in readers.get(out, [])
            if r.name not in inside
        ]
        if len(sources) != 1 or len(biases) != 1 or leaks:
            raise ValueError(
                f"{x}: expected one projection and one bias feeding it alone, found "
                f"{[n.name for n in sources]}, {biases}, read also by {leaks}"
            )
        return sources[0], biases[0]

    def finish(self) -> onnx.ModelProto:
        ordered: list[onnx.NodeProto] = []
        for node in self.model.graph.node:
            ordered.append(node)
            ordered.extend(self.after.get(node.name, []))
        del self.model.graph.node[:]
        self.model.graph.node.extend(ordered)
        return self.model


def prepare_for_int8(
    model: onnx.ModelProto, feeds: Iterable[Feed]
) -> tuple[onnx.ModelProto, list[str]]:
    """The FP32 graph rewritten so dynamic INT8 keeps its outlier channels (module doc), and the
    names of the MatMuls that must stay FP32. The result computes what `model` computes."""
    ranges = activation_ranges(model, feeds)
    editor = _Editor(model)
    for x, matmuls in projections(editor.model).items():
        producer = editor.producer.get(x)
        if producer is None:  # a graph input: nothing ahead of it to insert after
            continue
        if producer.op_type in SMOOTHED_PRODUCERS:
            editor.smooth(x, matmuls, ranges[x])
        elif has_outliers(ranges[x]):
            editor.split(x, matmuls, ranges[x])
    rewritten = editor.finish()
    onnx.checker.check_model(rewritten)
    return rewritten, editor.fp32_nodes
