"""tritonclient calls the KServe tests share: a BYTES `text` input, decoded strings, and a
call's rejection as (status, message)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException


def text_input(texts: list[str], name: str = "text") -> triton.InferInput:
    tensor = triton.InferInput(name, [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode("utf-8") for t in texts], dtype=np.object_))
    return tensor


def strings(array: Any) -> list[str]:
    return [item.decode("utf-8") for item in array]


def rejection(call: Any, *args: Any, **kwargs: Any) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as info:
        call(*args, **kwargs)
    return str(info.value.status()), str(info.value.message())
