"""runtime/listeners.py on a /proc tree written here (the kernel's formats; the real one is
read by tests/mesh/test_gateway_workers.py, where a worker finds a stranger on its port)."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import pytest

from hopline.runtime import workers
from hopline.runtime.listeners import command, listening, overlaps, owners, parent

HEADER = (
    "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
    "timeout inode\n"
)


def _row(local: str, remote: str, state: str, inode: int) -> str:
    timers = "00000000:00000000 00:00000000 00000000  1000        0"
    return f"   0: {local} {remote} {state} {timers} {inode} 1 0 0 10 0\n"


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    net = tmp_path / "net"
    net.mkdir()
    (net / "tcp").write_text(
        HEADER
        + _row("0100007F:1F41", "00000000:0000", "0A", 101)  # 127.0.0.1:8001, listening
        + _row("00000000:1F41", "00000000:0000", "0A", 102)  # 0.0.0.0:8001, listening
        + _row("0100007F:1F41", "0100007F:D431", "01", 103)  # an accepted connection
        + _row("0100007F:1F42", "00000000:0000", "0A", 104)  # 127.0.0.1:8002
    )
    (net / "tcp6").write_text(
        HEADER
        + _row("00000000000000000000000001000000:1F41", "0" * 32 + ":0000", "0A", 105)  # [::1]
        + _row("0000000000000000FFFF00000100007F:1F41", "0" * 32 + ":0000", "0A", 106)
    )
    for pid, ppid, name, inodes in (
        (10, 1, "gateway (sup)", []),
        (11, 10, "python3", [101, 999]),
        (12, 10, "python3", [102]),
        (20, 1, "a) (b", [105]),
    ):
        folder = tmp_path / str(pid)
        (folder / "fd").mkdir(parents=True)
        (folder / "stat").write_text(f"{pid} ({name}) S {ppid} {pid} {pid} 0 -1 4194560\n")
        (folder / "cmdline").write_bytes(b"python3\0-m\0hopline\0")
        for fd, inode in enumerate(inodes):
            os.symlink(f"socket:[{inode}]", folder / "fd" / str(fd))
    (tmp_path / "self").mkdir()  # not a pid: skipped
    return tmp_path


def test_listening_sockets_on_a_port_are_read_with_their_addresses(proc: Path) -> None:
    found = {(lst.address, lst.inode) for lst in listening(8001, proc)}
    assert found == {
        (ipaddress.ip_address(address), inode)
        for address, inode in [
            ("127.0.0.1", 101),
            ("0.0.0.0", 102),
            ("::1", 105),
            ("::ffff:127.0.0.1", 106),
        ]
    }
    assert [lst.inode for lst in listening(8002, proc)] == [104]
    assert listening(9, proc) == []


def test_a_missing_table_lists_nothing(tmp_path: Path) -> None:
    assert listening(8001, tmp_path) == []


def test_sockets_are_traced_to_the_processes_that_hold_them(proc: Path) -> None:
    assert owners([101, 102, 105, 106], proc) == {101: 11, 102: 12, 105: 20}
    assert parent(11, proc) == 10
    assert parent(20, proc) == 1  # a command name with spaces and parentheses
    assert parent(99, proc) is None
    assert command(11, proc) == "python3 -m hopline"
    assert command(99, proc) == ""


@pytest.mark.parametrize(
    ("a", "b", "shared"),
    [
        ("127.0.0.1", "127.0.0.1", True),
        ("127.0.0.1", "127.0.0.2", False),
        ("0.0.0.0", "127.0.0.1", True),
        ("0.0.0.0", "::1", False),  # an IPv4 wildcard takes no IPv6 connection
        ("::", "127.0.0.1", True),  # an IPv6 wildcard takes IPv4 too (Linux's default)
        ("::", "::1", True),
        ("::ffff:127.0.0.1", "127.0.0.1", True),
        ("::1", "127.0.0.1", False),
    ],
)
def test_which_addresses_one_port_shares(a: str, b: str, shared: bool) -> None:
    first, second = ipaddress.ip_address(a), ipaddress.ip_address(b)
    assert overlaps(first, second) is shared
    assert overlaps(second, first) is shared


def test_a_stranger_is_said_only_when_every_look_finds_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A socket closed between the read of the kernel's listeners and the read of the
    processes' descriptors looks ownerless once; one that stays is said."""
    seen = [["a socket of a process this one cannot see"], []]
    monkeypatch.setattr(workers, "_strangers_now", lambda listen: seen.pop(0) if seen else [])
    assert workers.strangers("127.0.0.1:1", between_s=0) == []
    stays = ["process 7 (other) on 127.0.0.1"]
    looks: list[str] = []

    def stranger(listen: str) -> list[str]:
        looks.append(listen)
        return stays

    monkeypatch.setattr(workers, "_strangers_now", stranger)
    assert workers.strangers("127.0.0.1:2", looks=3, between_s=0) == stays
    assert looks == ["127.0.0.1:2"] * 3
