"""Prompt sets: HumanEval problems, ShareGPT first turns, and the benchmark prompts file format.

Benchmark prompts file: a JSON list of ``{"id": str, "messages": [{"role": str, "content": str}, ...]}``, the
messages being what an OpenAI chat-completions request sends.  ``load_prompts_file`` validates it and says
which entry is wrong and why, so a hand-edited file fails at load time and not in the middle of a benchmark.
"""

from __future__ import annotations

import gzip
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

ROLES = ("system", "user", "assistant")
_READ_CHARS = 1 << 20
_ENGLISH_WORDS = frozenset(
    "the a an and or of to in on for with is are was be it this that you i my me your can what how do does "
    "please write make give me explain from as at by not if".split()
)


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: an id unique within its file and the chat messages to send."""

    id: str
    messages: tuple[dict[str, str], ...]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "messages": [dict(m) for m in self.messages]}


def load_humaneval(path: str | Path) -> list[dict]:
    """HumanEval problems (``task_id``, ``prompt``, ``entry_point``, ...) from its ``.jsonl`` or ``.jsonl.gz``."""
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":  # gzip magic, whatever the file is called
        raw = gzip.decompress(raw)
    problems = []
    for lineno, line in enumerate(raw.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            problem = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not a JSON line: {e}") from None
        if not isinstance(problem, dict) or not {"task_id", "prompt"} <= problem.keys():
            raise ValueError(f"{path}:{lineno}: a HumanEval problem needs 'task_id' and 'prompt'")
        problems.append(problem)
    return problems


def iter_json_array(path: str | Path, chunk_chars: int = _READ_CHARS) -> Iterator[Any]:
    """Yields the elements of a JSON array file one by one, stopping quietly where the file is cut off.

    The ShareGPT file in its wheel is truncated at 125 MB, so ``json.load`` fails on it.  Each element is
    decoded with ``json.JSONDecoder.raw_decode`` from a buffer that grows by ``chunk_chars`` when an element
    runs past its end; an element still incomplete at end of file is the cut, and iteration ends there.
    Memory stays at about one element plus one chunk, and reading stops as soon as the caller stops.
    """
    decoder = json.JSONDecoder()
    # errors="replace": the cut may split a multi-byte character; it only affects the discarded last element.
    with Path(path).open("r", encoding="utf-8", errors="replace") as f:
        buf, pos, eof = "", 0, False
        opened = False
        while True:
            pos = _skip_separators(buf, pos)
            if pos < len(buf) and not opened:
                if buf[pos] != "[":
                    raise ValueError(f"{path}: expected a JSON array, found {buf[pos]!r}")
                opened, pos = True, pos + 1
                continue
            if pos < len(buf) and buf[pos] == "]":
                return
            if pos < len(buf):
                try:
                    element, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError:
                    if eof:
                        return  # the cut
                else:
                    yield element
                    pos = end
                    continue
            if eof:
                return
            more = f.read(chunk_chars)
            eof = not more
            buf, pos = buf[pos:] + more, 0


def _skip_separators(buf: str, pos: int) -> int:
    """Skips whitespace and the commas between array elements."""
    while pos < len(buf) and buf[pos] in " \t\r\n,":
        pos += 1
    return pos


def first_human_turn(record: Any) -> str | None:
    """The text of the first ``"from": "human"`` turn of a ShareGPT record, or None if it has none."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    for turn in turns if isinstance(turns, list) else ():
        if isinstance(turn, dict) and turn.get("from") == "human" and isinstance(turn.get("value"), str):
            return turn["value"]
    return None


def looks_english(text: str) -> bool:
    """Cheap language filter: nearly all ASCII letters and a few common English function words.

    Good enough to keep a benchmark set readable; it lets through some English-looking code and rejects
    very short texts, which the length filter drops anyway.
    """
    letters = [c for c in text if c.isalpha()]
    if not letters or sum(c.isascii() for c in letters) / len(letters) < 0.98:
        return False
    words = {w.strip(".,:;!?\"'()").lower() for w in text.split()}
    return len(words & _ENGLISH_WORDS) >= 2


def load_sharegpt_first_turns(
    path: str | Path,
    limit: int | None = None,
    min_chars: int = 1,
    max_chars: int | None = None,
    english_only: bool = False,
) -> list[dict]:
    """``[{"id", "text"}]``: the first human turn of each conversation, in file order, filtered by length.

    Lengths are counted on the stripped text; records without a human turn are skipped, and so is a
    truncated last record.  ``limit`` stops reading early (the whole file is 125 MB).
    """
    turns: list[dict] = []
    if limit is not None and limit <= 0:
        return turns
    for index, record in enumerate(iter_json_array(path)):
        text = (first_human_turn(record) or "").strip()
        if not text or len(text) < min_chars or (max_chars is not None and len(text) > max_chars):
            continue
        if english_only and not looks_english(text):
            continue
        turns.append({"id": str(record.get("id", index)), "text": text})
        if limit is not None and len(turns) >= limit:
            break
    return turns


def load_prompts_file(path: str | Path) -> list[Prompt]:
    """Reads and validates a benchmark prompts file; ValueError naming the file and entry on any problem."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected a non-empty JSON list of {{'id', 'messages'}} objects")
    prompts = [parse_prompt(entry, f"{path}: prompt #{i}") for i, entry in enumerate(data)]
    seen: set[str] = set()
    for p in prompts:
        if p.id in seen:
            raise ValueError(f"{path}: duplicate prompt id {p.id!r}")
        seen.add(p.id)
    return prompts


def interleave_sources(prompts: Sequence[Prompt], limit: Optional[int] = None) -> list[Prompt]:
    """Round-robin over the prompts' sources (the id before the first ``/``: ``HumanEval``,
    ``sharegpt``, ...), keeping file order within each, so any first ``limit`` prompts mix the kinds."""
    groups: dict[str, list[Prompt]] = {}
    for p in prompts:
        groups.setdefault(p.id.split("/", 1)[0], []).append(p)
    mixed = [p for row in itertools.zip_longest(*groups.values()) for p in row if p is not None]
    return mixed[:limit]


def parse_prompt(entry: Any, where: str) -> Prompt:
    """Validates one ``{"id", "messages"}`` entry; ``where`` prefixes error messages."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected an object with 'id' and 'messages', got {type(entry).__name__}")
    extra = set(entry) - {"id", "messages"}
    if extra:
        raise ValueError(f"{where}: unknown key(s) {sorted(extra)}; allowed: 'id', 'messages'")
    pid = entry.get("id")
    if not isinstance(pid, str) or not pid.strip():
        raise ValueError(f"{where}: 'id' must be a non-empty string, got {pid!r}")
    messages = entry.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where} ({pid}): 'messages' must be a non-empty list")
    checked = tuple(_parse_message(m, f"{where} ({pid}) message #{j}") for j, m in enumerate(messages))
    if checked[-1]["role"] != "user":
        raise ValueError(f"{where} ({pid}): the last message must have role 'user' (the model answers it)")
    return Prompt(pid, checked)


def _parse_message(message: Any, where: str) -> dict[str, str]:
    if not isinstance(message, dict) or set(message) != {"role", "content"}:
        raise ValueError(f"{where}: expected exactly {{'role', 'content'}}, got {message!r:.80}")
    role, content = message["role"], message["content"]
    if role not in ROLES:
        raise ValueError(f"{where}: role must be one of {ROLES}, got {role!r}")
    if not isinstance(content, str) or not content.strip():
        raise ValueError(f"{where}: 'content' must be a non-empty string")
    return {"role": role, "content": content}
