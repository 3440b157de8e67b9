"""inference.GRPCInferenceService, the KServe v2 / Open Inference Protocol, on the gateway.

Existing clients (tritonclient, the KServe SDKs, stubs generated from the public spec) call
hopline unchanged on the gateway's port. ModelInfer takes a BYTES tensor `text` of shape
[batch]; each text goes through the gateway's own per-text path (GatewayService.predict_text:
cache, coalescing, hops), all of them concurrently, so both APIs give the same answers and share
one cache, and the gateway's identity rules (API keys, x-hopline-tenant) apply here too.

Statuses follow what Triton returns for the same mistakes, so client code written for Triton
handles hopline's errors unchanged:
- unknown model or version: NOT_FOUND (Triton: "Request for unknown model: ... is not found");
- a missing, unexpected or repeated input, a wrong datatype, a wrong shape, data whose size does
  not match the shape, an unknown requested output, a batch over the model's max_batch_size (or
  over HOPLINE_GATEWAY_MAX_IN_FLIGHT, where lower: each text takes one place in flight, so a
  larger batch could never be admitted), a bad parameter, a sequence_id (hopline's models are
  stateless): INVALID_ARGUMENT;
- as Predict: an empty text INVALID_ARGUMENT, a text over HOPLINE_MAX_TEXT_BYTES
  RESOURCE_EXHAUSTED, a missing or wrong API key UNAUTHENTICATED or PERMISSION_DENIED, a failing
  hop its own status.
ModelReady answers ready=false for an unknown model, as Triton does: it is a question, not a
mistake. ModelConfig, Triton's extension, reports what runs a version (gateway/model_config.py).
ModelStreamInfer, Triton's streaming extension (tritonclient's start_stream and
async_stream_infer), answers each request on a stream as ModelInfer would, up to
HOPLINE_STREAM_MAX_IN_FLIGHT at once, as PredictStream does (gateway/streaming.py); a request
that fails gets its status and message in `error_message` and the stream goes on.

Triton's request parameters are read as Triton reads them: `timeout` (tritonclient's
`infer(timeout=)`, microseconds) caps the request's time as a shorter gRPC deadline would;
`priority` is accepted and has no effect (one queue). An output's `classification` parameter
(tritonclient's `InferRequestedOutput(name, class_count=k)`, Triton's classification extension)
on `scores` returns its k best classes instead, as Triton does: BYTES of shape [batch, k], each
`"<score>:<index>:<label>"`, best first.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import struct
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, NamedTuple

import grpc
import numpy as np
from google.protobuf import json_format

from hopline.cache.keys import normalise_text
from hopline.gateway.call import unreadable
from hopline.gateway.client import CACHE_MODES, outcome_name
from hopline.gateway.errors import RequestError, abort
from hopline.gateway.identity import IdentityError
from hopline.gateway.model_config import Tensor, triton_config
from hopline.gateway.service import GatewayService
from hopline.gateway.streaming import (
    MAX_ID_BYTES,
    MODEL_STREAM_INFER,
    clipped_id,
    message_answered,
    message_failed,
    serve_stream,
    stream_message_span,
)
from hopline.gateway.turns import StreamTurns, Turns
from hopline.observability import metrics, schema
from hopline.observability.tracing import child_span, current_trace_id
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2
from hopline.protos.hopline.inference.v1 import inference_pb2
from hopline.protos.hopline.kserve.v2 import grpc_predict_v2_pb2 as pb
from hopline.protos.hopline.kserve.v2 import grpc_predict_v2_pb2_grpc as pb_grpc
from hopline.runtime.errors import StatusError, clip

SERVER_NAME = "hopline"
PLATFORM = "hopline"
# Request parameters (tenant, cache_mode; Triton's timeout, priority), Triton's
# classification of an output, and its ModelConfig (named as Triton names them).
EXTENSIONS = ("parameters", "classification", "model_configuration")
CLASSIFICATION = "classification"
CLASSIFIED = "scores"  # the one output with a score per class
TIMEOUT = "timeout"  # microseconds, as tritonclient's infer(timeout=) sends it
SEQUENCE_ID = "sequence_id"
INTEGER_KINDS = ("int64_param", "uint64_param")
TEXT_INPUT = "text"
TENSOR_META = pb.ModelMetadataResponse.TensorMetadata
Answers = Sequence[gateway_pb2.PredictResponse]


def _f32(rows: Any) -> bytes:
    return np.asarray(rows, dtype="<f4").tobytes()


def encode_bytes(items: Sequence[bytes]) -> bytes:
    """A BYTES tensor's raw form: each element as a 4-byte little-endian length, then it."""
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def _scores_row(answer: gateway_pb2.PredictResponse, labels: Sequence[str]) -> list[float]:
    scores = {s.label: s.score for s in answer.prediction.top_k}
    if len(scores) != len(labels):
        raise RequestError(
            grpc.StatusCode.INTERNAL,
            f"postprocess returned {len(scores)} scores for a model of {len(labels)} labels",
        )
    return [scores[label] for label in labels]


@dataclasses.dataclass(frozen=True)
class Output:
    """One ModelInfer output: its metadata and how to encode it from the batch's answers."""

    name: str
    datatype: str
    shape: Callable[[int, int], list[int]]  # (batch, classes); batch -1 for the metadata
    encode: Callable[[Answers, Sequence[str]], bytes]  # (answers, the model's labels)


OUTPUTS = {
    o.name: o
    for o in (
        Output(
            "label",
            "BYTES",
            lambda batch, _: [batch],
            lambda answers, _: encode_bytes([a.prediction.label.encode() for a in answers]),
        ),
        Output(
            "score",
            "FP32",
            lambda batch, _: [batch],
            lambda answers, _: _f32([a.prediction.score for a in answers]),
        ),
        # The full softmax row, columns in the order of the model's labels (labels.json).
        Output(
            "scores",
            "FP32",
            lambda batch, classes: [batch, classes],
            lambda answers, labels: _f32([_scores_row(a, labels) for a in answers]),
        ),
        Output(
            "out_of_scope",
            "BOOL",
            lambda batch, _: [batch],
            lambda answers, _: np.asarray(
                [a.prediction.out_of_scope for a in answers], dtype=np.bool_
            ).tobytes(),
        ),
        # What the cache did for each text: MISS, EXACT, SEMANTIC, FAIL_OPEN or SKIPPED.
        Output(
            "cache",
            "BYTES",
            lambda batch, _: [batch],
            lambda answers, _: encode_bytes(
                [outcome_name(a.cache.outcome).encode() for a in answers]
            ),
        ),
    )
}


def tensors(info: inference_pb2.ModelInfo) -> tuple[list[Tensor], list[Tensor]]:
    """The version's inputs and outputs, with whole shapes (-1: the number of texts)."""
    classes = len(info.labels)
    outputs = [Tensor(o.name, o.datatype, o.shape(-1, classes)) for o in OUTPUTS.values()]
    return [Tensor(TEXT_INPUT, "BYTES", [-1])], outputs


def _invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def split_bytes(blob: bytes, count: int, name: str) -> list[bytes]:
    """The elements of a raw BYTES tensor; refuses truncated data and a count off the shape."""
    items: list[bytes] = []
    offset = 0
    while offset < len(blob):
        if offset + 4 > len(blob):
            raise _invalid(
                f"raw data of input '{name}' ends inside a length prefix at byte {offset}: "
                "each element is a 4-byte little-endian length followed by its bytes"
            )
        (size,) = struct.unpack_from("<I", blob, offset)
        offset += 4
        if offset + size > len(blob):
            raise _invalid(
                f"element {len(items)} of input '{name}' declares {size} bytes but only "
                f"{len(blob) - offset} remain in its raw data"
            )
        items.append(blob[offset : offset + size])
        offset += size
    if len(items) != count:
        raise _invalid(
            f"unexpected number of string elements {len(items)} for inference input '{name}', "
            f"expecting {count} (its shape)"
        )
    return items


class BatchLimit(NamedTuple):
    """The most texts one request may carry (0: no limit) and what sets it."""

    texts: int
    setting: str

    @classmethod
    def of(cls, info: inference_pb2.ModelInfo, max_in_flight: int) -> BatchLimit:
        if max_in_flight and (not info.max_batch_size or max_in_flight < info.max_batch_size):
            # Each text takes one place in flight: a larger batch could never be admitted.
            return cls(max_in_flight, "the gateway's HOPLINE_GATEWAY_MAX_IN_FLIGHT")
        return cls(info.max_batch_size, "the model's max_batch_size")

    def check(self, count: int, model: str) -> None:
        if self.texts and count > self.texts:
            raise _invalid(
                f"inference request batch-size must be <= {self.texts} for '{model}' "
                f"({self.setting}), got {count} texts: split the batch"
            )


# The heaviest a stream's request counts for its reading (`texts_in`): one over the stream's
# width is read alone anyway, and a shape of 2**62 is refused when answered.
MAX_TEXTS_WEIGHT = 1 << 16


def texts_in(request: pb.ModelInferRequest) -> int:
    """The texts a request carries by its first input's shape, for a stream's reading
    (gateway/streaming.py): 1 for one without a readable shape, which fails at once."""
    if not request.inputs:
        return 1
    count = 1
    for dim in request.inputs[0].shape:
        count *= max(dim, 1)
        if count >= MAX_TEXTS_WEIGHT:
            return MAX_TEXTS_WEIGHT
    return count


def decode_texts(request: pb.ModelInferRequest, model: str, limit: BatchLimit) -> list[str]:
    """The texts of the request's single BYTES input, from raw or typed contents; a batch over
    `limit` is refused from its shape, before its data is read."""
    for tensor in request.inputs:
        if tensor.name != TEXT_INPUT:
            raise _invalid(
                f"unexpected inference input '{clip(tensor.name)}' for model '{model}': its only "
                f"input is '{TEXT_INPUT}' (BYTES, shape [batch])"
            )
    if len(request.inputs) != 1:
        raise _invalid(
            f"expected 1 inputs but got {len(request.inputs)} inputs for model '{model}': send "
            f"one BYTES input named '{TEXT_INPUT}' with shape [batch]"
        )
    tensor = request.inputs[0]
    if tensor.datatype != "BYTES":
        raise _invalid(
            f"inference input '{TEXT_INPUT}' data-type is '{clip(tensor.datatype)}', but model "
            f"'{model}' expects 'BYTES' (UTF-8 texts)"
        )
    shape = list(tensor.shape)
    if len(shape) != 1 or shape[0] < 1:
        raise _invalid(
            f"unexpected shape for input '{TEXT_INPUT}' for model '{model}'. Expected [N], one "
            f"dimension, the number of texts (at least 1), got {clip(str(shape))}"
        )
    count = shape[0]
    limit.check(count, model)
    raw = request.raw_input_contents
    if raw:
        if len(raw) != len(request.inputs):
            raise _invalid(
                f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs: "
                "send one entry per input, in the order of the inputs"
            )
        if tensor.HasField("contents"):
            raise _invalid(
                f"input '{TEXT_INPUT}' has data both in contents and in raw_input_contents: "
                "send it once"
            )
        elements = split_bytes(raw[0], count, TEXT_INPUT)
    else:
        typed = [field.name for field, _ in tensor.contents.ListFields()]
        if not typed:
            raise _invalid(
                f"input '{TEXT_INPUT}' has no data: send it in raw_input_contents or in "
                "contents.bytes_contents"
            )
        if typed != ["bytes_contents"]:
            wrong = next(name for name in typed if name != "bytes_contents")
            raise _invalid(
                f"input '{TEXT_INPUT}' is BYTES: its elements go in contents.bytes_contents, "
                f"not contents.{wrong}"
            )
        elements = list(tensor.contents.bytes_contents)
        if len(elements) != count:
            raise _invalid(
                f"unexpected number of string elements {len(elements)} for inference input "
                f"'{TEXT_INPUT}', expecting {count} (its shape)"
            )
    texts: list[str] = []
    for i, element in enumerate(elements):
        try:
            texts.append(element.decode("utf-8"))
        except UnicodeDecodeError:
            raise _invalid(f"element {i} of input '{TEXT_INPUT}' is not valid UTF-8") from None
    return texts


def string_parameter(parameters: Mapping[str, pb.InferParameter], key: str) -> str:
    if key not in parameters:
        return ""
    parameter = parameters[key]
    kind = parameter.WhichOneof("parameter_choice")
    if kind != "string_param":
        raise _invalid(f"parameter '{key}' must be a string, got {kind or 'no value'}")
    return parameter.string_param


def cache_mode(parameters: Mapping[str, pb.InferParameter]) -> common_pb2.CacheMode.ValueType:
    mode = string_parameter(parameters, "cache_mode") or "use"
    if mode not in CACHE_MODES:
        raise _invalid(
            f"parameter 'cache_mode' must be one of {', '.join(CACHE_MODES)}, got {clip(mode)!r}"
        )
    return CACHE_MODES[mode]


def integer_parameter(parameters: Mapping[str, pb.InferParameter], key: str, where: str) -> int:
    """An integer parameter's value (0 when absent); a negative one or another kind refused."""
    if key not in parameters:
        return 0
    parameter = parameters[key]
    kind = parameter.WhichOneof("parameter_choice")
    if kind not in INTEGER_KINDS:
        raise _invalid(f"parameter '{key}'{where} must be an integer, got {kind or 'no value'}")
    value = int(getattr(parameter, kind))
    if value < 0:
        raise _invalid(f"parameter '{key}'{where} must be 0 or more, got {value}")
    return value


def check_id(rid: str) -> None:
    """The reply echoes the id: one near the message size limit made the reply too large to
    send (RESOURCE_EXHAUSTED from gRPC's core, and an error logged per request)."""
    if len(rid) > MAX_ID_BYTES // 4 and (size := len(rid.encode())) > MAX_ID_BYTES:
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"ModelInferRequest.id is {size} bytes; the limit is {MAX_ID_BYTES}: send a shorter id",
        )


def timeout_s(parameters: Mapping[str, pb.InferParameter]) -> float | None:
    """Triton's `timeout` parameter in seconds; None when absent or 0 (no timeout)."""
    microseconds = integer_parameter(parameters, TIMEOUT, " (microseconds)")
    return microseconds / 1e6 if microseconds else None


def refuse_sequence(parameters: Mapping[str, pb.InferParameter], model: str) -> None:
    """A request of a sequence (Triton's stateful models) cannot be served as one: say so."""
    if SEQUENCE_ID not in parameters:
        return
    parameter = parameters[SEQUENCE_ID]
    kind = parameter.WhichOneof("parameter_choice")
    if kind is not None and getattr(parameter, kind):
        raise _invalid(
            f"model '{model}' is not a sequence model: hopline's models are stateless, so a "
            "request carries no sequence_id (tritonclient: leave sequence_id at 0)"
        )


@dataclasses.dataclass(frozen=True)
class Requested:
    """An output asked for; `classes`: Triton's classification, its k best classes instead."""

    name: str
    classes: int = 0


def requested_outputs(request: pb.ModelInferRequest, model: str) -> list[Requested]:
    if not request.outputs:
        return [Requested(name) for name in OUTPUTS]
    wanted: dict[str, Requested] = {}
    for output in request.outputs:
        if output.name not in OUTPUTS:
            raise _invalid(
                f"unexpected inference output '{clip(output.name)}' for model '{model}': its "
                f"outputs are {', '.join(OUTPUTS)}"
            )
        where = f" of output '{output.name}'"
        classes = integer_parameter(output.parameters, CLASSIFICATION, where)
        if classes and output.name != CLASSIFIED:
            raise _invalid(
                f"classification applies to output '{CLASSIFIED}' (a score per class), not "
                f"'{output.name}'"
            )
        asked = Requested(output.name, classes)
        if wanted.setdefault(output.name, asked) != asked:  # the same twice: answered once
            raise _invalid(
                f"output '{output.name}' is requested twice with different parameters: "
                "request it once"
            )
    return list(wanted.values())


def classified(answers: Answers, labels: Sequence[str], classes: int) -> bytes:
    """Each answer's `classes` best classes as Triton's classification writes them:
    "<score>:<index>:<label>", best first (ties: the lower index first)."""
    rows = np.asarray([_scores_row(a, labels) for a in answers], dtype=np.float32)
    best = np.argsort(-rows, axis=1, kind="stable")[:, :classes]
    return encode_bytes(
        [f"{rows[r, i]:f}:{i}:{labels[i]}".encode() for r in range(len(rows)) for i in best[r]]
    )


# tritonclient's start_stream(..., enable_empty_final_response=True) asks every response to
# say whether it is its request's last (Triton's decoupled models answer a request many
# times); hopline answers each request once, so each response is the last.
ENABLE_FINAL = "triton_enable_empty_final_response"
FINAL = "triton_final_response"


def final(
    request: pb.ModelInferRequest, reply: pb.ModelStreamInferResponse
) -> pb.ModelStreamInferResponse:
    """`reply`, marked as its request's last where the request asks for the mark (a client
    waiting for it waited for ever)."""
    asked = request.parameters.get(ENABLE_FINAL)
    if (
        asked is not None
        and asked.WhichOneof("parameter_choice") == "bool_param"
        and asked.bool_param
    ):
        reply.infer_response.parameters[FINAL].bool_param = True
    return reply


def _first_leaf(group: BaseExceptionGroup[StatusError]) -> StatusError:
    first = group.exceptions[0]
    return first if isinstance(first, StatusError) else _first_leaf(first)


def _server_version() -> str:
    try:
        return importlib.metadata.version("hopline")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class OpenInferenceService(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, gateway: GatewayService) -> None:
        self.gateway = gateway
        self.version = _server_version()

    def register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(self, server)

    async def ServerLive(
        self,
        request: pb.ServerLiveRequest,
        context: grpc.aio.ServicerContext[pb.ServerLiveRequest, pb.ServerLiveResponse],
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self,
        request: pb.ServerReadyRequest,
        context: grpc.aio.ServicerContext[pb.ServerReadyRequest, pb.ServerReadyResponse],
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.gateway.serving)

    async def ModelReady(
        self,
        request: pb.ModelReadyRequest,
        context: grpc.aio.ServicerContext[pb.ModelReadyRequest, pb.ModelReadyResponse],
    ) -> pb.ModelReadyResponse:
        try:
            info = await self.gateway.resolve_model(request.name, request.version)
        except RequestError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=info.ready and self.gateway.serving)

    async def ServerMetadata(
        self,
        request: pb.ServerMetadataRequest,
        context: grpc.aio.ServicerContext[pb.ServerMetadataRequest, pb.ServerMetadataResponse],
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(
            name=SERVER_NAME, version=self.version, extensions=list(EXTENSIONS)
        )

    async def ModelMetadata(
        self,
        request: pb.ModelMetadataRequest,
        context: grpc.aio.ServicerContext[pb.ModelMetadataRequest, pb.ModelMetadataResponse],
    ) -> pb.ModelMetadataResponse:
        try:
            # Who is asking first, as ModelInfer: a caller without a key learns nothing else.
            self.gateway.tenants.require_key(context.invocation_metadata() or ())
            info = await self.gateway.resolve_model(request.name, request.version)
        except (IdentityError, RequestError) as err:
            await context.abort(err.code, err.message)
        versions = sorted((v for n, v in self.gateway.models if n == info.name), key=int)
        inputs, outputs = tensors(info)
        return pb.ModelMetadataResponse(
            name=info.name,
            versions=versions,
            platform=PLATFORM,
            inputs=[TENSOR_META(**t._asdict()) for t in inputs],
            outputs=[TENSOR_META(**t._asdict()) for t in outputs],
        )

    async def ModelConfig(
        self,
        request: pb.ModelConfigRequest,
        context: grpc.aio.ServicerContext[pb.ModelConfigRequest, pb.ModelConfigResponse],
    ) -> pb.ModelConfigResponse:
        try:
            # Who is asking first, as ModelInfer: a caller without a key learns nothing else.
            self.gateway.tenants.require_key(context.invocation_metadata() or ())
            info = await self.gateway.resolve_model(request.name, request.version)
        except (IdentityError, RequestError) as err:
            await context.abort(err.code, err.message)
        limit = BatchLimit.of(info, self.gateway.admission.max_in_flight)
        config = triton_config(info, PLATFORM, *tensors(info), max_texts=limit.texts)
        return pb.ModelConfigResponse(config=json_format.ParseDict(config, pb.ModelConfig()))

    async def ModelInfer(
        self,
        request: pb.ModelInferRequest,
        context: grpc.aio.ServicerContext[pb.ModelInferRequest, pb.ModelInferResponse],
    ) -> pb.ModelInferResponse:
        metrics.GATEWAY_CALLS.labels("ModelInfer").inc()
        try:
            metadata = tuple(context.invocation_metadata() or ())
            return await self.infer(request, metadata, self.gateway.timeout_for(context))
        except StatusError as err:
            await abort(context, err)

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[pb.ModelInferRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        metadata = tuple(context.invocation_metadata() or ())
        turns = StreamTurns(self.gateway.admission)

        async def answer(request: pb.ModelInferRequest) -> pb.ModelStreamInferResponse:
            with stream_message_span(request.id) as span:
                try:
                    reply = pb.ModelStreamInferResponse(
                        infer_response=await self.infer(
                            request, metadata, self.gateway.timeout_for(context), turns
                        )
                    )
                except Exception as exc:  # one request's failure must not end the others
                    failed = message_failed(span, exc, request.id, MODEL_STREAM_INFER)
                    reply = pb.ModelStreamInferResponse(
                        error_message=f"{failed.code.name}: {failed.message}",
                        infer_response=pb.ModelInferResponse(
                            model_name=request.model_name,
                            model_version=request.model_version,
                            id=clipped_id(request.id),  # to match it by
                        ),
                    )
                else:
                    message_answered(MODEL_STREAM_INFER)
            return final(request, reply)

        stream = serve_stream(
            self.gateway, request_iterator, context, MODEL_STREAM_INFER, answer, texts_in
        )
        async for reply in stream:
            yield reply

    async def infer(
        self,
        request: pb.ModelInferRequest,
        metadata: Sequence[tuple[str, str | bytes]],
        deadline_s: float,
        stream: StreamTurns | None = None,
    ) -> pb.ModelInferResponse:
        """One inference request, alone or on a stream; raises a StatusError. `stream`: the
        turns its stream's texts share (else the request's own, when it needs them)."""
        started = time.perf_counter()
        gateway = self.gateway
        # Counted as it comes, as Predict is: a request refused before its texts are accepted is
        # one (failed ModelInfers were in no count: an SRE's probe); its other texts below.
        metrics.GATEWAY_REQUESTS.inc()
        # Identity first, as Predict does: an unauthenticated caller learns nothing else.
        try:
            claimed = string_parameter(request.parameters, "tenant")
        except RequestError:
            gateway.tenants.require_key(metadata)  # a caller without a key learns no more
            raise
        tenant = gateway.tenants.resolve(claimed, metadata)
        check_id(request.id)
        mode = cache_mode(request.parameters)
        asked_s = timeout_s(request.parameters)
        if asked_s is not None:
            deadline_s = min(deadline_s, asked_s)
        info = await gateway.resolve_model(request.model_name, request.model_version, deadline_s)
        refuse_sequence(request.parameters, info.name)
        limit = BatchLimit.of(info, gateway.admission.max_in_flight)
        texts = decode_texts(request, info.name, limit)
        for i, text in enumerate(texts):
            where = f"element {i} of input '{TEXT_INPUT}'"
            gateway.check_text(text, where=where)
            if not normalise_text(text):
                raise unreadable(where)
        outputs = requested_outputs(request, info.name)
        # All scores only when asked for: label and score alone share Predict's cache
        # entries (top_k is part of the cache scope).
        top_k = len(info.labels) if any(o.name == CLASSIFIED for o in outputs) else 1
        metrics.GATEWAY_REQUESTS.inc(max(len(texts) - 1, 0))
        turns, places = None, 0
        if len(texts) > 1:  # admitted whole, in its turn width's places (Admission.hold)
            width = gateway.admission.batch_width(tenant)
            places = min(width, len(texts)) if width else len(texts)
        if stream is not None:
            # Its texts take the stream's turns too; admitted text by text, a stream's
            # requests were refused halfway, their first texts' work thrown away (a load
            # probe: 20 of 60 requests, 420 texts tokenized and cancelled).
            turns = stream.for_tenant(tenant)
        elif places < len(texts):
            turns = Turns(lambda: places)
        answers = await self._predict_all(
            texts, info, tenant, top_k, mode, deadline_s, started, turns, places
        )
        return self._response(request, info, tenant, outputs, answers)

    async def _predict_all(
        self,
        texts: Sequence[str],
        info: inference_pb2.ModelInfo,
        tenant: str,
        top_k: int,
        mode: common_pb2.CacheMode.ValueType,
        timeout_s: float,
        started: float,
        turns: Turns | None,
        places: int = 0,
    ) -> list[gateway_pb2.PredictResponse]:
        """Every text at once, or as `turns` lets them (gateway/admission.py:batch_width);
        with `places`, in that many the batch holds (`Admission.hold`), refused whole."""
        failure: StatusError | None = None
        admission = self.gateway.admission
        held = (
            admission.hold(tenant, places, timeout_s - (time.perf_counter() - started))
            if places
            else contextlib.nullcontext()
        )

        async def one(i: int, text: str) -> gateway_pb2.PredictResponse:
            async with turns or contextlib.nullcontext():
                return await self._predict_one(
                    i, text, info, tenant, top_k, mode, timeout_s, started
                )

        try:
            # A TaskGroup cancels the other texts as soon as one fails: the request fails anyway.
            with held:
                async with asyncio.TaskGroup() as group:
                    tasks = [group.create_task(one(i, text)) for i, text in enumerate(texts)]
        # A failed hop, or the gateway's admission refusing a text (gateway/admission.py).
        except* StatusError as failed:
            # Not raised here: an exception raised inside except* is wrapped in a group again.
            failure = _first_leaf(failed)
        if failure is not None:
            raise failure
        return [task.result() for task in tasks]

    async def _predict_one(
        self,
        index: int,
        text: str,
        info: inference_pb2.ModelInfo,
        tenant: str,
        top_k: int,
        mode: common_pb2.CacheMode.ValueType,
        timeout_s: float,
        started: float,
    ) -> gateway_pb2.PredictResponse:
        """One text, under a span of its own (as a stream's message): its hops hang under
        it and its cache outcome is on it, not on the RPC's span, where the texts'
        attributes overwrote each other."""
        with child_span(schema.SPAN_INFER_TEXT, attributes={schema.TEXT_INDEX: index}, quiet=True):
            return await self.gateway.predict_text(
                text, info, tenant, top_k, mode, timeout_s, started
            )

    @staticmethod
    def _response(
        request: pb.ModelInferRequest,
        info: inference_pb2.ModelInfo,
        tenant: str,
        outputs: Sequence[Requested],
        answers: Answers,
    ) -> pb.ModelInferResponse:
        response = pb.ModelInferResponse(
            model_name=info.name, model_version=info.version, id=request.id
        )
        response.parameters["tenant"].string_param = tenant
        response.parameters["trace_id"].string_param = current_trace_id()
        labels = list(info.labels)
        for wanted in outputs:
            if wanted.classes:
                classes = min(wanted.classes, len(labels))
                shape = [len(answers), classes]
                response.outputs.add(name=wanted.name, datatype="BYTES", shape=shape)
                response.raw_output_contents.append(classified(answers, labels, classes))
                continue
            output = OUTPUTS[wanted.name]
            shape = output.shape(len(answers), len(labels))
            response.outputs.add(name=wanted.name, datatype=output.datatype, shape=shape)
            response.raw_output_contents.append(output.encode(answers, labels))
        return response
