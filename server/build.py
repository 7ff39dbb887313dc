"""Building the engine core from the server's settings: loading the models, then the core.

A module of its own (not ``server.__main__``) so that an engine process (``--engine-process``) can
name it: the child process imports this function to build its core.
"""

from __future__ import annotations

import gc
import logging

from server.settings import Settings

log = logging.getLogger("server")


def build_core(settings: Settings):
    """Loads target and draft and builds the :class:`EngineCore` (runs on the engine thread)."""
    import torch

    from engine.core import EngineCore
    from engine.models.loader import load_model

    if settings.threads:
        torch.set_num_threads(settings.threads)
    log.info("loading target %s (%s, %s)", settings.model, settings.dtype, settings.device)
    weights = dict(gguf_weights=settings.gguf_weights, quantize=settings.quantize)
    target = load_model(settings.model, settings.dtype, settings.device, **weights)
    draft = None
    if settings.draft_model:
        log.info("loading draft %s", settings.draft_model)
        draft = load_model(settings.draft_model, settings.dtype, settings.device, tokenizer_of=target, **weights)
    config = settings.engine_config()
    core = EngineCore(target, draft, config, model_name=settings.model_id)
    core.warm_up()  # on CUDA (warm_up = "auto"): /health says 503 until it is done
    log.info("engine ready: context %d tokens, tree %s, default method %s, max batch %d", core.max_model_len,
             list(settings.tree) if draft else "none (no draft model)", settings.spec_method, settings.max_batch)
    # What loading built (a few hundred thousand objects: tokenizer tables, modules, configs) lives as
    # long as the server: out of the garbage collector's scans from now on.  A full collection over it
    # is a stall of a large part of a step in every stream whenever one runs.
    gc.collect()
    gc.freeze()
    return core
