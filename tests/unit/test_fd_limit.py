"""File descriptors (runtime/fd_limit.py): a service raises its soft limit to the hard one at
start, and says once when its open descriptors near the limit, again once they are back.

The raise is done on this test process's own limit, restored after. The watch counts a real
process's descriptors in the last test; in the others its count is given, so that the limit
need not be reached (a process at its limit cannot open the file that says so: that case is
given as the EMFILE the count then raises)."""

from __future__ import annotations

import errno
import logging
import resource
from collections.abc import Iterator

import pytest

from hopline.runtime import fd_limit
from hopline.runtime.fd_limit import FdWatch, open_fds, raise_soft_limit


@pytest.fixture
def low_soft_limit() -> Iterator[int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(soft, 256) if hard == resource.RLIM_INFINITY else min(hard // 2, 256)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        yield hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_soft_limit_is_raised_to_the_hard_one(low_soft_limit: int) -> None:
    hard = low_soft_limit
    if hard == resource.RLIM_INFINITY:
        assert raise_soft_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return
    assert raise_soft_limit() == hard
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "hopline.runtime.fds"]


def test_nearing_the_limit_is_said_once_and_its_end_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    used = [10]
    watch = FdWatch(count=lambda: used[0], limit=lambda: 100)
    with caplog.at_level(logging.INFO, logger="hopline.runtime.fds"):
        for now in (10, 79, 80, 95, 99, 75, 69, 50, 85):
            used[0] = now
            watch.check()
    said = _said(caplog)
    assert len(said) == 3
    assert "nearly all in use" in said[0]
    assert "raise the limit" in said[0]
    assert "back under the limit" in said[1]
    assert "nearly all in use" in said[2]


def test_a_process_with_no_descriptor_left_to_count_with_is_at_its_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def out_of_fds() -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    with caplog.at_level(logging.INFO, logger="hopline.runtime.fds"):
        FdWatch(count=out_of_fds, limit=lambda: 64).check()
    [said] = _said(caplog)
    assert "nearly all in use" in said


def test_the_watch_counts_this_processs_own_descriptors(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    opened = open_fds()
    assert opened >= 3  # stdin, stdout, stderr at least
    files = [open("/dev/null") for _ in range(8)]  # noqa: SIM115 (closed below)
    try:
        assert open_fds() >= opened + 8
        # A limit the process is now within NEAR of: said.
        monkeypatch.setattr(fd_limit, "NEAR", (opened + 8) / (opened + 20))
        with caplog.at_level(logging.INFO, logger="hopline.runtime.fds"):
            FdWatch(limit=lambda: opened + 20).check()
        assert len(_said(caplog)) == 1
    finally:
        for f in files:
            f.close()
