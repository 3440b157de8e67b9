"""`hopline bench --rounds`: every other round measures the targets in reverse order."""

import argparse

import pytest

from hopline.bench.cli import _warn_past_streams_per_connection, round_robin


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


def test_callers_past_the_ports_streams_a_connection_are_noted(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The gateway's port holds 256 streams a connection: past it a closed loop's callers
    wait in the load generator's own gRPC, a wait it would time as the mesh's."""
    _warn_past_streams_per_connection(argparse.Namespace(concurrency=512, connections=1))
    assert "512 callers a connection" in capsys.readouterr().err
    for concurrency, connections in ((512, 2), (256, 1), (None, 1)):
        _warn_past_streams_per_connection(
            argparse.Namespace(concurrency=concurrency, connections=connections)
        )
        assert capsys.readouterr().err == ""
