"""The gateway's budget for a request with a client deadline ends a margin before it
(gateway/service.py:GatewayService.timeout_for), so its own DEADLINE_EXCEEDED, naming the hop
that ran out and carrying the trace id, reaches the client before the client's timer ends the
call with gRPC's bare "Deadline Exceeded". The hops were given the client's whole remaining
time, and the client's timer won most races (a helper's probe: 17 of 40 to 55 of 60 bare).
A stand-in context: only its time_remaining() is read."""

from __future__ import annotations

import pytest

from hopline.gateway.config import GatewayConfig
from hopline.gateway.service import REPLY_MARGIN_MAX_S, REPLY_MARGIN_SHARE, GatewayService


class Context:
    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining


def budget(remaining: float | None, cap_s: float = 10.0) -> float:
    gateway = GatewayService.__new__(GatewayService)  # timeout_for reads the config alone
    gateway.config = GatewayConfig(upstream_timeout_s=cap_s)
    return gateway.timeout_for(Context(remaining))  # type: ignore[arg-type]


@pytest.mark.parametrize("remaining", [0.02, 0.1, 0.45, 2.0])
def test_a_client_deadline_leaves_the_gateway_a_margin_to_answer(remaining: float) -> None:
    margin = min(REPLY_MARGIN_MAX_S, REPLY_MARGIN_SHARE * remaining)
    assert budget(remaining) == pytest.approx(remaining - margin)
    assert 0 < budget(remaining) < remaining


def test_without_a_sooner_client_deadline_the_budget_is_the_gateways_cap() -> None:
    assert budget(None) == 10.0
    assert budget(30.0) == 10.0
    assert budget(0.4, cap_s=0.3) == 0.3
