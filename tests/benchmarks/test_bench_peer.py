"""``bench_peer.py --base REV``: the base configurations run from a worktree of that revision (the
rest of the script needs a built llama-server and the model packs: run by hand, docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from benchmarks.bench_peer import checkout, remove


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


def test_the_base_tree_is_a_worktree_of_the_revision(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    for text in ("base", "head"):
        (repo / "server.py").write_text(text)
        git(repo, "add", "server.py")
        git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", text)
    tree = checkout("HEAD~1", repo)
    try:
        assert (tree / "server.py").read_text() == "base" and (repo / "server.py").read_text() == "head"
        assert git(tree, "rev-parse", "HEAD") == git(repo, "rev-parse", "HEAD~1")
    finally:
        remove(tree, repo)
    assert not tree.parent.exists() and str(tree) not in git(repo, "worktree", "list")
