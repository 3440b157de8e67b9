"""A call cancelled by its client's timer is DEADLINE_EXCEEDED in the server's span and metrics
(observability/tracing.py:_cancelled_code). The server's deadline, counted from the call's
arrival, passes a moment after the client's, so a cancel from the client's timer found time
still left and was counted CANCELLED (a helper's probe: 3 of 30 Predicts ended by their
deadline; dashboards filtering on DEADLINE_EXCEEDED undercounted). A stand-in context."""

from __future__ import annotations

import grpc
import pytest

from hopline.observability.tracing import DEADLINE_SLACK_S, _cancelled_code


class Context:
    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining


@pytest.mark.parametrize("remaining", [-0.1, 0.0, DEADLINE_SLACK_S / 5, DEADLINE_SLACK_S])
def test_a_cancel_at_the_deadline_is_the_deadlines(remaining: float) -> None:
    assert _cancelled_code(Context(remaining)) == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[arg-type]


@pytest.mark.parametrize("remaining", [None, 0.5])
def test_a_caller_giving_up_is_cancelled(remaining: float | None) -> None:
    assert _cancelled_code(Context(remaining)) == grpc.StatusCode.CANCELLED  # type: ignore[arg-type]
