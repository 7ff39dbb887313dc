"""Structured outputs: the grammar a request's output must follow, and its state while it runs.

A request may carry a :class:`GrammarSpec` (a JSON schema, ``json_object``, a regular expression or
an EBNF grammar).  The server compiles it, off the event loop, with :class:`Grammars` (one compiler
per tokenizer, cached by spec); the engine gives each sequence a :class:`GrammarState` that follows
the *committed* output tokens.  Everything a step decides under a grammar goes through three calls:

* :meth:`GrammarState.masks`: one allowed-token bitmask per tree row (the state after the row's
  path), and whether each path is allowed at all.  Verification masks the target's logits with
  them before logit bias, penalties, temperature, top-k/p and min-p, so the law it reproduces is
  the masked target's; the draft model masks its own rows the same way, so sampled drafts come from
  the masked ``q`` that verification is told about.
* :meth:`GrammarState.forced`: the tokens the grammar forces after a path (a single allowed token, or
  a forced string's tokens), which the ``grammar`` drafter (``engine.speculative.constrained``) adds
  to the tree as drafts that cost no draft forward, verified like any node.
* :meth:`GrammarState.commit`: after verification, the accepted tokens advance the matcher.

The grammar engine is xgrammar (``GrammarMatcher``: accept, rollback, bitmask fill), for its
structural tags (the tool-call format) and forced strings; llguidance measured faster per mask and
per compile, but the masks are a small part of a step either way (``docs/structured.md``).
The matcher interface is all this module uses of it, so the tests drive the same code with a toy
matcher over a small vocabulary (``tests/grammar_toy.py``).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

#: the kinds of grammar a request may name (a structural tag: xgrammar's, as JSON; tool calls use it)
JSON, REGEX, EBNF, STRUCTURAL_TAG = "json", "regex", "ebnf", "structural_tag"
#: ``response_format: json_object`` compiles this schema (xgrammar's built-in JSON grammar also allows arrays)
JSON_OBJECT_SCHEMA = '{"type": "object"}'
#: the longest grammar source a request may send (a schema, a regex or an EBNF text), in characters
MAX_SOURCE_CHARS = 65536
#: blanks the flexible JSON layout allows in a row, so a constrained request cannot run to max_tokens on blanks
MAX_WHITESPACE = 8


class GrammarError(ValueError):
    """A grammar that cannot be compiled (the server answers 400 naming ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match: ``kind`` (:data:`JSON`, :data:`REGEX`, :data:`EBNF`) and its
    source text (a JSON schema serialised, a regex, a grammar); ``param`` names the API field it came from."""

    kind: str
    source: str
    param: str = "response_format"

    @classmethod
    def json_schema(cls, schema: Any, param: str = "response_format") -> "GrammarSpec":
        text = schema if isinstance(schema, str) else json.dumps(schema)  # key order is the output's order
        return cls(JSON, text, param)


class Matcher(Protocol):
    """What :class:`GrammarState` needs of a grammar matcher (xgrammar's ``GrammarMatcher`` has it)."""

    def accept_token(self, token: int) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> Any: ...

    def is_terminated(self) -> bool: ...


@dataclass
class CompiledGrammar:
    """A compiled spec, shared by every request that sends it: ``new_matcher()`` gives a fresh state."""

    spec: GrammarSpec
    compiled: Any  # the engine's compiled grammar (xgrammar.CompiledGrammar), or a toy's factory
    vocab_size: int
    encode: Optional[Callable[[str], list[int]]] = None  # the tokenizer: a forced string's tokens

    def new_matcher(self) -> Matcher:
        if callable(self.compiled):
            return self.compiled()
        import xgrammar

        return xgrammar.GrammarMatcher(self.compiled)


def words(vocab_size: int) -> int:
    """int32 words of one bitmask row."""
    return (vocab_size + 31) // 32


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[..., words]`` int32 bitmask -> ``[..., vocab_size]`` bool (bit ``t % 32`` of word ``t // 32``),
    on the bitmask's device."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    out = (bitmask.unsqueeze(-1) >> bits).bitwise_and_(1).bool()
    return out.flatten(-2)[..., :vocab_size]


def apply_mask(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``logits`` with every token the grammar forbids at ``-inf`` (``allowed``: bool, same shape)."""
    return logits.masked_fill(~allowed, float("-inf"))


@dataclass
class Masks:
    """The allowed tokens after each of a batch of paths: ``bitmask[i]`` (int32 words, host) and
    whether path ``i`` itself is allowed (a forbidden path's row holds its longest allowed prefix's
    mask: it is never reached, and its logits stay finite)."""

    bitmask: torch.Tensor  # [paths, words] int32
    valid: list[bool]


class GrammarState:
    """One request's grammar while it runs: a matcher advanced by the committed output tokens only.
    Masks of tentative paths (a draft tree's) are filled by accepting the path and rolling it back."""

    def __init__(self, grammar: CompiledGrammar) -> None:
        self.grammar = grammar
        self.vocab_size = grammar.vocab_size
        self.matcher = grammar.new_matcher()
        self._all = torch.full((words(self.vocab_size),), -1, dtype=torch.int32)

    @property
    def terminated(self) -> bool:
        """The grammar has accepted a stop token: nothing more may be generated."""
        return bool(self.matcher.is_terminated())

    def commit(self, tokens: Sequence[int]) -> int:
        """Advances the matcher by accepted output tokens; returns how many it took: all of them, or
        those up to the stop token that ended the grammar (what follows it is not output).  A token
        the grammar refuses is a bug upstream (every emitted token was drawn from a masked law) and
        raises."""
        for n, tok in enumerate(tokens):
            if self.terminated:
                return n
            if not self.matcher.accept_token(int(tok)):
                raise RuntimeError(f"the grammar refused committed token {tok}")
        return len(tokens)

    def masks(self, paths: Sequence[Sequence[int]]) -> Masks:
        """The allowed tokens after each path (tokens past the committed output).  A row whose path
        ends in a stop token (the grammar is done) allows every token: whatever is drawn there
        follows the end of the output and is discarded."""
        bitmask = torch.empty(len(paths), words(self.vocab_size), dtype=torch.int32)
        valid = []
        for i, path in enumerate(paths):
            ok, n = self._advance(path)
            if self.matcher.is_terminated():
                bitmask[i] = self._all
            else:
                self.matcher.fill_next_token_bitmask(bitmask, i)
            if n:
                self.matcher.rollback(n)
            valid.append(ok)
        return Masks(bitmask, valid)

    def tree_masks(self, tokens: Sequence[int], parents: Sequence[int]) -> Masks:
        """:meth:`masks` for a tree's block rows: row 0 is the root (the committed state), row ``i + 1``
        node ``i`` (``parents[i]``: its parent node, -1 the root).  A dead node (a negative token) and
        everything below it is not allowed."""
        paths: list[list[int]] = [[]]
        for tok, p in zip(tokens, parents):
            paths.append(paths[p + 1] + [tok])
        return self.masks(paths)

    def forced(self, path: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces after ``path``; [] when the path is not allowed or
        nothing is forced.  Two kinds: a token that is the only one allowed where it stands (a stop
        token among them, which ends the run), and the tokens of a *forced string* (the text every
        continuation starts with, ``find_jump_forward_string``) as the tokenizer writes it: a string
        can be tokenized several ways, so no single token is forced there, but the tokenizer's own
        way is the one the model almost always takes.  Either kind is only ever a draft: verification
        decides, so the output law does not depend on it."""
        ok, n = self._advance(path)
        out: list[int] = []
        if ok:
            row = torch.empty(1, words(self.vocab_size), dtype=torch.int32)
            while len(out) < limit and not self.matcher.is_terminated():
                self.matcher.fill_next_token_bitmask(row, 0)
                tok = single_token(row[0], self.vocab_size)
                run = [tok] if tok is not None else self._forced_string_tokens()
                taken = 0
                for t in run[: limit - len(out)]:
                    if not self.matcher.accept_token(t):
                        break
                    out.append(t)
                    taken += 1
                if not taken:
                    break
        if n + len(out):
            self.matcher.rollback(n + len(out))
        return out

    def _forced_string_tokens(self) -> list[int]:
        jump = getattr(self.matcher, "find_jump_forward_string", None)
        if jump is None or self.grammar.encode is None:
            return []
        text = jump()
        return self.grammar.encode(text) if text else []

    def _advance(self, path: Sequence[int]) -> tuple[bool, int]:
        """Accepts ``path`` as far as the grammar allows: (all of it accepted, tokens accepted)."""
        n = 0
        for tok in path:  # a dead slot (-1) is no token: nothing below it is allowed
            if tok < 0 or self.matcher.is_terminated() or not self.matcher.accept_token(int(tok)):
                return False, n
            n += 1
        return True, n


def single_token(row: torch.Tensor, vocab_size: int) -> Optional[int]:
    """The one token a bitmask row allows, or None when it allows none or several."""
    live = row.nonzero()
    if live.numel() != 1:
        return None
    w = int(live[0, 0])
    bits = int(row[w]) & 0xFFFFFFFF
    if bits & (bits - 1):
        return None
    tok = 32 * w + bits.bit_length() - 1
    return tok if tok < vocab_size else None


class Grammars:
    """Compiles :class:`GrammarSpec` objects for one tokenizer, each spec once (a bounded cache).
    Thread-safe: the server compiles in worker threads while the engine runs."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], whitespace: str = "compact",
                 cache_size: int = 256) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.whitespace = whitespace  # JSON: "compact" (Python's separators) or "flexible" (bounded blanks)
        self.stop_token_ids = sorted(set(int(t) for t in stop_token_ids))
        self.cache_size = cache_size
        self._compiler = None
        self._cache: dict[GrammarSpec, CompiledGrammar] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        """Pickles as its tokenizer and options (for an engine process): the compiler and cache are rebuilt."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_compiler", "_cache", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _compiler=None, _cache={}, _lock=threading.Lock())

    def compiler(self):
        """xgrammar's compiler over this tokenizer (built on first use, which takes a moment for a large vocabulary)."""
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=self.stop_token_ids)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def json_layout(self) -> dict[str, Any]:
        """How JSON is laid out (xgrammar's options): compact, or blanks allowed but bounded."""
        if self.whitespace == "compact":
            return dict(any_whitespace=False, separators=(", ", ": "))
        return dict(any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar of ``spec`` (cached); :class:`GrammarError` naming ``spec.param`` if it
        cannot be compiled."""
        with self._lock:
            hit = self._cache.get(spec)
        if hit is not None:
            return hit
        if len(spec.source) > MAX_SOURCE_CHARS:
            raise GrammarError(f"the {spec.kind} grammar is {len(spec.source)} characters long; at most "
                               f"{MAX_SOURCE_CHARS} are accepted", spec.param)
        compiler = self.compiler()
        try:
            if spec.kind == JSON:
                json.loads(spec.source)
                compiled = compiler.compile_json_schema(spec.source, **self.json_layout())
            elif spec.kind == REGEX:
                compiled = compiler.compile_regex(spec.source)
            elif spec.kind == EBNF:
                compiled = compiler.compile_grammar(spec.source)
            elif spec.kind == STRUCTURAL_TAG:
                compiled = compiler.compile_structural_tag(spec.source)
            else:
                raise GrammarError(f"unknown grammar kind {spec.kind!r}", spec.param)
        except GrammarError:
            raise
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}", spec.param) from None
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / its own errors
            raise GrammarError(f"the {_NAMES[spec.kind]} cannot be compiled: {_short(exc)}", spec.param) from None
        out = CompiledGrammar(spec, compiled, self.vocab_size, self.encode)
        with self._lock:
            if len(self._cache) >= self.cache_size:
                self._cache.pop(next(iter(self._cache)))
            self._cache[spec] = out
        return out


_NAMES = {JSON: "JSON schema", REGEX: "regular expression", EBNF: "grammar", STRUCTURAL_TAG: "tool-call grammar"}


def _short(exc: Exception) -> str:
    """xgrammar's message without its source location prefix (``[time] file.cc:line: message``)."""
    text = str(exc).strip()
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1] if ".cc:" in text.split(": ", 1)[0] else text
    return text.splitlines()[0][:500] if text else type(exc).__name__
