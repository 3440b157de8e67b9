"""The gateway workers' supervisor (runtime/workers.py) on real child processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hopline.runtime import workers

# A worker that drains on SIGTERM and exits 0, as a gateway worker does.
DRAINS = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def test_a_worker_that_exits_0_on_its_own_fails_the_supervisor() -> None:
    """A worker gone without being asked (exit 0) leaves the gateway short: the supervisor
    stops the others, which drain and exit 0, and must still exit non-zero, or a service
    manager restarting on failure would leave the gateway down. It exited 0."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    draining = subprocess.Popen([sys.executable, "-c", DRAINS], stdout=subprocess.PIPE)
    try:
        assert draining.stdout is not None
        assert draining.stdout.readline() == b"ready\n"  # its SIGTERM handler is in place
        quits = subprocess.Popen([sys.executable, "-c", "pass"])
        code = workers._wait([draining, quits])
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        draining.kill()
        draining.wait()
        if draining.stdout is not None:
            draining.stdout.close()
    assert draining.returncode == 0  # it drained when told to
    assert code == 1


def test_the_folders_of_supervisors_that_no_longer_run_are_removed_at_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A supervisor killed outright (SIGKILL) cannot remove its folder; the next supervisor
    of the service removes every folder whose supervisor no longer runs, and leaves the
    folders of one that runs, of another service, and of names it did not make."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        prefix = workers.folder_prefix("gateway")
        dead = tmp_path / f"{prefix}{gone.pid}-a1b2c3"
        dead.mkdir()
        (dead / "0.port").write_text("9100")
        live = tmp_path / f"{prefix}{running.pid}-d4e5f6"
        live.mkdir()
        unnamed = tmp_path / f"{prefix}old_name"
        unnamed.mkdir()
        other = tmp_path / f"{workers.folder_prefix('cache')}{gone.pid}-g7h8i9"
        other.mkdir()
        assert workers.remove_orphaned_folders("gateway") == [dead]
        assert not dead.exists()
        assert [f.exists() for f in (live, unnamed, other)] == [True, True, True]
    finally:
        running.kill()
        running.wait()
