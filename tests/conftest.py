"""Fixtures and helpers shared by both lanes: tests/unit (no processes, no network) and
tests/mesh (real service processes). `pythonpath = ["tests"]` in pyproject.toml makes this
module and harness.py importable from either folder as `conftest` and `harness`."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from harness import Mesh, Topology

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
REFERENCE = SHARED / "reference" / "minilm_reference.json"
CLINC = SHARED / "data" / "clinc150" / "data_full.json"
DEFAULT_MODEL = "support-intents"


# What a test measured, for the run's summary: captured output of a passing test is
# dropped, and CI's log is the only place a stop's figures (request counts, visibility
# times) are seen.
_FIGURES: list[str] = []


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """`figures(line)` adds a line, under the test's id, to the run's "measured" section."""

    def add(line: str) -> None:
        _FIGURES.append(f"{request.node.nodeid}: {line}")

    return add


# Free bytes where the tests write (the first reading, the least), so a run that fills the
# disk says so in CI's log instead of leaving fixture errors to guess from.
_FREE_DISK: list[int] = []


def _note_free_disk(path: Path) -> None:
    stat = os.statvfs(path)
    free = stat.f_bavail * stat.f_frsize
    if not _FREE_DISK:
        _FREE_DISK.extend((free, free))
    _FREE_DISK[1] = min(_FREE_DISK[1], free)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _FREE_DISK:
        first, least = (round(b / 2**30, 1) for b in _FREE_DISK)
        _FIGURES.append(f"disk free where the tests write: {first} GiB at the start, {least} least")
    if _FIGURES:
        terminalreporter.section("measured")
        for line in _FIGURES:
            terminalreporter.write_line(line)


@pytest.fixture(scope="module", autouse=True)
def module_dirs_go_with_the_module(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[None]:
    """Folders a module's fixtures make with `tmp_path_factory.mktemp` are removed when the
    module ends, unless one of its tests failed (kept for reading, as pyproject.toml's
    "failed" retention keeps a failed test's `tmp_path`). Most hold a copy of the model
    (90 MB): a whole run left about 11 GB of them, the likely reason stop 84's CI failed in
    fixture set-up from one module on. Every `mktemp` in tests/ is in a module-scoped fixture,
    torn down (its processes stopped) before this autouse one; a session-scoped fixture must
    not call it. The free space is noted before each removal for the run's summary."""
    base = tmp_path_factory.getbasetemp()
    _note_free_disk(base)
    before = set(base.iterdir())
    failed_before = request.session.testsfailed
    yield
    _note_free_disk(base)
    if request.session.testsfailed > failed_before:
        return
    for path in set(base.iterdir()) - before:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def default_repo() -> Path:
    """The repository `make` built; tests never build the default model behind its back."""
    repo = Path(os.environ.get("HOPLINE_MODEL_REPO", ROOT / "models")).resolve()
    if not (repo / DEFAULT_MODEL / "1" / "config.json").is_file():
        pytest.fail(f"default model missing in {repo}: run `make model` (make test does)")
    return repo


@pytest.fixture(scope="session")
def reference() -> list[dict[str, Any]]:
    if not REFERENCE.is_file():
        pytest.skip(f"reference embeddings not found at {REFERENCE} (../shared is absent)")
    records: list[dict[str, Any]] = json.loads(REFERENCE.read_text(encoding="utf-8"))["records"]
    return records


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A module with `MESH_TOPOLOGIES = harness.TOPOLOGIES` runs every test that uses the mesh
    (directly or through another fixture) once per topology, one mesh per topology."""
    topologies = getattr(metafunc.module, "MESH_TOPOLOGIES", None)
    if topologies and "mesh" in metafunc.fixturenames:
        metafunc.parametrize("mesh", topologies, indirect=True, scope="module", ids=str)


@pytest.fixture(scope="module")
def mesh(
    default_repo: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Mesh]:
    """The mesh on free ports over a copy of the default repository: five processes, or the
    topology a module parametrizes it with (harness.TOPOLOGIES)."""
    topology: Topology = getattr(request, "param", Topology.FIVE_PROCESS)
    work = tmp_path_factory.mktemp(f"mesh-{topology}")
    repo = work / "models"
    repo.mkdir()
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    m = Mesh(repo, work, addrs=topology.addrs())
    try:
        yield m.start()
    finally:
        m.stop()


# --- helpers for tests split between the lanes ---------------------------------------------

# Support texts of many lengths: the batcher's tests (unit) and the inference service's
# queue bound (mesh).
BATCH_TEXTS = [
    "reset my password",
    "I was charged twice for the same order and want the second payment refunded please",
    "where is my parcel",
    "cancel",
    "can you tell me how to change the delivery address on an order that already shipped",
    "hi",
    "my card was declined at checkout even though it has money on it",
    "talk to a human",
    "the app crashes every time I open the settings page on my phone",
    "update billing info",
    "what are your opening hours on public holidays",
    "delete my account and all of my data",
]


def false_hit_rate(sims: Sequence[float], same: Sequence[bool], t: float) -> tuple[int, int]:
    """(hits, false hits) at threshold t, counted the slow, obvious way."""
    hits = [s for s, ok in zip(sims, same, strict=True) if s >= t]
    wrong = [s for s, ok in zip(sims, same, strict=True) if s >= t and not ok]
    return len(hits), len(wrong)


def check_conservative(
    sims: Sequence[float], same: Sequence[bool], t: float, target: float, min_hits: int = 1
) -> None:
    """A calibrated threshold t meets the target, as does every higher one with min_hits
    hits, and the next lower one does not (so t is the lowest that does)."""
    hits, wrong = false_hit_rate(sims, same, t)
    assert hits > 0
    assert wrong / hits <= target
    for u in sorted({s for s in sims if s > t}):
        h, w = false_hit_rate(sims, same, u)
        if h >= min_hits:
            assert w / h <= target, f"threshold {u} above the chosen {t} misses the target"
    lower = [s for s in sims if s < t]
    if lower:
        h, w = false_hit_rate(sims, same, max(lower))
        assert w / h > target, "the next lower threshold also meets the target: not the lowest"


# Hand-made OTLP JSON for `hopline trace report`: its analysis (unit) and its CLI (mesh).
MS = 1_000_000
PREDICT = "hopline.gateway.v1.GatewayService/Predict"
STATS = "hopline.gateway.v1.GatewayService/GetStats"
T0 = 1_700_000_000_000_000_000


def otlp_span(
    trace: str, sid: int, parent: int, name: str, kind: int, start_ms: float, end_ms: float
) -> dict[str, Any]:
    return {
        "traceId": trace,
        "spanId": f"{sid:016x}",
        "parentSpanId": f"{parent:016x}" if parent else "",
        "name": name,
        "kind": kind,
        "startTimeUnixNano": str(T0 + round(start_ms * MS)),
        "endTimeUnixNano": str(T0 + round(end_ms * MS)),
    }


def otlp_resource(service: str, spans: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": service}}]},
        "scopeSpans": [{"spans": spans}],
    }


def otlp_request(trace: str, inference_ms: float = 8.0) -> dict[str, Any]:
    """A miss: tokenize and the cache lookup together, then inference (slow or not), then
    postprocess, then 2 ms of the gateway's own work."""
    span, resource = otlp_span, otlp_resource
    inf_end = 21 + inference_ms
    return {
        "resourceSpans": [
            resource(
                "gateway",
                [
                    span(trace, 1, 0, PREDICT, 2, 0, inf_end + 7),
                    span(trace, 2, 1, "tokenize", 3, 0, 5),
                    span(trace, 3, 1, "cache_lookup", 3, 0, 20),
                    span(trace, 4, 1, "inference", 3, 20, inf_end + 1),
                    span(trace, 5, 1, "postprocess", 3, inf_end + 1, inf_end + 5),
                ],
            ),
            resource("tokenizer", [span(trace, 6, 2, "Tokenize", 2, 1, 4)]),
            resource(
                "cache",
                [
                    span(trace, 7, 3, "Lookup", 2, 1, 19),
                    span(trace, 8, 7, "cache.search", 1, 10, 18),
                ],
            ),
            resource(
                "inference",
                [
                    span(trace, 9, 4, "Infer", 2, 21, inf_end),
                    span(trace, 10, 9, "inference.queue", 1, 21, 22),
                    span(trace, 11, 9, "inference.run", 1, 22, inf_end),
                ],
            ),
            resource(
                "postprocess", [span(trace, 12, 5, "Postprocess", 2, inf_end + 2, inf_end + 4)]
            ),
        ]
    }


async def until(condition: Callable[[], bool]) -> None:
    """Let the event loop run until `condition` holds: for in-process stand-ins that do no
    I/O, so a thousand turns of the loop is far more than any of them needs."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


@pytest.fixture
def recorded_spans(monkeypatch: pytest.MonkeyPatch) -> Any:
    """hopline's tracer recording every span it makes into an in-memory exporter (returned),
    for this test only."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from hopline.observability import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_TRACER", provider.get_tracer("hopline"))
    return exporter
