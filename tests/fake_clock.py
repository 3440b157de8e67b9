"""A monotonic clock a test moves by hand, handed to code that takes a `clock` callable in
place of time.monotonic (admission, breakers, episodes, samplers, the local exact tier)."""

from __future__ import annotations


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
