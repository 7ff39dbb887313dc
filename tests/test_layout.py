"""The package's layering, checked on the source: nothing below the core imports the core, the
runner or the server, and speculative code sees a sequence only through ``SeqView``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from engine.sequence import Sequence
from engine.speculative.view import SeqView

ROOT = Path(__file__).resolve().parent.parent
ABOVE_THE_CORE = {"engine.core", "engine.runner", "engine.async_engine"}
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


@pytest.mark.parametrize("path", [p for p in sorted((ROOT / "engine").rglob("*.py"))
                                  if p.name not in ("core.py", "async_engine.py", "runner.py")],
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
    assert {"tokens", "draft_cached", "request", "generator", "init_candidates"} <= reads
