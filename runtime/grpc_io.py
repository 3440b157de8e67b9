"""Which threads read and write a process's gRPC sockets (`HOPLINE_GRPC_IO`), chosen before
gRPC loads: hopline's package `__init__` applies it, so every `hopline` command and every
service it starts gets it.

grpcio 1.85 reads and writes sockets on EventEngine's own threads (its `event_engine_client`
and `event_engine_listener` experiments, on by default); gRPC Python's asyncio layer then
learns of each completion from its poller thread, so every message crosses two threads before
the event loop sees it. `iomgr` (hopline's default) turns those two experiments off: the
poller thread reads the socket itself. Counted in a bare grpc.aio echo server on this
project's 2-core Xeon VM, 3,200 calls: its EventEngine threads woke 9,700 times with
grpcio's default and 90 times with `iomgr`. Measured (`docs/performance.md`, section 1):
echo p50 0.59-0.72 ms against 0.39-0.45, after 10 ms idle 1.51-1.72 against 1.05-1.42;
five-process miss c=1 p50 9.23 and 9.77 ms against 8.44 and 8.44 (two runs of 4 alternated
rounds, faster in all 8), co-located 4.99 and 4.95 against 4.79 and 4.50. `event-engine`
keeps grpcio's default.

gRPC reads GRPC_EXPERIMENTS once, when it loads, so this is an environment variable only (no
flag: by the time flags are parsed gRPC has loaded). A GRPC_EXPERIMENTS the operator set
is kept, and wins for any experiment it names. This module must not import grpc.
"""

from __future__ import annotations

import enum
import os
import sys
from collections.abc import Mapping, MutableMapping
from typing import Final

ENV = "HOPLINE_GRPC_IO"
GRPC_ENV = "GRPC_EXPERIMENTS"
# The grpc core experiments that move a channel's and a server's sockets onto EventEngine's
# threads (grpc/src/core/lib/experiments/experiments.yaml).
SOCKET_EXPERIMENTS = ("event_engine_client", "event_engine_listener")
# What hopline found and wrote, `given|written`, for the processes it starts (no experiment
# name holds a `|`).
WRITTEN_ENV, SEPARATOR = "HOPLINE_GRPC_EXPERIMENTS_WRITTEN", "|"


class GrpcIo(enum.StrEnum):
    IOMGR = "iomgr"  # sockets on the thread that polls completions: the default
    EVENT_ENGINE = "event-engine"  # sockets on EventEngine's threads: grpcio's default


DEFAULT = GrpcIo.IOMGR


def parse(raw: str) -> GrpcIo:
    try:
        return GrpcIo(raw.strip().lower())
    except ValueError:
        names = ", ".join(m.value for m in GrpcIo)
        raise ValueError(f"{raw!r} is not one of: {names}") from None


def experiments(given: str, io: GrpcIo) -> str:
    """GRPC_EXPERIMENTS for `io`: what the operator gave, then `io`'s settings for the socket
    experiments the operator did not name (grpc reads `-name` as off)."""
    parts = [p.strip() for p in given.split(",") if p.strip()]
    if io is GrpcIo.EVENT_ENGINE:
        return ",".join(parts)
    named = {p.lstrip("-") for p in parts}
    return ",".join(parts + [f"-{name}" for name in SOCKET_EXPERIMENTS if name not in named])


def apply(environ: MutableMapping[str, str]) -> GrpcIo | None:
    """Set GRPC_EXPERIMENTS in `environ` for the mode HOPLINE_GRPC_IO asks (the default when
    unset). None when the value is not a mode (`check` says so) or when gRPC had already
    loaded in this process: then this process keeps what it had; processes it starts follow
    `environ`."""
    try:
        io = parse(environ.get(ENV, DEFAULT.value))
    except ValueError:
        return None
    given = operators_experiments(environ)
    wanted = experiments(given, io)
    if wanted:
        environ[GRPC_ENV] = wanted
    else:
        environ.pop(GRPC_ENV, None)
    environ[WRITTEN_ENV] = f"{given}{SEPARATOR}{wanted}"
    return None if "grpc" in sys.modules else io


def operators_experiments(environ: Mapping[str, str]) -> str:
    """GRPC_EXPERIMENTS as the operator set it. A process hopline starts inherits what its
    parent wrote; that is set aside (so a child asked for another mode gets it) unless the
    operator changed the variable since."""
    current = environ.get(GRPC_ENV, "")
    before, sep, wrote = environ.get(WRITTEN_ENV, "").partition(SEPARATOR)
    return before if sep and current == wrote else current


def check(environ: Mapping[str, str] = os.environ) -> None:
    """Exit with a message naming the variable when HOPLINE_GRPC_IO is not a mode (status 2,
    as for every setting refused)."""
    raw = environ.get(ENV)
    if raw is None:
        return
    try:
        parse(raw)
    except ValueError as exc:
        sys.stderr.write(f"invalid {ENV}={raw!r}: {exc}\n")
        raise SystemExit(2) from None


VERBOSITY_ENV = "GRPC_VERBOSITY"
QUIET = "NONE"


def quiet(environ: MutableMapping[str, str]) -> None:
    """GRPC_VERBOSITY=NONE unless the operator set it. gRPC core writes to stderr in its own
    format, breaking one-JSON-object-a-line logs: unset, INFO lines ("I1206 ...
    chttp2_transport.cc:1403] ...: Got goaway [11] ... ping_timeout", in a replica's log
    once a gateway's keepalive had dropped it during a pause); at ERROR, a line for every TLS
    handshake naming a server the certificate does not ("E1206 ... ssl_transport_security.cc
    :3238] No match found for server name: <the client's string>": any client, no key, one
    line a connection; a security probe wrote 200 in a second). What a call meets reaches
    hopline's logs through its status; an operator debugging the transport sets the
    variable."""
    environ.setdefault(VERBOSITY_ENV, QUIET)


# Chosen once, when hopline's package loads: hopline/__init__.py imports this module before
# anything can import grpc.
quiet(os.environ)
IN_EFFECT: Final[GrpcIo | None] = apply(os.environ)


def in_effect() -> str:
    """What this process runs, for its `listening` log line: a mode, or `grpcio` when gRPC had
    loaded before hopline could choose (or the variable is not a mode)."""
    return IN_EFFECT.value if IN_EFFECT is not None else "grpcio"
