"""The ejection half of an upstream's service config (gateway/resilience.py): what it asks
gRPC's outlier detection for, that it sits beside the retry policy, and that grpc accepts it
(the mesh test tests/mesh/test_ejection.py shows it ejecting a broken replica)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import grpc

from hopline.gateway.config import GatewayConfig
from hopline.gateway.resilience import ejection_service_config, with_ejection
from hopline.gateway.upstream import Upstream, config_retry_policy


def settings(**overrides: Any) -> GatewayConfig:
    return dataclasses.replace(GatewayConfig(), **overrides)


def test_off_at_zero_percent() -> None:
    assert ejection_service_config(0, 10, 1.0, 10.0) is None
    retries = config_retry_policy(settings())
    assert with_ejection(retries, settings(upstream_eject_failure_percent=0)) == retries


def test_outlier_detection_over_round_robin_never_ejecting_the_last_replica() -> None:
    config = ejection_service_config(50, 10, 1.0, 10.0)
    assert config is not None
    policy = config["loadBalancingConfig"][0]["outlier_detection_experimental"]
    assert policy["childPolicy"] == [{"round_robin": {}}]
    assert policy["maxEjectionPercent"] == 50
    assert policy["failurePercentageEjection"]["minimumHosts"] == 2
    assert policy["failurePercentageEjection"]["threshold"] == 50
    assert policy["failurePercentageEjection"]["requestVolume"] == 10
    assert (policy["interval"], policy["baseEjectionTime"]) == ("1.000s", "10.000s")


def test_the_retry_policy_is_kept_beside_it() -> None:
    combined = with_ejection(config_retry_policy(settings()), settings())
    assert combined is not None
    assert {"methodConfig", "retryThrottling", "loadBalancingConfig"} <= combined.keys()
    alone = with_ejection(None, settings(upstream_retry_attempts=1))
    assert alone is not None
    assert set(alone) == {"loadBalancingConfig"}


def test_grpc_accepts_it() -> None:
    """IDLE, not TRANSIENT_FAILURE: grpc rejects a service config it cannot parse at once.
    Nothing is dialled."""

    async def states() -> list[grpc.ChannelConnectivity]:
        upstream = Upstream(
            "inference",
            "unix:/nonexistent/hopline-ejection-test.sock",
            lambda channel: channel,
            2,
            1024,
            with_ejection(config_retry_policy(settings()), settings()),
        )
        try:
            return [c.get_state(try_to_connect=False) for c in upstream.channels]
        finally:
            await upstream.close()

    assert asyncio.run(states()) == [grpc.ChannelConnectivity.IDLE] * 2
