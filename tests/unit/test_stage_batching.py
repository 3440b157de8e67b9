"""Gateway batching (hopline.gateway.stage_batching): rows that wait for a busy stage share
one RPC, a lone request waits for nothing, and a bad row fails only its own request.

The upstream here is a stand-in stub method that records the requests it gets and answers
the way the real tokenizer does (one padded row per text, INVALID_ARGUMENT for a text it
refuses); the real services are batched in tests/mesh/test_gateway_batching.py.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import grpc
import numpy as np
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import until
from hopline.gateway.stage_batching import BatchedStage, GatewayStages
from hopline.gateway.stage_codecs import TokenizeCodec
from hopline.observability import tracing
from hopline.protos.hopline.tokenizer.v1 import tokenizer_pb2
from hopline.runtime.fairness import FLOW
from hopline.runtime.tensors import from_tensor, to_tensor

Request = tokenizer_pb2.TokenizeRequest
Reply = tokenizer_pb2.TokenizeResponse


class Tokenizer:
    """Token ids are the words' lengths; the batch is padded to its longest text."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.gate: asyncio.Event | None = None
        self.refuse = "bad"  # a text containing this is INVALID_ARGUMENT
        self.down = False

    async def Tokenize(self, request: Request, **_: Any) -> Reply:
        texts = list(request.texts)
        self.calls.append(texts)
        if self.gate is not None:
            await self.gate.wait()
        if self.down:
            raise _error(grpc.StatusCode.UNAVAILABLE, "connection refused")
        if any(self.refuse in t for t in texts):
            raise _error(grpc.StatusCode.INVALID_ARGUMENT, "a text was refused")
        width = max(len(t.split()) for t in texts)
        ids = np.zeros((len(texts), width), dtype=np.int64)
        mask = np.zeros((len(texts), width), dtype=np.int64)
        for i, text in enumerate(texts):
            words = [len(w) for w in text.split()]
            ids[i, : len(words)] = words
            mask[i, : len(words)] = 1
        return Reply(input_ids=to_tensor("input_ids", ids), attention_mask=to_tensor("mask", mask))


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details, None)


def _stage(upstream: Tokenizer, in_flight: int = 1, max_rows: int = 32) -> BatchedStage[Any, Any]:
    return BatchedStage(
        "tokenize", lambda: upstream.Tokenize, TokenizeCodec(), in_flight, lambda _: max_rows
    )


def _ask(stage: BatchedStage[Any, Any], text: str, timeout: float = 5.0) -> asyncio.Task[Reply]:
    request = Request(model="m", model_version="1", texts=[text])
    return asyncio.ensure_future(stage(request, timeout=timeout))


def _ids(reply: Reply) -> list[int]:
    return [int(x) for x in from_tensor(reply.input_ids).ravel()]


Busy = tuple[Tokenizer, asyncio.Event, BatchedStage[Any, Any], asyncio.Task[Reply]]


async def _busy(max_rows: int = 32) -> Busy:
    """A stage of one slot whose upstream holds a first request ("busy") until its gate is
    set: what arrives next waits for the slot."""
    upstream = Tokenizer()
    upstream.gate = gate = asyncio.Event()
    stage = _stage(upstream, in_flight=1, max_rows=max_rows)
    first = _ask(stage, "busy")
    await until(lambda: len(upstream.calls) == 1)
    return upstream, gate, stage, first


def test_a_lone_request_goes_at_once_and_unchanged() -> None:
    async def scenario() -> None:
        upstream = Tokenizer()
        reply = await _ask(_stage(upstream), "hello there")
        assert upstream.calls == [["hello there"]]
        assert _ids(reply) == [5, 5]

    asyncio.run(scenario())


def test_a_lone_request_that_gives_up_frees_its_slot_and_a_crash_is_a_status() -> None:
    """The lone request's RPC runs in its caller's task: cancelling the caller ends the RPC
    and frees the slot for the next request (sent alone, not queued behind a ghost); an
    upstream that raises something other than a status answers UNKNOWN, as a server would."""

    async def scenario() -> None:
        upstream, _, stage, first = await _busy()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        upstream.gate = None
        assert _ids(await asyncio.wait_for(_ask(stage, "next one"), 2)) == [4, 3]
        assert upstream.calls == [["busy"], ["next one"]]

        async def crash(request: Request, **_: Any) -> Reply:
            raise ValueError("a bug in the stage")

        broken = BatchedStage("tokenize", lambda: crash, TokenizeCodec(), 1, lambda _: 32)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await _ask(broken, "anything")
        assert failed.value.code() == grpc.StatusCode.UNKNOWN
        assert "ValueError: a bug in the stage" in (failed.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError):  # its slot was freed: answered, not queued
            await asyncio.wait_for(_ask(broken, "again"), 1)

    asyncio.run(scenario())


def test_rows_waiting_for_a_busy_stage_share_one_rpc_and_get_their_own_rows() -> None:
    async def scenario() -> None:
        upstream, gate, stage, first = await _busy()
        texts = ["a bb", "ccc", "dddd ee f", "g"]
        waiting = [_ask(stage, t) for t in texts]
        await asyncio.sleep(0.01)
        assert len(upstream.calls) == 1  # queued behind the RPC in flight
        gate.set()
        replies = await asyncio.gather(first, *waiting)
        assert upstream.calls == [["busy"], texts]  # one more RPC carried all four
        # Each row is cut back to its own length: the same tensor a single call would give.
        assert [_ids(r) for r in replies[1:]] == [[1, 2], [3], [4, 2, 1], [1]]
        assert list(replies[2].input_ids.shape) == [1, 1]

    asyncio.run(scenario())


def test_with_company_requests_reaching_a_free_stage_in_one_loop_turn_share_one_rpc() -> None:
    """While other requests are in the gateway, the first request to find the slot free waits
    one turn of the event loop: the requests that reach the stage in the same turn (a burst
    of replies releasing their callers) go with it. Without company a lone request still goes
    at once, and a co-located upstream never gathers (GatewayStages.over)."""

    async def scenario() -> None:
        upstream = Tokenizer()
        company = [True]
        stage = BatchedStage(
            "tokenize",
            lambda: upstream.Tokenize,
            TokenizeCodec(),
            1,
            lambda _: 32,
            lambda: company[0],
        )
        texts = ["a bb", "ccc", "dddd ee f"]
        replies = await asyncio.gather(*(_ask(stage, t) for t in texts))
        assert upstream.calls == [texts]
        assert [_ids(r) for r in replies] == [[1, 2], [3], [4, 2, 1]]

        company[0] = False
        upstream.calls.clear()
        await asyncio.gather(*(_ask(stage, t) for t in texts))
        assert upstream.calls == [[t] for t in texts]  # each found the slot free: alone

        company[0] = True
        upstream.calls.clear()
        assert _ids(await asyncio.wait_for(_ask(stage, "g"), 2)) == [1]  # nobody else came
        assert upstream.calls == [["g"]]

        # Where a batch holds one row (a model of max_batch_size 1) nobody waits for company.
        single = BatchedStage(
            "tokenize", lambda: upstream.Tokenize, TokenizeCodec(), 1, lambda _: 1, lambda: True, 5
        )
        upstream.calls.clear()
        await asyncio.wait_for(asyncio.gather(*(_ask(single, t) for t in texts)), 1)
        assert upstream.calls == [[t] for t in texts]

    asyncio.run(scenario())


def test_a_gathering_request_lingers_for_company_until_the_batch_is_full() -> None:
    """With a linger (5 s here), the requests that reach the stage within it share the first
    one's RPC (they trickle in: a burst of replies releases callers whose next requests arrive
    apart); a batch that fills up goes at once, without waiting out the linger."""

    async def scenario() -> None:
        upstream = Tokenizer()
        stage = BatchedStage(
            "tokenize", lambda: upstream.Tokenize, TokenizeCodec(), 1, lambda _: 3, lambda: True, 5
        )
        first = _ask(stage, "a bb")
        await asyncio.sleep(0.02)
        second = _ask(stage, "ccc")
        await asyncio.sleep(0.02)
        assert upstream.calls == []  # still gathering
        third, fourth = _ask(stage, "dddd ee f"), _ask(stage, "g")
        await until(lambda: len(upstream.calls) == 1)  # the third row filled the batch
        assert upstream.calls == [["a bb", "ccc", "dddd ee f"]]
        assert [_ids(r) for r in await asyncio.gather(first, second, third)] == [
            [1, 2],
            [3],
            [4, 2, 1],
        ]
        # The fourth found the slot taken: it queued behind the batch and went when it ended.
        assert _ids(await asyncio.wait_for(fourth, 1)) == [1]
        assert upstream.calls[1:] == [["g"]]
        await stage.close()

    asyncio.run(scenario())


def test_only_stages_with_an_upstream_process_of_their_own_are_batched() -> None:
    """Batching and gathering are for RPCs. A co-located service's stage is a function call:
    GatewayStages.over leaves it unbatched (None), so each request calls the servicer alone
    and the inference service's own batcher merges them; remote stages get the configured
    slots, company and linger."""
    import dataclasses

    from hopline.gateway.upstream import CoLocated, GatewayUpstreams
    from hopline.model.run_width import cores
    from hopline.protos.hopline.inference.v1 import inference_pb2_grpc
    from hopline.runtime import config as cfg
    from hopline.runtime.inproc import InProcessService
    from hopline.services.inference.service import InferenceConfig, InferenceService

    def company() -> bool:
        return True

    settings = cfg.load(InferenceConfig, [])
    for workers, slots in ((0, cores() + 1), (5, 5)):
        servicer = InferenceService(dataclasses.replace(settings, workers=workers))
        try:
            # The service's own batcher runs as many batches at once as it has threads.
            assert servicer.concurrency == slots
            assert servicer.executor._max_workers == slots
            local: Any = CoLocated(
                InProcessService("inference", servicer), inference_pb2_grpc.InferenceServiceStub
            )
            remote: Any = object()  # an Upstream's place: only its type is looked at
            upstreams = GatewayUpstreams(
                tokenizer=remote, cache=remote, inference=local, postprocess=remote
            )
            stages = GatewayStages.over(upstreams, 3, 32, lambda m, v: 0, company, 0.001)
            assert stages.infer is None
            assert stages.tokenize is not None
            assert stages.postprocess is not None
            for stage in (stages.tokenize, stages.postprocess):
                assert (stage._in_flight, stage._company, stage._linger_s) == (3, company, 0.001)
            far = GatewayUpstreams(
                tokenizer=remote, cache=remote, inference=remote, postprocess=remote
            )
            alone = GatewayStages.over(far, 1, 32, lambda m, v: 0)
            assert alone.infer is not None
            assert alone.infer._in_flight == 1
            assert alone.infer._company is None
        finally:
            servicer.executor.shutdown()


def test_a_stage_keeps_its_slots_busy_and_queues_the_rest() -> None:
    """With three slots, three requests go on their way alone at once; the next ones wait
    for a free slot and then go together."""

    async def scenario() -> None:
        upstream = Tokenizer()
        upstream.gate = gate = asyncio.Event()
        stage = _stage(upstream, in_flight=3)
        first = [_ask(stage, f"first {i}") for i in range(3)]
        await until(lambda: len(upstream.calls) == 3)
        later = [_ask(stage, "later one"), _ask(stage, "later two words")]
        await asyncio.sleep(0.01)
        assert upstream.calls == [["first 0"], ["first 1"], ["first 2"]]
        gate.set()
        replies = await asyncio.gather(*first, *later)
        assert upstream.calls[3:] == [["later one", "later two words"]]
        assert [_ids(r) for r in replies[3:]] == [[5, 3], [5, 3, 5]]

    asyncio.run(scenario())


def test_each_replica_the_upstream_names_gets_its_own_slots() -> None:
    """One slot for two inference replicas kept one RPC on its way at a time: the replicas
    never ran at once, and with one of them slowed every miss queued behind its RPC (a
    probe: the hop's p50 from 57 to 320 ms). Slots are per replica, and follow the count."""

    async def scenario() -> None:
        upstream = Tokenizer()
        upstream.gate = gate = asyncio.Event()
        replicas = 2
        stage = BatchedStage(
            "tokenize",
            lambda: upstream.Tokenize,
            TokenizeCodec(),
            1,
            lambda _: 32,
            replicas=lambda: replicas,
        )
        first = [_ask(stage, f"first {i}") for i in range(2)]
        await until(lambda: len(upstream.calls) == 2)  # both at once, alone
        replicas = 3  # a host name that resolves to one more
        third = _ask(stage, "third")
        await until(lambda: len(upstream.calls) == 3)
        later = [_ask(stage, "later one"), _ask(stage, "later two")]
        await asyncio.sleep(0.01)
        assert len(upstream.calls) == 3  # every slot busy: they wait, together
        gate.set()
        await asyncio.gather(*first, third, *later)
        assert upstream.calls[3:] == [["later one", "later two"]]

    asyncio.run(scenario())


def test_a_bad_row_fails_only_its_own_request() -> None:
    async def scenario() -> None:
        upstream, gate, stage, first = await _busy()
        good, bad, other = _ask(stage, "fine"), _ask(stage, "bad text"), _ask(stage, "ok ok")
        gate.set()
        assert _ids(await good) == [4]
        assert _ids(await other) == [2, 2]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await bad
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await first
        # The batch was refused, then each row went alone.
        assert upstream.calls[1] == ["fine", "bad text", "ok ok"]
        assert sorted(map(tuple, upstream.calls[2:])) == [("bad text",), ("fine",), ("ok ok",)]

    asyncio.run(scenario())


def test_an_upstream_failure_reaches_every_row_without_retries() -> None:
    async def scenario() -> None:
        upstream, gate, stage, first = await _busy()
        rows = [_ask(stage, t) for t in ("one", "two")]
        upstream.down = True
        gate.set()
        for task in (first, *rows):
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await task
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert len(upstream.calls) == 2  # the failed batch was not split and sent again

    asyncio.run(scenario())


def test_a_row_whose_caller_gave_up_is_not_sent() -> None:
    async def scenario() -> None:
        upstream, gate, stage, first = await _busy()
        gone, kept = _ask(stage, "gone"), _ask(stage, "kept")
        late = _ask(stage, "late", timeout=0.01)
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as expired:
            await late
        assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        gate.set()
        await asyncio.gather(first, kept)
        assert upstream.calls == [["busy"], ["kept"]]

    asyncio.run(scenario())


def test_batches_hold_at_most_max_rows() -> None:
    async def scenario() -> None:
        upstream, gate, stage, first = await _busy(max_rows=3)
        rows = [_ask(stage, f"t{i}") for i in range(7)]
        gate.set()
        await asyncio.gather(first, *rows)
        assert [len(c) for c in upstream.calls] == [1, 3, 3, 1]

    asyncio.run(scenario())


def test_a_tenant_behind_another_tenants_backlog_goes_in_the_next_batch() -> None:
    """One tenant's nine rows wait for the busy slot, then another tenant's one: it goes in
    the next RPC (it went in the fourth of four, arrival order); each tenant's own rows keep
    their order. Tenants as the gateway's admission sets them (runtime/fairness.py:FLOW)."""

    def ask_as(stage: BatchedStage[Any, Any], tenant: str, text: str) -> asyncio.Task[Reply]:
        context = contextvars.copy_context()
        context.run(FLOW.set, tenant)
        request = Request(model="m", model_version="1", texts=[text])
        return asyncio.get_running_loop().create_task(stage(request, timeout=5.0), context=context)

    async def scenario() -> None:
        upstream, gate, stage, first = await _busy(max_rows=3)
        flood = [ask_as(stage, "flood", f"f{i}") for i in range(9)]
        other = ask_as(stage, "other", "other")
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(first, *flood, other)
        assert upstream.calls[1] == ["f0", "other", "f1"]
        assert [t for c in upstream.calls[2:] for t in c] == [f"f{i}" for i in range(2, 9)]

    asyncio.run(scenario())


def test_the_batch_span_is_linked_to_every_request_span(monkeypatch: pytest.MonkeyPatch) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_TRACER", provider.get_tracer("hopline"))
    client = provider.get_tracer("test")

    async def scenario() -> None:
        _, gate, stage, first = await _busy()
        rows = []
        for text in ("one", "two two"):
            # As gateway/upstream.py:call_hop calls a stage: inside its hop span, with that
            # span's context in the metadata too.
            with client.start_as_current_span(f"hop {text}"):
                request = Request(model="m", model_version="1", texts=[text])
                metadata = tracing.outgoing_metadata()
                rows.append(asyncio.ensure_future(stage(request, timeout=5, metadata=metadata)))
        gate.set()
        await asyncio.gather(first, *rows)

    asyncio.run(scenario())
    spans = {s.name: s for s in exporter.get_finished_spans()}
    batch = spans["gateway.stage_batch"]
    hops = [spans["hop one"], spans["hop two two"]]
    assert [link.context.span_id for link in batch.links] == [h.context.span_id for h in hops]
    assert batch.parent is not None
    assert batch.parent.span_id == hops[0].context.span_id  # in the first request's trace
    assert batch.attributes is not None
    assert batch.attributes["hopline.batch_size"] == 2
    assert batch.attributes["hopline.hop"] == "tokenize"


def test_a_stage_over_a_list_of_replicas_gets_slots_for_each() -> None:
    """GatewayStages.over hands the stage its upstream's replica count (a list of two here;
    one address, one), so the per-replica slots above are what a gateway runs with."""
    from hopline.gateway.upstream import GatewayUpstreams, Upstream

    async def scenario() -> tuple[int, int]:
        two: Any = Upstream(
            "inference", "ipv4:127.0.0.1:8013,127.0.0.1:8023", lambda c: c, 1, 1 << 20
        )
        one: Any = Upstream("tokenize", "127.0.0.1:8011", lambda c: c, 1, 1 << 20)
        try:
            upstreams = GatewayUpstreams(tokenizer=one, cache=one, inference=two, postprocess=one)
            stages = GatewayStages.over(upstreams, 3, 32, lambda m, v: 0)
            assert stages.infer is not None
            assert stages.tokenize is not None
            return stages.infer._slots(), stages.tokenize._slots()
        finally:
            await two.close()
            await one.close()

    assert asyncio.run(scenario()) == (6, 3)
