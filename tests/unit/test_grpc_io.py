"""HOPLINE_GRPC_IO (runtime/grpc_io.py): which GRPC_EXPERIMENTS each mode writes, that an
operator's own GRPC_EXPERIMENTS is kept and wins, and that a wrong value is named.
tests/mesh/test_process_imports.py checks what a running service does with it."""

from __future__ import annotations

import re

import pytest

from hopline.runtime import grpc_io
from hopline.runtime.grpc_io import GrpcIo


def test_iomgr_turns_off_both_socket_experiments() -> None:
    assert grpc_io.experiments("", GrpcIo.IOMGR) == "-event_engine_client,-event_engine_listener"


def test_an_experiment_the_operator_named_keeps_their_setting() -> None:
    given = "event_engine_client, work_serializer_dispatch"
    assert grpc_io.experiments(given, GrpcIo.IOMGR) == (
        "event_engine_client,work_serializer_dispatch,-event_engine_listener"
    )


def test_event_engine_leaves_grpcio_to_its_defaults() -> None:
    assert grpc_io.experiments("", GrpcIo.EVENT_ENGINE) == ""
    assert grpc_io.experiments("-tcp_rcv_lowat", GrpcIo.EVENT_ENGINE) == "-tcp_rcv_lowat"


def test_apply_writes_the_default_mode_into_the_environment() -> None:
    environ: dict[str, str] = {}
    # grpc is loaded in the test process, so this process keeps what it had: None.
    assert grpc_io.apply(environ) is None
    assert environ["GRPC_EXPERIMENTS"] == "-event_engine_client,-event_engine_listener"


def test_apply_leaves_grpc_experiments_unset_for_event_engine_and_for_a_wrong_value() -> None:
    for value in ("event-engine", "epoll"):
        environ = {"HOPLINE_GRPC_IO": value}
        grpc_io.apply(environ)
        assert "GRPC_EXPERIMENTS" not in environ


def test_a_child_asked_for_event_engine_gets_it_though_its_parent_wrote_iomgr() -> None:
    parent = {"GRPC_EXPERIMENTS": "-tcp_rcv_lowat"}
    grpc_io.apply(parent)
    assert parent["GRPC_EXPERIMENTS"] == (
        "-tcp_rcv_lowat,-event_engine_client,-event_engine_listener"
    )
    child = {**parent, "HOPLINE_GRPC_IO": "event-engine"}
    grpc_io.apply(child)
    assert child["GRPC_EXPERIMENTS"] == "-tcp_rcv_lowat"
    grpc_io.apply(grandchild := {**child, "HOPLINE_GRPC_IO": "iomgr"})
    assert grandchild["GRPC_EXPERIMENTS"] == parent["GRPC_EXPERIMENTS"]


def test_an_operator_who_changes_the_inherited_variable_is_followed() -> None:
    parent: dict[str, str] = {}
    grpc_io.apply(parent)
    child = {**parent, "GRPC_EXPERIMENTS": "event_engine_listener"}
    grpc_io.apply(child)
    assert child["GRPC_EXPERIMENTS"] == "event_engine_listener,-event_engine_client"


def test_a_wrong_value_is_named_with_the_modes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        grpc_io.check({"HOPLINE_GRPC_IO": "epoll"})
    assert refused.value.code == 2  # a setting refused, as every other (it was 1)
    said = capsys.readouterr().err
    assert re.search(r"invalid HOPLINE_GRPC_IO='epoll'.*iomgr, event-engine", said), said
    grpc_io.check({"HOPLINE_GRPC_IO": " Event-Engine "})
    grpc_io.check({})


def test_grpc_core_is_quiet_unless_the_operator_asks() -> None:
    """Unset, gRPC core wrote INFO lines in its own format into JSON logs
    (tests/mesh/test_grpc_core_logs.py); an operator's GRPC_VERBOSITY wins."""
    environ: dict[str, str] = {}
    grpc_io.quiet(environ)
    assert environ["GRPC_VERBOSITY"] == "NONE"
    environ = {"GRPC_VERBOSITY": "debug"}
    grpc_io.quiet(environ)
    assert environ["GRPC_VERBOSITY"] == "debug"
