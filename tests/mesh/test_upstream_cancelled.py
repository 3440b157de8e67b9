"""An upstream's CANCELLED is a replica going away: retried on the other replica, and never
passed to a client that did not cancel.

gRPC core ends the calls a stopping server had accepted but not yet handed to a handler with
CANCELLED rather than UNAVAILABLE (grpc/grpc#41785). A rolling replacement under load met it
once in CI (one `CANCELLED: inference: CANCELLED` in 4586 requests). That race cannot be made
to happen on demand, so the second replica here stands in for it: HOPLINE_TEST_FAULT=CANCELLED
(test-only) makes every one of its service RPCs end CANCELLED while its health says SERVING.
Ejection is off, so only the retry policy (gateway/upstream.py:RETRYABLE_CODES) stands between
that replica and the client.
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path

import grpc
import pytest

from conftest import DEFAULT_MODEL
from harness import beside_faulty_inference, rpcs_answered
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc

REQUESTS = 40


@pytest.mark.parametrize("retries", [True, False], ids=["retries", "no_retries"])
def test_an_upstream_cancelled_is_retried_elsewhere_or_reported_unavailable(
    default_repo: Path, tmp_path: Path, retries: bool
) -> None:
    gateway_env = {
        "HOPLINE_UPSTREAM_EJECT_FAILURE_PERCENT": "0",
        "HOPLINE_UPSTREAM_RETRY_ATTEMPTS": "3" if retries else "1",
    }
    outcomes: Counter[str] = Counter()
    with (
        beside_faulty_inference(
            default_repo, tmp_path, DEFAULT_MODEL, "CANCELLED", gateway_env
        ) as (mesh, bad_metrics),
        grpc.insecure_channel(mesh.gateway) as channel,
    ):
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for _ in range(REQUESTS):
            request = gateway_pb2.PredictRequest(
                text=f"where is my order {uuid.uuid4()}",
                cache_mode=common_pb2.CACHE_MODE_BYPASS,  # every request needs inference
            )
            try:
                stub.Predict(request, timeout=10)
                outcomes["OK"] += 1
            except grpc.RpcError as err:
                outcomes[f"{err.code().name}: {err.details()}"] += 1
        cancelled_by_bad = rpcs_answered(bad_metrics, "Infer")

    print(f"\nretries={retries}: {dict(outcomes)}; the faulty replica ended {cancelled_by_bad}")
    assert cancelled_by_bad > 0, "the faulty replica was never called: the test shows nothing"
    if retries:
        assert outcomes == Counter({"OK": REQUESTS})
    else:
        failed = {o for o in outcomes if o != "OK"}
        assert failed == {
            "UNAVAILABLE: inference service unavailable (it ended the call while shutting down)"
        }
        assert outcomes["OK"] > 0
