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
from harness import Mesh
from polyglot import LANGUAGES, OUTPUT, run_example


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
    # Each language spells the code its own way: InvalidArgument (Go), INVALID_ARGUMENT.
    assert "INVALIDARGUMENT" in out.stderr.upper().replace("_", "")
    assert "text is empty" in out.stderr


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
