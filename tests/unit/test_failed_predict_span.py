"""A failed Predict's span says whose and which model's it was, as a served one's does
(gateway/service.py:_describe_failure): only `rpc.grpc.status_code` was on it, so a
tenant's or a model version's failures could not be searched for in Jaeger (a tracing
probe). The gateway over stand-ins (tests/gateway_stand_ins.py), a recording tracer."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from servicer_context import Aborted, AbortingContext

from gateway_stand_ins import Mesh, run
from hopline.observability import schema, tracing
from hopline.protos.hopline.gateway.v1 import gateway_pb2


def test_a_failed_predicts_span_names_the_tenant_and_model_asked_for(
    recorded_spans: InMemorySpanExporter,
) -> None:
    exporter = recorded_spans

    async def scenario(mesh: Mesh) -> None:
        request = gateway_pb2.PredictRequest(
            text="hi", model="no-such-model", model_version="7", tenant="acme"
        )
        context = AbortingContext()
        with (
            tracing.tracer().start_as_current_span("Predict"),
            pytest.raises(Aborted, match="no-such-model"),
        ):
            await mesh.gateway.Predict(request, context.as_context())

    run(scenario)
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "Predict"]
    assert span.attributes is not None
    assert span.attributes[schema.MODEL] == "no-such-model"
    assert span.attributes[schema.MODEL_VERSION] == "7"
    assert span.attributes[schema.TENANT] == "acme"
