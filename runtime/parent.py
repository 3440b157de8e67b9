"""A child process that ends with its parent: SIGTERM from the kernel when the parent dies,
even by SIGKILL (PR_SET_PDEATHSIG), so a killed `hopline run` or gateway supervisor leaves no
orphans holding the ports. Linux only.

Each child asks for it itself, after exec (`follow_parent`), never the parent between fork and
exec: code run between fork and exec is unsafe beside threads, which the parent has by then
(gRPC's, the gateway's imports'). Under a pids limit, `hopline run` waited for good for a child
forked so that never reached exec, deaf to Ctrl-C (the resource-exhaustion probe's
reproduction, once the health checks' own hang was bounded).
"""

from __future__ import annotations

import ctypes
import os
import signal

# What stops a hopline process gracefully (a service drains, `hopline run` and the gateway's
# supervisor stop their children so): SIGHUP too, which a closed terminal or SSH session sends
# and which, left to its default, ended a service at once, undrained and unlogged (exit 129;
# an operator's probe).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
LAUNCHER_ENV = "HOPLINE_LAUNCHER_PID"  # `hopline run`'s pid, given to the services it starts
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGTERM for this process when its parent dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def follow_parent(variable: str, parent: str) -> None:
    """`die_with_parent`, for the parent whose pid `variable` holds: a parent that died
    before this call is caught by comparing that pid with the parent's now."""
    die_with_parent()
    if str(os.getppid()) != os.environ.get(variable):
        raise SystemExit(f"{parent} exited before this process started")
