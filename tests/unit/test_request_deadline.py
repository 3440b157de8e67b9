"""How long the gateway works on one request (gateway/service.py:GatewayService.timeout_for):
the client's deadline where it is sooner than HOPLINE_UPSTREAM_TIMEOUT_S, else the setting.
The README had called the setting a per-hop timeout used only without a client deadline; a
client asking for 30 s was cut at 10 (found by probing a mesh with its inference stopped)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, cast

import pytest

from hopline.gateway.config import GatewayConfig
from hopline.gateway.service import GatewayService


class Context:
    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining


@pytest.mark.parametrize(
    ("remaining", "expected"), [(None, 10.0), (2.5, 2.5), (10.0, 10.0), (30.0, 10.0)]
)
def test_the_clients_deadline_where_sooner_else_the_setting(
    remaining: float | None, expected: float
) -> None:
    gateway = SimpleNamespace(config=dataclasses.replace(GatewayConfig(), upstream_timeout_s=10.0))
    budget = GatewayService.timeout_for(cast("Any", gateway), cast("Any", Context(remaining)))
    assert budget == expected
