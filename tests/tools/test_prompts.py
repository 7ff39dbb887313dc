"""Tests for tools.prompts: prompts-file validation, truncated ShareGPT parsing, HumanEval loading."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from tools.prompts import (
    Prompt,
    iter_json_array,
    load_humaneval,
    load_prompts_file,
    load_sharegpt_first_turns,
    looks_english,
)
from tests import ROOT

PROMPTS_DIR = ROOT / "benchmarks" / "prompts"


def write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def test_load_prompts_file_valid(tmp_path: Path) -> None:
    data = [
        {"id": "a", "messages": [user("hi")]},
        {"id": "b", "messages": [{"role": "system", "content": "be brief"}, user("why?")]},
    ]
    prompts = load_prompts_file(write_json(tmp_path / "p.json", data))
    assert prompts == [
        Prompt("a", (user("hi"),)),
        Prompt("b", ({"role": "system", "content": "be brief"}, user("why?"))),
    ]
    assert [p.to_json() for p in prompts] == data


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"id": "a"}, "non-empty JSON list"),
        ([], "non-empty JSON list"),
        (["text"], "prompt #0: expected an object"),
        ([{"messages": [user("x")]}], "'id' must be a non-empty string"),
        ([{"id": "", "messages": [user("x")]}], "'id' must be a non-empty string"),
        ([{"id": 3, "messages": [user("x")]}], "'id' must be a non-empty string"),
        ([{"id": "a", "messages": []}], "'messages' must be a non-empty list"),
        ([{"id": "a", "messages": "hi"}], "'messages' must be a non-empty list"),
        ([{"id": "a", "messages": [user("x")], "tags": []}], "unknown key"),
        ([{"id": "a", "messages": [{"role": "robot", "content": "x"}]}], "role must be one of"),
        ([{"id": "a", "messages": [{"role": "user", "content": 5}]}], "'content' must be a non-empty string"),
        ([{"id": "a", "messages": [{"role": "user"}]}], "expected exactly"),
        ([{"id": "a", "messages": [user("x"), {"role": "assistant", "content": "y"}]}], "last message"),
        ([{"id": "a", "messages": [user("x")]}, {"id": "a", "messages": [user("y")]}], "duplicate prompt id 'a'"),
    ],
)
def test_load_prompts_file_rejects(tmp_path: Path, data: Any, message: str) -> None:
    path = write_json(tmp_path / "p.json", data)
    with pytest.raises(ValueError, match=message) as err:
        load_prompts_file(path)
    assert str(path) in str(err.value)


def test_load_prompts_file_invalid_json(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text('[{"id": "a",', encoding="utf-8")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_prompts_file(path)


def sharegpt_record(cid: str, *turns: tuple[str, str]) -> dict:
    return {"id": cid, "conversations": [{"from": who, "value": text} for who, text in turns]}


def write_truncated_sharegpt(path: Path) -> None:
    """A pretty-printed array (like the real file) cut inside its last record, mid multi-byte character."""
    records = [
        sharegpt_record("r1_0", ("human", "  How do I sort a list in Python?  "), ("gpt", "Use sorted().")),
        sharegpt_record("r2_0", ("gpt", "Hello!"), ("human", "Tell me a joke about cats, please.")),
        sharegpt_record("r3_0", ("gpt", "No human turn here.")),
        sharegpt_record("r4_0", ("human", "ok")),
        sharegpt_record("r5_0", ("human", "x" * 200)),
        sharegpt_record("r6_0", ("human", "Ünïcödé wörds — 日本語 — are fine in the parser, {not} [json]")),
        sharegpt_record("r7_0", ("human", "This record is cut off before it ends, so it must be dropped.")),
    ]
    text = json.dumps(records, indent=2, ensure_ascii=False)
    raw = text.encode("utf-8")
    cut = text.index("This record is cut") + len("This record is cut")
    cut_bytes = len(text[:cut].encode("utf-8"))
    # End on half of a 3-byte character, as a byte-level cut can.
    path.write_bytes(raw[:cut_bytes].replace(b"This record is cut", b"This record is \xe6\x97"))


@pytest.mark.parametrize("chunk_chars", [7, 64, 1 << 20])
def test_iter_json_array_stops_at_cut(tmp_path: Path, chunk_chars: int) -> None:
    path = tmp_path / "sharegpt.json"
    write_truncated_sharegpt(path)
    ids = [r["id"] for r in iter_json_array(path, chunk_chars=chunk_chars)]
    assert ids == ["r1_0", "r2_0", "r3_0", "r4_0", "r5_0", "r6_0"]


def test_iter_json_array_complete_and_empty(tmp_path: Path) -> None:
    assert list(iter_json_array(write_json(tmp_path / "a.json", [{"a": 1}, {"b": [2, 3]}]), chunk_chars=3)) == [
        {"a": 1},
        {"b": [2, 3]},
    ]
    assert list(iter_json_array(write_json(tmp_path / "e.json", []))) == []
    with pytest.raises(ValueError, match="expected a JSON array"):
        list(iter_json_array(write_json(tmp_path / "o.json", {"a": 1})))


def test_sharegpt_first_turns_filters_and_limits(tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    write_truncated_sharegpt(path)
    turns = load_sharegpt_first_turns(path, min_chars=5, max_chars=100)
    assert [t["id"] for t in turns] == ["r1_0", "r2_0", "r6_0"]  # r3 no human turn, r4 short, r5 long, r7 cut
    assert turns[0]["text"] == "How do I sort a list in Python?"  # stripped
    assert turns[1]["text"] == "Tell me a joke about cats, please."  # first *human* turn, not the first turn
    assert load_sharegpt_first_turns(path, limit=2, min_chars=5, max_chars=100) == turns[:2]
    assert [t["id"] for t in load_sharegpt_first_turns(path, english_only=True)] == ["r1_0", "r2_0"]


def test_looks_english() -> None:
    assert looks_english("How do I sort a list in Python?")
    assert not looks_english("Wie kann ich eine Liste in Python sortieren?")
    assert not looks_english("如何在 Python 中对列表进行排序？ the and")
    assert not looks_english("")


def test_load_humaneval_gz_and_plain(tmp_path: Path) -> None:
    problems = [{"task_id": "HumanEval/0", "prompt": "def f():\n"}, {"task_id": "HumanEval/1", "prompt": "x"}]
    lines = "\n".join(json.dumps(p) for p in problems) + "\n\n"
    gz = tmp_path / "he.jsonl.gz"
    gz.write_bytes(gzip.compress(lines.encode()))
    plain = tmp_path / "he.jsonl"
    plain.write_text(lines)
    assert load_humaneval(gz) == problems
    assert load_humaneval(plain) == problems
    plain.write_text('{"task_id": "x"}\n')
    with pytest.raises(ValueError, match="he.jsonl:1: a HumanEval problem needs"):
        load_humaneval(plain)


def test_committed_prompt_files_are_valid_and_disjoint() -> None:
    bench = load_prompts_file(PROMPTS_DIR / "bench.json")
    train = load_prompts_file(PROMPTS_DIR / "train.json")
    smoke = load_prompts_file(PROMPTS_DIR / "smoke.json")
    assert (len(bench), len(train), len(smoke)) == (20, 120, 3)
    assert [p.id for p in bench[:10]] == [f"HumanEval/{i}" for i in range(10)]
    assert sum(p.id.startswith("sharegpt/") for p in bench) == 10
    assert sum(p.id.startswith("HumanEval/") for p in train) == 60
    assert not {p.id for p in bench} & {p.id for p in train}
    assert not {p.messages[-1]["content"] for p in bench} & {p.messages[-1]["content"] for p in train}
    assert all(50 <= len(p.messages[-1]["content"]) <= 600 for p in bench if p.id.startswith("sharegpt/"))
