"""Who listens on a TCP port in this network namespace (Linux: /proc/net/tcp and tcp6, and
each process's open sockets).

Gateway workers share their port with SO_REUSEPORT (runtime/workers.py), and so does any
other process of the same user that sets it (gRPC servers do by default): bound to the same
address, it would take its share of the gateway's connections. The supervisor refuses a port
already taken before its workers start, but they bind seconds later, once ready; each worker
checks after binding that only its siblings listen there.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Iterable
from pathlib import Path

PROC = Path("/proc")
_LISTEN = "0A"  # the TCP state column of a listening socket
_TABLES = ("tcp", "tcp6")


@dataclasses.dataclass(frozen=True)
class Listener:
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int
    inode: int


def listening(port: int, proc: Path = PROC) -> list[Listener]:
    """The TCP sockets listening on `port`, any address, as this namespace's kernel lists them."""
    found = []
    for table in _TABLES:
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue  # no IPv6 in this kernel, or no /proc: nothing listed
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            address, _, hex_port = local.partition(":")
            if state == _LISTEN and int(hex_port, 16) == port:
                found.append(Listener(_address(address), port, inode))
    return found


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc's address: 32-bit words, each in the host's (little-endian) byte order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def overlaps(
    a: ipaddress.IPv4Address | ipaddress.IPv6Address,
    b: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> bool:
    """Whether two listeners on one port could be handed the same connection: the same
    address, or one of them every address of the other's family (an IPv6 wildcard takes
    IPv4 too, Linux's default)."""
    a, b = _plain(a), _plain(b)
    for wild, other in ((a, b), (b, a)):
        if wild.is_unspecified and (wild.version == 6 or other.version == 4):
            return True
    return a == b


def _plain(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def owners(inodes: Iterable[int], proc: Path = PROC) -> dict[int, int]:
    """Socket inode -> the pid of a process holding it, for the processes this one may look
    into (its own user's; another user's sockets cannot share a port with ours anyway)."""
    wanted = {f"socket:[{inode}]": inode for inode in inodes}
    held: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue  # another user's, or gone
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target in wanted:
                held.setdefault(wanted[target], int(entry.name))
    return held


def parent(pid: int, proc: Path = PROC) -> int | None:
    """`pid`'s parent, or None when it is gone."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or parentheses itself.
    return int(stat.rpartition(")")[2].split()[1])


def command(pid: int, proc: Path = PROC) -> str:
    """`pid`'s command line, for a message; "" when it cannot be read."""
    try:
        return (proc / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""
