"""The gateway workers' supervisor (runtime/workers.py) on real child processes."""

from __future__ import annotations

import signal
import subprocess
import sys

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
