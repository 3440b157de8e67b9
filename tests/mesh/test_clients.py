"""The generated Go, Java and Node clients' examples against a live mesh.

`make test` builds them first (`make clients`: generators and libraries from the Go module
proxy, Maven Central and npm). A missing build fails here with that reason: these clients are
part of what hopline ships, so a machine that cannot build them has not tested them.
"""

from __future__ import annotations

import re
import subprocess
import uuid

import pytest

from conftest import ROOT
from harness import Mesh, free_port
from hopline.runtime.api_keys import API_KEY_ENV, KEY_RULE
from polyglot import LANGUAGES, OUTPUT, assert_usage_error, run_example


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
