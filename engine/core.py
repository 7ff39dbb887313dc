"""The synchronous engine: ``step()`` = schedule -> run -> postprocess.

``EngineCore`` owns the target (and optional draft) model, their KV caches, the scheduler and the
runner.  It is driven by one thread (see ``engine.async_engine``); nothing here is thread-safe.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Optional

import torch

from engine.config import EngineConfig
from engine.device import tensor as device_tensor
from engine.models.loader import LoadedModel
from engine.models.qweight import QuantLinear, quantized_copy
from engine.models.vocab import OutputVocab, frequent_vocab
from engine.request import GenerationRequest, RequestOutput, RequestRejected
from engine.runner import ModelRunner, SeqStepResult, record_step
from engine.sampler import SamplingTensors, token_count_matrix
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.speculative.adaptive import AdaptiveSpeculation, SpecPolicy
from engine.speculative.cost_model import measure_curve
from engine.speculative.maxgram import MATCH_CLASSES, BigramTable, LengthChooser, MaxGramDrafter, match_class
from engine.speculative.methods import (
    CASCADE, LOSSY, MAXGRAM, MCSD, MCSD_MAXGRAM, MJSD_LOSSY, NEEDS_DRAFT, TARGET_INIT_LOSSY, DraftPlan,
)
from engine.speculative.mjsd import LOSSY_NOTE as MJSD_NOTE
from engine.speculative.target_init import LOSSY_NOTE as TARGET_INIT_NOTE
from engine.speculative.proposer import DraftModelProposer
from engine.speculative.tree import SubTree, TreeTopology
from engine.stats import StepStats
from engine.stop import TextStream

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, target: LoadedModel, draft: Optional[LoadedModel] = None,
                 config: Optional[EngineConfig] = None, model_name: Optional[str] = None,
                 policy: Optional[SpecPolicy] = None) -> None:
        """``policy`` overrides the speculation policy the config describes (tests, head training)."""
        self.config = config or EngineConfig()
        self.target = target
        self.tokenizer = target.tokenizer
        self.model_name = model_name or target.source
        self.max_model_len = min(self.config.max_model_len, target.config.max_position_embeddings,
                                 target.config.sliding_window or 1 << 30)
        self.vocab_size = target.config.vocab_size
        self.topology = TreeTopology(self.config.tree if draft is not None else ())
        cfg = self.config
        # the largest verification block any method builds, and the most draft-cache entries a step appends
        self.init_topology = TreeTopology((cfg.target_init_k,) + (1,) * (cfg.target_init_depth - 1))
        max_nodes = max(self.topology.num_nodes + cfg.maxgram_branches * cfg.maxgram_len + cfg.maxgram_tail,
                        cfg.cascade_depth + cfg.maxgram_tail, cfg.mjsd_depth, self.init_topology.num_nodes)
        self.cache = target.model.new_cache(cfg.max_batch, self.max_model_len + max_nodes + 1)
        draft_len = self.max_model_len + max(self.topology.num_nodes, cfg.cascade_depth * (cfg.maxgram_len + 1),
                                             cfg.mjsd_beam * cfg.mjsd_depth, self.init_topology.num_nodes) + 1
        bigram = BigramTable.from_corpus(self.tokenizer, cfg.maxgram_corpus) if cfg.maxgram_corpus else None
        self.maxgram = MaxGramDrafter(cfg.maxgram_len, cfg.maxgram_max_ngram, cfg.maxgram_min_ngram, bigram)
        proposer = None
        self.policy: Optional[SpecPolicy] = None
        self.draft_vocab: Optional[OutputVocab] = None
        if draft is not None:
            _check_pair(target, draft)
            draft_cache = draft.model.new_cache(self.config.max_batch, draft_len)
            self.draft_vocab = _draft_vocab(draft, cfg)
            if cfg.draft_int8:  # after the vocabulary cut, which copies bf16 rows of the output layer
                draft = self._int8_draft(draft)
            if policy is None and self.config.adaptive:
                policy = AdaptiveSpeculation.from_config(self.config, self.topology, target, draft, self.cache,
                                                         draft_cache, self.draft_vocab)
            self.policy = policy
            proposer = DraftModelProposer(draft.model, draft_cache, self.vocab_size, self.config.without_replacement,
                                          self.topology, policy, chunk=self.config.prefill_chunk,
                                          vocab=self.draft_vocab)
        self.maxgram_lengths = self._maxgram_lengths(target) if cfg.load_aware else None
        self.runner = ModelRunner(target.model, self.cache, self.vocab_size, proposer, self.maxgram,
                                  mjsd_beam=cfg.mjsd_beam, mjsd_tau=cfg.mjsd_tau, target_init_k=cfg.target_init_k)
        self.scheduler = Scheduler(self.config, self.cache, proposer.cache if proposer else None)
        self.eos_token_ids = set(target.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(self.tokenizer.eos_token_id))
        self._stats: list[StepStats] = []

    @staticmethod
    def _int8_draft(draft: LoadedModel) -> LoadedModel:
        """The draft with its linears in Q8_0 blocks (int8 per 32 weights, ``engine.models.qweight``);
        on other devices than the CPU, where those kernels do not run, the draft as it is (logged), so
        that a CPU preset that asks for it still starts on a GPU."""
        if draft.model.device.type != "cpu":
            log.warning("draft_int8 is implemented for CPU only; the draft stays %s on %s",
                        draft.model.dtype, draft.model.device)
            return draft
        if any(isinstance(m, QuantLinear) for m in draft.model.modules()):
            log.info("draft %s: weights already in quantized blocks; draft_int8 has nothing to do", draft.source)
            return draft
        log.info("draft %s: linear weights in Q8_0 blocks", draft.source)
        return replace(draft, model=quantized_copy(draft.model, "q8_0"))

    def _maxgram_lengths(self, target: LoadedModel) -> LengthChooser:
        """Max-Gram's load-aware length cap, on the target cost curve (the adaptive policy's when it
        measured one, else measured here: a few forwards)."""
        budget = getattr(self.policy, "chooser", None)
        if budget is not None:
            curve = budget.cost.target
        else:
            b, n = self.config.max_batch, self.config.maxgram_len
            points = [(x, y) for x in sorted({1, max(1, b // 2), b}) for y in sorted({1, 1 + n // 2, 1 + n})]
            curve = measure_curve(target.model, self.cache, points, reps=2)
        return LengthChooser(curve, self.config.maxgram_len)

    # ------------------------------------------------------------------ requests
    def add_request(self, req: GenerationRequest) -> None:
        """Queues a request; raises ``ValueError`` with a user-facing message if it cannot run."""
        self._validate(req)
        stream = TextStream.create(self.tokenizer, req.prompt_token_ids, req.sampling, self.eos_token_ids)
        seq = Sequence.create(req, stream)
        seq.sampling_tensors = SamplingTensors.from_params([req.sampling], self.vocab_size, device=self.target.model.device)
        if req.spec.method is None:
            req.spec.method = self.config.spec_method
        if req.spec.enabled and req.spec.method in LOSSY and self.runner.proposer:
            seq.spec.note = MJSD_NOTE if req.spec.method == MJSD_LOSSY else TARGET_INIT_NOTE
        if req.spec.enabled and req.spec.adaptive and not isinstance(self.policy, AdaptiveSpeculation):
            seq.spec.note = "adaptive speculation is off on this server (start it with --adaptive); the tree is fixed"
        if not self.runner.proposer and req.spec.enabled and req.spec.method in NEEDS_DRAFT:
            seq.request.spec.enabled = False
            seq.spec.note = (f"speculation is off: the server runs without a draft model, which method "
                             f"{req.spec.method!r} needs (method 'maxgram' needs none)")
        if req.sampling.needs_history:
            dev = self.target.model.device
            seq.output_counts = torch.zeros(self.vocab_size, dtype=torch.int32, device=dev)
            if req.sampling.repetition_penalty != 1.0:
                seq.prompt_mask = token_count_matrix([req.prompt_token_ids], self.vocab_size, dev)[0] > 0
        self.scheduler.add(seq)

    def check_request(self, req: GenerationRequest) -> None:
        """Raises :class:`RequestRejected` if this engine cannot run ``req`` as asked.  Reads only the
        engine's fixed configuration, so the server calls it from its own thread before answering
        (a streaming request is refused with a 400, not an error after the first byte)."""
        n = len(req.prompt_token_ids)
        if n == 0:
            raise RequestRejected("the prompt is empty", "prompt")
        if min(req.prompt_token_ids) < 0 or max(req.prompt_token_ids) >= self.vocab_size:
            raise RequestRejected(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        if n + req.sampling.max_tokens > self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {n + req.sampling.max_tokens} tokens ({n} in the prompt, "
                f"{req.sampling.max_tokens} in the completion). Please reduce the prompt or max_tokens.",
                "max_tokens")
        if max(req.sampling.logit_bias, default=-1) >= self.vocab_size:
            raise RequestRejected(f"logit_bias token ids must be < {self.vocab_size}", "logit_bias")
        if req.spec.method == MJSD_LOSSY and req.sampling.needs_history:
            raise RequestRejected("speculative.method 'mjsd-lossy' does not support presence/frequency/repetition "
                                  "penalties", "speculative.method")
        if req.spec.tree is not None and req.spec.enabled:
            try:
                self.topology.subtree(req.spec.tree)
            except ValueError as exc:
                raise RequestRejected(str(exc), "speculative.tree") from None

    def _validate(self, req: GenerationRequest) -> None:
        self.check_request(req)
        if self.scheduler.find(req.request_id) is not None:
            raise ValueError(f"request id {req.request_id!r} is already running")

    def abort_request(self, request_id: str) -> None:
        seq = self.scheduler.find(request_id)
        if seq is not None:
            self.scheduler.finish(seq)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_cache_usage(self) -> float:
        return self.cache.usage()

    def drain_step_stats(self) -> list[StepStats]:
        out, self._stats = self._stats, []
        return out

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        stats = StepStats()
        if plan.prefill:
            stats.prefill_tokens = sum(end - s.target_cached for s, end in plan.prefill)
            self.runner.prefill(plan.prefill)
        outputs = []
        if plan.decode:
            budget = self.policy.budget(plan.decode) if self.policy is not None else None
            plans = self._cap_maxgram(plan.decode, [self._plan(seq, budget) for seq in plan.decode])
            stats.budget = max(p.sub.num_nodes for p in plans)
            results, failed = self.runner.step(plan.decode, plans, stats)
            if failed:
                kept = {id(r.seq) for r in results}
                plans = [p for s, p in zip(plan.decode, plans) if id(s) in kept]
            self._observe_maxgram(results, plans)
            if self.policy is not None:
                self.policy.observe(results)
            for res in results:
                record_step(stats, res)
                try:
                    outputs.append(self._postprocess(res, stats))
                except Exception as exc:  # noqa: BLE001 - e.g. detokenization: this request alone fails
                    log.exception("postprocessing failed for request %s", res.seq.request_id)
                    failed.append((res.seq, exc))
            outputs += [self._fail(seq, exc) for seq, exc in failed]
        stats.step_seconds = time.perf_counter() - t0
        if not plan.empty:
            self._stats.append(stats)
        return outputs

    def _fail(self, seq: Sequence, exc: Exception) -> RequestOutput:
        """Ends ``seq`` with an error (its slots freed); the batch's other requests are untouched."""
        self.scheduler.finish(seq)
        return RequestOutput(request_id=seq.request_id, new_token_ids=[], new_text="", finished=True,
                             finish_reason="error", error=f"generation failed: {type(exc).__name__}: {exc}",
                             prompt_tokens=seq.num_prompt, completion_tokens=seq.num_output, spec=seq.spec)

    def _cap_maxgram(self, seqs: list[Sequence], plans: list[DraftPlan]) -> list[DraftPlan]:
        """Caps Max-Gram's root proposals by the load-aware length chooser, per match class.  A sequence
        whose match is long enough to be trusted drafts nothing else (``ModelRunner._trust_maxgram``),
        so its draft tree does not count among the step's other rows."""
        if self.maxgram_lengths is None:
            return plans
        match = [self.maxgram.root_match(s) if p.maxgram and p.branches and s.request.spec.adaptive is not False
                 else None for s, p in zip(seqs, plans)]
        if all(m is None for m in match):
            return plans
        counts = [0] * MATCH_CLASSES
        others = 0
        for m, p in zip(match, plans):
            if m is None:
                others += 1 + p.sub.num_nodes + p.cascade + p.tail + p.mjsd + p.maxgram * p.branches
            else:
                counts[match_class(m)] += 1
                if not (p.trust and m >= p.trust):
                    others += p.sub.num_nodes + p.tail
        caps = self.maxgram_lengths.choose(counts, others)
        return [p if m is None else replace(p, maxgram=min(p.maxgram, caps[match_class(m)]),
                                            maxgram_class=match_class(m))
                for m, p in zip(match, plans)]

    def _observe_maxgram(self, results: list[SeqStepResult], plans: list[DraftPlan]) -> None:
        if self.maxgram_lengths is None:
            return
        for res, plan in zip(results, plans):
            tree = res.tree
            if tree.tokens and not tree.num_sub and tree.draft_index is None and plan.maxgram_class is not None:
                # Max-Gram alone drafted it (also when trusting it replaced the draft model)
                self.maxgram_lengths.observe(plan.maxgram_class, max(tree.depths()), len(res.result.accepted),
                                             plan.maxgram)

    def _plan(self, seq: Sequence, budget: Optional[tuple[int, ...]] = None) -> DraftPlan:
        """What each drafter of the request's method may draft this step.  The budget caps the draft
        model's tree (a budget of plain decoding also stops the vertical cascade, which runs the draft
        model); Max-Gram has no drafting cost and always proposes."""
        spec, cfg = seq.request.spec, self.config
        empty = self.topology.subtree(())
        if spec.adaptive is False:
            budget = None  # this request asked for its whole tree every step
        elif budget != () and seq.draft_slot is not None and self.policy is not None \
                and not self.policy.catch_up_pays(seq):
            budget = ()  # the draft lags too far behind for this request to gain from catching up (or
            # this is its first token, which never waits for the draft to read the prompt)
        room = seq.remaining - 1
        if spec.max_depth is not None:
            room = min(room, spec.max_depth)
        if spec.enabled and spec.method == TARGET_INIT_LOSSY and seq.draft_slot is not None:
            if seq.init_candidates is None:  # the first step only draws candidates
                return DraftPlan(TARGET_INIT_LOSSY, empty, init=True)
            depth = min(cfg.target_init_depth, room + 1)  # the candidate itself, then its chain
            return DraftPlan(TARGET_INIT_LOSSY, self.init_topology.subtree(self.init_topology.widths[:depth]),
                             init=True)
        if not spec.enabled or room <= 0:
            return DraftPlan(spec.method or MCSD, empty)
        if spec.method == MAXGRAM:
            return DraftPlan(MAXGRAM, empty, maxgram=min(cfg.maxgram_len, room), branches=cfg.maxgram_branches)
        if seq.draft_slot is None:
            return DraftPlan(spec.method, empty)
        if spec.method == MJSD_LOSSY:
            return DraftPlan(MJSD_LOSSY, empty, mjsd=min(cfg.mjsd_depth, room) if budget != () else 0)
        if spec.method == CASCADE:
            depth = min(cfg.cascade_depth, room) if budget != () else 0
            return DraftPlan(CASCADE, empty, maxgram=min(cfg.maxgram_len, room), cascade=depth,
                             tail=min(cfg.maxgram_tail, room - depth), trust=cfg.maxgram_trust)
        sub = self._subtree(seq, budget)
        if spec.method == MCSD_MAXGRAM:
            return DraftPlan(MCSD_MAXGRAM, sub, maxgram=min(cfg.maxgram_len, room), branches=cfg.maxgram_branches,
                             tail=min(cfg.maxgram_tail, room - sub.max_depth) if sub.num_nodes else 0,
                             trust=cfg.maxgram_trust)
        return DraftPlan(MCSD, sub)

    def _subtree(self, seq: Sequence, budget: Optional[tuple[int, ...]] = None) -> SubTree:
        """The largest tree this sequence may draft this step: its request's tree (or the engine's),
        within the step's budget (a width config; ``None`` = no cap), its max_depth and what remains."""
        spec = seq.request.spec
        if not spec.enabled or seq.draft_slot is None:
            return self.topology.subtree(())
        widths = spec.tree if spec.tree is not None else self.topology.widths
        if budget is not None:
            widths = tuple(min(a, b) for a, b in zip(widths, budget))
        depth = min(len(widths), seq.remaining - 1)
        if spec.max_depth is not None:
            depth = min(depth, spec.max_depth)
        return self.topology.subtree(tuple(widths[: max(depth, 0)]))

    def _postprocess(self, res: SeqStepResult, stats: StepStats) -> RequestOutput:
        seq, result = res.seq, res.result
        update = seq.stream.feed(result.tokens)
        new = result.tokens[: update.consumed]
        seq.tokens.extend(new)
        if seq.output_counts is not None and new:
            dev = seq.output_counts.device
            seq.output_counts.index_add_(0, device_tensor(new, dev), torch.ones(len(new), dtype=torch.int32, device=dev))
        if res.next_candidates is not None:
            seq.init_candidates = res.next_candidates
        if res.drafted:
            seq.spec.steps += 1
            seq.spec.drafted_tokens += res.drafted
            seq.spec.accepted_tokens += len(result.accepted)
        stats.emitted_tokens += len(new)
        if update.finished:
            self.scheduler.finish(seq)
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=new, new_text=update.text,
            finished=update.finished, finish_reason=update.finish_reason,
            logprobs=res.logprobs[: len(new)] if res.logprobs is not None else None,
            prompt_tokens=seq.num_prompt, completion_tokens=seq.num_output, spec=seq.spec,
        )


def _draft_vocab(draft: LoadedModel, cfg: EngineConfig) -> Optional[OutputVocab]:
    """The draft's output layer cut to the ``draft_vocab`` most frequent tokens of ``draft_vocab_file``
    and every special token, or None (``draft_vocab`` 0, or not smaller than the vocabulary)."""
    vocab_size = draft.config.vocab_size
    if cfg.draft_vocab <= 0 or cfg.draft_vocab >= vocab_size:
        return None
    special = set(draft.config.eos_token_ids)
    if draft.tokenizer is not None:
        special |= set(draft.tokenizer.all_special_ids) | set(getattr(draft.tokenizer, "added_tokens_decoder", {}))
    ids = frequent_vocab(cfg.draft_vocab_file, cfg.draft_vocab, vocab_size, special)
    lm_head = getattr(draft.model, "lm_head", None)
    return OutputVocab(ids, vocab_size, None if lm_head is None else lm_head.weight)


def _check_pair(target: LoadedModel, draft: LoadedModel) -> None:
    """Target and draft must share a tokenizer (same ids for the same text)."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if target.tokenizer is not None and draft.tokenizer is not None:
        probe = "def hello_world():\n    print('héllo, wörld') # 12345"
        if target.tokenizer.encode(probe) != draft.tokenizer.encode(probe):
            raise ValueError("the draft model's tokenizer differs from the target's; they must share one")
    if abs(tv - dv) > 1024:
        raise ValueError(f"target vocab {tv} and draft vocab {dv} differ too much to share a tokenizer")
