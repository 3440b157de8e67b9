"""PredictStream: many requests on one stream, answered by id, failures per request."""

from __future__ import annotations

import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from harness import NOT_SERVING, TOPOLOGIES, Mesh, health
from hopline.gateway.config import GatewayConfig
from hopline.gateway.streaming import MAX_ID_BYTES
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.runtime import config as cfg

# Every test here passes with the stateless stages in their own processes and in the gateway.
MESH_TOPOLOGIES = TOPOLOGIES

OK = grpc.StatusCode.OK.value[0]
# HOPLINE_STREAM_MAX_IN_FLIGHT as the meshes here run it (its default).
MAX_IN_FLIGHT = cfg.load(GatewayConfig, []).stream_max_in_flight


def stream_of(
    *requests: tuple[str, gateway_pb2.PredictRequest],
) -> Iterator[gateway_pb2.PredictStreamRequest]:
    for rid, request in requests:
        yield gateway_pb2.PredictStreamRequest(id=rid, request=request)


def test_every_request_is_answered_once_by_id_and_failures_stay_per_request(
    mesh: Mesh,
) -> None:
    salt = uuid.uuid4().hex[:8]
    texts = {
        f"r{n}": f"{text} {salt}"
        for n, text in enumerate(
            [
                "where is my order",
                "I want a refund for my purchase",
                "cancel my subscription please",
                "how do I reset my password",
            ]
            * 5
        )
    }
    requests = [(rid, gateway_pb2.PredictRequest(text=t, tenant="s")) for rid, t in texts.items()]
    requests.insert(3, ("empty", gateway_pb2.PredictRequest(text="  ")))
    requests.insert(7, ("nomodel", gateway_pb2.PredictRequest(text="hi", model="no-such-model")))
    counted = {code: _messages(mesh, code) for code in ("OK", "INVALID_ARGUMENT", "NOT_FOUND")}
    with grpc.insecure_channel(mesh.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        replies = list(stub.PredictStream(stream_of(*requests), timeout=60))
        # The same texts through unary Predict, for the labels to compare with.
        unary = {
            rid: stub.Predict(gateway_pb2.PredictRequest(text=t, tenant="s"), timeout=30)
            for rid, t in texts.items()
        }
    by_id = {r.id: r for r in replies}
    assert len(replies) == len(requests) == len(by_id), [r.id for r in replies]
    assert by_id["empty"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "empty" in by_id["empty"].message
    assert not by_id["empty"].HasField("response")
    assert by_id["nomodel"].code == grpc.StatusCode.NOT_FOUND.value[0]
    assert "no-such-model" in by_id["nomodel"].message
    for rid in texts:
        assert by_id[rid].code == OK, by_id[rid].message
        assert by_id[rid].response.prediction.label == unary[rid].prediction.label, rid
    # One stream, one trace: every request on it is a subtree of the stream's span. Every
    # message carries it, a failed one's too (they had none: response is unset on failure).
    assert len({by_id[rid].response.trace_id for rid in texts}) == 1
    stream_trace = by_id["r0"].response.trace_id
    assert len(stream_trace) == 32
    assert {r.trace_id for r in replies} == {stream_trace}
    # Each message's status is counted: the stream's own RPC is OK, and its failed messages
    # were in no metric.
    assert {code: _messages(mesh, code) - n for code, n in counted.items()} == {
        "OK": len(texts),
        "INVALID_ARGUMENT": 1,
        "NOT_FOUND": 1,
    }


def _messages(mesh: Mesh, code: str) -> float:
    said = gateway_metric(
        mesh, f'hopline_stream_messages_total{{code="{code}",method="PredictStream"}}'
    )
    return said or 0.0


def test_an_empty_stream_ends_cleanly(mesh: Mesh) -> None:
    with grpc.insecure_channel(mesh.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        assert list(stub.PredictStream(iter(()), timeout=10)) == []


def gateway_metric(mesh: Mesh, line_start: str) -> float | None:
    url = f"http://127.0.0.1:{mesh.metrics_ports['gateway']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(line_start):
                return float(line.rsplit(" ", 1)[1])
    return None


def test_a_cancelled_stream_is_closed_out_and_the_gateway_carries_on(mesh: Mesh) -> None:
    """The interceptor follows a stream to its end, cancellation included: the in-flight
    gauge drops back and the stream's latency is recorded once.

    Recorded as CANCELLED or as OK: when a client's cancel lands between messages, grpc.aio
    hands the handler an end of input, indistinguishable from a half-close (the context says
    neither cancelled nor done), and the handler may finish before grpc cancels its task.
    Measured on a bare grpc.aio bidi server shaped like PredictStream: 10 of 400 such cancels
    ended as a normal end of input. Waiting for CANCELLED alone failed this test by chance.
    """
    in_flight = 'hopline_rpc_in_flight{method="PredictStream",service="hopline.gateway.v1.'
    ended = [
        f'hopline_rpc_duration_seconds_count{{code="{code}",method="PredictStream",'
        'service="hopline.gateway.v1.GatewayService"}'
        for code in ("CANCELLED", "OK")
    ]

    def streams_ended() -> float:
        return sum(gateway_metric(mesh, line) or 0.0 for line in ended)

    before = streams_ended()
    more = threading.Event()

    def client() -> Iterator[gateway_pb2.PredictStreamRequest]:
        yield gateway_pb2.PredictStreamRequest(
            id="a", request=gateway_pb2.PredictRequest(text="where is my order")
        )
        more.wait(30)  # holds the stream open until the test cancels it

    with grpc.insecure_channel(mesh.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        call = stub.PredictStream(client(), timeout=30)
        first = next(iter(call))  # grpc-stubs types the call as iterable, not an iterator
        assert first.id == "a"
        assert first.code == OK
        assert gateway_metric(mesh, in_flight) == 1.0
        call.cancel()  # type: ignore[no-untyped-call]  # unannotated in grpc-stubs
        more.set()
        deadline = time.monotonic() + 10
        while streams_ended() != before + 1:
            assert time.monotonic() < deadline, "the cancelled stream was never closed out"
            time.sleep(0.05)
        assert gateway_metric(mesh, in_flight) == 0.0
        reply = stub.Predict(gateway_pb2.PredictRequest(text="where is my order"), timeout=10)
        assert reply.prediction.label


def test_a_client_that_does_not_read_is_held_back_and_loses_nothing(mesh: Mesh) -> None:
    """A client that sends a stream of requests and reads none of the responses: the gateway
    answers about its in-flight limit plus what the HTTP/2 windows hold, then stops reading
    (before, it answered every request it was sent and queued the responses in memory), and
    once the client reads, every request is answered, by its id.

    The client turns off gRPC's window growth (BDP probing) so that what the windows hold is
    their 64 KiB start, the same on every machine."""
    sent = 20_000
    text = f"I forgot my password {uuid.uuid4().hex[:8]}"
    before = int(mesh.gateway_counters()["requests"])
    options = [("grpc.http2.bdp_probe", 0)]
    with grpc.insecure_channel(mesh.gateway, options=options) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        requests = ((str(n), gateway_pb2.PredictRequest(text=text)) for n in range(sent))
        call = stub.PredictStream(stream_of(*requests), timeout=120)
        answered, last = 0, -1
        deadline = time.monotonic() + 60
        # Until the gateway has answered some and then stops: not before it starts.
        while answered != last or answered < MAX_IN_FLIGHT:
            assert time.monotonic() < deadline, f"still answering after 60 s: {answered}"
            time.sleep(1.0)
            last, answered = answered, int(mesh.gateway_counters()["requests"]) - before
        # MAX_IN_FLIGHT, and the replies 64 KiB windows hold (293 on the machine it was
        # written on); without the hold, all 20,000.
        assert answered < 2_000, answered
        ids = [reply.id for reply in call if reply.code == OK]
    assert sorted(ids, key=int) == [str(n) for n in range(sent)]


def test_what_a_client_writes_ahead_of_the_gateway_is_held_back_at_its_window(
    mesh: Mesh,
) -> None:
    """A client that writes and never reads: past the requests it works on the gateway stops
    reading, and gRPC must then stop taking the client's messages at the stream's window.
    It had grown that window with the measured bandwidth-delay product, and 4.2 MB of
    requests a stream waited in the gateway's memory (100 such streams: 425 MB; a probe).
    The client's own receive window is fixed (as in the test above), so what it measures is
    what the gateway let in: requests taken from the client's iterator."""
    text = f"tell me about my order {uuid.uuid4().hex} " + "x" * 4_000
    pulled = 0
    lock = threading.Lock()

    def requests() -> Iterator[gateway_pb2.PredictStreamRequest]:
        nonlocal pulled
        for n in range(100_000):
            with lock:
                pulled += 1
            request = gateway_pb2.PredictRequest(text=text, cache_mode=common_pb2.CACHE_MODE_BYPASS)
            yield gateway_pb2.PredictStreamRequest(id=str(n), request=request)

    options = [("grpc.http2.bdp_probe", 0)]
    with grpc.insecure_channel(mesh.gateway, options=options) as channel:
        call = gateway_pb2_grpc.GatewayServiceStub(channel).PredictStream(requests(), timeout=120)
        taken, last = 0, -1
        deadline = time.monotonic() + 60
        while taken != last or taken < MAX_IN_FLIGHT:  # until the client is held back
            assert time.monotonic() < deadline, f"still taking requests after 60 s: {taken}"
            time.sleep(1.0)
            with lock:
                last, taken = taken, pulled
        call.cancel()  # type: ignore[no-untyped-call]  # unannotated in grpc-stubs
    # The requests worked on, those whose answers the client's 64 KiB window holds, and 64
    # KiB of requests (16 of these): about 200; with the window grown, over 1,000.
    assert taken < 600, taken


def test_streams_are_refused_until_the_gateway_is_ready(default_repo: Path, tmp_path: Path) -> None:
    """A gateway whose inference service never answers stays NOT_SERVING; a stream opened
    then is refused UNAVAILABLE by the readiness gate, like a unary call."""
    alone = Mesh(default_repo, tmp_path)
    alone.spawn(("gateway",))
    try:
        deadline = time.monotonic() + 60
        while health(alone.gateway) != NOT_SERVING:
            assert alone.procs["gateway"].poll() is None, alone.log("gateway")
            assert time.monotonic() < deadline, alone.log("gateway")
            time.sleep(0.2)
        with grpc.insecure_channel(alone.gateway) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            request = gateway_pb2.PredictRequest(text="hi")
            with pytest.raises(grpc.RpcError) as info:
                list(stub.PredictStream(stream_of(("a", request)), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "not ready" in (info.value.details() or "")
    finally:
        alone.stop()


def test_streams_past_the_gateways_limit_are_refused_and_the_open_ones_served(
    default_repo: Path, tmp_path: Path
) -> None:
    """One client could open any number of PredictStreams (5,000 in a probe, about 30 KB of
    the gateway's memory each, idle). Past HOPLINE_GATEWAY_MAX_STREAMS a new one is refused
    RESOURCE_EXHAUSTED before it reads a message; the open ones still answer, and a closed
    one's place is taken again."""
    limited = Mesh(default_repo, tmp_path, HOPLINE_GATEWAY_MAX_STREAMS="2")
    limited.start()
    request = gateway_pb2.PredictRequest(text="where is my parcel")
    sends: list[threading.Event] = []

    def held(stub: gateway_pb2_grpc.GatewayServiceStub) -> tuple[Any, threading.Event]:
        """A stream that sends one request now and a second when its event is set."""
        more = threading.Event()
        sends.append(more)

        def requests() -> Iterator[gateway_pb2.PredictStreamRequest]:
            yield gateway_pb2.PredictStreamRequest(id="first", request=request)
            more.wait(60)
            yield gateway_pb2.PredictStreamRequest(id="second", request=request)

        call = stub.PredictStream(requests(), timeout=60)
        assert next(iter(call)).id == "first"  # open, read and answered
        return call, more

    try:
        with grpc.insecure_channel(limited.gateway) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            first, more_first = held(stub)
            second, more_second = held(stub)
            with pytest.raises(grpc.RpcError) as info:
                list(stub.PredictStream(stream_of(("a", request)), timeout=30))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "HOPLINE_GATEWAY_MAX_STREAMS" in (info.value.details() or "")
            more_first.set()  # the open streams are served on, and end cleanly
            assert [r.id for r in first] == ["second"]
            third = list(stub.PredictStream(stream_of(("a", request)), timeout=30))
            assert [r.code for r in third] == [OK]  # the closed stream's place
            more_second.set()
            assert [r.id for r in second] == ["second"]
    finally:
        for event in sends:
            event.set()
        limited.stop()


def test_a_drain_answers_what_a_stream_read_and_ends_it_unavailable(
    default_repo: Path, tmp_path: Path
) -> None:
    """SIGTERM to the gateway while a client keeps sending on a stream: once the drain delay
    is over the gateway stops reading it, answers every request it read, and ends the stream
    UNAVAILABLE, so the client knows to send the rest elsewhere. Before, the stream kept
    taking requests through the whole grace period and was then cut off ("Cancelling all
    calls") with answers in flight."""
    grace_s = 30.0
    mesh = Mesh(default_repo, tmp_path, HOPLINE_DRAIN_GRACE_S=str(grace_s)).start()
    sent: list[str] = []
    stop = threading.Event()

    def requests() -> Iterator[gateway_pb2.PredictStreamRequest]:
        n = 0
        while not stop.is_set():
            rid = f"r{n}"
            sent.append(rid)
            yield gateway_pb2.PredictStreamRequest(
                id=rid, request=gateway_pb2.PredictRequest(text=f"where is parcel {n}")
            )
            n += 1
            time.sleep(0.05)

    try:
        with grpc.insecure_channel(mesh.gateway) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            call = stub.PredictStream(requests(), timeout=120)
            answered: list[gateway_pb2.PredictStreamResponse] = []

            def read_all() -> None:
                for reply in call:
                    answered.append(reply)
                    if len(answered) == 10:
                        mesh.procs["gateway"].terminate()  # SIGTERM

            with pytest.raises(grpc.RpcError) as info:
                read_all()
            stop.set()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
        assert "shutting down" in (info.value.details() or "")
        assert len(answered) > 10  # requests kept being answered through the drain delay
        assert all(r.code == OK for r in answered), [r.message for r in answered if r.code]
        # What was read was answered, none lost: requests are read in the order sent.
        assert sorted(r.id for r in answered) == sorted(sent[: len(answered)])
        assert mesh.procs["gateway"].wait(timeout=60) == 0
        assert "grace period over" not in mesh.log("gateway")
    finally:
        stop.set()
        mesh.stop()


def test_a_drain_ends_a_half_closed_stream_ok_once_it_is_answered(
    default_repo: Path, tmp_path: Path
) -> None:
    """A client that sent its last request and half-closed, its answers still on their way
    (inference slowed on purpose) when the gateway drains: every request is answered and the
    stream ends OK. Before, the drain ended it UNAVAILABLE after answering everything, so a
    client took a finished stream for a failed one and sent it all again elsewhere."""
    mesh = Mesh(
        default_repo,
        tmp_path,
        service_env={"inference": {"HOPLINE_TEST_DELAY_MS": "1500"}},
        HOPLINE_DRAIN_GRACE_S="30",
    ).start()
    salt = uuid.uuid4().hex[:8]
    ids = [f"h{n}" for n in range(3)]
    try:
        with grpc.insecure_channel(mesh.gateway) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            call = stub.PredictStream(
                iter(
                    gateway_pb2.PredictStreamRequest(
                        id=rid,
                        request=gateway_pb2.PredictRequest(text=f"where is parcel {rid} {salt}"),
                    )
                    for rid in ids
                ),
                timeout=60,
            )
            time.sleep(0.5)  # read and half-closed; the answers wait on inference
            mesh.procs["gateway"].terminate()  # SIGTERM
            answered = list(call)  # raises if the stream does not end OK
        assert sorted(r.id for r in answered) == ids
        assert all(r.code == OK for r in answered), [r.message for r in answered if r.code]
        assert mesh.procs["gateway"].wait(timeout=60) == 0
    finally:
        mesh.stop()


def test_an_undecodable_message_ends_the_stream_after_answering_what_came_before(
    mesh: Mesh,
) -> None:
    """Five good requests, then bytes that are not a PredictStreamRequest: the stream ends
    INVALID_ARGUMENT naming the message type, and the five read before it are answered
    first (before, the gateway did their work and dropped their answers)."""
    salt = uuid.uuid4().hex[:8]
    good = [
        gateway_pb2.PredictStreamRequest(
            id=f"g{n}", request=gateway_pb2.PredictRequest(text=f"where is parcel {n} {salt}")
        ).SerializeToString()
        for n in range(5)
    ]
    with grpc.insecure_channel(mesh.gateway) as channel:
        call = channel.stream_stream(
            "/hopline.gateway.v1.GatewayService/PredictStream", None, None
        )(iter([*good, b"\x0a\xff\xff\xff\xff"]), timeout=60)
        answered: list[gateway_pb2.PredictStreamResponse] = []

        def read_all() -> None:
            for raw in call:
                answered.append(gateway_pb2.PredictStreamResponse.FromString(raw))

        with pytest.raises(grpc.RpcError) as info:
            read_all()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hopline.gateway.v1.PredictStreamRequest" in (info.value.details() or "")
    assert sorted(r.id for r in answered) == [f"g{n}" for n in range(5)]
    assert all(r.code == OK for r in answered), [r.message for r in answered]


def test_an_id_over_the_limit_fails_its_own_request_not_the_stream(mesh: Mesh) -> None:
    """An id near the message size limit made its reply too large to send, and gRPC ended the
    whole stream RESOURCE_EXHAUSTED, losing the requests beside it."""
    huge = "X" * (4 * 1024 * 1024 - 100)
    request = gateway_pb2.PredictRequest(text="where is my parcel")
    with grpc.insecure_channel(mesh.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        replies = list(
            stub.PredictStream(
                stream_of(("a", request), (huge, request), ("b", request)), timeout=60
            )
        )
    by_code = {r.id[:8]: r for r in replies}
    assert len(replies) == 3
    assert by_code["a"].code == OK
    assert by_code["b"].code == OK
    refused = by_code["XXXXXXXX"]
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert refused.id == huge[:MAX_ID_BYTES]
    assert f"PredictStreamRequest.id is {len(huge)} bytes; the limit is {MAX_ID_BYTES}" in (
        refused.message
    )
