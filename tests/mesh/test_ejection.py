"""A replica that keeps failing is ejected: traffic moves to the other one.

Two inference replicas behind one gateway address (`ipv4:127.0.0.1:A,127.0.0.1:B`); the second
is started with HOPLINE_TEST_FAULT=INTERNAL (test-only: every service RPC fails, health still
says SERVING, as a replica with a broken model would). INTERNAL is not retried (UNAVAILABLE
and CANCELLED are), so without ejection about half of all requests fail for as long as the
broken replica runs; with gRPC's outlier detection (gateway/resilience.py) the failures stop
once the replica has been judged, and it gets no more calls.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import grpc
import pytest

from conftest import DEFAULT_MODEL
from harness import beside_faulty_inference, rpcs_answered
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc

JUDGING = 100  # requests at the least before the tail
INTERVAL_S = 1.0
# ... and this long, whatever the requests took: gRPC judges replicas once per interval, on
# the calls of the interval before, so by then the broken one has been judged twice. (A count
# of requests alone is no clock: on a quiet machine 100 took 1.2 s and the tail began before
# the ejection, CI, this stop.)
JUDGING_S = 3 * INTERVAL_S
TAIL = 60  # the last requests, sent after the broken replica could have been judged
# Judged every second on at least 2 calls (one gateway channel, so a replica sees half of the
# requests even on a slow machine); ejected for longer than the test runs.
EJECTION = {
    "HOPLINE_UPSTREAM_EJECT_INTERVAL_S": str(INTERVAL_S),
    "HOPLINE_UPSTREAM_EJECT_MIN_REQUESTS": "2",
    "HOPLINE_UPSTREAM_EJECT_BASE_S": "120",
}


@pytest.mark.parametrize("ejection", [True, False], ids=["ejection", "no_ejection"])
def test_a_replica_answering_errors_is_ejected_and_traffic_moves_to_the_other(
    default_repo: Path, tmp_path: Path, ejection: bool
) -> None:
    gateway_env = EJECTION if ejection else {"HOPLINE_UPSTREAM_EJECT_FAILURE_PERCENT": "0"}
    failed: list[int] = []
    codes: set[str] = set()
    bad_calls_before_tail = 0.0
    with (
        beside_faulty_inference(default_repo, tmp_path, DEFAULT_MODEL, "INTERNAL", gateway_env) as (
            mesh,
            bad_metrics,
        ),
        grpc.insecure_channel(mesh.gateway) as channel,
    ):
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        judged_at = time.monotonic() + JUDGING_S
        i = tail_from = 0
        while not tail_from or i < tail_from + TAIL:
            if not tail_from and i >= JUDGING and time.monotonic() >= judged_at:
                tail_from = i
                bad_calls_before_tail = rpcs_answered(bad_metrics, "Infer")
            request = gateway_pb2.PredictRequest(
                text=f"where is my order {uuid.uuid4()}",
                cache_mode=common_pb2.CACHE_MODE_BYPASS,  # every request needs inference
            )
            try:
                stub.Predict(request, timeout=10)
            except grpc.RpcError as err:
                failed.append(i)
                codes.add(f"{err.code().name}: {err.details()}")
            i += 1
        tail_failures = [n for n in failed if n >= tail_from]
        bad_calls_in_tail = rpcs_answered(bad_metrics, "Infer") - bad_calls_before_tail

    print(
        f"\nejection={ejection}: {len(failed)} of {i} failed, "
        f"{len(tail_failures)} in the last {TAIL}: {codes}"
    )
    assert failed, "the broken replica was never called: the test shows nothing"
    assert codes == {
        "INTERNAL: inference failed with INTERNAL: injected fault (HOPLINE_TEST_FAULT)"
    }
    if ejection:
        assert tail_failures == [], f"still failing after ejection: {failed}"
        assert bad_calls_in_tail == 0
    else:
        assert len(tail_failures) >= TAIL // 4, "without ejection the broken replica keeps failing"
        assert bad_calls_in_tail > 0
