"""numpy arrays to and from `hopline.common.v1.Tensor` (raw little-endian bytes)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from hopline.protos.hopline.common.v1 import common_pb2

DataType = common_pb2.DataType

_TO_NUMPY: dict[int, np.dtype[np.generic]] = {
    common_pb2.DATA_TYPE_BOOL: np.dtype("bool"),
    common_pb2.DATA_TYPE_INT32: np.dtype("<i4"),
    common_pb2.DATA_TYPE_INT64: np.dtype("<i8"),
    common_pb2.DATA_TYPE_FP16: np.dtype("<f2"),
    common_pb2.DATA_TYPE_FP32: np.dtype("<f4"),
}
_FROM_NUMPY = {dt: code for code, dt in _TO_NUMPY.items()}
# The dtypes a model's config.json may name (KServe v2 names), those a tensor can carry, by
# name: a request's dtype is checked against its number, not named per tensor.
DTYPE_CODES: dict[str, int] = {
    common_pb2.DataType.Name(code).removeprefix("DATA_TYPE_"): code  # type: ignore[arg-type]
    for code in _TO_NUMPY
}
DTYPE_NAMES = frozenset(DTYPE_CODES)


class TensorError(ValueError):
    """A tensor whose dtype, shape or byte size is inconsistent."""


def by_name(tensors: Sequence[common_pb2.Tensor], what: str) -> dict[str, common_pb2.Tensor]:
    """`tensors` by name; TensorError when one is named twice (the last would be used and the
    first never looked at: a fuzzing probe)."""
    named = {t.name: t for t in tensors}
    if len(named) < len(tensors):
        names = [t.name for t in tensors]
        twice = sorted({n for n in names if names.count(n) > 1})
        raise TensorError(f"{what}(s) {twice} given more than once: send each once")
    return named


def dtype_name(code: int) -> str:
    """The dtype's name (`INT64`); a number the enum does not name (a client may send any)
    reads `unknown dtype N`."""
    try:
        return common_pb2.DataType.Name(code).removeprefix("DATA_TYPE_")  # type: ignore[arg-type]
    except ValueError:
        return f"unknown dtype {code}"


def to_tensor(name: str, array: npt.NDArray[np.generic]) -> common_pb2.Tensor:
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    code = _FROM_NUMPY.get(np.dtype(dtype))
    if code is None:
        raise TensorError(f"{name}: unsupported dtype {array.dtype}")
    data = np.ascontiguousarray(array, dtype=dtype)
    return common_pb2.Tensor(
        name=name,
        dtype=code,  # type: ignore[arg-type]
        shape=list(data.shape),
        raw=data.tobytes(),
    )


def from_tensor(tensor: common_pb2.Tensor) -> npt.NDArray[np.generic]:
    """A read-only view over the message's bytes (no copy)."""
    dtype = _TO_NUMPY.get(tensor.dtype)
    if dtype is None:
        raise TensorError(f"tensor {tensor.name!r}: unsupported dtype {tensor.dtype}")
    shape = tuple(tensor.shape)
    if any(d < 0 for d in shape):
        raise TensorError(f"tensor {tensor.name!r}: negative dimension in shape {list(shape)}")
    # Python ints: an int64 product wraps (2**62 x 4 elements of 8 bytes counted 0 bytes,
    # which an empty payload matched). And cheaper: from_tensor 2.9 against 9.0 us a call.
    expected = math.prod(shape) * dtype.itemsize
    if expected != len(tensor.raw):
        raise TensorError(
            f"tensor {tensor.name!r}: shape {list(shape)} of {dtype_name(tensor.dtype)} needs "
            f"{expected} bytes, got {len(tensor.raw)}"
        )
    try:
        return np.frombuffer(tensor.raw, dtype=dtype).reshape(shape)
    except ValueError as exc:  # numpy's bounds on dimensions, e.g. [0, 2**62]: "too big"
        raise TensorError(f"tensor {tensor.name!r}: shape {list(shape)}: {exc}") from None
