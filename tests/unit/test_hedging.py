"""Hedged stage calls (gateway/hedging.py): a call that its replica holds unanswered far past
the stage's usual time is sent again on the next replica. Two real gRPC servers behind one
round_robin channel, as the gateway's channel to a `dns:///` name of two replicas is; one of
them is made to hold every call without answering, as a stopped process does (its
connection stays up, so neither retries nor ejection move the call)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from hopline.gateway import hedging
from hopline.gateway.addresses import one_endpoint, replica_targets, resolve_replicas
from hopline.gateway.hedging import LOG_EVERY_S, Hedging
from hopline.gateway.stage_batching import GatewayStages
from hopline.gateway.upstream import GatewayUpstreams, Upstream

METHOD = "/hopline.test.Echo/Call"
TIMEOUT_S = 3.0  # each call's deadline: far longer than a hedge takes, far shorter than a hang
MIN_DELAY_S = 0.05


class Replica:
    """Echoes its request with its own name; holds every call while `hung` is set."""

    def __init__(self, name: bytes, arrivals: list[tuple[bytes, bytes]]) -> None:
        self.name = name
        self.arrivals = arrivals  # (replica, request), every replica's, in order
        self.hung = False
        self.calls = 0
        self.address = ""  # host:port, once it serves
        self.fault: grpc.StatusCode | None = None
        self._release = asyncio.Event()

    async def call(self, request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        self.calls += 1
        self.arrivals.append((self.name, request))
        if self.hung:
            await self._release.wait()
        if self.fault is not None:
            await context.abort(self.fault, "broken replica")
        return self.name + b":" + request

    def release(self) -> None:
        self._release.set()

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        method = grpc.unary_unary_rpc_method_handler(self.call)
        return grpc.method_handlers_generic_handler("hopline.test.Echo", {"Call": method})


@contextlib.asynccontextmanager
async def replicas(count: int) -> AsyncIterator[tuple[list[Replica], grpc.aio.Channel]]:
    """`count` replicas behind one round_robin channel."""
    arrivals: list[tuple[bytes, bytes]] = []
    started = [Replica(b"abcdefgh"[i : i + 1], arrivals) for i in range(count)]
    servers, ports = [], []
    for replica in started:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((replica.handler(),))
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        replica.address = f"127.0.0.1:{ports[-1]}"
        await server.start()
        servers.append(server)
    config = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})
    channel = grpc.aio.insecure_channel(
        "ipv4:" + ",".join(f"127.0.0.1:{port}" for port in ports),
        options=[("grpc.service_config", config)],
    )
    await channel.channel_ready()
    yield started, channel
    for replica in started:
        replica.release()
    await channel.close(None)
    for server in servers:
        await server.stop(None)


@contextlib.asynccontextmanager
async def two_replicas() -> AsyncIterator[tuple[Replica, Replica, grpc.aio.Channel]]:
    async with replicas(2) as ([a, b], channel):
        yield a, b, channel


def hedged(channel: grpc.aio.Channel, attempts: int = 3) -> Hedging[bytes]:
    method = channel.unary_unary(METHOD, None, None)
    return Hedging[bytes]("tokenize", lambda: method, attempts, MIN_DELAY_S)


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(TIMEOUT_S):
        while not condition():  # noqa: ASYNC110 (the replicas count calls; no event to wait on)
            await asyncio.sleep(0.01)


async def warm(call: Callable[..., Any], n: int = 2 * hedging.MIN_SAMPLES) -> None:
    """Enough answered calls for the stage's p99, hence the hedging delay."""
    for i in range(n):
        await call(b"warm %d" % i, timeout=TIMEOUT_S)


async def held_with_its_hedge(
    call: Hedging[bytes], a: Replica, b: Replica
) -> asyncio.Future[bytes]:
    """A call `b"q"` both replicas hold, once its first attempt and its hedge have arrived."""
    await warm(call)
    a.hung = b.hung = True
    pending = asyncio.ensure_future(call(b"q", timeout=TIMEOUT_S))
    await until(lambda: a.calls + b.calls >= 2 * hedging.MIN_SAMPLES + 2)
    return pending


def test_calls_held_by_a_hung_replica_are_answered_by_the_other() -> None:
    asyncio.run(_calls_held_by_a_hung_replica_are_answered_by_the_other())


async def _calls_held_by_a_hung_replica_are_answered_by_the_other() -> None:
    """One call at a time, as a stage with one RPC on its way sends them: round_robin gives
    every other call to the hung replica, and each of those is answered by its hedge."""
    async with two_replicas() as (_, b, channel):
        call = hedged(channel)
        await warm(call)
        delay = call.delay_s()
        assert delay is not None
        assert MIN_DELAY_S <= delay < TIMEOUT_S / 4
        b.hung = True
        before_b = b.calls
        replies = [await call(b"q%d" % i, timeout=TIMEOUT_S) for i in range(20)]
        assert replies == [b"a:q%d" % i for i in range(20)]  # every one answered, by `a`
        assert b.calls - before_b >= 5, "few calls reached the hung replica: nothing proven"


def test_a_lone_hung_upstream_spends_the_budget_then_stops_hedging() -> None:
    """Hedges that answer nothing (both replicas hung) are limited by the budget: they do
    not multiply a stall into more load. Each call still ends at its own deadline."""
    asyncio.run(_a_lone_hung_upstream_spends_the_budget_then_stops_hedging())


async def _a_lone_hung_upstream_spends_the_budget_then_stops_hedging() -> None:
    async with two_replicas() as (a, b, channel):
        call = hedged(channel, attempts=5)
        await warm(call)
        a.hung = b.hung = True
        before = a.calls + b.calls
        calls = 40
        results = await asyncio.gather(
            *(call(b"q%d" % i, timeout=1.0) for i in range(calls)), return_exceptions=True
        )
        assert all(
            isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            for r in results
        ), results
        hedges = a.calls + b.calls - before - calls
        assert 1 <= hedges <= hedging.TOKENS // hedging.HEDGE + 1, f"{hedges} hedges for {calls}"


def test_a_first_attempt_failing_after_a_hedge_was_sent_takes_the_hedge() -> None:
    """The hung replica's call fails (its connection dropped, say) while the hedge is on its
    way: the caller gets the hedge's reply, not the failure."""
    asyncio.run(_a_first_attempt_failing_after_a_hedge_was_sent_takes_the_hedge())


async def _a_first_attempt_failing_after_a_hedge_was_sent_takes_the_hedge() -> None:
    async with two_replicas() as (a, b, channel):
        call = hedged(channel)
        pending = await held_with_its_hedge(call, a, b)
        first_at = next(name for name, request in a.arrivals if request == b"q")
        first, second = (a, b) if first_at == a.name else (b, a)
        # The replica that has the first attempt fails it; the other answers the hedge.
        first.fault = grpc.StatusCode.UNAVAILABLE
        second.hung = False
        first.release()
        second.release()
        assert (await pending).endswith(b":q")


def test_a_caller_that_gives_up_cancels_its_hedges() -> None:
    asyncio.run(_a_caller_that_gives_up_cancels_its_hedges())


async def _a_caller_that_gives_up_cancels_its_hedges() -> None:
    async with two_replicas() as (a, b, channel):
        call = hedged(channel)
        pending = await held_with_its_hedge(call, a, b)
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        await asyncio.sleep(0)
        assert not call._open, "the call is still tracked after its caller gave up"


def test_no_hedging_before_the_stage_has_a_p99() -> None:
    asyncio.run(_no_hedging_before_the_stage_has_a_p99())


async def _no_hedging_before_the_stage_has_a_p99() -> None:
    async with two_replicas() as (_, b, channel):
        call = hedged(channel)
        assert call.delay_s() is None
        await warm(call, hedging.MIN_SAMPLES - 1)
        assert call.delay_s() is None
        await call(b"last", timeout=TIMEOUT_S)
        assert call.delay_s() is not None
        assert b.calls > 0


def test_after_a_hedge_answers_first_calls_send_two_attempts_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(hedging, "SUSPECT_S", 600.0)
    asyncio.run(_after_a_hedge_answers_first_calls_send_two_attempts_at_once())


async def _after_a_hedge_answers_first_calls_send_two_attempts_at_once() -> None:
    """Once a hedge has answered first, the hung replica is still in round_robin's turn:
    calls then send their second attempt at once, so a call whose first pick is the hung one
    does not wait out the delay. Here the calls' deadlines are shorter than the delay: each
    one whose first pick was the hung replica failed DEADLINE_EXCEEDED before. Suspect mode
    is held for the whole test and the deadlines leave seconds of slack, so a machine
    stalled by other work cannot end it (it failed under loaded unit lanes)."""
    async with two_replicas() as (_, b, channel):
        method = channel.unary_unary(METHOD, None, None)
        # With a 4 s delay the calls below get 2 s each (half of it), and the hedged one its
        # delay and 3 s more; with 2 s the slack was 1 s, and it failed once beside three
        # meshes (stop 105). A call answered by its hedge ends as soon as it is answered.
        call = Hedging[bytes]("tokenize", lambda: method, 3, 4.0)
        await warm(call)
        delay = call.delay_s()
        assert delay is not None
        assert delay >= 4.0
        b.hung = True
        for i in range(2):  # one of two consecutive calls meets the hung replica first
            slow = await call(b"slow %d" % i, timeout=delay + TIMEOUT_S)
            assert slow == b"a:slow %d" % i
        before_b = b.calls
        replies = [await call(b"q%d" % i, timeout=delay / 2) for i in range(10)]
        assert replies == [b"a:q%d" % i for i in range(10)]
        assert b.calls - before_b >= 5, "the hung replica had few calls: nothing proven"


def test_with_three_replicas_a_stuck_call_is_still_hedged() -> None:
    asyncio.run(_with_three_replicas_a_stuck_call_is_still_hedged())


async def _with_three_replicas_a_stuck_call_is_still_hedged() -> None:
    """With three replicas, two of suspect mode's at-once hedges in three are wasted (the
    first attempt, on a live replica, answers first); they spent the whole budget, and the
    next call whose first pick was the hung replica got no hedge at all and held its stage
    until gRPC dropped the connection (a helper's probe: 5-6 s). Suspect mode now leaves a
    reserve for calls seen stuck. One caller, so that a call's two attempts are consecutive
    picks (with several, all three attempts can land on the hung replica, which no budget
    changes); deadlines far shorter than a hang: every call answered."""
    async with replicas(3) as (started, channel):
        method = channel.unary_unary(METHOD, None, None)
        call = Hedging[bytes]("tokenize", lambda: method, 3, MIN_DELAY_S)
        await warm(call)
        started[2].hung = True
        replies = [await call(b"q%d" % i, timeout=1.0) for i in range(60)]
        assert [r.split(b":", 1)[1] for r in replies] == [b"q%d" % i for i in range(60)]
        assert started[2].calls > 20, "the hung replica had few calls: nothing proven"


@pytest.mark.parametrize(
    ("target", "one"),
    [
        ("127.0.0.1:8011", True),
        ("[::1]:8011", True),
        ("ipv4:127.0.0.1:8011", True),
        ("ipv4:127.0.0.1:8011,127.0.0.1:8012", False),
        ("ipv6:[::1]:8011,[::1]:8012", False),
        ("unix:/run/hopline/tokenizer.sock", True),
        ("tokenizer:8011", False),  # a name: a headless Service resolves to every pod
        ("dns:///tokenizer.hopline.svc:8011", False),
        ("localhost:8011", False),
    ],
)
def test_one_endpoint_tells_a_single_server_from_a_name_or_a_list(target: str, one: bool) -> None:
    assert one_endpoint(target) is one


def test_a_stage_with_one_server_is_not_hedged() -> None:
    """A hedge to a single server goes to the server holding the first attempt: with one
    tokenizer slowed by another tenant's load, the gateway sent hedges and logged "is one
    hung?" for nothing (a helper's probe). A list of replicas or a name is hedged."""

    @dataclasses.dataclass
    class Remote:  # an Upstream's place: only its target is read
        target: str

    single: Any = Remote("127.0.0.1:8011")
    listed: Any = Remote("ipv4:127.0.0.1:8011,127.0.0.1:8012")
    named: Any = Remote("tokenizer:8011")
    far = GatewayUpstreams(tokenizer=single, cache=single, inference=listed, postprocess=named)
    stages = GatewayStages.over(far, 1, 32, lambda m, v: 0, hedge_attempts=3)
    hedged = {
        hop: stage is not None and stage._hedging is not None
        for hop, stage in (
            ("tokenize", stages.tokenize),
            ("infer", stages.infer),
            ("postprocess", stages.postprocess),
        )
    }
    assert hedged == {"tokenize": False, "infer": True, "postprocess": True}
    for stage in (stages.infer, stages.postprocess):
        if stage is not None and stage._hedging is not None:
            stage._hedging.close()


@contextlib.asynccontextmanager
async def one_channel_each(
    started: list[Replica],
) -> AsyncIterator[Callable[[], list[tuple[str, Callable[..., Any]]]]]:
    """A channel to each replica alone, as `Upstream.replica_stubs` makes them."""
    channels = {r.address: grpc.aio.insecure_channel(r.address) for r in started}
    methods: list[tuple[str, Callable[..., Any]]] = [
        (address, c.unary_unary(METHOD, None, None)) for address, c in channels.items()
    ]
    yield lambda: methods
    for channel in channels.values():
        await channel.close(None)


def test_many_callers_and_a_hung_replica_every_call_answered_by_a_named_replica(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="hopline.gateway"):
        a, _hung = asyncio.run(
            _many_callers_and_a_hung_replica_every_call_answered_by_a_named_replica()
        )
    # The warning names the replicas the hedges found answering (it named none: which one to
    # drain, an SRE could not tell; a network-fault probe).
    said = [r for r in caplog.records if "is one hung?" in r.getMessage()]
    assert said, [r.getMessage() for r in caplog.records]
    answering = {address for r in said for address in r.hedges_answered_by}  # type: ignore[attr-defined]
    assert answering == {a}, answering


async def _many_callers_and_a_hung_replica_every_call_answered_by_a_named_replica() -> tuple[
    str, str
]:
    """Eight callers, two replicas, one hung. A hedge sent on round_robin's next pick, with
    the other callers' picks between, reached the hung replica about half the time, and a
    call whose three attempts all did waited for the connection to drop (every caller 5 s in
    two runs of four: a helper's probe). Named per replica, a call's hedges never go where
    its other hedges went, and avoid a replica whose hedge was left unanswered."""
    async with replicas(2) as ([a, b], channel), one_channel_each([a, b]) as named:
        method = channel.unary_unary(METHOD, None, None)
        call = Hedging[bytes]("tokenize", lambda: method, 3, MIN_DELAY_S, named)
        await warm(call)
        b.hung = True
        before_b = b.calls

        async def caller(n: int) -> list[bytes]:
            return [await call(b"c%d-%d" % (n, i), timeout=TIMEOUT_S) for i in range(8)]

        replies = await asyncio.gather(*(caller(n) for n in range(8)))
        assert [r for rs in replies for r in rs if not r.startswith(b"a:")] == []
        assert b.calls - before_b >= 10, "few calls reached the hung replica: nothing proven"
        return a.address, b.address


def test_a_hedge_never_goes_where_the_calls_hedges_went() -> None:
    asyncio.run(_a_hedge_never_goes_where_the_calls_hedges_went())


async def _a_hedge_never_goes_where_the_calls_hedges_went() -> None:
    """Three replicas, two of them hung: a stuck call's two hedges go to two replicas, so
    one reaches the live one, however the other callers' picks fall."""
    async with replicas(3) as ([a, b, c], channel), one_channel_each([a, b, c]) as named:
        method = channel.unary_unary(METHOD, None, None)
        call = Hedging[bytes]("tokenize", lambda: method, 3, MIN_DELAY_S, named)
        await warm(call)
        b.hung = c.hung = True
        replies = await asyncio.gather(*(call(b"q%d" % i, timeout=TIMEOUT_S) for i in range(6)))
        assert all(r.startswith(b"a:") for r in replies), replies


@pytest.mark.parametrize(
    ("target", "replicas"),
    [
        ("ipv4:127.0.0.1:8011,127.0.0.1:8012", ["ipv4:127.0.0.1:8011", "ipv4:127.0.0.1:8012"]),
        ("ipv6:[::1]:8011,[::1]:8012", ["ipv6:[::1]:8011", "ipv6:[::1]:8012"]),
        ("127.0.0.1:8011", ["127.0.0.1:8011"]),
        ("tokenizer:8011", None),  # resolved when needed
    ],
)
def test_replica_targets_name_each_server_of_a_list(
    target: str, replicas: list[str] | None
) -> None:
    assert replica_targets(target) == replicas


def test_a_host_name_resolves_to_one_target_per_address() -> None:
    for target in ("localhost:8011", "dns:///localhost:8011", "dns://8.8.8.8/localhost:8011"):
        found = asyncio.run(resolve_replicas(target))
        assert "ipv4:127.0.0.1:8011" in found, found
        assert len(found) == len(set(found))


def test_an_upstream_dials_each_replica_of_its_list_for_hedges() -> None:
    async def scenario() -> list[str]:
        upstream = Upstream(
            "tokenize", "ipv4:127.0.0.1:8011,127.0.0.1:8012", lambda c: c, 1, 1 << 20
        )
        try:
            first = upstream.replica_stubs()
            assert upstream.replica_stubs() == first  # made once, then kept
            return [address for address, _ in first]
        finally:
            await upstream.close()

    assert asyncio.run(scenario()) == ["ipv4:127.0.0.1:8011", "ipv4:127.0.0.1:8012"]


def test_the_warning_names_the_replicas_of_the_hedges_it_counts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A line every LOG_EVERY_S counts the hedges since the last, and the replicas were those
    of the last REPLICA_MEMORY_S only: hedges answered 5-10 s before the line were counted
    with no replica named (a re-run of the network-fault probe). The line names every
    replica seen since the first hedge it counts, and none from before it."""
    hedging: Hedging[Any] = Hedging("infer", lambda: None, attempts=3, min_delay_s=0.1)  # type: ignore[arg-type,return-value]
    t0 = 1000.0
    hedging._logged = t0  # the last line
    hedging._answered_at = {"10.0.0.1:9": t0 - 1, "10.0.0.2:9": t0 + 1}  # before it, and after
    hedging._unanswered_at = {"10.0.0.3:9": t0 + 2}
    hedging._unlogged, hedging._unlogged_since = [3, 2], t0 + 0.5
    with caplog.at_level(logging.WARNING, logger="hopline.gateway"):
        hedging._log(t0 + LOG_EVERY_S + 0.1, 0.1)  # the answer at t0 + 1 is 9 s old by now
    (line,) = [r for r in caplog.records if "is one hung?" in r.getMessage()]
    assert line.hedges_answered_by == ["10.0.0.2:9"]  # type: ignore[attr-defined]
    assert line.hedges_unanswered_by == ["10.0.0.3:9"]  # type: ignore[attr-defined]
    assert line.hedges == 3  # type: ignore[attr-defined]


def test_hedges_none_of_which_answered_first_say_overload_not_a_hung_replica(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Under plain overload every replica is slow, hedges answer no sooner than their first
    attempts, and the line asked "is one hung?" all the same (an SRE's probe: 11 hedges)."""
    hedging: Hedging[Any] = Hedging("infer", lambda: None, attempts=3, min_delay_s=0.1)  # type: ignore[arg-type,return-value]
    t0 = 1000.0
    hedging._logged = t0
    hedging._unlogged, hedging._unlogged_since = [11, 0], t0 + 0.5
    with caplog.at_level(logging.WARNING, logger="hopline.gateway"):
        hedging._log(t0 + LOG_EVERY_S + 2.0, 1.935)
    (line,) = [r for r in caplog.records if "sent again" in r.getMessage()]
    assert "every replica is slow (overloaded?), not one hung" in line.getMessage()
    assert "is one hung?" not in line.getMessage()
