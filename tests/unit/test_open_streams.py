"""The gateway's count of open PredictStreams (gateway/open_streams.py): past its limit a new
stream is refused RESOURCE_EXHAUSTED; once a second tenant has opened one, no tenant holds
more than half; a closed stream's place is free again. Through a real gateway:
tests/mesh/test_stream.py."""

from __future__ import annotations

import grpc
import pytest

from hopline.gateway.errors import RequestError
from hopline.gateway.open_streams import OpenStreams


def _refused(streams: OpenStreams, tenant: str) -> str:
    with pytest.raises(RequestError) as info:
        streams.open(tenant)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    return info.value.message


def test_past_the_limit_a_stream_is_refused_until_one_closes() -> None:
    streams = OpenStreams(3)
    for _ in range(3):
        streams.open("a")  # one tenant alone may hold every place
    assert "holds 3 open streams, its limit (HOPLINE_GATEWAY_MAX_STREAMS)" in _refused(streams, "a")
    streams.close("a")
    streams.open("a")
    assert streams.total == 3


def test_once_shared_no_tenant_holds_more_than_half() -> None:
    streams = OpenStreams(12)
    for _ in range(6):
        streams.open("flood")
    streams.open("other")
    assert "holds 6 open streams, half the gateway's 12" in _refused(streams, "flood")
    for _ in range(3):
        streams.close("flood")
    for _ in range(5):
        streams.open("other")  # the other tenant has its half
    assert streams.total == 9  # under the limit: the refusal is the share's
    assert "half the gateway's 12" in _refused(streams, "other")
    for _ in range(6):
        streams.close("other")
    assert streams.open_by_tenant == {"flood": 3}  # nothing kept for a tenant with none open
    for _ in range(3):
        streams.open("flood")
    assert "half" in _refused(streams, "flood")  # shared once, shared for good


def test_zero_is_no_limit() -> None:
    streams = OpenStreams(0)
    for n in range(10_000):
        streams.open(f"t{n % 3}")
    assert streams.total == 10_000
