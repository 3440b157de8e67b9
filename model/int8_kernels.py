"""INT8 weights every x86 CPU computes exactly, and a check for versions built before them.

ONNX Runtime's u8s8 kernels on x86 CPUs without VNNI (AVX2, AVX-512 before Cascade Lake,
AMD before Zen 4) multiply with vpmaddubsw: each pair of u8 x s8 products along K (rows 2i
and 2i+1 of the weight) is added into a saturating int16. Two same-sign 8-bit weights of 127
reach 255 x 254 = 64770 and are clipped at 32767, so the model runs, silently wrong: on an
AMD EPYC with AVX2 a full-range build of support-intents fell to embedding cosine 0.945
against FP32, and the same file was right on a VNNI CPU (vpdpbusd adds in int32).

A pair cannot overflow while its two magnitudes sum to at most PAIR_LIMIT (255 x 128 =
32640), and a pair of opposite signs never can. `pair_safe_int8` gives each output channel
the finest scale that keeps every same-sign pair of that channel within the limit: between
8 bits (a channel whose large weights sit beside small or opposite-sign ones) and 7 bits
(the worst case, [-64, 64], where hopline's previous builds put every channel). On
support-intents the median channel kept 1.2x the resolution of 7 bits; the check sentences'
worst cosine to FP32 went from 0.9852 to 0.9910 (hopline.model.quantize's module doc).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import numpy as np
import numpy.typing as npt

log = logging.getLogger("hopline.model.int8_kernels")

# The largest |w1| + |w2| of a same-sign pair that cannot overflow int16: 255 * 128 <= 32767.
PAIR_LIMIT = 128
INT8_MAX = 127  # symmetric weights: -127..127, zero point 0
# CPU flags (as Linux's /proc/cpuinfo names them) of int8 dot products that add in int32.
INT32_DOT_PRODUCT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
CPUINFO = Path("/proc/cpuinfo")

F32 = npt.NDArray[np.float32]
I8 = npt.NDArray[np.int8]


def _pairs(w: npt.NDArray[np.generic]) -> tuple[npt.NDArray[np.generic], npt.NDArray[np.generic]]:
    """Rows 2i and 2i+1 of a [K, N] weight (an odd K pads a zero row, as the kernels do)."""
    if w.shape[0] % 2:
        w = np.vstack([w, np.zeros((1, w.shape[1]), w.dtype)])
    return w[0::2], w[1::2]


def _same_sign_pair_sums(w: npt.NDArray[np.generic]) -> npt.NDArray[np.generic]:
    first, second = _pairs(w)
    same = np.sign(first) == np.sign(second)
    return np.where(same, np.abs(first) + np.abs(second), 0)


def pair_safe_int8(w: F32) -> tuple[I8, F32]:
    """Symmetric per-output-channel int8 of a [K, N] weight, and each channel's scale, fine
    as the pair limit allows: |q| <= 127 and every same-sign pair sums to at most PAIR_LIMIT.

    A scale of max(largest |w|, largest same-sign pair sum) / 127 bounds a pair by 127 before
    rounding, so by 128 after it."""
    w = np.asarray(w, dtype=np.float32)
    widest = np.maximum(np.abs(w).max(axis=0), _same_sign_pair_sums(w).max(axis=0))
    scale = np.where(widest > 0, widest / INT8_MAX, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, scale


def widest_pair(q: npt.NDArray[np.integer]) -> int:
    """The largest |q1| + |q2| of a same-sign pair in a [K, N] int8 weight (0 if none)."""
    return int(_same_sign_pair_sums(q.astype(np.int32)).max(initial=0))


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """This CPU's feature flags, or None where the kernel does not list them (not Linux)."""
    return read_cpu_flags(CPUINFO)


def read_cpu_flags(cpuinfo: Path) -> frozenset[str] | None:
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return None


def widest_int8_pair(model_path: Path) -> int:
    """`widest_pair` over the int8 weights of the model's integer MatMuls (0 if none)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(model_path))
    integer_ops = {"MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat"}
    weights = {n.input[1] for n in model.graph.node if n.op_type in integer_ops}
    widest = 0
    for init in model.graph.initializer:
        if init.name in weights and init.data_type == onnx.TensorProto.INT8:
            values = numpy_helper.to_array(init)
            widest = max(widest, widest_pair(values.reshape(values.shape[0], -1)))
    return widest


def saturates_here(model_path: Path, flags: frozenset[str] | None) -> bool:
    """True when the model's int8 weights are too wide for this CPU's u8s8 kernels. A CPU whose
    flags are unknown is not judged: no warning without evidence."""
    if flags is None or not ({"avx2", "avx512bw"} & flags) or INT32_DOT_PRODUCT_FLAGS & flags:
        return False
    return widest_int8_pair(model_path) > PAIR_LIMIT


def warn_if_saturating(model_key: str, model_path: Path) -> bool:
    """One warning line when `model_path` will compute wrong products on this CPU; the
    version still loads (its answers are close, not exact), and the line says how to fix it."""
    flags = cpu_flags()
    if not saturates_here(model_path, flags):
        return False
    log.warning(
        "INT8 weights of %s have pairs too wide for this CPU, which has no VNNI: ONNX Runtime's "
        "u8s8 kernels saturate int16 sums here, so its answers drift from the ones its build "
        "checked (embedding cosine 0.945 measured on such a CPU). Rebuild it with this "
        "hopline (`hopline model build --precision int8`), whose weights keep every pair "
        "within the int16 sum",
        model_key,
    )
    return True
