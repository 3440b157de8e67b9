"""A miss that joins an identical one's inference has a span for its wait, linked to the
span that inference runs under (gateway/model_path.py:ModelPath._joining): the wait read as
the gateway's own time in the joiner's trace, and nothing led from it to the hops that
answered it, in the leader's trace (a tracing probe's leftover). The gateway over stand-ins
(tests/gateway_stand_ins.py), a recording tracer."""

from __future__ import annotations

import asyncio

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import until
from gateway_stand_ins import Mesh, run
from hopline.observability import schema, tracing
from hopline.protos.hopline.gateway.v1 import gateway_pb2


def test_a_joined_miss_waits_in_a_span_linked_to_the_leaders(
    recorded_spans: InMemorySpanExporter,
) -> None:
    exporter = recorded_spans

    async def predict(mesh: Mesh, n: int) -> gateway_pb2.PredictResponse:
        with tracing.tracer().start_as_current_span(f"Predict {n}"):
            return await mesh.predict("my card was declined")

    async def scenario(mesh: Mesh) -> None:
        mesh.inference.gate = asyncio.Event()
        leader = asyncio.create_task(predict(mesh, 0))
        await until(lambda: len(mesh.inference.requests) == 1)
        joiner = asyncio.create_task(predict(mesh, 1))
        await until(lambda: mesh.gateway.coalescer.coalesced == 1)
        mesh.inference.gate.set()
        replies = await asyncio.gather(leader, joiner)
        assert [r.cache.coalesced for r in replies] == [False, True]

    run(scenario)
    spans = exporter.get_finished_spans()
    by_name = {s.name: s for s in spans}
    (wait,) = [s for s in spans if s.name == schema.SPAN_COALESCED_WAIT]
    joiner, leader = by_name["Predict 1"], by_name["Predict 0"]
    assert wait.context is not None
    assert joiner.context is not None
    assert wait.parent is not None
    assert wait.parent.span_id == joiner.context.span_id
    assert wait.context.trace_id == joiner.context.trace_id
    inference = by_name[schema.SPAN_INFERENCE]  # the leader's hop, in the leader's trace
    assert inference.parent is not None
    assert leader.context is not None
    assert inference.context is not None
    assert inference.context.trace_id == leader.context.trace_id
    [link] = wait.links
    assert link.context.trace_id == leader.context.trace_id
    assert link.context.span_id == inference.parent.span_id  # the span the run started under
