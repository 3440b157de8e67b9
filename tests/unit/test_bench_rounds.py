"""`hopline bench --rounds`: every other round measures the targets in reverse order."""

from hopline.bench.cli import round_robin


def test_rounds_alternate_direction() -> None:
    order = list(round_robin(["echo", "mesh", "peer_b"], 3))
    assert order == [
        *("echo", "mesh", "peer_b"),
        *("peer_b", "mesh", "echo"),
        *("echo", "mesh", "peer_b"),
    ]


def test_each_target_is_first_in_some_round_of_an_ab() -> None:
    order = list(round_robin(["mesh", "peer_b"], 4))
    firsts = order[0::2]
    assert firsts == ["mesh", "peer_b", "mesh", "peer_b"]


def test_zero_rounds_still_measures_once() -> None:
    assert list(round_robin(["mesh"], 0)) == ["mesh"]
