"""The generated Go, Java and Node clients' examples against a live mesh.

`make test` builds them first (`make clients`: generators and libraries from the Go module
proxy, Maven Central and npm). A missing build fails here with that reason: these clients are
part of what hopline ships, so a machine that cannot build them has not tested them.
"""

from __future__ import annotations

import http.server
import re
import shutil
import socket
import ssl
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as triton
from triton_calls import strings, text_input

from conftest import DEFAULT_MODEL, ROOT
from harness import Mesh, free_port
from hopline.cli.certs import env_for, make_certs
from hopline.runtime.api_keys import API_KEY_ENV, KEY_RULE
from hopline.runtime.tls import CA_ENV
from polyglot import LANGUAGES, OUTPUT, assert_usage_error, run_example

# Addresses no example may dial: each was a call that failed (Go's UNKNOWN "failed to exit idle
# mode" or UNAVAILABLE "invalid port", Node's UNAVAILABLE) or, for "127.0.0.1:", Java's call
# to port 80; none of them a usage error said before anything is sent.
UNPARSEABLE = [
    "",
    "::::",
    "127.0.0.1:",
    "http://127.0.0.1:8001",
    "[::1",
    "[::1]",
    "127.0.0.1:99999",
    "127.0.0.1:0",
    "127.0.0.1:-5",
    ":8001",
    "::1:8001",
    "gateway",
    # Not DNS names (grpc-java refused them at once, Go and Node failed resolving them), a
    # port with six digits (Go took 021100 as 21100), an IPv6 address of one colon.
    "a..b:8001",
    "-gateway:8001",
    "gate_way:8001",
    "127.0.0.1:018001",
    "[:]:8001",
]


@pytest.fixture(scope="module")
def tls_mesh(default_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """The mesh over TLS (`make certs`'s code): the gateway serves TLS only, its certificate
    signed by the mesh's CA and naming 127.0.0.1."""
    work = tmp_path_factory.mktemp("clients-tls")
    repo = work / "models"
    repo.mkdir()
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    tls = env_for(make_certs(work / "tls"))
    m = Mesh(
        repo,
        work,
        HOPLINE_TLS_CA=tls["HOPLINE_TLS_CA"],
        HOPLINE_TLS_CERT=tls["HOPLINE_TLS_CERT"],  # `{name}`: each process its own
        HOPLINE_TLS_KEY=tls["HOPLINE_TLS_KEY"],
    )
    try:
        yield m.start()
    finally:
        m.stop()


@pytest.mark.parametrize("lang", LANGUAGES)
def test_example_prints_the_label_and_trace_id(mesh: Mesh, lang: str) -> None:
    # Unique text: a miss through every hop, not an answer some other test left in the cache.
    text = f"I want a refund for my purchase {uuid.uuid4().hex[:8]}"
    out = run_example(lang, mesh.gateway, text, 10_000)
    assert out.returncode == 0, out.stderr
    match = OUTPUT.match(out.stdout.strip())
    assert match, out.stdout
    assert match["label"] == "refund_request"
    assert match["model"] == "support-intents"
    assert match["cache"] == "CACHE_OUTCOME_MISS"
    assert 0 < float(match["score"]) <= 1


@pytest.mark.parametrize("lang", LANGUAGES)
def test_example_reports_a_refusal_with_its_status(mesh: Mesh, lang: str) -> None:
    """An empty text is refused by the gateway; the example names the status and exits 1."""
    out = run_example(lang, mesh.gateway, "   ", 10_000)
    assert out.returncode == 1, out.stdout
    # The canonical code name in every language, as `hopline predict` prints it (not Go's
    # own Code.String(), InvalidArgument).
    assert out.stderr.startswith("predict failed: INVALID_ARGUMENT: text is empty"), out.stderr


@pytest.mark.parametrize("lang", LANGUAGES)
def test_example_names_the_address_nothing_answers_at(lang: str) -> None:
    """No gateway at the address is a failed call (exit 1, UNAVAILABLE), said with the
    address and why (Java's own status says only "io exception")."""
    addr = f"127.0.0.1:{free_port()}"
    out = run_example(lang, addr, "where is my order", 10_000)
    assert out.returncode == 1, out.stdout
    assert out.stderr.startswith("predict failed: UNAVAILABLE: "), out.stderr
    assert addr in out.stderr, out.stderr
    assert "refused" in out.stderr.lower(), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("lang", LANGUAGES)
def test_example_names_an_address_that_does_not_resolve(lang: str) -> None:
    """A name no resolver knows (`.invalid` never resolves) is UNAVAILABLE naming the address,
    in one line: not Go's bare "produced zero addresses" nor grpc-java's logged stack trace."""
    addr = "gateway.hopline.invalid:8001"
    out = run_example(lang, addr, "where is my order", 10_000)
    assert out.returncode == 1, out.stdout
    assert out.stderr.startswith("predict failed: UNAVAILABLE: "), out.stderr
    assert addr in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("lang", LANGUAGES)
def test_example_names_the_address_that_never_answers(lang: str) -> None:
    """A port that accepts connections and never speaks HTTP/2 runs out the deadline: said
    with the address (no library's message names it)."""
    with socket.create_server(("127.0.0.1", free_port())) as silent:  # never accepts
        addr = f"127.0.0.1:{silent.getsockname()[1]}"
        out = run_example(lang, addr, "where is my order", 1_500)
    assert out.returncode == 1, out.stdout
    assert out.stderr.startswith("predict failed: DEADLINE_EXCEEDED: "), out.stderr
    assert addr in out.stderr, out.stderr
    assert "Resolution note" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("lang", LANGUAGES)
def test_example_names_a_port_that_answers_http1(lang: str) -> None:
    """An HTTP/1 server at the address (a metrics port given by mistake) answers, but not in
    HTTP/2: a failed call said with the address and that (Java ended INTERNAL with neither,
    Go hinted at TLS)."""
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        addr = f"127.0.0.1:{server.server_address[1]}"
        out = run_example(lang, addr, "where is my order", 5_000)
    finally:
        server.shutdown()
        server.server_close()
    assert out.returncode == 1, out.stdout
    assert out.stderr.startswith("predict failed: "), out.stderr
    assert addr in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    if lang != "node":  # grpc-js says "Protocol error", and no hint is added to it
        assert "not in HTTP/2" in out.stderr, out.stderr
        assert f"set {CA_ENV}" not in out.stderr, out.stderr


def test_go_example_refuses_text_that_is_not_utf8() -> None:
    """Bytes that are not UTF-8 are a usage error, where grpc-go failed the call INTERNAL
    "string field contains invalid UTF-8". (Java's and Node's runtimes decode the command line
    themselves, each such byte becoming U+FFFD before the example sees it: docs/clients.md.)"""
    out = run_example("go", f"127.0.0.1:{free_port()}", "caf\udce9 order", 10_000)
    assert_usage_error(out, "-text is not UTF-8 text")


@pytest.mark.parametrize("addr", UNPARSEABLE)
@pytest.mark.parametrize("lang", LANGUAGES)
def test_example_refuses_an_address_that_does_not_parse(lang: str, addr: str) -> None:
    """Not host:port (a name or IPv4 address, or an IPv6 one in brackets, and a port from 1 to
    65535): a usage error naming the address, before anything is sent (no gateway here)."""
    out = run_example(lang, addr, "where is my order", 10_000)
    assert_usage_error(out, f'address "{addr}": ')


@pytest.mark.parametrize("lang", LANGUAGES)
def test_example_dials_a_name_and_a_bracketed_ipv6_address(lang: str) -> None:
    """The forms the rule accepts are dialled (nothing listens there: UNAVAILABLE, exit 1)."""
    port = free_port()
    for addr in (f"localhost:{port}", f"[::1]:{port}"):
        out = run_example(lang, addr, "where is my order", 10_000)
        assert out.returncode == 1, (addr, out.stderr)
        assert out.stderr.startswith("predict failed: UNAVAILABLE: "), out.stderr
        assert addr in out.stderr, out.stderr


@pytest.mark.parametrize("content", [None, "not a certificate\n", "der"])
@pytest.mark.parametrize("lang", LANGUAGES)
def test_example_refuses_a_ca_file_it_cannot_use(
    lang: str, content: str | None, tmp_path: Path
) -> None:
    """HOPLINE_TLS_CA naming a missing file, or one with no PEM certificate (a DER one too,
    which Node took and then failed every handshake with, "unable to verify the first
    certificate"), is a usage error naming the setting and the file, before anything is sent."""
    ca = tmp_path / "ca.crt"
    if content == "der":
        pem = (make_certs(tmp_path / "tls", roles=()) / "ca.crt").read_text()
        ca.write_bytes(ssl.PEM_cert_to_DER_cert(pem))
    elif content is not None:
        ca.write_text(content)
    addr = f"127.0.0.1:{free_port()}"
    out = run_example(lang, addr, "where is my order", 10_000, tls_ca=str(ca))
    assert_usage_error(out, f'{CA_ENV}="{ca}"')
    assert ("cannot read" if content is None else "holds no PEM certificate") in out.stderr


@pytest.mark.parametrize("lang", LANGUAGES)
def test_example_calls_a_tls_gateway_with_its_ca(tls_mesh: Mesh, lang: str, tmp_path: Path) -> None:
    """With HOPLINE_TLS_CA the example dials TLS and verifies the gateway against that CA; and
    says nothing else (Node's DEP0123 warning about an IP address as the TLS server name). The
    file here has a key before the certificate, which Java refused as no certificate."""
    ca = tmp_path / "key-then-ca.pem"
    given = Path(tls_mesh.env[CA_ENV])
    ca.write_text(given.with_name("ca.key").read_text() + given.read_text())
    text = f"I want a refund for my purchase {uuid.uuid4().hex[:8]}"
    out = run_example(lang, tls_mesh.gateway, text, 10_000, tls_ca=str(ca))
    assert out.returncode == 0, out.stderr
    match = OUTPUT.match(out.stdout.strip())
    assert match, out.stdout
    assert match["label"] == "refund_request"
    assert out.stderr == ""


@pytest.mark.parametrize("lang", LANGUAGES)
def test_plaintext_example_at_a_tls_gateway_hints_at_tls(tls_mesh: Mesh, lang: str) -> None:
    """Without HOPLINE_TLS_CA the TLS gateway closes the connection: UNAVAILABLE, in one line
    naming the address and the setting that would have worked."""
    out = run_example(lang, tls_mesh.gateway, "where is my order", 10_000)
    assert out.returncode == 1, out.stdout
    assert out.stderr.startswith("predict failed: UNAVAILABLE: "), out.stderr
    assert tls_mesh.gateway in out.stderr, out.stderr
    assert f"set {CA_ENV}" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_tritonclient_calls_a_tls_gateway_with_its_ca(tls_mesh: Mesh) -> None:
    """docs/clients.md's way for tritonclient: ssl=True and the CA file as root_certificates."""
    client = triton.InferenceServerClient(
        url=tls_mesh.gateway, ssl=True, root_certificates=tls_mesh.env[CA_ENV]
    )
    try:
        assert client.is_server_ready()
        result = client.infer(
            DEFAULT_MODEL,
            [text_input(["I want a refund for my purchase"])],
            outputs=[triton.InferRequestedOutput("label")],
            client_timeout=10,
        )
        assert strings(result.as_numpy("label")) == ["refund_request"]
    finally:
        client.close()


@pytest.mark.parametrize("timeout", ["soon", "0"])
@pytest.mark.parametrize("lang", LANGUAGES)
def test_example_refuses_a_bad_timeout_in_one_line(mesh: Mesh, lang: str, timeout: str) -> None:
    """A usage mistake is exit 2 and one line, before anything is sent: not a stack trace
    (Java's NumberFormatException, grpc-js's RangeError), nor a call with a spent deadline."""
    out = run_example(lang, mesh.gateway, "where is my order", timeout)
    assert_usage_error(out, timeout)


@pytest.mark.parametrize("lang", LANGUAGES)
def test_example_refuses_an_unsendable_api_key_before_calling(mesh: Mesh, lang: str) -> None:
    """A key no header can carry is refused as `hopline predict` refuses it: not gRPC's
    INTERNAL (Go), a mangled key sent (Java) or a stack trace (Node). This mesh has no keys:
    a key sent at all would be answered."""
    out = run_example(lang, mesh.gateway, "where is my order", 10_000, api_key="clé-secrète")
    assert_usage_error(out, f"{API_KEY_ENV}: an API key must be {KEY_RULE}")


def test_generated_code_is_not_committed() -> None:
    """Generated code is ignored, never committed: the clients' and the Python stubs `make
    protos` writes beside each .proto. What is committed is the protos."""
    tracked = subprocess.run(
        ["git", "ls-files", "clients", "protos"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    generated = [p for p in tracked if re.search(r"(^|/)(gen|target|dist|node_modules)/", p)]
    assert generated == []
    assert [p for p in tracked if p.startswith("protos/") and p.endswith((".py", ".pyi"))] == []
