"""Malformed requests against both front-door APIs of a real mesh, from a fixed seed.

Predict and KServe ModelInfer each get thousands of bad requests as raw bytes (no client-side
serializer, so nothing is checked before the gateway sees it): random bytes, truncated and
bit-flipped valid messages, strings that are not UTF-8, cache modes outside the enum, huge
strings, bad tensor shapes, datatypes, raw contents and parameters. Every answer must be a
client-mistake status (or OK, where a mutation happens to be a valid request) with a short
message naming no address; never UNKNOWN or INTERNAL. Afterwards the gateway is alive, its log
holds no traceback, the undecodable ones were counted, and a valid request is answered as
before.

ModelInfer requests are built with tritonclient's stubs (the same wire protocol), never
hopline's KServe stubs: both claim the protobuf package `inference` in this pytest process.
"""

from __future__ import annotations

import asyncio
import collections
import random
import re
import struct
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from tritonclient.grpc import service_pb2

from harness import SERVING, Mesh, health
from hopline.protos.hopline.gateway.v1 import gateway_pb2

SEED = 20_240_607
PER_API = 2_600  # requests per API: 5,200 in all
CONCURRENCY = 16
PREDICT = "/hopline.gateway.v1.GatewayService/Predict"
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
MODEL = "support-intents"
TEXTS = [
    "where is my parcel",
    "reset my password",
    "I was charged twice for my order",
    "talk to a human",
    "cancel my subscription please",
]
ALLOWED = {
    grpc.StatusCode.OK,  # a mutation can still be a valid request
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # a text over HOPLINE_MAX_TEXT_BYTES
}
INVALID = {grpc.StatusCode.INVALID_ARGUMENT}
MARK = "\x01MARK\x01"  # a placeholder replaced on the wire by as many bytes of bad UTF-8
BAD_UTF8 = [b"\xff\xfe\xfd\xfc\xfb\xfa", b"\xc0\x80\xc0\x80\xc0\x80", b"\xed\xa0\x80abc"]
ADDRESS = re.compile(r"\d+\.\d+\.\d+\.\d+:\d+|ipv[46]:|unix:")

Case = tuple[str, str, bytes, set[grpc.StatusCode]]  # (method, kind, bytes, statuses allowed)


def bad_utf8(message: bytes, rng: random.Random) -> bytes:
    """`message` with its MARK placeholder replaced by bytes that are not UTF-8."""
    marker = MARK.encode()
    assert marker in message
    return message.replace(marker, rng.choice(BAD_UTF8)[: len(marker)].ljust(len(marker), b"\xff"))


def mutations(valid: bytes, rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """Generic damage to a valid message: random bytes, truncation, flipped bits."""
    while True:
        roll = rng.random()
        if roll < 0.3:
            yield "random", rng.randbytes(rng.randint(0, 96))
        elif roll < 0.6:
            yield "truncated", valid[: rng.randint(0, len(valid) - 1)]
        elif roll < 0.9:
            data = bytearray(valid)
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            yield "bitflip", bytes(data)
        else:
            # A valid prefix, then garbage (a bad tag, a wire type protobuf does not have).
            tail = rng.choice([b"\x00", b"\x07\x01", b"\xff" * 11, rng.randbytes(8)])
            yield "garbage_tail", valid + tail


# -- Predict ----------------------------------------------------------------------------------


def predict(**fields: Any) -> bytes:
    return gateway_pb2.PredictRequest(**fields).SerializeToString()


def predict_cases(rng: random.Random) -> list[Case]:
    def valid() -> bytes:
        return predict(text=rng.choice(TEXTS), model=MODEL, top_k=rng.randint(1, 3))

    targeted: list[Callable[[], tuple[str, bytes, set[grpc.StatusCode]]]] = [
        lambda: ("bad_utf8_text", bad_utf8(predict(text=f"hi {MARK}"), rng), INVALID),
        lambda: ("bad_utf8_model", bad_utf8(predict(text="hi", model=MARK), rng), INVALID),
        lambda: (
            "bad_utf8_version",
            bad_utf8(predict(text="hi", model_version=MARK), rng),
            INVALID,
        ),
        lambda: ("bad_utf8_tenant", bad_utf8(predict(text="hi", tenant=MARK), rng), INVALID),
        lambda: (
            "enum_out_of_range",
            predict(
                text=rng.choice(TEXTS),
                cache_mode=rng.choice([4, 5, 99, 2**31 - 1, -1, -(2**31)]),
            ),
            INVALID,
        ),
        lambda: (
            "huge_model",
            predict(text="hi", model="m" * rng.randint(8_000, 20_000)),
            {grpc.StatusCode.NOT_FOUND},
        ),
        lambda: (
            "huge_version",
            predict(text="hi", model=MODEL, model_version="9" * rng.randint(8_000, 20_000)),
            {grpc.StatusCode.NOT_FOUND},
        ),
        lambda: (
            "huge_text",
            predict(text="a" * rng.randint(16_385, 60_000)),
            {grpc.StatusCode.RESOURCE_EXHAUSTED},
        ),
        lambda: ("huge_tenant", predict(text="hi", tenant="t" * 16_384), INVALID),
        lambda: ("empty_text", predict(text=rng.choice(["", " ", "\n\t"])), INVALID),
        lambda: (
            "bad_top_k",
            predict(text="hi", top_k=rng.choice([-1, -(2**31), 27, 1000, 2**31 - 1])),
            INVALID,
        ),
    ]
    return _mix(PREDICT, rng, valid, targeted)


# -- ModelInfer -------------------------------------------------------------------------------


def encode_bytes(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def infer(
    texts: list[bytes] | None = None,
    *,
    model: str = MODEL,
    name: str = "text",
    datatype: str = "BYTES",
    shape: list[int] | None = None,
    raw: list[bytes] | None = None,
    outputs: list[str] | None = None,
    parameters: dict[str, Any] | None = None,
    **fields: Any,
) -> bytes:
    texts = [b"where is my parcel"] if texts is None else texts
    request = service_pb2.ModelInferRequest(model_name=model, **fields)
    tensor = request.inputs.add(name=name, datatype=datatype)
    tensor.shape.extend([len(texts)] if shape is None else shape)
    request.raw_input_contents.extend([encode_bytes(texts)] if raw is None else raw)
    for output in outputs or []:
        request.outputs.add(name=output)
    for key, value in (parameters or {}).items():
        if isinstance(value, str):
            request.parameters[key].string_param = value
        else:
            request.parameters[key].int64_param = value
    return bytes(request.SerializeToString())


def model_infer_cases(rng: random.Random) -> list[Case]:
    def valid() -> bytes:
        return infer([t.encode() for t in rng.sample(TEXTS, rng.randint(1, 3))])

    typed = service_pb2.ModelInferRequest(model_name=MODEL)
    both = typed.inputs.add(name="text", datatype="BYTES", shape=[1])
    both.contents.bytes_contents.append(b"hi")
    typed.raw_input_contents.append(encode_bytes([b"hi"]))
    both_bytes = bytes(typed.SerializeToString())
    wrong_typed = service_pb2.ModelInferRequest(model_name=MODEL)
    wrong_typed.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.int_contents.append(1)
    wrong_typed_bytes = bytes(wrong_typed.SerializeToString())

    bad_parameters: list[dict[str, Any]] = [
        {"tenant": 7},
        {"cache_mode": "sometimes"},
        {"cache_mode": "c" * 20_000},
        {"cache_mode": 1},
        {"tenant": "t" * 20_000},
    ]
    targeted: list[Callable[[], tuple[str, bytes, set[grpc.StatusCode]]]] = [
        lambda: ("bad_utf8_model", bad_utf8(infer(model=MARK), rng), INVALID),
        lambda: ("bad_utf8_input_name", bad_utf8(infer(name=MARK), rng), INVALID),
        lambda: ("bad_utf8_datatype", bad_utf8(infer(datatype=MARK), rng), INVALID),
        lambda: ("bad_utf8_id", bad_utf8(infer(id=MARK), rng), INVALID),
        lambda: (
            "bad_utf8_parameter",
            bad_utf8(infer(parameters={rng.choice(["tenant", MARK]): MARK}), rng),
            INVALID,
        ),
        lambda: ("bad_utf8_output", bad_utf8(infer(outputs=[MARK]), rng), INVALID),
        lambda: ("bad_utf8_element", infer([b"ok", rng.choice(BAD_UTF8)]), INVALID),
        lambda: (
            "bad_shape",
            infer(
                shape=rng.choice(
                    [[], [0], [-1], [-7], [2], [1, 1], [2**62], [1] * rng.randint(2, 300)]
                )
            ),
            INVALID,
        ),
        lambda: (
            "bad_datatype",
            infer(datatype=rng.choice(["FP32", "INT64", "", "bytes", "STRING", "B" * 20_000])),
            INVALID,
        ),
        lambda: (
            "bad_raw",
            infer(
                raw=rng.choice(
                    [
                        [b"\x05\x00"],  # ends inside a length prefix
                        [b"\x32\x00\x00\x00hi"],  # declares 50 bytes, 2 follow
                        [encode_bytes([b"hi"]), b"extra"],  # more entries than inputs
                        [],  # no data at all
                    ]
                )
            ),
            INVALID,
        ),
        lambda: ("raw_and_contents", both_bytes, INVALID),
        lambda: ("wrong_typed_contents", wrong_typed_bytes, INVALID),
        lambda: ("bad_input_name", infer(name=rng.choice(["TEXT", "", "x" * 20_000])), INVALID),
        lambda: ("bad_parameter", infer(parameters=rng.choice(bad_parameters)), INVALID),
        lambda: (
            "bad_output",
            infer(outputs=[rng.choice(["logits", "", "o" * 20_000])]),
            INVALID,
        ),
        lambda: (
            "huge_model",
            infer(model="m" * rng.randint(8_000, 20_000)),
            {grpc.StatusCode.NOT_FOUND},
        ),
        lambda: ("empty_element", infer([b"hi", b"  "]), INVALID),
        lambda: (
            "huge_element",
            infer([b"a" * 17_000]),
            {grpc.StatusCode.RESOURCE_EXHAUSTED},
        ),
        lambda: ("over_max_batch", infer([b"hi"] * rng.randint(65, 500)), INVALID),
    ]
    return _mix(MODEL_INFER, rng, valid, targeted)


def _mix(
    method: str,
    rng: random.Random,
    valid: Callable[[], bytes],
    targeted: list[Callable[[], tuple[str, bytes, set[grpc.StatusCode]]]],
) -> list[Case]:
    """PER_API cases: half generic damage to valid messages, half targeted mistakes."""
    cases: list[Case] = []
    for i in range(PER_API):
        if i % 2:
            kind, data = next(mutations(valid(), rng))
            cases.append((method, kind, data, ALLOWED))
        else:
            kind, data, expected = rng.choice(targeted)()
            cases.append((method, kind, data, expected))
    return cases


# -- the test ---------------------------------------------------------------------------------


def _identity(data: bytes) -> bytes:
    return data


async def _send(target: str, cases: list[Case]) -> list[tuple[grpc.StatusCode, str]]:
    async with grpc.aio.insecure_channel(target) as channel:
        calls = {
            method: channel.unary_unary(
                method, request_serializer=_identity, response_deserializer=_identity
            )
            for method in (PREDICT, MODEL_INFER)
        }
        slots = asyncio.Semaphore(CONCURRENCY)

        async def one(method: str, data: bytes) -> tuple[grpc.StatusCode, str]:
            async with slots:
                try:
                    await calls[method](data, timeout=30)
                except grpc.aio.AioRpcError as err:
                    return err.code(), err.details() or ""
                return grpc.StatusCode.OK, ""

        return await asyncio.gather(*(one(method, data) for method, _, data, _ in cases))


def _undecodable_counted(mesh: Mesh) -> int:
    port = mesh.metrics_ports["gateway"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return int(
        sum(
            float(line.rpartition(" ")[2])
            for line in text.splitlines()
            if line.startswith("hopline_undecodable_requests_total{")
        )
    )


def _valid_answers(mesh: Mesh) -> tuple[str, list[str]]:
    """A Predict's label and a ModelInfer's labels, over plain (typed) stubs."""
    with grpc.insecure_channel(mesh.gateway) as channel:
        reply = channel.unary_unary(
            PREDICT,
            request_serializer=_identity,
            response_deserializer=gateway_pb2.PredictResponse.FromString,
        )(predict(text=TEXTS[0], cache_mode=2), timeout=30)  # BYPASS: a fresh inference
        answer = channel.unary_unary(
            MODEL_INFER,
            request_serializer=_identity,
            response_deserializer=service_pb2.ModelInferResponse.FromString,
        )(infer([t.encode() for t in TEXTS], outputs=["label"]), timeout=30)
    raw = answer.raw_output_contents[0]
    labels, offset = [], 0
    while offset < len(raw):
        (size,) = struct.unpack_from("<I", raw, offset)
        labels.append(raw[offset + 4 : offset + 4 + size].decode())
        offset += 4 + size
    return reply.prediction.label, labels


def test_thousands_of_malformed_requests_get_client_statuses_and_break_nothing(
    mesh: Mesh,
) -> None:
    before = _valid_answers(mesh)
    counted_before = _undecodable_counted(mesh)
    rng = random.Random(SEED)
    cases = predict_cases(rng) + model_infer_cases(rng)
    rng.shuffle(cases)

    started = time.perf_counter()
    answers = asyncio.run(_send(mesh.gateway, cases))
    elapsed = time.perf_counter() - started

    histogram: collections.Counter[str] = collections.Counter()
    by_kind: dict[tuple[str, str], collections.Counter[str]] = collections.defaultdict(
        collections.Counter
    )
    wrong: list[str] = []
    undecodable = 0
    for (method, kind, data, expected), (code, details) in zip(cases, answers, strict=True):
        api = method.rpartition("/")[2]
        histogram[code.name] += 1
        by_kind[api, kind][code.name] += 1
        undecodable += details.startswith("the request is not a valid ")
        problems = []
        if code not in expected:
            problems.append("status")
        if len(details) > 600:
            problems.append(f"{len(details)}-char message")
        if ADDRESS.search(details):
            problems.append("an address in the message")
        if problems:
            wrong.append(f"{api}/{kind} {code.name} {problems} {details[:200]!r} {data[:60]!r}")
    summary = f"{len(cases)} requests in {elapsed:.1f} s, seed {SEED}: {dict(histogram)}"
    print(summary)
    for (api, kind), codes in sorted(by_kind.items()):
        print(f"  {api:10s} {kind:22s} {dict(codes)}")
    assert len(cases) >= 5_000
    assert not wrong, f"{summary}\n" + "\n".join(wrong[:40])
    assert not {"UNKNOWN", "INTERNAL"} & set(histogram)
    assert undecodable > 1_000  # the decoding path was exercised, not only validation

    # Nothing broke: the gateway is up, logged no traceback, counted each undecodable request,
    # and a valid request gets the same answers as before.
    assert "gateway" not in mesh.exited()
    assert health(mesh.gateway) == SERVING
    log = mesh.log("gateway")
    assert "Traceback" not in log
    assert "Unexpected" not in log
    assert _undecodable_counted(mesh) - counted_before == undecodable
    assert _valid_answers(mesh) == before


@pytest.mark.parametrize("api", ["predict", "model_infer"])
def test_the_corpus_is_fixed_by_its_seed(api: str) -> None:
    build = predict_cases if api == "predict" else model_infer_cases
    first = build(random.Random(SEED))
    assert first == build(random.Random(SEED))
    assert len(first) == PER_API
