"""Opening a milvus-lite file waits for a server slow to start, and reports one that fails to
start as what happened, then stops it.

Stand-in: milvus-lite's server binary is replaced (milvus-lite's own BIN_PATH setting) by a
script: one that runs the real server after a delay, as a loaded machine does (CI once failed a
cache start so), one that never opens its socket, one that exits while starting. The real
binary cannot be made to do any of these on demand."""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from pathlib import Path

import pytest

from hopline.cache.milvus_store import MilvusStore
from hopline.cache.store import CacheStoreError
from hopline.runtime import grpc_io


def fake_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    milvus = bin_dir / "milvus"
    pid_file = tmp_path / "server.pid"
    milvus.write_text(f"#!/bin/sh\necho $$ > {pid_file}\n{script}\n")
    milvus.chmod(0o755)
    monkeypatch.setenv("BIN_PATH", str(bin_dir))
    monkeypatch.setenv("GLOG_log_dir", str(tmp_path / "logs"))
    return pid_file


def alive(pid: int) -> bool:
    """Running, not a zombie: milvus-lite reaps its server when it stops it."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def open_store(db: Path) -> None:
    MilvusStore(str(db), "c", 4, timeout_s=0.5, start_timeout_s=2.0)


def test_a_server_slower_to_bind_than_milvus_lite_waits_is_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # milvus-lite gives its server 0.5 s and pymilvus then fails at once on a missing socket.
    spec = importlib.util.find_spec("milvus_lite")
    assert spec is not None
    assert spec.origin is not None
    lib = Path(spec.origin).parent / "lib"
    fake_server(tmp_path, monkeypatch, f'sleep 1.5\nLD_LIBRARY_PATH={lib} exec {lib}/milvus "$@"')
    store = MilvusStore(str(tmp_path / "cache.db"), "c", 4, timeout_s=5.0)
    try:
        assert store.count() == 0
    finally:
        store.close()


def test_a_server_that_never_answers_is_reported_and_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pid_file = fake_server(tmp_path, monkeypatch, "exec sleep 60")
    started = time.monotonic()
    with pytest.raises(CacheStoreError) as raised:
        open_store(tmp_path / "cache.db")
    message = str(raised.value)
    assert "milvus-lite's server did not answer within 2s" in message, message
    assert str(tmp_path / "logs") in message, message
    # The start budget, not the 0.5 s call timeout, bounded the wait.
    assert time.monotonic() - started >= 2.0
    pid = int(pid_file.read_text())
    try:
        assert not alive(pid), "the server of a failed open was left running"
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_server_that_exits_while_starting_is_reported_with_its_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_server(tmp_path, monkeypatch, "sleep 1\nexit 3")
    with pytest.raises(CacheStoreError) as raised:
        open_store(tmp_path / "cache.db")
    message = str(raised.value)
    assert "milvus-lite's server exited with code 3 while starting" in message, message
    assert "another process holds it" not in message, message


def test_a_server_that_exits_at_once_is_milvus_lites_own_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # milvus-lite waits 0.5 s for its server and gives up if it has exited: the same answer as
    # for a file another process holds (tests/mesh/test_cache_startup.py has that case).
    fake_server(tmp_path, monkeypatch, "exit 1")
    with pytest.raises(CacheStoreError, match="another process holds it"):
        open_store(tmp_path / "cache.db")


def real_binary() -> Path:
    spec = importlib.util.find_spec("milvus_lite")
    assert spec is not None
    assert spec.origin is not None
    return Path(spec.origin).parent / "lib"


HOPLINES = ",".join(f"-{name}" for name in grpc_io.SOCKET_EXPERIMENTS)


@pytest.mark.parametrize(
    ("operators", "server_gets"),
    [("", "<unset>"), ("-work_serializer_dispatch", "-work_serializer_dispatch")],
)
def test_the_server_starts_with_the_operators_grpc_experiments_not_hoplines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, operators: str, server_gets: str
) -> None:
    # As runtime/grpc_io.py leaves the environment of a process hopline runs: the operator's
    # experiments (if any), then hopline's socket ones, which milvus-lite's gRPC core lacks.
    written = grpc_io.experiments(operators, grpc_io.GrpcIo.IOMGR)
    assert HOPLINES in written
    monkeypatch.setenv(grpc_io.GRPC_ENV, written)
    monkeypatch.setenv(grpc_io.WRITTEN_ENV, f"{operators}{grpc_io.SEPARATOR}{written}")
    lib = real_binary()
    seen = tmp_path / "experiments"
    fake_server(
        tmp_path,
        monkeypatch,
        f'echo "${{GRPC_EXPERIMENTS-<unset>}}" > {seen}\n'
        f'LD_LIBRARY_PATH={lib} exec {lib}/milvus "$@"',
    )
    store = MilvusStore(str(tmp_path / "cache.db"), "c", 4, timeout_s=5.0)
    try:
        assert seen.read_text().strip() == server_gets
        # This process's own variable is as it was, for whatever it starts later.
        assert os.environ[grpc_io.GRPC_ENV] == written
    finally:
        store.close()


def test_the_real_server_logs_no_unknown_grpc_experiment(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # milvus-lite's server writes to this process's stderr; it logged an error line
    # ("Unknown experiment: event_engine_listener") at every start while it got hopline's.
    assert HOPLINES in os.environ.get(grpc_io.GRPC_ENV, "")  # hopline's package wrote it
    store = MilvusStore(str(tmp_path / "cache.db"), "c", 4, timeout_s=5.0)
    try:
        assert store.count() == 0
    finally:
        store.close()
    err = capfd.readouterr().err
    assert "Unknown experiment" not in err, err
