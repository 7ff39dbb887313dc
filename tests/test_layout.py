"""The package's layering, checked on the source: no import circle in ``engine/`` or ``server/``,
nothing below the core imports the core, the runner or the server, and speculative code sees a
sequence only through ``SeqView``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from engine.sequence import Sequence
from engine.speculative.view import SeqView

ROOT = Path(__file__).resolve().parent.parent
ABOVE_THE_CORE = {"engine.core", "engine.runner", "engine.async_engine", "engine.engine_process"}
SPECULATIVE = sorted((ROOT / "engine" / "speculative").glob("*.py"))


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (also under ``TYPE_CHECKING`` and in functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def module_graph(root: Path, packages: tuple[str, ...] = ("engine", "server")) -> dict[str, set[str]]:
    """Module -> the package modules it imports (every import: module level, in functions and under
    ``TYPE_CHECKING``; ``from a import b`` counts ``a.b`` when that is a module)."""
    paths = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            paths[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in paths.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {m for m in found if m in paths and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's import circles: its strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                out.append(sorted(component))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    found = circles(module_graph(ROOT))
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_circle_scan_finds_a_circle(tmp_path):
    """A type-only import closing a loop counts (the scan would pass vacuously otherwise)."""
    (tmp_path / "engine").mkdir()
    (tmp_path / "server").mkdir()
    (tmp_path / "engine" / "a.py").write_text("from engine.b import B\n")
    (tmp_path / "engine" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from engine import c\n")
    (tmp_path / "engine" / "c.py").write_text("def f():\n    import engine.a\n")
    (tmp_path / "server" / "d.py").write_text("import engine.a\n")
    assert circles(module_graph(tmp_path)) == [["engine.a", "engine.b", "engine.c"]]


@pytest.mark.parametrize("path", [p for p in sorted((ROOT / "engine").rglob("*.py"))
                                  if p.name not in ("core.py", "async_engine.py", "engine_process.py", "runner.py")],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_below_the_core_imports_the_core_the_runner_or_the_server(path):
    found = {m for m in imports(path) if m in ABOVE_THE_CORE or m == "server" or m.startswith("server.")}
    assert not found, f"{path.relative_to(ROOT)} imports {sorted(found)}"


@pytest.mark.parametrize("path", SPECULATIVE, ids=lambda p: p.name)
def test_speculative_code_does_not_import_the_sequence(path):
    assert "engine.sequence" not in imports(path), f"{path.name}: use engine.speculative.view.SeqView"


def view_members() -> set[str]:
    members = set(getattr(SeqView, "__annotations__", {}))
    return members | {n for n, v in vars(SeqView).items() if isinstance(v, property)}


def sequence_reads(path: Path) -> set[str]:
    """Attributes read or written on what the speculative code names a sequence: ``seq``, ``s`` and
    ``sq``, and items of ``seqs`` (the package's naming convention)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if isinstance(v, ast.Name) and v.id in ("seq", "s", "sq") \
                or isinstance(v, ast.Subscript) and isinstance(v.value, ast.Name) and v.value.id == "seqs":
            out.add(node.attr)
    return out


@pytest.mark.parametrize("path", SPECULATIVE, ids=lambda p: p.name)
def test_speculative_code_reads_only_the_view(path):
    extra = sequence_reads(path) - view_members()
    assert not extra, f"{path.name} reads {sorted(extra)} of a sequence, which SeqView does not declare"


def test_the_engines_sequence_is_a_view():
    assert view_members() >= {"tokens", "request", "draft_cached", "root", "remaining"}
    missing = {m for m in view_members() if not hasattr(Sequence, m) and m not in Sequence.__dataclass_fields__}
    assert not missing
    from engine.request import GenerationRequest, SamplingParams

    assert isinstance(Sequence.create(GenerationRequest("r", [1, 2, 3], SamplingParams()), stream=None), SeqView)


def test_the_read_check_sees_the_sequences():
    """The scan above finds what the drafters do read (it would pass vacuously otherwise)."""
    reads = set().union(*map(sequence_reads, SPECULATIVE))
    assert {"tokens", "draft_cached", "request", "generator", "carry"} <= reads
