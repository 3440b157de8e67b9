"""How long `hopline run` waits for "up" (cli/run.py:ready_bound_s): beyond the cache's own
bound on loading its collection, read from the environment the cache reads."""

from __future__ import annotations

import pytest

from hopline.cache.store import LOAD_TIMEOUT_S
from hopline.cli.run import READY_TIMEOUT_S, ready_bound_s


def test_the_default_covers_the_caches_default_load_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("HOPLINE_CACHE_LOAD_TIMEOUT_S", raising=False)
    assert ready_bound_s() == READY_TIMEOUT_S + LOAD_TIMEOUT_S


def test_a_longer_load_bound_gives_the_mesh_as_much_longer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HOPLINE_CACHE_LOAD_TIMEOUT_S", "1800")
    assert ready_bound_s() == READY_TIMEOUT_S + 1800


def test_an_invalid_load_bound_is_refused_with_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOPLINE_CACHE_LOAD_TIMEOUT_S", "-5")
    with pytest.raises(SystemExit, match="HOPLINE_CACHE_LOAD_TIMEOUT_S"):
        ready_bound_s()
