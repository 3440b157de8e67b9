"""A long-lived stream's turns (gateway/turns.py:Turns) follow the width of the moment: a
ModelStreamInfer stream opened while its tenant had the gateway to itself puts half the
gateway's limit in flight (one caller: its backlog took every place and its tenant's other
requests were refused, a client probe), and once another tenant has come no more than its
tenant's always-left places (gateway/admission.py:stream_width); the turns already taken run
to their end. A take may weigh several turns (a stream's request, by its texts)."""

from __future__ import annotations

import asyncio

from fake_clock import FakeClock

from hopline.gateway.admission import Admission
from hopline.gateway.turns import StreamTurns, Turns

LIMIT, MINIMUM = 64, 16


async def _taken_at_once(turns: Turns, n: int) -> int:
    """How many of `n` more takes succeed without a release."""
    takes = [asyncio.ensure_future(turns.acquire()) for _ in range(n)]
    await asyncio.sleep(0)
    done = sum(t.done() for t in takes)
    for t in takes:
        t.cancel()
    await asyncio.gather(*takes, return_exceptions=True)
    return done


def test_a_stream_opened_alone_narrows_once_another_tenant_comes() -> None:
    async def main() -> None:
        admission = Admission(
            max_in_flight=LIMIT,
            cache_budget_ms=40,
            clock=FakeClock(1000.0),
            tenant_min_in_flight=MINIMUM,
        )
        admission.tenants.tenancy.seen("bulk")  # its first request
        turns = StreamTurns(admission).for_tenant("bulk")
        for _ in range(LIMIT // 2):  # alone: half the gateway's places, no more
            await turns.acquire()
        assert await _taken_at_once(turns, 1) == 0
        admission.tenants.tenancy.seen("other")  # another tenant's first request
        # Another tenant has come: no new turn until fewer than its tenant's places are out.
        for _ in range(LIMIT // 2 - MINIMUM):
            turns.release()
        assert await _taken_at_once(turns, 1) == 0
        turns.release()
        assert await _taken_at_once(turns, 2) == 1

    asyncio.run(main())


def test_turns_go_first_come_first_served_and_a_cancelled_waiter_gives_its_turn_on() -> None:
    async def main() -> None:
        turns = Turns(lambda: 1)
        await turns.acquire()
        order: list[str] = []

        async def take(name: str) -> None:
            await turns.acquire()
            order.append(name)

        first = asyncio.create_task(take("first"))
        second = asyncio.create_task(take("second"))
        third = asyncio.create_task(take("third"))
        await asyncio.sleep(0)
        turns.release()  # handed to `first`...
        first.cancel()  # ...which is cancelled before it runs: the turn goes to `second`
        await asyncio.gather(first, return_exceptions=True)
        await asyncio.sleep(0)
        assert second.done()
        assert (order, turns.taken) == (["second"], 1)
        turns.release()
        await third
        assert (order, turns.taken) == (["second", "third"], 1)
        turns.release()
        assert turns.taken == 0

    asyncio.run(main())


def test_no_width_is_no_bound() -> None:
    async def main() -> None:
        turns = Turns(lambda: None)
        assert await _taken_at_once(turns, 500) == 500

    asyncio.run(main())


def test_a_heavy_take_waits_for_room_in_order_and_one_over_the_width_goes_alone() -> None:
    """A stream reads its next request only when its texts fit (gateway/streaming.py): 80
    requests of 64 texts read at once waited for their turns behind each other until the
    gateway's 10 s cap failed most of them (a client probe: 47 of 80)."""

    async def main() -> None:
        turns = Turns(lambda: 100)
        await turns.acquire(64)
        heavy = asyncio.create_task(turns.acquire(64))
        light = asyncio.create_task(turns.acquire(1))  # behind the heavy one: first come
        await asyncio.sleep(0)
        assert not heavy.done()
        assert not light.done()
        turns.release(64)
        await asyncio.gather(heavy, light)
        assert turns.taken == 65
        turns.release(65)
        await turns.acquire(500)  # over the width: alone, when nothing else is out
        assert await _taken_at_once(turns, 1) == 0
        turns.release(500)
        assert turns.taken == 0

    asyncio.run(main())
