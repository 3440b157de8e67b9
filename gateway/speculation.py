"""Speculative inference: start the model while the cache lookup is still on its way.

A miss pays the lookup and then the model, one after the other; started together, it pays
the longer of the two. The price is an inference that a hit makes useless (cancelled, but
often already running). So the gateway speculates while hits at the cache service are rare,
measured per model as a moving average over its recent lookups, and stops when they are
common enough that the wasted inferences would cost more capacity than the latency is worth.
(Repeats the gateway answers from its local exact tier never reach this point.)

`HOPLINE_GATEWAY_SPECULATE`: auto (that rule), on (always), off (never: lookup, then model).
"""

from __future__ import annotations

import enum


class SpeculationMode(enum.StrEnum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


class Speculation:
    """When to start inference beside a cache lookup, from the hits the lookups have had."""

    def __init__(self, mode: SpeculationMode, max_hit_rate: float, window: int = 50) -> None:
        self.mode = mode
        self.max_hit_rate = max_hit_rate
        self._alpha = 1.0 / max(1, window)  # weight of the newest lookup in the average
        self._hit_rate: dict[str, float] = {}  # model -> recent share of lookups that hit

    def should(self, model: str) -> bool:
        if self.mode is SpeculationMode.AUTO:
            return self._hit_rate.get(model, 0.0) < self.max_hit_rate
        return self.mode is SpeculationMode.ON

    def record(self, model: str, hit: bool) -> None:
        """One lookup's outcome at the cache service (FAIL_OPEN counts as a miss)."""
        rate = self._hit_rate.get(model, 0.0)
        self._hit_rate[model] = rate + self._alpha * (float(hit) - rate)

    def hit_rate(self, model: str) -> float:
        return self._hit_rate.get(model, 0.0)
