"""Tool calls in the model's native format: the grammar that enforces them, and the parser that turns
the model's text into OpenAI ``tool_calls``.

Qwen2.5 (and the Hermes format it follows) writes a call as::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, blocks separated by a newline.  Its chat template renders the tools into the
system prompt.  ``tool_choice``:

* ``auto``: free text; calls are parsed out of it afterwards;
* ``none``: the tools are not rendered and nothing is parsed;
* ``required``: a grammar (xgrammar's structural tag) allows only call blocks, at least one, each
  call's arguments matching its tool's ``parameters`` schema (one block when
  ``parallel_tool_calls`` is false);
* a named function: a grammar allows exactly one block calling it.

:class:`ToolCallParser` reads the text incrementally, so a stream and a whole response give the same
calls: the content before the first block, then each call's name as soon as it is written and its
arguments as raw JSON fragments (what the model wrote, never re-serialised: the fragments of a stream
join to the arguments of the response).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from engine.grammar import MAX_WHITESPACE, STRUCTURAL_TAG, GrammarSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders a ``tools`` list (else a request with tools is a 400)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    return "tools" in template


def _call_tag(tool: dict[str, Any]) -> dict[str, Any]:
    """One call block of ``tool`` in the native format, its arguments constrained by its schema."""
    fn = tool["function"]
    schema = fn.get("parameters") or {"type": "object"}
    return {"type": "tag", "begin": f'{OPEN}\n{{"name": {json.dumps(fn["name"], ensure_ascii=False)}, "arguments": ',
            "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE},
            "end": f"}}\n{CLOSE}"}


def tool_grammar(tools: list[dict[str, Any]], choice: Any, parallel: bool) -> Optional[GrammarSpec]:
    """The grammar ``tool_choice`` imposes (None for ``auto`` and ``none``): ``required`` allows call
    blocks only (at least one; one when not ``parallel``), a named function exactly one call to it."""
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        tool = next(t for t in tools if t["function"]["name"] == name)
        fmt: dict[str, Any] = _call_tag(tool)
        param = "tool_choice"
    elif choice == "required":
        fmt = {"type": "tags_with_separator", "tags": [_call_tag(t) for t in tools], "separator": "\n",
               "at_least_one": True, "stop_after_first": not parallel}
        param = "tools"
    else:
        return None
    return GrammarSpec(STRUCTURAL_TAG, json.dumps({"type": "structural_tag", "format": fmt}), param)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Call:
    """One parsed call: its id, name and the arguments' raw JSON text so far."""

    id: str
    name: str
    arguments: str = ""
    done: bool = False


@dataclass
class Event:
    """What the parser found in a piece of text: ``content`` text, a call's start (``index``, ``call``
    with its id and name) or a fragment of its ``arguments``."""

    kind: str  # "content" | "call" | "arguments"
    text: str = ""
    index: int = 0
    call: Optional[Call] = None


@dataclass
class ToolCallParser:
    """Incremental: :meth:`feed` the text as it comes, :meth:`finish` at the end."""

    text: str = ""
    calls: list[Call] = field(default_factory=list)
    _pos: int = 0  # text before this is handled
    _in_call: bool = False
    _args_at: int = -1  # where the open call's arguments start (-1: not yet seen)
    _sent: int = 0  # arguments text of the open call already emitted
    _after_call: bool = False  # a block just closed: newlines before the next are skipped

    def feed(self, delta: str) -> list[Event]:
        self.text += delta
        out: list[Event] = []
        while True:
            step = self._call_step(out) if self._in_call else self._text_step(out)
            if not step:
                return out

    def finish(self) -> list[Event]:
        """Whatever is held back: a partial opening tag is content; an open call stays unfinished."""
        out: list[Event] = []
        if self._in_call and self._args_at < 0:  # a block that never became a call we can read
            out.append(Event("content", OPEN + self.text[self._pos:]))
            self._pos, self._in_call = len(self.text), False
        if not self._in_call and self._pos < len(self.text):
            out.append(Event("content", self.text[self._pos:]))
            self._pos = len(self.text)
        return out

    def _text_step(self, out: list[Event]) -> bool:
        if self._after_call:  # the newlines between blocks are no content
            while self._pos < len(self.text) and self.text[self._pos] == "\n":
                self._pos += 1
            if self._pos == len(self.text):
                return False
            self._after_call = False
        at = self.text.find(OPEN, self._pos)
        if at < 0:
            keep = _partial_suffix(self.text, OPEN, self._pos)  # a tag may be starting: hold it back
            if len(self.text) - keep > self._pos:
                out.append(Event("content", self.text[self._pos: len(self.text) - keep]))
                self._pos = len(self.text) - keep
            return False
        if at > self._pos:
            out.append(Event("content", self.text[self._pos: at]))
        self._pos, self._in_call, self._args_at, self._sent = at + len(OPEN), True, -1, 0
        return True

    def _call_step(self, out: list[Event]) -> bool:
        body = self.text[self._pos:]
        if self._args_at < 0:
            head = _HEAD.match(body)
            if head is None:
                end = body.find(CLOSE)
                if end < 0:
                    return False
                out.append(Event("content", OPEN + body[: end + len(CLOSE)]))  # not a call we can read
                self._pos += end + len(CLOSE)
                self._in_call = False
                return True
            self.calls.append(Call(new_call_id(), json.loads(f'"{head.group(1)}"')))
            out.append(Event("call", index=len(self.calls) - 1, call=self.calls[-1]))
            self._args_at = head.end()
        args = body[self._args_at:]
        start = len(args) - len(args.lstrip())
        try:
            _, end = json.JSONDecoder().raw_decode(args, start)
        except json.JSONDecodeError:
            end = -1  # not complete yet: all of it belongs to the arguments
        upto = end if end >= 0 else len(args)
        if upto - start > self._sent:
            piece = args[start + self._sent: upto]
            self.calls[-1].arguments += piece
            out.append(Event("arguments", piece, index=len(self.calls) - 1))
            self._sent = upto - start
        if end < 0:
            return False
        close = body.find(CLOSE, self._args_at + end)
        if close < 0:
            return False
        self.calls[-1].done = True
        self._pos += close + len(CLOSE)
        self._in_call, self._after_call = False, True
        return True


def _partial_suffix(text: str, tag: str, start: int) -> int:
    """Length of the longest suffix of ``text[start:]`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def parse(text: str) -> tuple[str, list[Call]]:
    """The content and the calls of a whole response (the same parser a stream uses)."""
    parser = ToolCallParser()
    events = parser.feed(text) + parser.finish()
    return "".join(e.text for e in events if e.kind == "content"), parser.calls


def decode_arguments(arguments: Any) -> Any:
    """A history message's call arguments for the chat template: OpenAI clients send them as a JSON
    string, which the template would encode a second time; ValueError if it is not JSON."""
    if isinstance(arguments, str):
        return json.loads(arguments) if arguments.strip() else {}
    return arguments
