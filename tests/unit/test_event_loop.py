"""HOPLINE_EVENT_LOOP (runtime/event_loop.py): services run on uvloop by default, on asyncio's
loop when asked, and on asyncio's, with one warning, where uvloop cannot be imported."""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest

from hopline.runtime import config as cfg
from hopline.runtime.config import ServerConfig
from hopline.runtime.event_loop import EventLoop, run, running


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_is_the_default() -> None:
    config = cfg.load(ServerConfig, [], prog="t")
    assert config.event_loop is EventLoop.UVLOOP
    assert run(_loop_module, config.event_loop).startswith("uvloop")


def test_asyncio_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOPLINE_EVENT_LOOP", "asyncio")
    config = cfg.load(ServerConfig, [], prog="t")
    assert config.event_loop is EventLoop.ASYNCIO
    assert run(_loop_module, config.event_loop).startswith("asyncio")


def test_an_unknown_loop_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOPLINE_EVENT_LOOP", "tokio")
    with pytest.raises(SystemExit, match="'tokio' is not one of: uvloop, asyncio"):
        cfg.load(ServerConfig, [], prog="t")


def test_missing_uvloop_falls_back_to_asyncio_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    with caplog.at_level(logging.WARNING, logger="hopline.runtime.event_loop"):
        assert run(_loop_module, EventLoop.UVLOOP).startswith("asyncio")
    assert [r.getMessage() for r in caplog.records] == [
        "uvloop is not installed; running on asyncio's event loop"
    ]


@pytest.mark.parametrize("kind", list(EventLoop))
def test_running_names_the_loop_that_runs(kind: EventLoop) -> None:
    async def named() -> str:
        return running()

    assert run(named, kind) == kind.value
