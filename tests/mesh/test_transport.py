"""The gateway's links to its upstreams: pooled channels are separate connections, and
co-located services can talk over unix: sockets."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from conftest import DEFAULT_MODEL
from harness import Mesh
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc

UPSTREAMS = ("tokenizer", "cache", "inference", "postprocess")


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:  # closed while we looked
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    return inodes


def established(pid: int) -> list[tuple[int, int]]:
    """(local port, remote port) of the TCP connections process `pid` holds (from /proc)."""
    mine = _socket_inodes(pid)
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            if state == "01" and inode in mine:  # 01: ESTABLISHED
                found.append((int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)))
    return found


def established_to(pid: int, port: int) -> int:
    return sum(1 for _, remote in established(pid) if remote == port)


def _predict_many(gateway: str, texts: list[str]) -> list[gateway_pb2.PredictResponse]:
    with grpc.insecure_channel(gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)

        def one(text: str) -> gateway_pb2.PredictResponse:
            reply: gateway_pb2.PredictResponse = stub.Predict(
                gateway_pb2.PredictRequest(text=text, cache_mode=common_pb2.CACHE_MODE_BYPASS),
                timeout=30,
            )
            return reply

        with ThreadPoolExecutor(max_workers=8) as pool:
            return list(pool.map(one, texts))


def _repo(default_repo: Path, work: Path) -> Path:
    repo = work / "models"
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    return repo


def test_channel_pool_opens_separate_connections(default_repo: Path, tmp_path: Path) -> None:
    """With 3 channels per upstream the gateway holds 3 TCP connections to each service.

    gRPC would otherwise share one connection between channels with identical arguments,
    and every call would queue behind one HTTP/2 connection.
    """
    mesh = Mesh(
        _repo(default_repo, tmp_path),
        tmp_path,
        service_env={"gateway": {"HOPLINE_CHANNELS_PER_UPSTREAM": "3"}},
    )
    mesh.start()
    try:
        replies = _predict_many(mesh.gateway, [f"where is order {i}" for i in range(24)])
        assert all(r.prediction.label for r in replies)
        pid = mesh.procs["gateway"].pid
        for name in ("tokenizer", "inference", "postprocess"):
            port = int(mesh.addrs[name].rsplit(":", 1)[1])
            assert established_to(pid, port) == 3, name
    finally:
        mesh.stop()


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    # Not tmp_path: a unix socket path must fit in 108 bytes, pytest's paths can be longer.
    path = Path(tempfile.mkdtemp(prefix="hl-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_unix_socket_addresses(default_repo: Path, tmp_path: Path, socket_dir: Path) -> None:
    """Every upstream on a unix: socket; the gateway dials them and answers as over TCP."""
    addrs = {name: f"unix:{socket_dir / name}.sock" for name in UPSTREAMS}
    mesh = Mesh(_repo(default_repo, tmp_path), tmp_path, addrs=addrs)
    mesh.start()
    try:
        for name in UPSTREAMS:
            assert (socket_dir / f"{name}.sock").is_socket(), name
        replies = _predict_many(mesh.gateway, ["reset my password", "talk to a human"] * 4)
        assert [r.prediction.label for r in replies[:2]] == ["password_reset", "human_agent"]
        hops = {t.hop for t in replies[0].timings}
        assert {"tokenize", "inference", "postprocess"} <= hops, hops
        # The gateway's only TCP connections are its clients': none goes out to a service.
        own = int(mesh.gateway.rsplit(":", 1)[1])
        outbound = [c for c in established(mesh.procs["gateway"].pid) if c[0] != own]
        assert outbound == [], outbound
    finally:
        mesh.stop()
