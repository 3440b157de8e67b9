"""End to end through the gateway with `hopline predict`, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from harness import TOPOLOGIES, Mesh

# Every test here passes with the stateless stages in their own processes and in the gateway.
MESH_TOPOLOGIES = TOPOLOGIES

OBVIOUS = {
    "I forgot my password and can't log in": "password_reset",
    "where is my package? it still hasn't arrived": "order_status",
    "let me speak to a real human please": "human_agent",
    "I want my money back for this order": "refund_request",
    "please cancel my subscription": "cancel_subscription",
}


def predict(mesh: Mesh, text: str, *extra: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "hopline", "predict", text, "--json", *extra],
        env=dict(os.environ, HOPLINE_GATEWAY_ADDR=mesh.gateway),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


@pytest.mark.parametrize(("text", "label"), sorted(OBVIOUS.items()))
def test_obvious_utterances_get_sensible_labels(mesh: Mesh, text: str, label: str) -> None:
    doc = predict(mesh, text, "--tenant", "labels-test")
    assert doc["label"] == label, doc
    assert doc["score"] > 0.3
    assert doc["model"] == "support-intents"
    assert doc["model_version"] == "1"


def test_json_contract_and_exact_hit_scoped_by_tenant(mesh: Mesh) -> None:
    text = "How do I update the credit card on my account?"
    first = predict(mesh, text, "--tenant", "acme")
    for key in (
        "label",
        "score",
        "model",
        "model_version",
        "cache",
        "similarity",
        "timings_ms",
        "trace_id",
    ):
        assert key in first
    assert first["cache"] == "MISS"
    assert set(first["timings_ms"]) >= {"tokenize", "inference", "postprocess", "total"}
    # A key the cache does not hold: the gateway's key mirror vouched for the miss, no lookup.
    assert "cache_lookup" not in first["timings_ms"]
    assert len(first["trace_id"]) == 32
    assert int(first["trace_id"], 16)

    second = predict(mesh, text, "--tenant", "acme")
    assert second["cache"] == "EXACT"
    assert second["similarity"] == 1.0
    assert (second["label"], second["score"]) == (first["label"], first["score"])
    assert "inference" not in second["timings_ms"]  # the hit short-circuited the model
    assert second["trace_id"] != first["trace_id"]

    # Same text, another tenant: never served from acme's entry.
    other = predict(mesh, text, "--tenant", "globex")
    assert other["cache"] == "MISS"
    assert other["label"] == first["label"]

    # Normalisation: case and whitespace differences hit the same exact entry.
    assert (
        predict(mesh, "  how do I update the CREDIT card on my account? ", "--tenant", "acme")[
            "cache"
        ]
        == "EXACT"
    )


def test_human_output_and_cache_bypass(mesh: Mesh) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hopline",
            "predict",
            "what are your opening hours on sunday",
            "--top-k",
            "3",
            "--cache",
            "bypass",
        ],
        env=dict(os.environ, HOPLINE_GATEWAY_ADDR=mesh.gateway),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "label" in out.stdout
    assert "SKIPPED" in out.stdout
    assert "trace id" in out.stdout
    assert out.stdout.count("  top ") == 2


def test_out_of_scope_text_is_flagged(mesh: Mesh) -> None:
    doc = predict(mesh, "what is the boiling point of nitrogen in kelvin", "--top-k", "2")
    assert doc["label"] == "out_of_scope", doc
    assert doc["out_of_scope"] is True
    assert len(doc["top_k"]) == 2
