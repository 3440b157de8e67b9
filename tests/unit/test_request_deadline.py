"""How long the gateway works on one request (gateway/service.py:GatewayService.timeout_for):
the client's deadline where it is sooner than HOPLINE_UPSTREAM_TIMEOUT_S, else the setting.
The README had called the setting a per-hop timeout used only without a client deadline; a
client asking for 30 s was cut at 10 (found by probing a mesh with its inference stopped).

A client's deadline is kept less a margin (10%, at most 50 ms), so the gateway's own
DEADLINE_EXCEEDED, naming the hop that ran out and carrying the trace id, reaches the client
before the client's timer ends the call with gRPC's bare "Deadline Exceeded": the hops were
given the client's whole remaining time, and the client's timer won most races (a helper's
probe: 17 of 40 to 55 of 60 bare)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, cast

import pytest

from hopline.gateway.config import GatewayConfig
from hopline.gateway.service import REPLY_MARGIN_MAX_S, GatewayService


class Context:
    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining


@pytest.mark.parametrize(
    ("remaining", "expected"),
    [(None, 10.0), (2.5, 2.5 - REPLY_MARGIN_MAX_S), (10.0, 10.0), (30.0, 10.0), (0.1, 0.09)],
)
def test_the_clients_deadline_where_sooner_else_the_setting(
    remaining: float | None, expected: float
) -> None:
    gateway = SimpleNamespace(config=dataclasses.replace(GatewayConfig(), upstream_timeout_s=10.0))
    budget = GatewayService.timeout_for(cast("Any", gateway), cast("Any", Context(remaining)))
    assert budget == pytest.approx(expected)
