"""The gRPC service config the gateway's upstream channels get: which methods retry, on which
status, how many times, and the retry budget; none at all when retries are off."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import grpc
import pytest

from hopline.gateway.config import GatewayConfig
from hopline.gateway.upstream import (
    RETRY_METHODS,
    Upstream,
    channel_options,
    config_retry_policy,
    retry_budget,
    retry_service_config,
    upstream_service_config,
)
from hopline.protos.hopline.cache.v1 import cache_pb2
from hopline.protos.hopline.inference.v1 import inference_pb2
from hopline.protos.hopline.postprocess.v1 import postprocess_pb2
from hopline.protos.hopline.tokenizer.v1 import tokenizer_pb2


def policy(**changes: Any) -> dict[str, Any]:
    config = config_retry_policy(dataclasses.replace(GatewayConfig(), **changes))
    assert config is not None
    return config


def test_defaults() -> None:
    config = GatewayConfig()
    assert config.upstream_retry_attempts == 3
    (method,) = policy()["methodConfig"]
    retry = method["retryPolicy"]
    assert retry["maxAttempts"] == 3
    assert retry["initialBackoff"] == "0.010s"
    assert retry["maxBackoff"] == "0.100s"
    assert retry["backoffMultiplier"] == 2
    # Twice the gateway's 256 requests in flight: all of them may fail at once on a replica
    # that dies, and each must still be retried (retry_budget).
    assert policy()["retryThrottling"] == {"maxTokens": 512, "tokenRatio": 0.1}
    # No per-attempt timeout: every attempt shares the call's one deadline.
    assert "timeout" not in method
    assert "perAttemptRecvTimeout" not in retry


def test_unavailable_and_cancelled_are_retried_and_nothing_else() -> None:
    """CANCELLED because a stopping server ends the calls it had not started with it
    (grpc/grpc#41785). Not DEADLINE_EXCEEDED (the call's deadline is spent; the cache's budget
    must hold) nor RESOURCE_EXHAUSTED (an overloaded upstream, or a message too large)."""
    (method,) = policy()["methodConfig"]
    assert method["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE", "CANCELLED"]


def test_every_unary_upstream_method_is_covered_and_nothing_else() -> None:
    (method,) = policy()["methodConfig"]
    named = {(n["service"], n["method"]) for n in method["name"]}
    # Every name is a whole method (no service-wide wildcard) and exists in its contract.
    services = {
        "hopline.tokenizer.v1.TokenizerService": tokenizer_pb2,
        "hopline.cache.v1.CacheService": cache_pb2,
        "hopline.inference.v1.InferenceService": inference_pb2,
        "hopline.postprocess.v1.PostprocessService": postprocess_pb2,
    }
    unary: set[tuple[str, str]] = set()
    for full_name, module in services.items():
        descriptor = module.DESCRIPTOR.services_by_name[full_name.rsplit(".", 1)[1]]
        for m in descriptor.methods:
            if not m.client_streaming and not m.server_streaming:
                unary.add((full_name, m.name))
    assert named == unary
    assert ("hopline.cache.v1.CacheService", "WatchInvalidations") not in named
    assert sum(len(m) for m in RETRY_METHODS.values()) == len(named)


@pytest.mark.parametrize("attempts", [0, 1, -1])
def test_one_attempt_or_fewer_turns_retries_off(attempts: int) -> None:
    config = dataclasses.replace(GatewayConfig(), upstream_retry_attempts=attempts)
    assert config_retry_policy(config) is None
    options = dict(channel_options(0, 1024, config_retry_policy(config)))
    assert "grpc.service_config" not in options
    # The channel keeps gRPC's defaults otherwise (transparent retries).
    assert "grpc.enable_retries" not in options


@pytest.mark.parametrize("attempts", [1, 3])
def test_upstream_channels_pick_only_replicas_whose_health_says_serving(attempts: int) -> None:
    """With or without retries: gRPC's client-side health checking on the server's overall
    status (""), which a hopline service sets SERVING once ready and NOT_SERVING on SIGTERM
    (tests/mesh/test_upstream_health.py shows the picks follow it)."""
    config = dataclasses.replace(GatewayConfig(), upstream_retry_attempts=attempts)
    parsed = json.loads(
        dict(channel_options(0, 1024, upstream_service_config(config)))["grpc.service_config"]
    )
    assert parsed["healthCheckConfig"] == {"serviceName": ""}
    assert ("methodConfig" in parsed) == (attempts > 1)
    assert "loadBalancingConfig" in parsed  # ejection is kept beside it


def test_values_are_clamped_to_what_grpc_accepts() -> None:
    config = retry_service_config(
        attempts=9, initial_backoff_ms=0, max_backoff_ms=0, budget_tokens=5000, token_ratio=0
    )
    assert config is not None
    retry = config["methodConfig"][0]["retryPolicy"]
    assert retry["maxAttempts"] == 5
    assert retry["initialBackoff"] == retry["maxBackoff"] == "0.001s"
    assert config["retryThrottling"] == {"maxTokens": 1000, "tokenRatio": 0.001}
    # A max backoff under the initial one is raised to it.
    slow = retry_service_config(3, 50, 10, 20, 0.1)
    assert slow is not None
    assert slow["methodConfig"][0]["retryPolicy"]["maxBackoff"] == "0.050s"


def test_channels_carry_it_as_json() -> None:
    options = dict(channel_options(1, 1024, policy(upstream_retry_attempts=4)))
    assert options["grpc.enable_retries"] == 1
    parsed = json.loads(options["grpc.service_config"])
    assert parsed["methodConfig"][0]["retryPolicy"]["maxAttempts"] == 4
    # Still round_robin over every address, one connection per channel.
    assert options["grpc.lb_policy_name"] == "round_robin"
    assert options["hopline.channel_index"] == 1


def test_grpc_accepts_the_service_config() -> None:
    """A channel built with it is IDLE (grpc answers a service config it rejects with a
    channel in TRANSIENT_FAILURE at once); nothing is dialled, the unix socket is never
    opened."""

    async def states() -> list[grpc.ChannelConnectivity]:
        upstream = Upstream(
            "tokenize",
            "unix:/nonexistent/hopline-retry-test.sock",
            lambda channel: channel,
            2,
            1024,
            # What the gateway's channels carry: health checking, retries and ejection.
            upstream_service_config(
                dataclasses.replace(GatewayConfig(), upstream_retry_attempts=5)
            ),
        )
        try:
            return [c.get_state(try_to_connect=False) for c in upstream.channels]
        finally:
            await upstream.close()

    assert asyncio.run(states()) == [grpc.ChannelConnectivity.IDLE] * 2


@pytest.mark.parametrize(
    ("tokens", "max_in_flight", "budget"),
    [(0, 256, 512), (0, 10, 20), (0, 600, 1000), (0, 0, 1000), (7, 256, 7)],
)
def test_the_retry_budget_follows_the_in_flight_limit_unless_set(
    tokens: int, max_in_flight: int, budget: int
) -> None:
    config = GatewayConfig(upstream_retry_tokens=tokens, max_in_flight=max_in_flight)
    assert retry_budget(config) == budget
    assert (
        policy(upstream_retry_tokens=tokens, max_in_flight=max_in_flight)["retryThrottling"][
            "maxTokens"
        ]
        == budget
    )
