"""Loopback ports for what starts on free ports: the tests' and the bench's meshes, Jaeger, Milvus.

Ports come from just below the kernel's ephemeral range, never from a port-0 bind: the kernel
hands ephemeral ports to every outgoing connection and every server that asks for port 0, and
some servers pick their own in that range, so a port chosen there and bound a moment later
can be taken in between. CI lost a run that way (stop 65): two standalone Milvus servers ran
side by side, started after their meshes' ports were chosen, and the second one's root
coordinator, finding its default 53100 taken, took the next port up, 53101, which a port-0
probe had handed to a mesh's inference service. Below the range only a program that names
the port can take it; the bind probe sees those already listening.

Another hopline process drawing at the same moment (a second test session, a bench beside
one) would not be seen by the probe either: a port chosen there is not bound until its
service starts. So each chosen port is also claimed, by a lock on a file named after it in
`claims_dir()`, held until the process that chose it exits, and a port another process holds is
drawn again. A drain test lost a run that way (stop 74): its inference service found the
port it was given taken, while a second pytest session ran on the same machine.
"""

from __future__ import annotations

import fcntl
import os
import random
import re
import socket
import tempfile
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# How far below the ephemeral range to draw from: 24576-32767 with Linux's default range.
# Milvus's component ports (9091, 13333, 19529-19531, 21121-21124, each the next one up when
# taken) and most servers' defaults lie lower; its root coordinator's 53100 lies higher.
QUIET_SPAN = 8192
# The fewest ports a quiet range must hold to be used: with fewer, random draws would meet
# each other and other test processes' too often.
QUIET_MIN = 1024
_TRIES_PER_PORT = 64


def claims_dir() -> Path:
    """One folder per user: a shared one in /tmp would let another user's files stand in for
    it. Found when a port is first claimed, never at import: every command imports this
    module, and with no writable temporary folder (a Kubernetes pod's read-only root with
    nothing mounted on /tmp) tempfile's search raised at import, so `hopline cache
    milvus-user`, even its --help, failed before doing anything (a deploy probe: the
    production overlay's Job crash-looped and no cache pod ever started)."""
    try:
        return Path(tempfile.gettempdir()) / f"hopline-ports-{os.getuid()}"
    except OSError:  # nothing writable: ports are granted unclaimed (see `claim`)
        return Path("/nonexistent/hopline-ports")


# Ports this process chose, each with its claim's open file: closing it (here never, the exit
# does) would release the claim.
_handed_out: dict[int, int | None] = {}


def claim(port: int, folder: Path | None = None) -> bool:
    """Whether this process now holds `port`: False when this or another process claimed it.
    Where the folder (`claims_dir()` unless given) cannot be written, every port not yet
    handed out here is granted."""
    if port in _handed_out:
        return False
    try:
        folder = folder or claims_dir()
        folder.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(folder / str(port), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        _handed_out[port] = None
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _handed_out[port] = fd
    return True


def quiet_range(ephemeral_file: Path = EPHEMERAL_RANGE_FILE) -> range | None:
    """The ports below the ephemeral range this module draws from, or None where that range
    is unknown or starts too low to leave room (the kernel's port-0 choice is used then)."""
    try:
        low = int(ephemeral_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    start = max(1024, low - QUIET_SPAN)
    return range(start, low) if low - start >= QUIET_MIN else None


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports free now on `host`, none handed out before by this process nor
    claimed by another (`claim`).

    All probe sockets stay open until every port is chosen, and ports handed out earlier are
    skipped: the kernel may give back a port it gave a moment ago, and two servers told the
    same port either fail or, worse, split one port's traffic.
    """
    ports: list[int] = []
    probes: list[socket.socket] = []
    draws = quiet_range()
    tries = _TRIES_PER_PORT * count if draws is not None else 0
    try:
        while len(ports) < count:
            probe = socket.socket()
            probes.append(probe)
            wanted = random.choice(draws) if draws is not None and tries > 0 else 0
            tries -= 1
            try:
                probe.bind((host, wanted))
            except OSError:
                continue  # taken (or in TIME_WAIT): draw again
            port = int(probe.getsockname()[1])
            if claim(port):
                ports.append(port)
        return ports
    finally:
        for probe in probes:
            probe.close()


def address_in_use(address: str) -> bool:
    """Whether something already listens on `address` (host:port): a mesh started over
    another would find the other's services SERVING and report itself up."""
    host, _, port = address.rpartition(":")
    if address.startswith("unix:") or not port.isdigit():
        return False  # a Unix socket path: not probed here; the server's own bind error names it
    host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not a user
        try:
            probe.bind((host, int(port)))
        except OSError:
            return True
    return False


# gRPC's own name schemes (its resolvers), matched without regard to case as gRPC matches
# them. Any other `scheme://` is taken for a host name: gRPC resolves an unknown scheme's
# target as dns:///TARGET, so http://host:port looks up a host named "http" and never
# connects (a cache address so failed open on every request; an inference one was waited
# for for ever).
GRPC_SCHEMES = ("dns", "ipv4", "ipv6", "unix", "unix-abstract", "vsock")
_URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_GRPC_FORMS = (
    "gRPC addresses are host:port, dns:///host:port, ipv4:ADDR:PORT, ipv6:[ADDR]:PORT, "
    "unix:PATH, unix-abstract:NAME or vsock:CID:PORT"
)


def port_problem(address: str, *, listen: bool = False) -> str | None:
    """What is wrong with the port of a host:port address, or None. gRPC takes a port past
    65535 modulo 65536 (127.0.0.1:99999 binds 34463), so a typo would start a service on a
    port nobody dials; and it takes a host alone as port 443, which a caller may mean (a
    name behind TLS) but a service binding (`listen`) never does. An empty address is no
    address (gRPC's resolver refuses it, and a gateway waited for it for ever), nor is one
    with spaces around it (gRPC resolves them as part of the host name) or a URL of a
    scheme gRPC has no resolver for (GRPC_SCHEMES). Other forms (unix:PATH, dns:///NAME,
    inproc) are left to their users."""
    if not address.strip():
        return "an empty address: set host:port, unix:PATH or, for an upstream, inproc"
    if address != address.strip():
        return f"{address!r}: whitespace around the address (gRPC looks it up as part of the host)"
    if _named_by_scheme(address):
        return None
    if url := _URL_SCHEME.match(address):
        return f"{address!r}: {_GRPC_FORMS}; {url[1]}:// is no scheme gRPC resolves"
    if ":" not in address:
        return f"{address!r}: a listen address needs its port (host:port)" if listen else None
    port = address.rpartition(":")[2]
    if not port.isdigit() or int(port) > 65535:
        return f"{address!r}: the port must be a number from 0 to 65535"
    return None


def dial_problem(address: str, named_by: str) -> str | None:
    """What is wrong with an address a command dials (`hopline predict --gateway`, `bench
    --target`, `cache stats --cache`, ...), naming where it came from (`named_by`: the flag
    or the variable), or None. Left to gRPC, 127.0.0.1:87137 dialled port 21601, another
    server (a newcomer's probe: predict answered from it, and `cache invalidate` removed
    entries from the wrong cache), and `127.0.0.1:` port 443. A port of 0 is no server's."""
    problem = port_problem(address)
    port = address.rpartition(":")[2]
    host_port = not _named_by_scheme(address) and ":" in address
    if host_port and not (port.isdigit() and 0 < int(port) < 65536):
        problem = f"{address!r}: the port must be a number from 1 to 65535"
    return None if problem is None else f"{named_by} {problem}"


def _named_by_scheme(address: str) -> bool:
    """Whether `address` is in one of gRPC's own schemes' forms (not host:port)."""
    return address.lower().startswith(tuple(f"{scheme}:" for scheme in GRPC_SCHEMES))
