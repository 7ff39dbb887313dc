"""A toy grammar over the exact-law harness's six-token vocabulary, behind the same matcher interface
as xgrammar's (``engine.grammar.Matcher``), so the engine's grammar code runs unchanged on it.

The grammar is a transition table: after token ``t`` the next token must be one of ``ALLOWED[t]``.
Token 1 forces 2 and token 4 forces 5 (one token allowed), so forced drafts appear; it never ends.
"""

from __future__ import annotations

import torch

from engine.grammar import CompiledGrammar, GrammarSpec, GrammarState

ALLOWED = {0: (1, 2, 3), 1: (2,), 2: (0, 3, 4), 3: (1, 5), 4: (5,), 5: (0, 1, 2, 4)}


class ToyMatcher:
    """The state is the last token (the prompt's last token at the start)."""

    def __init__(self, first: int) -> None:
        self.stack = [first]
        self.calls = {"fill": 0, "accept": 0}

    def accept_token(self, token: int) -> bool:
        self.calls["accept"] += 1
        if token not in ALLOWED[self.stack[-1]]:
            return False
        self.stack.append(token)
        return True

    def rollback(self, num_tokens: int) -> None:
        assert 0 < num_tokens < len(self.stack), "rolled back past the committed state"
        del self.stack[-num_tokens:]

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        self.calls["fill"] += 1
        bits = sum(1 << t for t in ALLOWED[self.stack[-1]])
        bitmask[index] = 0
        bitmask[index, 0] = bits

    def is_terminated(self) -> bool:
        return False


def toy_grammar(first: int, vocab: int = 6) -> CompiledGrammar:
    """A compiled toy grammar whose matchers start after token ``first``."""
    return CompiledGrammar(GrammarSpec("toy", f"after {first}"), lambda: ToyMatcher(first), vocab)


def toy_state(first: int, vocab: int = 6) -> GrammarState:
    return GrammarState(toy_grammar(first, vocab))


def allowed_mask(last: int, vocab: int = 6) -> torch.Tensor:
    """[vocab] bool: what the toy grammar allows after ``last``."""
    out = torch.zeros(vocab, dtype=torch.bool)
    out[list(ALLOWED[last])] = True
    return out
