"""A Milvus server on a loopback port for tests, so the cache is exercised by URI
(`http://127.0.0.1:PORT`) as a deployment runs it, not only by file.

Two kinds:
- LITE: the server binary milvus-lite ships (the engine pymilvus runs for a file URI),
  started on a TCP address. Always installed (milvus-lite is a hopline dependency).
- STANDALONE: a real Milvus standalone, the PyPI package `milvus` (`milvus-server`), which
  `make milvus-standalone` installs into .tools/milvus-standalone (not a hopline dependency:
  it is a 2.3 server with its own embedded etcd and object store, for the server lane only).

HOPLINE_TEST_MILVUS picks what every test mesh's cache uses: `file` (default, milvus-lite by
file), `lite-server` or `standalone` (one server per mesh, so meshes stay isolated: neither
milvus-lite's server nor hopline's collection naming gives a mesh a database of its own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib.util
import os
import signal
import subprocess
import time
from pathlib import Path

from hopline.cache.milvus_store import quiet_pymilvus
from hopline.runtime import grpc_io
from hopline.runtime.ports import free_ports

ROOT = Path(__file__).resolve().parent.parent
STANDALONE_VENV = ROOT / ".tools" / "milvus-standalone"
STANDALONE_COMPONENTS = (
    "rootCoord",
    "proxy",
    "queryCoord",
    "queryNode",
    "indexNode",
    "dataCoord",
    "dataNode",
)


class MilvusKind(enum.Enum):
    FILE = "file"
    LITE_SERVER = "lite-server"
    STANDALONE = "standalone"


def chosen_kind() -> MilvusKind:
    value = os.environ.get("HOPLINE_TEST_MILVUS", MilvusKind.FILE.value)
    try:
        return MilvusKind(value)
    except ValueError:
        allowed = ", ".join(k.value for k in MilvusKind)
        raise ValueError(f"HOPLINE_TEST_MILVUS must be one of {allowed}, got {value!r}") from None


def lane_env(kind: MilvusKind) -> dict[str, str]:
    """Settings a mesh needs on a Milvus server, for the tests to check behaviour.

    With a server URI every exact-index miss reads Milvus (another replica's stores may be
    there), and a read through a server is a hop to another process: on this shared 2-core
    machine, with test suites and builds beside it, milvus-lite's server took up to 100 ms
    for a key query, past the gateway's 40 ms cache budget, and a lookup that fails open
    would make a behaviour test flaky. The server lanes give a lookup 2 s: they prove the
    cache is correct over a server; its latency is measured (bench/scripts/server_lookups.py,
    deploy/README.md), not asserted.
    """
    return {} if kind is MilvusKind.FILE else {"HOPLINE_CACHE_BUDGET_MS": "2000"}


def _lite_command(data: Path, port: int) -> tuple[list[str], dict[str, str]]:
    # Found, not imported: importing milvus_lite warns (pkg_resources), an error under pytest.
    spec = importlib.util.find_spec("milvus_lite")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("milvus-lite is not installed (a hopline dependency)")
    lib = Path(spec.origin).parent / "lib"
    # glog's files go to the server's folder, not /tmp, and gRPC's experiments are the
    # operator's, not hopline's (cache/milvus_lite.py:server_environment says why).
    env = dict(os.environ, LD_LIBRARY_PATH=str(lib), GLOG_log_dir=str(data))
    env.pop(grpc_io.GRPC_ENV, None)
    if operators := grpc_io.operators_experiments(os.environ):
        env[grpc_io.GRPC_ENV] = operators
    return [str(lib / "milvus"), str(data / "milvus.db"), f"127.0.0.1:{port}", "ERROR"], env


def _standalone_command(data: Path, port: int) -> tuple[list[str], dict[str, str]]:
    server = STANDALONE_VENV / "bin" / "milvus-server"
    if not server.is_file():
        raise FileNotFoundError(f"{server} is missing: run `make milvus-standalone`")
    # Its other components find free ports of their own; each advertises 127.0.0.1, or the
    # proxy hands clients the machine's first non-loopback address. Its embedded etcd is the
    # exception: without a config file of its own it listens on etcd's fixed defaults
    # (2379, 2380), so a second standalone beside the first fails to start.
    client, peer = free_ports(2)
    etcd = data / "embed-etcd.yaml"
    etcd.write_text(
        f"listen-client-urls: http://127.0.0.1:{client}\n"
        f"advertise-client-urls: http://127.0.0.1:{client}\n"
        f"listen-peer-urls: http://127.0.0.1:{peer}\n"
        f"initial-advertise-peer-urls: http://127.0.0.1:{peer}\n"
        f"initial-cluster: default=http://127.0.0.1:{peer}\n"
    )
    command = [str(server), "--data", str(data), "--proxy-port", str(port)]
    command += ["--etcd-port", str(client)]
    for component in STANDALONE_COMPONENTS:
        command += ["--extra-config", f"{component}.ip=127.0.0.1"]
    # A Strong read waits for the next time tick (200 ms by default); the cache's batched
    # writer pays two per batch, so at the default a few hundred stores take over a minute.
    command += ["--extra-config", "proxy.timeTickInterval=20"]
    # Milvus reads any setting from the environment too (etcd.config.path: ETCD_CONFIG_PATH);
    # the wrapper's --extra-config can only change keys its template already has.
    return command, dict(os.environ, ETCD_CONFIG_PATH=str(etcd))


ROOT_TOKEN = "root:Milvus"  # the root user a Milvus with authentication starts with


@dataclasses.dataclass(frozen=True)
class Security:
    """A standalone that authenticates and serves TLS with the certificates in `certs`
    (cli/certs.py's layout: ca.crt, milvus.crt and .key; cache.crt and .key for the client);
    `mutual` asks every client for a certificate the CA signed (tlsMode 2, else 1). Settings
    go in by environment, as `_standalone_command`'s do."""

    certs: Path
    mutual: bool = False

    def server_env(self) -> dict[str, str]:
        return {
            "COMMON_SECURITY_AUTHORIZATIONENABLED": "true",
            "COMMON_SECURITY_TLSMODE": "2" if self.mutual else "1",
            "TLS_SERVERPEMPATH": str(self.certs / "milvus.crt"),
            "TLS_SERVERKEYPATH": str(self.certs / "milvus.key"),
            "TLS_CAPEMPATH": str(self.certs / "ca.crt"),
        }

    def cache_settings(self) -> dict[str, str]:
        """CacheConfig's fields for a cache this server takes (the token in a file)."""
        token = self.certs / "milvus-token"
        token.write_text(ROOT_TOKEN + "\n")
        settings = {"milvus_token_file": str(token), "milvus_ca": str(self.certs / "ca.crt")}
        if self.mutual:
            settings["milvus_client_cert"] = str(self.certs / "cache.crt")
            settings["milvus_client_key"] = str(self.certs / "cache.key")
        return settings

    def client_kwargs(self) -> dict[str, str]:
        kwargs = {"token": ROOT_TOKEN}
        if self.mutual:
            kwargs |= {
                "ca_pem_path": str(self.certs / "ca.crt"),
                "client_pem_path": str(self.certs / "cache.crt"),
                "client_key_path": str(self.certs / "cache.key"),
            }
        else:
            kwargs["server_pem_path"] = str(self.certs / "ca.crt")
        return kwargs


class MilvusServer:
    """One server process over `data`; `uri` is what HOPLINE_CACHE_URI takes."""

    def __init__(
        self,
        data: Path,
        kind: MilvusKind = MilvusKind.LITE_SERVER,
        security: Security | None = None,
    ) -> None:
        if kind is MilvusKind.FILE:
            raise ValueError("a file URI needs no server")
        if security is not None and kind is not MilvusKind.STANDALONE:
            raise ValueError("only the standalone authenticates and serves TLS")
        self.kind = kind
        self.data = data
        self.security = security
        self.port = free_ports(1)[0]
        scheme = "http" if security is None else "https"
        self.uri = f"{scheme}://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 180.0) -> MilvusServer:
        self.data.mkdir(parents=True, exist_ok=True)
        build = _lite_command if self.kind is MilvusKind.LITE_SERVER else _standalone_command
        command, env = build(self.data, self.port)
        if self.security is not None:
            env = {**env, **self.security.server_env()}
        with (self.data / "server.log").open("ab") as log:
            self.process = subprocess.Popen(
                command,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.data,
                start_new_session=True,  # its own group: the standalone's wrapper forks
            )
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        """Ready when pymilvus can list collections: the port alone opens before that."""
        MilvusClient = quiet_pymilvus().MilvusClient

        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"Milvus {self.kind.value} exited: {self.log_tail()}")
            try:
                access = {} if self.security is None else self.security.client_kwargs()
                client = MilvusClient(self.uri, timeout=2, dedicated=True, **access)
                client.list_collections(timeout=2)
                client.close()
                return
            except Exception as exc:  # not up yet: pymilvus raises many kinds
                last = str(exc)[:200]
                time.sleep(0.2)
        raise RuntimeError(f"Milvus {self.kind.value} not ready in {timeout_s} s: {last}")

    def log_tail(self, lines: int = 20) -> str:
        path = self.data / "server.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        # The standalone may ignore SIGTERM while its components shut down: SIGKILL after.
        process, self.process = self.process, None
        if process is None:
            return
        # Signals go to the group: the wrapper's child must not outlive the test.
        os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
