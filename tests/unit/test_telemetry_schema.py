"""The span names and `hopline.` attributes in the code are exactly those of the schema
(hopline.observability.schema), and docs/observability.md lists every one of them."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT
from hopline.observability import schema

# Every folder of Python code (a missing one would be skipped silently by rglob: checked below).
PACKAGES = ("runtime", "model", "services", "gateway", "cache", "observability", "cli", "bench")
# call_hop opens the gateway's client span for a hop, named by its first argument (a
# StageHop passes its own first argument on to it); child_span opens a span under the
# current one (when its trace is recorded).
SPAN_CALLS = {"start_as_current_span", "start_span", "call_hop", "child_span", "StageHop"}
# OpenTelemetry semantic conventions the code also uses.
SEMCONV = ("rpc.", "server.")


def _sources() -> list[Path]:
    assert all((ROOT / pkg).is_dir() for pkg in PACKAGES), PACKAGES
    return [
        p
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
        if "_pb2" not in p.name and p.name != "schema.py"
    ]


def _resolve(node: ast.expr) -> str | None:
    """A string literal, or `schema.NAME`; None for anything computed at run time."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "schema"
    ):
        value = getattr(schema, node.attr)
        assert isinstance(value, str)
        return value
    return None


def _keys(node: ast.expr) -> list[str | None]:
    if isinstance(node, ast.Dict):
        return [_resolve(k) for k in node.keys if k is not None]
    return []


def _used() -> tuple[set[str], set[str], list[str]]:
    spans: set[str] = set()
    attrs: set[str] = set()
    dynamic: list[str] = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Subscript):  # a generic class's call: StageHop[A, B](...)
                func = func.value
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if called in SPAN_CALLS and node.args:
                name = _resolve(node.args[0])
                if name is None:
                    dynamic.append(where)
                else:
                    spans.add(name)
                for kw in node.keywords:
                    if kw.arg == "attributes":
                        found = _keys(kw.value)
                        assert None not in found, f"{where}: attribute keys must be constants"
                        attrs.update(k for k in found if k)
            elif called == "set_attribute" and node.args:
                key = _resolve(node.args[0])
                assert key is not None, f"{where}: attribute keys must be constants"
                attrs.add(key)
            elif called == "set_attributes" and node.args:
                found = _keys(node.args[0])
                assert found, f"{where}: set_attributes takes a dict literal"
                assert None not in found, f"{where}: attribute keys must be constants"
                attrs.update(k for k in found if k)
    return spans, attrs, dynamic


def test_code_uses_only_declared_attributes_and_every_declared_one() -> None:
    spans, attrs, _ = _used()
    ours = {a for a in attrs if not a.startswith(SEMCONV)}
    assert all(a.startswith("hopline.") for a in ours), sorted(ours)
    assert ours <= set(schema.ATTRIBUTES), sorted(ours - set(schema.ATTRIBUTES))
    assert set(schema.ATTRIBUTES) <= ours, (
        f"declared but never set: {set(schema.ATTRIBUTES) - ours}"
    )
    assert spans <= set(schema.SPANS), sorted(spans - set(schema.SPANS))


def test_every_declared_span_is_opened_somewhere() -> None:
    spans, _, dynamic = _used()
    # Only two span names are computed: the server span (named after the RPC) and the hop
    # span call_hop opens with the name its callers pass; child_span and StageHop pass
    # theirs on, and so does the tracer itself (spans.py: start_as_current_span calls
    # start_span).
    assert sorted({p.split(":")[0] for p in dynamic}) == [
        "gateway/direct_hop.py",
        "gateway/upstream.py",
        "observability/spans.py",
        "observability/tracing.py",
    ]
    assert len(dynamic) == 5, dynamic
    assert set(schema.SPANS) == spans, set(schema.SPANS) ^ spans


def test_docs_list_every_span_and_attribute() -> None:
    doc = (ROOT / "docs" / "observability.md").read_text()
    for name in [*schema.SPANS, *schema.ATTRIBUTES]:
        assert f"`{name}`" in doc, f"docs/observability.md does not list {name}"
