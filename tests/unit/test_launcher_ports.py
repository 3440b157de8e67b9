"""Ports: free ones drawn where nothing else is handed them, and `hopline run` over a port
another program listens on, which must refuse, naming the address, not find the other
program's services SERVING and report itself up (it did: "up in 0.0 s", then its own
services failed to bind). No process is started."""

from __future__ import annotations

import contextlib
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hopline.runtime import ports
from hopline.runtime.launcher import CALLEES_STOP_S, Mesh, MeshError
from hopline.runtime.ports import (
    EPHEMERAL_RANGE_FILE,
    QUIET_SPAN,
    address_in_use,
    claim,
    free_ports,
    port_problem,
    quiet_range,
)
from hopline.runtime.service_table import spec


def test_a_mesh_over_a_busy_address_refuses_to_start_and_names_it(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        assert address_in_use(address)
        mesh = Mesh(tmp_path, addrs={"cache": address})
        with pytest.raises(MeshError) as refused:
            mesh.start(("cache",))
        named = f"address in use: cache on {address} ({spec('cache').addr_env})"
        assert named in str(refused.value)
        assert mesh.procs == {}
    assert not address_in_use(address)


def test_free_ports_come_from_below_the_ephemeral_range_so_a_port_0_bind_cannot_take_them() -> None:
    """CI lost a run to a port chosen by a port-0 bind: a Milvus server started after the
    mesh's ports were chosen gave one of its components the inference service's port. Ports
    drawn below the kernel's ephemeral range are never handed to a port-0 bind or an outgoing
    connection; here 300 port-0 listeners opened after the draw take none of them."""
    quiet = quiet_range()
    if quiet is None:
        pytest.skip(f"{EPHEMERAL_RANGE_FILE} missing or its range starts too low to draw below")
    chosen = free_ports(12)
    again = free_ports(12)
    assert len(set(chosen) | set(again)) == 24, "a port handed out twice"
    assert all(port in quiet for port in chosen + again)
    with contextlib.ExitStack() as stack:
        taken = set()
        for _ in range(300):
            listener = stack.enter_context(socket.socket())
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            taken.add(listener.getsockname()[1])
        assert not taken & set(chosen + again)
        for port in chosen:
            assert not address_in_use(f"127.0.0.1:{port}")


def test_quiet_range_reads_the_kernels_ephemeral_range(tmp_path: Path) -> None:
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    assert quiet_range(ranges) == range(32768 - QUIET_SPAN, 32768)
    ranges.write_text("1500\t65535\n")  # no room below: the kernel's own choice instead
    assert quiet_range(ranges) is None
    assert quiet_range(tmp_path / "absent") is None


def test_a_port_gRPC_would_wrap_is_a_problem() -> None:
    """gRPC binds and dials a port past 65535 modulo 65536; other address forms are their
    users' to judge."""
    for fine in ("127.0.0.1:0", "0.0.0.0:65535", "[::1]:8001", "unix:/tmp/x.sock", "dns:///a:80"):
        assert port_problem(fine) is None, fine
    for wrong in ("127.0.0.1:65536", "127.0.0.1:99999", "host:http", "127.0.0.1:"):
        assert port_problem(wrong) == f"{wrong!r}: the port must be a number from 0 to 65535"


def test_a_listen_address_without_its_port_or_an_empty_one_is_a_problem() -> None:
    """gRPC binds a host alone on 443 (a tokenizer started on HOPLINE_TOKENIZER_ADDR=127.0.0.1
    served there), and resolves an empty target to nothing (a gateway waited for its upstream
    for ever). A caller may name a host alone: 443 behind TLS is what it means."""
    assert port_problem("127.0.0.1", listen=True) == (
        "'127.0.0.1': a listen address needs its port (host:port)"
    )
    assert port_problem("127.0.0.1") is None
    assert port_problem("inproc") is None
    assert port_problem("unix:/tmp/x.sock", listen=True) is None
    for empty in ("", "  "):
        for listen in (True, False):
            problem = port_problem(empty, listen=listen)
            assert problem is not None
            assert problem.startswith("an empty address")


CLAIMER = """
import sys
from hopline.runtime.ports import claim
print(all(claim(int(port)) for port in sys.argv[1:]), flush=True)
sys.stdin.read()
"""


def test_a_port_another_process_chose_is_not_handed_out_until_it_exits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two test sessions (or a bench beside one) draw from the same quiet range. A port the
    other chose is not listened on until its service starts, so the bind probe alone would
    hand it out here too; its claim keeps it out. The draws are narrowed to eight ports, all
    claimed by a second process: every port chosen here must come from elsewhere."""
    start = random.randrange(40_000, 60_000, 8)  # clear of the ports drawn by other tests
    window = range(start, start + 8)
    other = subprocess.Popen(
        [sys.executable, "-c", CLAIMER, *map(str, window)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout is not None
        assert other.stdout.readline().strip() == "True", "the other process claimed no port"
        monkeypatch.setattr(ports, "quiet_range", lambda: window)
        chosen = free_ports(3)
        assert not set(chosen) & set(window), f"{chosen} holds a port the other process chose"
        assert not claim(window[0])
    finally:
        other.communicate("")
    assert claim(window[0]), "the claim outlived the process that held it"


def _spread(base: int) -> dict[str, int]:
    """`base` for the gateway, the next ports for the others in the order of their default
    ports (8002, 8021-8024), as the README's table says."""
    names = ("gateway", "tokenizer", "cache", "inference", "postprocess")
    return {name: base + i for i, name in enumerate(names)}


def test_one_metrics_port_for_the_whole_mesh_is_spread_over_its_processes(
    tmp_path: Path,
) -> None:
    """`HOPLINE_METRICS_PORT=21463 hopline run` gave every process 21463: the first to bind
    served it, the others logged that they could not, and a scrape got whichever won."""
    mesh = Mesh(tmp_path, env={"HOPLINE_METRICS_PORT": "21463"})
    assert mesh.metrics_ports == _spread(21463)
    assert Mesh(tmp_path, env={"HOPLINE_METRICS_PORT": "0"}).metrics_ports == {}  # all off
    chosen = {"gateway": 1, "cache": 2}
    assert (
        Mesh(tmp_path, metrics_ports=chosen, env={"HOPLINE_METRICS_PORT": "9"}).metrics_ports
        == chosen
    )


def test_one_health_port_for_the_whole_mesh_is_spread_as_the_metrics_port(
    tmp_path: Path,
) -> None:
    """`HOPLINE_HEALTH_PORT=21160 hopline run` gave every process 21160: the gateway bound it
    and every other service failed its start ("cannot bind the health port"), and the mesh
    never came up (a security probe)."""
    mesh = Mesh(tmp_path, env={"HOPLINE_HEALTH_PORT": "21160"})
    assert mesh.health_ports == _spread(21160)
    assert Mesh(tmp_path).health_ports == {}  # unset: none, as each service's default


class StuckProcess:
    """A stand-in child (no process is started here): `wait` records its timeout and, for a
    child that does not drain, times out."""

    def __init__(self, drains: bool) -> None:
        self.drains = drains
        self.signals: list[int] = []
        self.waited: list[float] = []
        self.killed = False

    def poll(self) -> int | None:
        return 0 if self.killed or (self.drains and self.signals) else None

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)

    def wait(self, timeout: float | None = None) -> int:
        self.waited.append(timeout or 0.0)
        if not (self.drains or self.killed):
            time.sleep(timeout or 0.0)  # as a child that does not drain
            raise subprocess.TimeoutExpired("stand-in", timeout or 0.0)
        return 0

    def kill(self) -> None:
        self.killed = True


def test_a_gateway_that_uses_its_whole_stop_leaves_the_cache_its_share(tmp_path: Path) -> None:
    """The gateway that did not drain in time was killed at the stop's deadline, leaving the
    cache none of it: killed undrained, with the stores the gateway had just sent it."""
    mesh = Mesh(tmp_path)
    gateway, cache = StuckProcess(drains=False), StuckProcess(drains=True)
    mesh.procs = {"gateway": gateway, "cache": cache}  # type: ignore[dict-item]
    mesh.stop(timeout_s=1.0)
    assert gateway.killed
    assert cache.signals
    assert not cache.killed
    # Of a 1 s stop, the gateway's deadline leaves the cache half (CALLEES_STOP_S is 2 s).
    assert CALLEES_STOP_S > 0.5
    assert cache.waited[0] >= 0.4, cache.waited
