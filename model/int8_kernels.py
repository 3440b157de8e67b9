"""Will this CPU compute an INT8 model's products exactly? A check for versions built before
hopline's INT8 weights went to 7 bits (hopline.model.quantize's module doc).

ONNX Runtime's u8s8 kernels on x86 CPUs without VNNI (AVX2, AVX-512 before Cascade Lake,
AMD before Zen 4) multiply with vpmaddubsw, which adds each pair of u8 x s8 products into a
saturating int16. With 8-bit weights a pair reaches 255 x 127 x 2 = 64770 and is clipped at
32767, so the model runs, silently wrong: on an AMD EPYC with AVX2 a full-range build of
support-intents fell to embedding cosine 0.945 against FP32, and the same file was right on
a VNNI CPU. 7-bit weights keep every pair within 255 x 64 x 2 = 32640.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

log = logging.getLogger("hopline.model.int8_kernels")

# The largest |weight| for which an AVX2 u8s8 pair cannot overflow int16: 255 * 64 * 2 <= 32767.
SAFE_WEIGHT_MAGNITUDE = 64
# CPU flags (as Linux's /proc/cpuinfo names them) of int8 dot products that add in int32.
INT32_DOT_PRODUCT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
CPUINFO = Path("/proc/cpuinfo")


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


def widest_int8_weight(model_path: Path) -> int:
    """The largest |value| among the int8 weights of the model's integer MatMuls (0 if none)."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(model_path))
    integer_ops = {"MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat"}
    weights = {n.input[1] for n in model.graph.node if n.op_type in integer_ops}
    widest = 0
    for init in model.graph.initializer:
        if init.name in weights and init.data_type == onnx.TensorProto.INT8:
            values = numpy_helper.to_array(init).astype(np.int16)
            widest = max(widest, int(np.abs(values).max(initial=0)))
    return widest


def saturates_here(model_path: Path, flags: frozenset[str] | None) -> bool:
    """True when the model's int8 weights are too wide for this CPU's u8s8 kernels. A CPU whose
    flags are unknown is not judged: no warning without evidence."""
    if flags is None or not ({"avx2", "avx512bw"} & flags) or INT32_DOT_PRODUCT_FLAGS & flags:
        return False
    return widest_int8_weight(model_path) > SAFE_WEIGHT_MAGNITUDE


def warn_if_saturating(model_key: str, model_path: Path) -> bool:
    """One warning line when `model_path` will compute wrong products on this CPU; the
    version still loads (its answers are close, not exact), and the line says how to fix it."""
    flags = cpu_flags()
    if not saturates_here(model_path, flags):
        return False
    log.warning(
        "INT8 weights of %s use the full 8-bit range, and this CPU has no VNNI: ONNX Runtime's "
        "u8s8 kernels saturate int16 sums here, so its answers drift from the ones its build "
        "checked (embedding cosine 0.945 measured on such a CPU). Rebuild it with this "
        "hopline (`hopline model build --precision int8`), which quantizes weights to 7 bits",
        model_key,
    )
    return True
