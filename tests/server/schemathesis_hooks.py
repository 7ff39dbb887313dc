"""schemathesis hooks for ``test_schemathesis.py`` (loaded through ``SCHEMATHESIS_HOOKS``).

``positive_data_acceptance`` fails any 400 to a request its generator took from the schema.  A few
refusals depend on the served model and configuration, which no JSON schema states: the context
length (prompt tokens plus ``max_tokens``), the vocabulary (token ids in a prompt, ``logit_bias`` or ``/detokenize``),
the draft tree (``speculative.tree``), the queue (``len(prompt) * n`` completions at once), and
whether a structured output's schema, regex or grammar compiles, whether the chat template renders
tools, whether a string holds JSON (a history message's tool-call arguments), and the rules a JSON
schema cannot state between values (a named ``tool_choice`` must be one of the ``tools``, whose names
must differ).  This check is that one minus those refusals, recognised by their error ``code``; every
other 400 to a schema-valid request still fails.
"""

from __future__ import annotations

import schemathesis

MODEL_LIMITS = {"context_length_exceeded", "token_id_out_of_range", "speculation_does_not_fit",
                "too_many_completions",
                "invalid_grammar",  # whether a schema, regex or grammar compiles: no JSON schema can say
                "tools_not_supported",  # the served model's chat template renders no tools
                "invalid_tool_arguments",  # whether a history call's arguments string holds JSON: none can say
                "unknown_tool", "duplicate_tool_name"}  # a value that must (not) name another's: neither


@schemathesis.check
def accepts_what_fits_the_model(ctx, response, case) -> None:
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 400:
        return None
    error = response.json().get("error") or {}
    if error.get("code") in MODEL_LIMITS:
        return None
    raise AssertionError(f"a schema-valid request was refused: {error.get('message')!r} "
                         f"(param {error.get('param')!r}, code {error.get('code')!r})")
