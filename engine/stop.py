"""Incremental detokenisation and stop conditions.

A request's output is produced token by token (plain decoding) or several tokens at a time (a
speculative step emits ``accepted + 1``).  :class:`TextStream` turns those tokens into the text that
may be sent to the client *now*:

* :class:`IncrementalDetokenizer` yields the text delta of each token, holding back incomplete UTF-8
  sequences and decoding in a window of previous tokens (SentencePiece leading spaces);
* :class:`StopChecker` holds a request's stop conditions: stop strings, stop / EOS token ids and
  ``max_tokens``;
* :class:`TextStream` withholds a tail that could still grow into a stop string, cuts the text right
  before a completed stop string, and tells the caller how many fed tokens were consumed.

Stop-string semantics are those of the character stream, independent of how it is split into tokens
or steps: the stop string that *completes first* wins (ties: the one that starts first), the output is
cut right before it, and nothing after it is ever emitted.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from engine.request import SamplingParams

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas for a growing token sequence (the prefix-offset / read-offset technique).

    ``ids[prefix_offset:read_offset]`` are a few tokens already turned into text; decoding
    ``ids[prefix_offset:]`` and removing the text of that prefix gives the new text, with the
    leading space / merge behaviour a token has *in context* (a SentencePiece "▁word" decodes to
    "word" alone but " word" after another token).  While the decoded text ends in U+FFFD the last
    token(s) end inside a multi-byte UTF-8 character, so nothing is emitted and the offsets stay put
    until the character completes.  The window starts on the last few prompt tokens.
    """

    PROMPT_WINDOW = 5

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._backend = _backend_decoder(tokenizer)
        self._ids = list(prompt_token_ids[-self.PROMPT_WINDOW:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # all text produced so far

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _advance(self, allow_incomplete: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        incomplete = new_text.endswith(_REPLACEMENT_CHAR) and not allow_incomplete
        if len(new_text) <= len(prefix_text) or incomplete:
            return ""
        delta = new_text[len(prefix_text):]
        # the tokens just read become the next prefix window; drop everything before it
        self._ids = self._ids[self._read_offset:]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self.text += delta
        return delta

    def add(self, token_id: int) -> str:
        """Append one token and return the text that became final (possibly "")."""
        self._ids.append(int(token_id))
        return self._advance(allow_incomplete=False)

    def flush(self) -> str:
        """At the end of generation, return text still held for an incomplete UTF-8 sequence."""
        return self._advance(allow_incomplete=True)


def _backend_decoder(tokenizer):
    """The ``tokenizers`` object behind a ``transformers`` fast tokenizer whose decoding is the
    library's own: its ``decode`` without clean-up is exactly the backend's, without the wrapper's
    conversions (a few microseconds a call, two calls a token a stream).  None otherwise (another
    tokenizer, or a class that decodes its own way).  Imports nothing: a tokenizer of the library's
    classes has their modules loaded already."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not callable(getattr(backend, "decode", None)):
        return None
    base = getattr(sys.modules.get("transformers.tokenization_utils_base"), "PreTrainedTokenizerBase", None)
    library = {getattr(getattr(sys.modules.get(module), name, None), "_decode", None)
               for module, name in (("transformers.tokenization_utils_tokenizers", "TokenizersBackend"),
                                    ("transformers.tokenization_utils_fast", "PreTrainedTokenizerFast"))} - {None}
    cls = type(tokenizer)  # a wrapper that forwards attributes to a tokenizer is not one
    if base is None or getattr(cls, "decode", None) is not base.decode:
        return None
    if getattr(cls, "_decode", None) not in library:
        return None
    return backend


class StopChecker:
    """A request's stop conditions (immutable; shared logic for every :class:`TextStream`).

    ``eos_token_ids`` count as stop tokens unless ``ignore_eos``.  Stop strings are matched on
    detokenised text; a stop token finishes the request without emitting its own text.
    """

    def __init__(
        self,
        stop_strings: Sequence[str] = (),
        stop_token_ids: Iterable[int] = (),
        eos_token_ids: Iterable[int] = (),
        ignore_eos: bool = False,
        max_tokens: int = 16,
    ) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.stop_strings = tuple(dict.fromkeys(stop_strings))
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        if not ignore_eos:
            self.stop_token_ids |= frozenset(int(t) for t in eos_token_ids)
        self.max_tokens = max_tokens
        # the KMP failure function of each stop string: memory linear in their total length (a set of
        # every prefix was quadratic: one long stop string took gigabytes)
        self._failure = [_failure_function(s) for s in self.stop_strings]

    @classmethod
    def from_params(cls, params: SamplingParams, eos_token_ids: Iterable[int]) -> "StopChecker":
        return cls(params.stop, params.stop_token_ids, eos_token_ids, params.ignore_eos, params.max_tokens)

    def is_stop_token(self, token_id: int) -> bool:
        return int(token_id) in self.stop_token_ids

    def find_stop(self, text: str) -> Optional[tuple[int, str]]:
        """``(start, stop_string)`` of the match in ``text`` that ends first (ties: starts first)."""
        best: Optional[tuple[int, int, str]] = None  # (end, start, stop)
        for s in self.stop_strings:
            start = text.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        return None if best is None else (best[1], best[2])

    def holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string (a tail
        that may still become one).  Time linear in the stop strings' lengths: each string's KMP
        automaton reads the last ``len(s) - 1`` characters of ``text``."""
        best = 0
        for stop, fail in zip(self.stop_strings, self._failure):
            state = 0
            for ch in text[max(0, len(text) - (len(stop) - 1)):] if len(stop) > 1 else "":
                while state and (state == len(stop) or stop[state] != ch):
                    state = fail[state - 1]
                if stop[state] == ch:
                    state += 1
            if state == len(stop):  # a whole match ending here is find_stop's; its proper prefix may go on
                state = fail[state - 1]
            best = max(best, state)
        return best


@dataclass
class StreamUpdate:
    """What one :meth:`TextStream.feed` call produced."""

    text: str  # text that may be emitted now
    consumed: int  # leading fed tokens that belong to the output; the rest are dropped
    finished: bool = False
    finish_reason: Optional[str] = None  # "stop" | "length"
    stop_reason: Optional[str | int] = None  # the stop string or stop/EOS token id that finished it


class TextStream:
    """Per-request output text: detokenise, withhold possible stop-string starts, stop.

    Each fed token, in order:

    1. count it; a stop / EOS token finishes with ``"stop"`` (its text is not emitted);
    2. else append its text delta to the withheld buffer; if a stop string now occurs there, emit the
       text before it and finish with ``"stop"`` (the withheld buffer always contains every character
       a future match could start at, so a match can never involve already-emitted text);
    3. else, at ``max_tokens`` tokens, finish with ``"length"``;
    4. else emit all but the longest tail that is a proper prefix of a stop string.

    On finish the withheld text (and any incomplete UTF-8 held by the detokenizer) is flushed.
    Tokens fed after the finishing one are not consumed.
    """

    def __init__(self, detokenizer: IncrementalDetokenizer, checker: StopChecker) -> None:
        self.detokenizer = detokenizer
        self.checker = checker
        self.num_tokens = 0  # consumed tokens, stop/EOS token included
        self.text = ""  # everything emitted so far
        self.finished = False
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[str | int] = None
        self._held = ""

    @classmethod
    def create(
        cls,
        tokenizer,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        eos_token_ids: Iterable[int],
        skip_special_tokens: bool = True,
    ) -> "TextStream":
        detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        return cls(detok, StopChecker.from_params(params, eos_token_ids))

    def feed(self, token_ids: Iterable[int]) -> StreamUpdate:
        """Feed one step's tokens; stops at the first token that finishes the request."""
        pieces, consumed = [], 0
        for tok in token_ids:
            if self.finished:
                break
            consumed += 1
            pieces.append(self._step(int(tok)))
        emitted = "".join(pieces)
        self.text += emitted
        return StreamUpdate(emitted, consumed, self.finished, self.finish_reason, self.stop_reason)

    def end(self) -> str:
        """Finishes the stream with ``"stop"`` (its grammar is complete); returns the withheld text."""
        if self.finished:
            return ""
        rest = self._finish("stop", None)
        self.text += rest
        return rest

    def _step(self, tok: int) -> str:
        self.num_tokens += 1
        checker = self.checker
        if checker.is_stop_token(tok):
            return self._finish("stop", tok)
        self._held += self.detokenizer.add(tok)
        if checker.stop_strings:  # (without any, nothing is looked for or withheld: most requests)
            match = checker.find_stop(self._held)
            if match is not None:
                out = self._held[:match[0]]
                self._held = ""
                self._set_finished("stop", match[1])
                return out
        if self.num_tokens >= checker.max_tokens:
            return self._finish("length", None)
        cut = len(self._held) - checker.holdback(self._held) if checker.stop_strings else len(self._held)
        out, self._held = self._held[:cut], self._held[cut:]
        return out

    def _finish(self, reason: str, stop_reason: Optional[str | int]) -> str:
        """Flush withheld text; a stop string completed by the flushed bytes still truncates."""
        rest = self._held + self.detokenizer.flush()
        self._held = ""
        match = self.checker.find_stop(rest)
        if match is not None:
            rest = rest[:match[0]]
            reason, stop_reason = "stop", match[1]
        self._set_finished(reason, stop_reason)
        return rest

    def _set_finished(self, reason: str, stop_reason: Optional[str | int]) -> None:
        self.finished = True
        self.finish_reason = reason
        self.stop_reason = stop_reason


def _failure_function(s: str) -> list[int]:
    """``out[i]``: length of the longest proper prefix of ``s[:i + 1]`` that is also its suffix."""
    out = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = out[k - 1]
        if s[i] == s[k]:
            k += 1
        out[i] = k
    return out
