"""The gateway's local exact tier follows the cache's WatchInvalidations stream for good
(gateway/exact_tier.py:LocalExactTier.follow). Renewed TLS files make the gateway dial again
and close the old channels after a grace, which cancels the open stream: the follow task
ended then, silently, leaving the tier live and deaf, serving answers the cache had
invalidated (found by probing a TLS mesh: a certificate rewritten in place, then an
Invalidate, then the old answer EXACT minutes later). A real gRPC server and channels."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from fake_clock import FakeClock

from hopline.gateway.exact_tier import STEADY_S, LocalExactTier
from hopline.gateway.key_mirror import KeyMirror
from hopline.protos.hopline.cache.v1 import cache_pb2, cache_pb2_grpc


class Watches:
    """The cache's WatchInvalidations alone: says the stream is live, then holds it open, as
    the cache does between events (with `heartbeat_ms`, promising a message that often and
    then, as behind a silent partition, sending none)."""

    def __init__(self, heartbeat_ms: int = 0) -> None:
        self.opened = 0
        self.heartbeat_ms = heartbeat_ms

    async def watch(
        self, request: cache_pb2.WatchInvalidationsRequest, context: Any
    ) -> AsyncIterator[cache_pb2.WatchInvalidationsResponse]:
        self.opened += 1
        yield cache_pb2.WatchInvalidationsResponse(live=True, heartbeat_ms=self.heartbeat_ms)
        await asyncio.Event().wait()

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        method = grpc.unary_stream_rpc_method_handler(
            self.watch,
            request_deserializer=cache_pb2.WatchInvalidationsRequest.FromString,
            response_serializer=cache_pb2.WatchInvalidationsResponse.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(
            "hopline.cache.v1.CacheService", {"WatchInvalidations": method}
        )


async def until(condition: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def follow_then_close_the_channel() -> tuple[Watches, LocalExactTier, asyncio.Task[None]]:
    server = grpc.aio.server()
    watches = Watches()
    server.add_generic_rpc_handlers((watches.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channels: list[grpc.aio.Channel] = []

    def watch() -> Any:
        channels.append(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
        stub = cache_pb2_grpc.CacheServiceStub(channels[-1])
        return stub.WatchInvalidations(cache_pb2.WatchInvalidationsRequest())

    tier = LocalExactTier(capacity=10)
    task = asyncio.create_task(tier.follow(watch, KeyMirror(capacity=0), max_retry_s=0.1))
    try:
        await until(lambda: tier.live, "the first stream live")
        await channels[0].close(grace=0.05)  # as Upstream._redial closes the old channels
        await until(lambda: watches.opened == 2 or task.done(), "a second stream opened")
        await until(lambda: tier.live or task.done(), "live again")
        return watches, tier, task
    finally:
        if not task.done():
            task.cancel()
        for channel in channels:
            await channel.close(grace=None)
        await server.stop(grace=None)


def test_a_watch_cut_by_its_channel_closing_is_opened_again() -> None:
    watches, tier, _ = asyncio.run(follow_then_close_the_channel())
    assert watches.opened == 2
    assert tier.live


def test_cancelling_the_follow_still_ends_it() -> None:
    async def main() -> bool:
        tier = LocalExactTier(capacity=10)

        async def never() -> AsyncIterator[cache_pb2.WatchInvalidationsResponse]:
            await asyncio.Event().wait()
            yield cache_pb2.WatchInvalidationsResponse()

        task = asyncio.create_task(tier.follow(never, KeyMirror(capacity=0)))
        await asyncio.sleep(0.01)
        task.cancel()
        try:
            await asyncio.wait_for(task, 5)
        except asyncio.CancelledError:
            return True
        return False

    assert asyncio.run(main())


@contextlib.asynccontextmanager
async def following(
    watches: Watches, tier: LocalExactTier, max_retry_s: float = 2.0
) -> AsyncIterator[None]:
    """`tier` following `watches` over a real server and channel, for the block's length."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((watches.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = cache_pb2_grpc.CacheServiceStub(channel)
    task = asyncio.create_task(
        tier.follow(
            lambda: stub.WatchInvalidations(cache_pb2.WatchInvalidationsRequest()),
            KeyMirror(capacity=0),
            max_retry_s=max_retry_s,
        )
    )
    try:
        yield
    finally:
        task.cancel()
        await channel.close(grace=None)
        await server.stop(grace=None)


def test_a_stream_silent_past_its_promised_heartbeats_is_taken_for_lost() -> None:
    """Behind a silent network partition nothing ends the stream but gRPC's keepalive (15 s):
    the tier served an answer invalidated 14 s earlier (a probe). The cache promises a
    message every heartbeat_ms; after HEARTBEATS_MISSED such periods of silence the tier
    stops serving and opens a new stream. Without the promise (an older cache) it waits."""

    async def main() -> tuple[int, int]:
        watches = Watches(heartbeat_ms=20)
        tier = LocalExactTier(capacity=10)
        went_off = 0

        def reset(live: bool) -> None:
            nonlocal went_off
            went_off += not live
            LocalExactTier.reset(tier, live)

        tier.reset = reset  # type: ignore[method-assign]
        async with following(watches, tier, max_retry_s=0.05):
            await until(lambda: watches.opened >= 3, "the silent stream given up, twice")
            return watches.opened, went_off

    opened, went_off = asyncio.run(main())
    assert opened >= 3
    assert went_off >= 2  # the copy stopped serving each time


def test_a_cache_that_promises_no_heartbeat_is_not_given_up() -> None:
    async def main() -> tuple[int, bool]:
        watches = Watches()
        tier = LocalExactTier(capacity=10)
        async with following(watches, tier):
            await until(lambda: tier.live, "live")
            await asyncio.sleep(0.5)
            return watches.opened, tier.live

    assert asyncio.run(main()) == (1, True)


def test_a_watch_that_keeps_ending_soon_after_it_opens_backs_off_and_is_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A link that cut every connection after a few KB (a proxy's byte limit, under load) had
    the tier go off and live again three times a second: 118 log lines in 15 s, each drop a
    cleared copy and a full resync of the key mirror, as the reconnects' backoff started
    afresh at each live stream (a network-fault probe). It starts afresh only once a watch
    has held STEADY_S, and an episode of short watches is said at its start and its end."""
    clock = FakeClock(1000.0)
    waits: list[float] = []
    # How long each stream stays live before it ends; the last one never ends.
    lives = [0.5] * 8 + [STEADY_S + 1, 0.5]
    opened = 0

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        clock.advance(seconds)
        await asyncio.sleep(0)

    async def stream() -> AsyncIterator[cache_pb2.WatchInvalidationsResponse]:
        nonlocal opened
        life = lives[opened] if opened < len(lives) else None
        opened += 1
        yield cache_pb2.WatchInvalidationsResponse(live=True)
        if life is None:
            await asyncio.Event().wait()
        clock.advance(life or 0.0)
        yield cache_pb2.WatchInvalidationsResponse()  # a heartbeat, then the stream ends

    async def main() -> None:
        tier = LocalExactTier(capacity=10)
        task = asyncio.create_task(
            tier.follow(stream, KeyMirror(capacity=0), sleep=sleep, clock=clock)
        )
        await until(lambda: opened > len(lives), "every stream opened")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.INFO, logger="hopline.gateway.exact_tier"):
        asyncio.run(main())
    assert waits == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0, 0.1, 0.2]
    said = [r.getMessage() for r in caplog.records if r.name == "hopline.gateway.exact_tier"]
    assert said == [
        "local exact tier live",
        "local exact tier off until the cache answers",
        "local exact tier live and steady again",  # after 8 drops: the ninth watch held
        "local exact tier off until the cache answers",
        "local exact tier live",
        "local exact tier off until the cache answers",
    ]
    steady = next(r for r in caplog.records if r.getMessage().endswith("steady again"))
    assert steady.__dict__["drops"] == 8
