"""The generated Go, Java and Node clients' examples, run as a user runs them (built by `make
clients`; a missing build fails the test that needs it, with the reason)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from conftest import ROOT

LANGUAGES = ("go", "java", "node")

OUTPUT = re.compile(
    r"^label=(?P<label>\S+) score=(?P<score>[0-9.]+) model=(?P<model>\S+)/(?P<version>\S+) "
    r"cache=(?P<cache>\S+) trace_id=(?P<trace>[0-9a-f]{32})$"
)


def java_command() -> list[str]:
    classpath = ROOT / "clients/java/target/classpath.txt"
    if not classpath.is_file():
        pytest.fail(f"{classpath} is missing: run `make clients` (Maven Central, JDK 17+)")
    java = shutil.which("java")
    if java is None:
        pytest.fail("no `java` on PATH: the Java client needs a JDK 17+")
    classes = ROOT / "clients/java/target/classes"
    return [
        java,
        "-cp",
        f"{classes}:{classpath.read_text().strip()}",
        "dev.hopline.example.Predict",
    ]


def go_command() -> list[str]:
    binary = ROOT / "build/clients/go-predict"
    if not binary.is_file():
        pytest.fail(f"{binary} is missing: run `make clients` (Go toolchain, Go module proxy)")
    return [str(binary)]


def node_command() -> list[str]:
    script = ROOT / "clients/node/dist/src/predict.js"
    if not script.is_file():
        pytest.fail(f"{script} is missing: run `make clients` (Node 18+, npm)")
    node = shutil.which("node")
    if node is None:
        pytest.fail("no `node` on PATH: the Node client needs Node 18+")
    return [node, str(script)]


def run_example(
    lang: str, addr: str, text: str, timeout_ms: int | str, api_key: str = "", tls_ca: str = ""
) -> subprocess.CompletedProcess[str]:
    """One run of `lang`'s example, with `api_key` (if any) in HOPLINE_API_KEY and `tls_ca`
    (if any) in HOPLINE_TLS_CA (else plaintext, whatever this process's environment says). A
    str `timeout_ms` is passed as it is (Go's `-timeout` too): for the examples' usage
    errors."""
    timeout = timeout_ms if isinstance(timeout_ms, str) else f"{timeout_ms}ms"
    if lang == "go":
        cmd = [*go_command(), "-addr", addr, "-text", text, "-timeout", timeout]
    else:
        cmd = [*(java_command() if lang == "java" else node_command()), addr, text, str(timeout_ms)]
    env = {k: v for k, v in os.environ.items() if k not in ("HOPLINE_API_KEY", "HOPLINE_TLS_CA")}
    if api_key:
        env["HOPLINE_API_KEY"] = api_key
    if tls_ca:
        env["HOPLINE_TLS_CA"] = tls_ca
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, env=env)


def assert_usage_error(out: subprocess.CompletedProcess[str], says: str) -> None:
    """A usage mistake: exit 2, nothing on stdout, and one line on stderr that `says` what (no
    stack trace: Java's `at ...` frames, Node's source excerpt, Go's flag defaults)."""
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("predict: error: "), out.stderr
    assert says in lines[0], out.stderr
