"""Start-time fair queueing (hopline.runtime.fairness): one tenant's order is its arrival
order, several tenants get equal shares of what is served, and nothing is remembered of a
tenant once its items are gone. The batchers that use it: tests/unit/test_batching.py and
tests/unit/test_stage_batching.py; a flood through a real gateway: tests/mesh/test_admission.py.
"""

from __future__ import annotations

from hopline.runtime.fairness import FairQueue, VirtualClock


def _drain(queue: FairQueue[str]) -> list[str]:
    return [queue.pop() for _ in range(len(queue))]


def test_one_flow_is_served_in_arrival_order_whatever_the_costs() -> None:
    queue: FairQueue[str] = FairQueue()
    for i, cost in enumerate([1, 5, 1, 12, 3, 1]):
        queue.push(f"r{i}", "tenant-a", cost)
    assert _drain(queue) == [f"r{i}" for i in range(6)]
    unnamed: FairQueue[str] = FairQueue()
    for i in range(5):
        unnamed.push(f"r{i}")
    assert _drain(unnamed) == [f"r{i}" for i in range(5)]


def test_a_flow_arriving_behind_a_backlog_goes_next() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(100):
        queue.push(f"flood{i}", "flood")
    queue.push("other", "tenant-b")
    assert _drain(queue)[:2] == ["flood0", "other"]


def test_waiting_flows_take_equal_turns_and_costly_items_count_as_more() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(4):
        queue.push(f"a{i}", "a")
    for i in range(4):
        queue.push(f"b{i}", "b")
    assert _drain(queue) == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3"]
    for i in range(2):
        queue.push(f"big{i}", "big", cost=4)
    for i in range(8):
        queue.push(f"one{i}", "small")
    order = _drain(queue)
    # Rows served, not items: four of "small"'s 1-row items for each of "big"'s 4-row ones.
    assert order.index("big1") > order.index("one3")
    assert order.index("big1") < order.index("one5")


def test_a_flow_that_went_quiet_does_not_save_up_turns() -> None:
    """A flow is remembered only while it has items waiting: one back from a pause starts at
    the queue's virtual time, beside the others, not ahead of them by what it missed."""
    queue: FairQueue[str] = FairQueue()
    queue.push("a0", "a")
    assert queue.pop() == "a0"
    for i in range(6):
        queue.push(f"b{i}", "b")
    for _ in range(3):
        queue.pop()
    for i in range(3):
        queue.push(f"a{i + 1}", "a")
    assert _drain(queue) == ["a1", "b3", "a2", "b4", "a3", "b5"]


def test_nothing_is_kept_of_flows_whose_items_left() -> None:
    clock = VirtualClock()
    buckets: list[FairQueue[str]] = [FairQueue(clock), FairQueue(clock)]
    for n in range(10_000):
        buckets[n % 2].push(f"r{n}", f"tenant-{n}")
    assert clock.flows == 10_000
    given_up = buckets[0].prune(lambda item: int(item[1:]) % 4 == 0)
    assert len(given_up) == 2_500
    assert len(buckets[0]) == 2_500
    _drain(buckets[0])
    buckets[1].clear()
    assert clock.flows == 0
    assert not buckets[0]
    assert not buckets[1]


def test_buckets_sharing_a_clock_share_the_turns() -> None:
    """A batcher's length buckets: the flood fills one, another tenant's item in the other is
    the next in fair order (the scheduler picks the bucket whose head's tag is lowest)."""
    clock = VirtualClock()
    short, long = FairQueue[str](clock), FairQueue[str](clock)
    for i in range(50):
        short.push(f"flood{i}", "flood")
    short.pop()
    long.push("other", "tenant-b")
    assert long.head_tag() <= short.head_tag()
