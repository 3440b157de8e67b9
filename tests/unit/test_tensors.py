"""runtime/tensors.py: a tensor's bytes must match its shape and dtype, whatever the shape."""

from __future__ import annotations

import numpy as np
import pytest

from hopline.protos.hopline.common.v1 import common_pb2
from hopline.runtime.tensors import TensorError, dtype_name, from_tensor, to_tensor


def test_round_trip() -> None:
    array = np.arange(12, dtype=np.int64).reshape(3, 4)
    assert np.array_equal(from_tensor(to_tensor("ids", array)), array)


def test_bytes_that_do_not_match_the_shape_are_refused() -> None:
    tensor = to_tensor("ids", np.arange(12, dtype=np.int64).reshape(3, 4))
    tensor.shape[:] = [3, 5]
    with pytest.raises(TensorError, match=r"needs 120 bytes, got 96"):
        from_tensor(tensor)


def test_a_shape_whose_size_overflows_int64_is_refused_not_wrapped() -> None:
    """2**62 x 4 int64 elements: int64 arithmetic wraps the byte count to 0, which an empty
    payload would match; the size is counted in Python integers, so it is refused."""
    tensor = common_pb2.Tensor(
        name="ids", dtype=common_pb2.DATA_TYPE_INT64, shape=[2**62, 4], raw=b""
    )
    with pytest.raises(TensorError, match="needs"):
        from_tensor(tensor)


def test_an_empty_tensor_with_a_huge_dimension_is_refused_as_a_tensor_error() -> None:
    """[0, 2**62] holds no element, so 0 bytes match it; numpy then cannot make the view."""
    tensor = common_pb2.Tensor(
        name="ids", dtype=common_pb2.DATA_TYPE_INT64, shape=[0, 2**62], raw=b""
    )
    with pytest.raises(TensorError, match=r"tensor 'ids': shape \[0, 4611686018427387904\]"):
        from_tensor(tensor)


def test_a_dtype_number_the_enum_does_not_name_is_named_in_words() -> None:
    assert dtype_name(common_pb2.DATA_TYPE_INT64) == "INT64"
    assert dtype_name(99) == "unknown dtype 99"
    tensor = common_pb2.Tensor(name="ids", dtype=99, shape=[1], raw=b"\0" * 8)  # type: ignore[arg-type]
    with pytest.raises(TensorError, match="unsupported dtype 99"):
        from_tensor(tensor)
