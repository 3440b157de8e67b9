"""How each stage's single requests become one batched request, and its reply theirs again
(gateway/stage_batching.py sends them).

Rows are cut back to their own length when a batch is split (the tokenizer pads a batch to
its longest text), so a batched row is the same tensor a single request would have carried.
Inference rows are keyed by length bucket, so a 9-token text is never padded to a 200-token
one in a shared run. Rows are keyed by the files they expect (`model_digest`) too: a request
asked again to make a lagging stage reload never shares an RPC with rows that do not.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.inference.v1 import inference_pb2
from hopline.protos.hopline.postprocess.v1 import postprocess_pb2
from hopline.protos.hopline.tokenizer.v1 import tokenizer_pb2
from hopline.runtime.batching import DEFAULT_BUCKETS
from hopline.runtime.tensors import from_tensor, to_tensor

# Token lengths rows are grouped by for the inference stage: the models' default buckets.
LENGTH_BUCKETS = DEFAULT_BUCKETS

Req = TypeVar("Req")
Rep = TypeVar("Rep")


class Codec(Generic[Req, Rep]):
    """How one stage's single requests become one request, and its reply becomes theirs."""

    def key(self, request: Req) -> Hashable:
        raise NotImplementedError

    def merge(self, requests: Sequence[Req]) -> Req:
        raise NotImplementedError

    def split(self, requests: Sequence[Req], reply: Rep) -> list[Rep]:
        raise NotImplementedError


def _rows_of(tensor: common_pb2.Tensor) -> list[np.ndarray[Any, Any]]:
    return list(from_tensor(tensor))


def _stack(name: str, rows: Sequence[np.ndarray[Any, Any]]) -> common_pb2.Tensor:
    """Rows of different lengths padded with zeros to the longest (mask 0: not attended)."""
    width = max(r.shape[-1] for r in rows)
    out = np.zeros((len(rows), width), dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, : r.shape[-1]] = r
    return to_tensor(name, out)


class TokenizeCodec(Codec[tokenizer_pb2.TokenizeRequest, tokenizer_pb2.TokenizeResponse]):
    def key(self, request: tokenizer_pb2.TokenizeRequest) -> Hashable:
        return (request.model, request.model_version, request.model_digest)

    def merge(
        self, requests: Sequence[tokenizer_pb2.TokenizeRequest]
    ) -> tokenizer_pb2.TokenizeRequest:
        first = requests[0]
        return tokenizer_pb2.TokenizeRequest(
            model=first.model,
            model_version=first.model_version,
            texts=[t for r in requests for t in r.texts],
            model_digest=first.model_digest,
        )

    def split(
        self,
        requests: Sequence[tokenizer_pb2.TokenizeRequest],
        reply: tokenizer_pb2.TokenizeResponse,
    ) -> list[tokenizer_pb2.TokenizeResponse]:
        ids, mask = from_tensor(reply.input_ids), from_tensor(reply.attention_mask)
        parts = []
        for i in range(len(requests)):
            length = int(mask[i].sum())  # the batch pads every row to its longest
            parts.append(
                tokenizer_pb2.TokenizeResponse(
                    input_ids=to_tensor(reply.input_ids.name, ids[i : i + 1, :length]),
                    attention_mask=to_tensor(reply.attention_mask.name, mask[i : i + 1, :length]),
                    model_digest=reply.model_digest,
                )
            )
        return parts


class InferCodec(Codec[inference_pb2.InferRequest, inference_pb2.InferResponse]):
    def key(self, request: inference_pb2.InferRequest) -> Hashable:
        # Rows of like length only: one request is one padded run at the inference service,
        # so a 9-token text must not be padded to a 200-token one.
        length = int(request.inputs[0].shape[-1]) if request.inputs else 0
        bucket = next((b for b in LENGTH_BUCKETS if length <= b), length)
        # Token ids and embeddings (the head alone) never share a run.
        names = tuple(t.name for t in request.inputs)
        return (
            request.model,
            request.model_version,
            request.model_digest,
            tuple(request.outputs),
            names,
            bucket,
        )

    def merge(self, requests: Sequence[inference_pb2.InferRequest]) -> inference_pb2.InferRequest:
        first = requests[0]
        inputs = [
            _stack(spec.name, [row for r in requests for row in _rows_of(r.inputs[i])])
            for i, spec in enumerate(first.inputs)
        ]
        return inference_pb2.InferRequest(
            model=first.model,
            model_version=first.model_version,
            inputs=inputs,
            outputs=first.outputs,
            model_digest=first.model_digest,
        )

    def split(
        self, requests: Sequence[inference_pb2.InferRequest], reply: inference_pb2.InferResponse
    ) -> list[inference_pb2.InferResponse]:
        outputs = [from_tensor(t) for t in reply.outputs]
        return [
            inference_pb2.InferResponse(
                outputs=[
                    to_tensor(t.name, out[rows])
                    for t, out in zip(reply.outputs, outputs, strict=True)
                ],
                queue_ms=reply.queue_ms,
                compute_ms=reply.compute_ms,
                model_digest=reply.model_digest,
            )
            for rows in _row_slices(int(r.inputs[0].shape[0]) for r in requests)
        ]


class PostprocessCodec(
    Codec[postprocess_pb2.PostprocessRequest, postprocess_pb2.PostprocessResponse]
):
    def key(self, request: postprocess_pb2.PostprocessRequest) -> Hashable:
        names = tuple(t.name for t in request.outputs)
        return (request.model, request.model_version, request.model_digest, request.top_k, names)

    def merge(
        self, requests: Sequence[postprocess_pb2.PostprocessRequest]
    ) -> postprocess_pb2.PostprocessRequest:
        first = requests[0]
        outputs = [
            to_tensor(t.name, np.concatenate([from_tensor(r.outputs[i]) for r in requests]))
            for i, t in enumerate(first.outputs)
        ]
        return postprocess_pb2.PostprocessRequest(
            model=first.model,
            model_version=first.model_version,
            outputs=outputs,
            top_k=first.top_k,
            model_digest=first.model_digest,
        )

    def split(
        self,
        requests: Sequence[postprocess_pb2.PostprocessRequest],
        reply: postprocess_pb2.PostprocessResponse,
    ) -> list[postprocess_pb2.PostprocessResponse]:
        return [
            postprocess_pb2.PostprocessResponse(
                predictions=reply.predictions[rows], model_digest=reply.model_digest
            )
            for rows in _row_slices(int(r.outputs[0].shape[0]) for r in requests)
        ]


def _row_slices(counts: Iterable[int]) -> list[slice]:
    """Where each request's rows lie in the batch, in order (`counts`: rows per request)."""
    slices, start = [], 0
    for rows in counts:
        slices.append(slice(start, start + rows))
        start += rows
    return slices
