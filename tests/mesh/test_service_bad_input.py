"""A client's mistake sent straight to an internal service (each listens on its own port in
the five-process topology) gets INVALID_ARGUMENT with what to fix, never UNKNOWN, and costs the
service nothing: real inference, postprocess and cache processes on loopback.

Each case here once answered UNKNOWN or OK, or held a service's event loop (a fuzzing pass
over every RPC of stop 62 found them)."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from conftest import DEFAULT_MODEL
from harness import SERVING, Mesh, health
from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.inference.v1 import inference_pb2, inference_pb2_grpc
from hopline.protos.hopline.postprocess.v1 import postprocess_pb2, postprocess_pb2_grpc
from hopline.runtime.tensors import to_tensor

VOCAB = 30_522  # the default model's tokenizer
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def mesh(default_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    started = Mesh(default_repo, tmp_path_factory.mktemp("bad-input"))
    started.start(("inference", "postprocess", "cache"))
    try:
        yield started
    finally:
        started.stop()


def invalid(call: Callable[[], Any]) -> str:
    """The details of the INVALID_ARGUMENT `call` must end with."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    details = info.value.details() or ""
    assert info.value.code() == INVALID, details
    return details


def ids_request(ids: np.ndarray[Any, Any], mask: np.ndarray[Any, Any] | None = None) -> Any:
    return inference_pb2.InferRequest(
        model=DEFAULT_MODEL,
        inputs=[
            to_tensor("input_ids", ids),
            to_tensor("attention_mask", np.ones_like(ids) if mask is None else mask),
        ],
    )


@pytest.fixture(scope="module")
def infer(mesh: Mesh) -> Iterator[Callable[[Any], inference_pb2.InferResponse]]:
    with grpc.insecure_channel(mesh.addrs["inference"]) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        yield lambda request: stub.Infer(request, timeout=30)


def test_token_ids_outside_the_vocabulary_are_refused(infer: Callable[[Any], Any]) -> None:
    for bad in (VOCAB, 10**9, -1):
        request = ids_request(np.array([[101, bad, 102]], dtype=np.int64))
        details = invalid(functools.partial(infer, request))
        assert details.endswith(f"token id {bad}; {DEFAULT_MODEL}/1 takes ids 0 to {VOCAB - 1}")
    mask = np.array([[1, 2, 1]], dtype=np.int64)
    details = invalid(lambda: infer(ids_request(np.array([[101, 7592, 102]]), mask)))
    assert details == "input 'attention_mask' must hold only 0 and 1"


def test_a_bad_request_beside_good_ones_fails_alone(infer: Callable[[Any], Any]) -> None:
    good = ids_request(np.array([[101, 7592, 2088, 102]], dtype=np.int64))
    bad = ids_request(np.array([[101, 99_999, 2088, 102]], dtype=np.int64))

    def one(request: Any) -> grpc.StatusCode:
        try:
            infer(request)
        except grpc.RpcError as err:
            return err.code()
        return grpc.StatusCode.OK

    with ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(one, [good, good, good, bad] * 10))
    assert codes == ([grpc.StatusCode.OK] * 3 + [INVALID]) * 10, codes


def test_dtypes_and_shapes_no_tensor_can_have_are_refused(infer: Callable[[Any], Any]) -> None:
    ids = ids_request(np.array([[101, 102]], dtype=np.int64))
    ids.inputs[0].dtype = 99
    details = invalid(lambda: infer(ids))
    assert details == "input 'input_ids' must be INT64, got unknown dtype 99"
    huge = inference_pb2.InferRequest(
        model=DEFAULT_MODEL,
        inputs=[
            common_pb2.Tensor(name=name, dtype=common_pb2.DATA_TYPE_INT64, shape=[0, 2**62])
            for name in ("input_ids", "attention_mask")
        ],
    )
    assert "shape [0, 4611686018427387904]" in invalid(lambda: infer(huge))


def test_postprocess_refuses_rows_and_widths_no_model_output_has(mesh: Mesh) -> None:
    with grpc.insecure_channel(mesh.addrs["postprocess"]) as channel:
        stub = postprocess_pb2_grpc.PostprocessServiceStub(channel)

        def ask(tensor: common_pb2.Tensor, include_embedding: bool = False) -> Any:
            request = postprocess_pb2.PostprocessRequest(
                model=DEFAULT_MODEL, outputs=[tensor], include_embedding=include_embedding
            )
            return stub.Postprocess(request, timeout=10)

        started = time.monotonic()
        no_bytes = common_pb2.Tensor(
            name="sentence_embedding", dtype=common_pb2.DATA_TYPE_FP32, shape=[3_000_000, 0]
        )
        assert "3000000 rows" in invalid(lambda: ask(no_bytes, include_embedding=True))
        # Refused, not worked through: it had held the event loop for about 14 s.
        assert time.monotonic() - started < 5
        narrow = to_tensor("sentence_embedding", np.zeros((2, 0), np.float32))
        assert "must be 384 wide" in invalid(lambda: ask(narrow, include_embedding=True))
        tall = to_tensor("logits", np.zeros((65, 26), np.float32))
        assert "65 rows" in invalid(lambda: ask(tall))
        huge = common_pb2.Tensor(name="logits", dtype=common_pb2.DATA_TYPE_FP32, shape=[0, 2**62])
        invalid(lambda: ask(huge))
        assert health(mesh.addrs["postprocess"]) == SERVING
        answered = ask(to_tensor("logits", np.zeros((1, 26), np.float32)))
        assert len(answered.predictions) == 1


def test_the_cache_refuses_endless_lifetimes_and_texts_no_entry_holds(mesh: Mesh) -> None:
    scope = common_pb2.Scope(tenant="t", model="m", model_version="1")
    with grpc.insecure_channel(mesh.addrs["cache"]) as channel:
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        for ttl in (math.nan, math.inf):
            store = cache_pb2.StoreRequest(
                scope=scope,
                text="kept for ever",
                prediction=common_pb2.Prediction(label="order_status", score=0.9),
                mode="exact",
                ttl_s=ttl,
            )
            details = invalid(functools.partial(stub.Store, store, timeout=10))
            assert "ttl_s must be a finite number" in details
        for broken in (
            common_pb2.Prediction(label="order_status", score=math.nan),
            common_pb2.Prediction(
                label="order_status",
                score=0.9,
                top_k=[common_pb2.LabelScore(label="order_status", score=math.inf)],
            ),
        ):
            store = cache_pb2.StoreRequest(
                scope=scope, text="a model that answered NaN", prediction=broken, mode="exact"
            )
            details = invalid(functools.partial(stub.Store, store, timeout=10))
            assert "scores not a number" in details
        # What is echoed is clipped: a whole bad value in the message passed gRPC's 16 KiB of
        # metadata, and the client got RESOURCE_EXHAUSTED instead of INVALID_ARGUMENT.
        nans = common_pb2.Prediction(
            label="order_status",
            score=0.9,
            top_k=[common_pb2.LabelScore(label="x", score=math.nan)] * 3000,
        )
        for store in (
            cache_pb2.StoreRequest(scope=scope, text="many NaNs", prediction=nans, mode="exact"),
            cache_pb2.StoreRequest(
                scope=scope,
                text="a long mode",
                prediction=common_pb2.Prediction(label="order_status", score=0.9),
                mode="m" * 20_000,
            ),
        ):
            details = invalid(functools.partial(stub.Store, store, timeout=10))
            assert len(details) < 400, details[:400]
        # common.proto's embedding is one L2-normalised FP32 row: a stored tensor is served
        # to every repeat as it is (10 values under a [1, 384] shape were, as were NaNs).
        unit = np.full(384, 384**-0.5, np.float32)
        for tensor, said in (
            (to_tensor("e", unit[None, :]), "needs 1536 bytes"),  # raw cut below
            (to_tensor("e", unit.astype(np.int32)), "must be FP32"),
            (to_tensor("e", np.stack([unit, unit])), "holds 2 rows"),
            (to_tensor("e", np.full(384, np.nan, np.float32)), "not numbers"),
        ):  # fmt: skip
            if said.startswith("needs"):
                tensor.raw = b"abc"
            prediction = common_pb2.Prediction(label="order_status", score=0.9, embedding=tensor)
            store = cache_pb2.StoreRequest(
                scope=scope, text="a broken embedding", prediction=prediction, mode="exact"
            )
            details = invalid(functools.partial(stub.Store, store, timeout=10))
            assert said in details, details
        fine = common_pb2.Prediction(
            label="order_status", score=0.9, embedding=to_tensor("embedding", unit)
        )
        stub.Store(
            cache_pb2.StoreRequest(scope=scope, text="a unit row", prediction=fine, mode="exact"),
            timeout=10,
        )
        for bad_ids in (["z" * 20_000], ["y" * 64] * 500):
            invalidate = cache_pb2.InvalidateRequest(entry_ids=bad_ids)
            details = invalid(functools.partial(stub.Invalidate, invalidate, timeout=10))
            assert len(details) < 400, details[:400]
        lookup = cache_pb2.LookupRequest(
            scope=scope, text="x" * 70_000, mode="semantic", threshold=0.9
        )
        details = invalid(lambda: stub.Lookup(lookup, timeout=10))
        assert details == "text is over 65535 bytes, more than any cache entry holds"


def test_names_no_model_has_are_not_found_and_echoes_are_bounded(
    mesh: Mesh, infer: Callable[[Any], Any]
) -> None:
    """A model name past the file system's 255 bytes answered UNKNOWN with an OSError and
    the repository's path, a traceback in the log; a 20,000-character output name was echoed
    whole, past gRPC's 16 KiB trailer limit, and the caller got RESOURCE_EXHAUSTED "Stream
    removed" instead of its status; NaN logits were answered OK with score nan (a fuzzing
    probe): INTERNAL now, the model's fault."""
    long_name = "s" * 300
    ids = np.array([[101, 2054, 102]], np.int64)
    request = ids_request(ids)
    request.model = long_name
    with pytest.raises(grpc.RpcError) as info:
        infer(request)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    details = info.value.details() or ""
    assert "unknown model 'sss" in details
    assert "File name too long" not in details
    assert str(mesh.repo) not in details
    assert len(details) < 300
    request = ids_request(ids)
    request.outputs.append("o" * 20_000)
    assert "has no output(s)" in invalid(lambda: infer(request))
    twice = ids_request(ids)
    twice.inputs.append(twice.inputs[0])  # the second was run, the first never looked at
    assert "['input_ids'] given more than once" in invalid(lambda: infer(twice))
    with grpc.insecure_channel(mesh.addrs["postprocess"]) as channel:
        stub = postprocess_pb2_grpc.PostprocessServiceStub(channel)
        finite = to_tensor("logits", np.zeros((1, 26), np.float32))
        assert "given more than once" in invalid(
            lambda: stub.Postprocess(
                postprocess_pb2.PostprocessRequest(model=DEFAULT_MODEL, outputs=[finite, finite]),
                timeout=10,
            )
        )
        logits = to_tensor("logits", np.full((1, 26), np.nan, np.float32))
        with pytest.raises(grpc.RpcError) as info:  # the model's fault, not the caller's
            stub.Postprocess(
                postprocess_pb2.PostprocessRequest(model=DEFAULT_MODEL, outputs=[logits]),
                timeout=10,
            )
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert "logits hold NaN or infinity" in (info.value.details() or "")
        with pytest.raises(grpc.RpcError) as info:
            stub.Postprocess(
                postprocess_pb2.PostprocessRequest(model=long_name, outputs=[logits]), timeout=10
            )
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "OSError" not in mesh.log("inference") + mesh.log("postprocess")
