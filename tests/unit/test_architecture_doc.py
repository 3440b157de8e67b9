"""docs/architecture.md names real code, and so do the other docs.

Every `path.py:Name` or `path.py:Class.method` in the doc (and in README.md, deploy/README.md
and the rest of docs/) must be a file under the repository root that defines that name, and
every row of the doc's service table must be a folder whose `service.py` defines the servicer
and config classes, matching the service table in
runtime/service_table.py. Sources are read with `ast`: nothing of hopline is imported,
nothing is started.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
# Fewer references each, but code moves under them too (docs/performance.md named
# `cache/service.py:_evict` after the write side moved to cache/writer.py).
OTHER_DOCS = sorted(
    {ROOT / "README.md", ROOT / "deploy" / "README.md", *(ROOT / "docs").glob("*.md")} - {DOC}
)
SERVICE_TABLE = ROOT / "runtime" / "service_table.py"

# `gateway/service.py:GatewayService.Predict`: a relative .py path, ':', dotted names.
REFERENCE = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.py):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
SERVICE_TABLE_HEADER = "| service | folder |"
# The doc's request path alone has more than this many references; far fewer means the
# pattern stopped matching the doc's notation, and the test would pass on nothing.
MIN_REFERENCES = 60


@dataclass(frozen=True)
class Reference:
    path: str
    name: str

    def __str__(self) -> str:
        return f"{self.path}:{self.name}"


@dataclass(frozen=True)
class ServiceRow:
    name: str
    folder: str
    servicer: str
    config: str
    address: str
    metrics_port: int


def references(text: str) -> list[Reference]:
    """Every `path.py:Name` in `text`, in order, each once."""
    found = (Reference(m[1], m[2]) for m in REFERENCE.finditer(text))
    return list(dict.fromkeys(found))


@functools.cache
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def defined_names(body: Sequence[ast.stmt]) -> dict[str, ast.stmt]:
    """Names a module or class body defines: functions, classes and assigned names,
    including those under top-level if/try blocks (TYPE_CHECKING, optional imports)."""
    names: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names[leaf.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, ast.If):
            names |= defined_names(node.body) | defined_names(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                names |= defined_names(block)
            for handler in node.handlers:
                names |= defined_names(handler.body)
    return names


def problem(ref: Reference, root: Path = ROOT) -> str | None:
    """Why `ref` does not name real code, or None when it does."""
    path = (root / ref.path).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        return f"{ref}: no file {ref.path}"
    scope: Sequence[ast.stmt] = parse(path).body
    walked: list[str] = []
    for part in ref.name.split("."):
        node = defined_names(scope).get(part)
        if node is None:
            where = ".".join(walked) or "module level"
            return f"{ref}: {ref.path} defines no {part!r} at {where}"
        walked.append(part)
        # Only a class has members to look up; inside a function or a value there are none.
        scope = node.body if isinstance(node, ast.ClassDef) else []
    return None


def problems(refs: Iterable[Reference], root: Path = ROOT) -> list[str]:
    return [p for p in (problem(ref, root) for ref in refs) if p is not None]


def _cell(raw: str) -> str:
    return raw.strip().strip("`").strip()


def service_rows(text: str) -> list[ServiceRow]:
    """The rows of the doc's service table (the one whose header starts `| service | folder |`)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(SERVICE_TABLE_HEADER))
    header = [_cell(c) for c in lines[start].strip("|").split("|")]
    rows: list[ServiceRow] = []
    for line in lines[start + 2 :]:  # past the header and its |---| line
        if not line.startswith("|"):
            break
        cells = dict(zip(header, (_cell(c) for c in line.strip("|").split("|")), strict=True))
        rows.append(
            ServiceRow(
                name=cells["service"],
                folder=cells["folder"].rstrip("/"),
                servicer=cells["servicer"],
                config=cells["config"],
                address=cells["default gRPC address"],
                metrics_port=int(cells["default metrics port"]),
            )
        )
    return rows


def constants(node: ast.AST) -> set[object]:
    return {leaf.value for leaf in ast.walk(node) if isinstance(leaf, ast.Constant)}


def callee(call: ast.Call) -> str:
    return ast.unparse(call.func)


def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def test_the_doc_uses_the_reference_notation() -> None:
    refs = references(doc_text())
    assert len(refs) >= MIN_REFERENCES, (
        f"only {len(refs)} `path.py:Name` references found in {DOC}; the notation or the "
        "pattern changed"
    )


def test_every_reference_names_a_definition() -> None:
    missing = problems(references(doc_text()))
    assert not missing, "stale references in docs/architecture.md:\n" + "\n".join(missing)


def test_every_reference_in_the_other_docs_names_a_definition() -> None:
    refs = {doc: references(doc.read_text(encoding="utf-8")) for doc in OTHER_DOCS}
    assert sum(map(len, refs.values())) >= len(OTHER_DOCS), "the other docs name no code"
    missing = [
        f"{doc.relative_to(ROOT)}: {p}" for doc, found in refs.items() for p in problems(found)
    ]
    assert not missing, "stale references:\n" + "\n".join(missing)


def test_the_check_catches_bogus_references(tmp_path: Path) -> None:
    """The checker itself: real names pass, each kind of wrong one is reported."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        "import os\n"
        "LIMIT: int = 3\n"
        "A, B = 1, 2\n"
        "if os.name:\n"
        "    def guarded() -> None: ...\n"
        "class Outer:\n"
        "    size = 1\n"
        "    class Inner:\n"
        "        async def run(self) -> None: ...\n"
        "    def method(self) -> None:\n"
        "        def local() -> None: ...\n",
        encoding="utf-8",
    )
    text = (
        "`pkg/mod.py:LIMIT` `pkg/mod.py:B` `pkg/mod.py:guarded` `pkg/mod.py:Outer.size` "
        "`pkg/mod.py:Outer.Inner.run` `pkg/mod.py:Outer.method`, and then the wrong ones: "
        "`pkg/mod.py:os` `pkg/mod.py:Outer.nothing` `pkg/mod.py:Outer.method.local` "
        "`pkg/mod.py:Inner` `pkg/none.py:Outer` `../mod.py:Outer`."
    )
    refs = references(text)
    assert [str(r) for r in refs][:2] == ["pkg/mod.py:LIMIT", "pkg/mod.py:B"]
    assert len(refs) == 12
    bad = problems(refs, tmp_path)
    assert [message.split(": ", 1)[0] for message in bad] == [
        "pkg/mod.py:os",  # imported, not defined there
        "pkg/mod.py:Outer.nothing",
        "pkg/mod.py:Outer.method.local",  # inside a function body: not addressable
        "pkg/mod.py:Inner",  # nested, not at module level
        "pkg/none.py:Outer",
        "../mod.py:Outer",  # outside the root
    ]


def test_every_service_in_the_table_has_its_folder_and_classes() -> None:
    rows = service_rows(doc_text())
    assert rows, "no service table in docs/architecture.md"
    for row in rows:
        folder = ROOT / row.folder
        assert folder.is_dir(), f"{row.name}: no folder {row.folder}/"
        # Layout rule: a service's folder is named after it.
        assert folder.name == row.name, f"{row.name} lives in {row.folder}/"
        module = folder / "service.py"
        assert module.is_file(), f"{row.name}: no {row.folder}/service.py"
        tree = parse(module)
        classes = {
            name
            for name, node in defined_names(tree.body).items()
            if isinstance(node, ast.ClassDef)
        }
        assert row.servicer in classes, f"{row.name}: service.py defines no class {row.servicer}"
        if row.config in classes:
            continue
        # Or its config.py beside it does, and service.py imports it from there (the launcher
        # finds both classes in the service's module).
        config = folder / "config.py"
        assert config.is_file(), f"{row.name}: no class {row.config} in service.py, no config.py"
        assert row.config in {
            name
            for name, node in defined_names(parse(config).body).items()
            if isinstance(node, ast.ClassDef)
        }, f"{row.name}: {row.folder}/config.py defines no class {row.config}"
        source = "hopline." + row.folder.replace("/", ".") + ".config"
        assert any(
            isinstance(node, ast.ImportFrom)
            and node.module == source
            and row.config in {a.name for a in node.names}
            for node in tree.body
        ), f"{row.name}: service.py does not import {row.config} from {source}"


def test_the_table_matches_the_runtime_service_table() -> None:
    """Each doc row is one entry of runtime/service_table.py, with the same module,
    classes, address and metrics port, and that table has no service the doc lacks."""
    rows = service_rows(doc_text())
    calls = [node for node in ast.walk(parse(SERVICE_TABLE)) if isinstance(node, ast.Call)]
    entries: list[ast.Call] = []
    for row in rows:
        matching = [call for call in calls if row.servicer in constants(call)]
        assert len(matching) == 1, f"{row.name}: {len(matching)} entries name {row.servicer}"
        entry = matching[0]
        values = constants(entry)
        module = "hopline." + row.folder.replace("/", ".") + ".service"
        for expected in (module, row.config, row.address, row.metrics_port):
            assert expected in values, (
                f"{row.name}: the doc says {expected!r}; runtime/service_table.py has "
                f"{sorted(map(str, values))}"
            )
        entries.append(entry)
    kinds = {callee(entry) for entry in entries}
    assert len(kinds) == 1, f"service entries built by different calls: {kinds}"
    table_size = sum(callee(call) in kinds for call in calls)
    assert table_size == len(rows), (
        f"runtime/service_table.py has {table_size} services, the doc's table {len(rows)}"
    )
