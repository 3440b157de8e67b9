"""What an upstream address names: one server, a list of replicas, or a host name that
resolves to some (gateway/hedging.py sends a hedge to one replica by its own channel, and
hedges nothing where there is only one)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket


def one_endpoint(target: str) -> bool:
    """Whether `target` names exactly one server: an IP literal with its port, an `ipv4:` or
    `ipv6:` list of one, a Unix socket or a vsock address. A host name may resolve to several
    (a headless Service's pods), so it is not one. Hedging such a target only sends the call
    again to the server holding the first (a single tokenizer slowed by load drew hedges and
    "is one hung?" warnings: a helper's probe)."""
    scheme, _, rest = target.partition(":")
    if scheme.lower() in ("unix", "unix-abstract", "vsock"):
        return True
    if scheme.lower() in ("ipv4", "ipv6"):
        return "," not in rest
    host = target.rpartition(":")[0].strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


REPLICAS_RESOLVE_S = 30.0  # gRPC's own minimum between resolutions of a name


def replica_targets(target: str) -> list[str] | None:
    """The one-server targets an `ipv4:`/`ipv6:` list names (`ipv4:A,B` -> `ipv4:A`,
    `ipv4:B`), `[target]` for any other one-server address, None for a host name (what it
    resolves to is asked when needed: `resolve_replicas`)."""
    scheme, _, rest = target.partition(":")
    if scheme.lower() in ("ipv4", "ipv6"):
        return [f"{scheme}:{address}" for address in rest.split(",") if address]
    return [target] if one_endpoint(target) else None


async def resolve_replicas(target: str) -> list[str]:
    """The addresses a host-name target (`host:port`, `dns:///host:port`) resolves to now, as
    one-server targets; gRPC's default port 443 where none is given."""
    name = target
    if name.lower().startswith("dns:"):
        name = name[4:]
        if name.startswith("//"):
            name = name[2:].partition("/")[2]  # dns://AUTHORITY/host:port
    host, _, port = name.rpartition(":") if ":" in name else (name, "", "443")
    infos = await asyncio.get_running_loop().getaddrinfo(
        host.strip("[]"), int(port or 443), type=socket.SOCK_STREAM
    )
    found: list[str] = []
    for family, *_, address in infos:
        ip, port_no = str(address[0]), int(address[1])
        one = f"ipv6:[{ip}]:{port_no}" if family == socket.AF_INET6 else f"ipv4:{ip}:{port_no}"
        if one not in found:
            found.append(one)
    return found
