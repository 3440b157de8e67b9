"""A small Python client for the gateway, used by `hopline predict` and the tests."""

from __future__ import annotations

from typing import Any

from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.runtime.api_keys import caller_metadata
from hopline.runtime.service_table import spec
from hopline.runtime.tls import channel, operator_tls

CACHE_MODES = {
    "use": common_pb2.CACHE_MODE_USE,
    "bypass": common_pb2.CACHE_MODE_BYPASS,
    "refresh": common_pb2.CACHE_MODE_REFRESH,
}


def gateway_address(explicit: str | None = None) -> str:
    """The flag's address where given (empty too: refused by its caller, not replaced by the
    default, which may be another mesh's gateway), else HOPLINE_GATEWAY_ADDR's."""
    return explicit if explicit is not None else spec("gateway").address()


def outcome_name(outcome: int) -> str:
    return common_pb2.CacheOutcome.Name(outcome).removeprefix("CACHE_OUTCOME_")  # type: ignore[arg-type]


def to_json(response: gateway_pb2.PredictResponse) -> dict[str, Any]:
    """The stable `--json` contract for scripts."""
    pred = response.prediction
    return {
        "label": pred.label,
        "score": round(pred.score, 6),
        "out_of_scope": pred.out_of_scope,
        "top_k": [{"label": s.label, "score": round(s.score, 6)} for s in pred.top_k],
        "model": response.model,
        "model_version": response.model_version,
        "tenant": response.tenant,
        "cache": outcome_name(response.cache.outcome),
        "cache_detail": response.cache.detail,
        "similarity": round(response.cache.similarity, 6),
        "timings_ms": {t.hop: round(t.ms, 3) for t in response.timings},
        "trace_id": response.trace_id,
    }


def predict(
    text: str,
    *,
    gateway: str | None = None,
    tenant: str = "",
    model: str = "",
    model_version: str = "",
    top_k: int = 1,
    cache_mode: str = "use",
    timeout_s: float = 10.0,
    api_key: str | None = None,
) -> gateway_pb2.PredictResponse:
    """One Predict. Over TLS when HOPLINE_TLS_CA is set (with the operator's certificate, if
    there is one); with `api_key`, else HOPLINE_API_KEY, as the caller's API key."""
    with channel(gateway_address(gateway), operator_tls("gateway")) as chan:
        stub = gateway_pb2_grpc.GatewayServiceStub(chan)
        request = gateway_pb2.PredictRequest(
            text=text,
            tenant=tenant,
            model=model,
            model_version=model_version,
            top_k=top_k,
            cache_mode=CACHE_MODES[cache_mode],
        )
        response: gateway_pb2.PredictResponse = stub.Predict(
            request, timeout=timeout_s, metadata=caller_metadata(api_key)
        )
        return response
