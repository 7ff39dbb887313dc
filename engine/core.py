"""The synchronous engine: ``step()`` = schedule -> run -> postprocess.

``EngineCore`` owns the target (and optional draft) model, their KV caches, the scheduler and the
runner.  It is driven by one thread (see ``engine.async_engine``); nothing here is thread-safe.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable, Optional

import torch

from engine.config import EngineConfig
from engine.kv_cache import KVCache
from engine.device import tensor as device_tensor
from engine.grammar import Grammars
from engine.graphs import CaptureReport, install as install_graphs
from engine.models import cpu_kernels
from engine.models.loader import LoadedModel
from engine.models.model import Model
from engine.models.qweight import QuantLinear, quantized_copy
from engine.models.vocab import OutputVocab, frequent_vocab
from engine.request import GenerationRequest, RequestOutput, RequestRejected, SamplingParams
from engine.runner import ModelRunner, SeqStepResult, record_step
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence
from engine.speculative.adaptive import AdaptiveSpeculation, SpecPolicy
from engine.speculative.drafter import build_drafters
from engine.speculative.drafter import limits as drafter_limits
from engine.registry import method, methods
from engine.speculative.methods import DraftPlan
from engine.speculative.proposer import DraftModelProposer
from engine.speculative.planner import Planner
from engine.speculative.tree import TreeTopology
from engine.speculative.verify import build_rules
from engine.stats import StepStats
from engine.stop import TextStream

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, target: LoadedModel, draft: Optional[LoadedModel] = None,
                 config: Optional[EngineConfig] = None, model_name: Optional[str] = None,
                 policy: Optional[SpecPolicy] = None) -> None:
        """``policy`` overrides the speculation policy the config describes (tests, head training)."""
        self.config = config or EngineConfig()
        cpu_kernels.set_batch_invariant(self.config.batch_invariant)  # before the first forward
        self.target = target
        self.tokenizer = target.tokenizer
        self.model_name = model_name or target.source
        self.max_model_len = min(self.config.max_model_len, target.config.max_position_embeddings,
                                 target.config.sliding_window or 1 << 30)
        self.vocab_size = target.config.vocab_size
        self.topology = TreeTopology(self.config.tree if draft is not None else ())
        cfg = self.config
        # the drafters say how large a verification block and how many draft-cache entries a step may need
        rows, entries = drafter_limits(cfg, self.topology)
        self.cache = self._new_cache(target, self.max_model_len + rows + 1)
        self.capture_reports: dict[str, CaptureReport] = {}  # what capturing each model's graphs took
        draft_len = self.max_model_len + entries + 1
        proposer = None
        self.policy: Optional[SpecPolicy] = None
        self.draft_vocab: Optional[OutputVocab] = None
        if draft is not None:
            _check_pair(target, draft)
            draft_cache = self._new_cache(draft, draft_len)
            self.draft_vocab = _draft_vocab(draft, cfg)
            if cfg.draft_int8:  # after the vocabulary cut, which copies bf16 rows of the output layer
                draft = self._int8_draft(draft)
            # after every cache exists: a model drafting for itself has its rotary tables sized for both
            self._install_graphs("target", target.model, self.cache, rows, rows)
            self._install_graphs("draft", draft.model, draft_cache, rows, entries + rows)
            if policy is None and self.config.adaptive:
                policy = AdaptiveSpeculation.from_config(self.config, self.topology, target, draft, self.cache,
                                                         draft_cache, self.draft_vocab, max_rows=rows)
            self.policy = policy
            proposer = DraftModelProposer(draft.model, draft_cache, self.vocab_size, self.config.without_replacement,
                                          self.topology, policy, chunk=self.config.prefill_chunk,
                                          vocab=self.draft_vocab)
        if draft is None:
            self._install_graphs("target", target.model, self.cache, rows, rows)
        self.planner = Planner.build(cfg, self.topology, self.policy, self.tokenizer, target.model, self.cache)
        drafters = build_drafters(self.planner.drafter_context(proposer))
        self.runner = ModelRunner(target.model, self.cache, self.vocab_size, proposer, drafters,
                                  build_rules(cfg, self.vocab_size), self.topology)
        self.scheduler = Scheduler(self.config, self.cache, proposer.cache if proposer else None, rows, entries)
        self.eos_token_ids = set(target.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(self.tokenizer.eos_token_id))
        # structured outputs: the server compiles each request's grammar with this (off the event loop)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids, cfg.grammar_whitespace)
        self._stats: list[StepStats] = []
        self._steps = 0  # steps begun
        self._later: list[tuple[int, Callable[[], None]]] = []  # (step, work) for while the device works: defer()
        self._learning = True  # the planner and the drafters learn from each step (not while warming up)
        self.decode_ahead = _chosen(cfg.decode_ahead, target.model.device)
        self.overlap_host_work = _chosen(cfg.defer_host_work, target.model.device)  # defer(): before the next read

    def _new_cache(self, model: LoadedModel, max_len: int) -> KVCache:
        """A paged cache of ``kv_cache_tokens`` (default: ``max_batch`` sequences of ``max_len``) for one
        model; sequences of up to ``max_len`` positions."""
        cfg = self.config
        bs = cfg.kv_block_size
        blocks = -(-(cfg.kv_cache_tokens or cfg.max_batch * max_len) // bs)
        if blocks * bs < max_len:
            raise ValueError(f"kv_cache_tokens {cfg.kv_cache_tokens} cannot hold one sequence of max_model_len "
                             f"{self.max_model_len} (it needs {max_len} positions with its speculation): raise "
                             f"kv_cache_tokens or lower max_model_len")
        return model.model.new_cache(cfg.max_batch, max_len, bs, blocks)

    def _install_graphs(self, name: str, model: Model, cache: KVCache, rows: int, width: int) -> None:
        """``model``'s forwards at fixed shapes (``engine.graphs``), captured now as CUDA graphs when the
        device is CUDA, before the cost model times them: the first requests then pay nothing, and
        ``/health`` answers 503 until it is done.  Logs progress, the time taken and the graph pool's
        device memory (``capture_reports``)."""
        captured = install_graphs(model, cache, self.config, rows, width)
        if captured is None or not captured.graphs:
            return  # none, or the static path run eagerly: nothing to prepare

        def progress(done: int, total: int, bucket) -> None:
            if done == total or done % max(1, total // 10) == 0:
                log.info("capturing the %s's CUDA graphs: %d/%d buckets (now %s)", name, done, total, bucket)

        report = captured.capture(progress)
        self.capture_reports[name] = report
        log.info("%s: %d CUDA graphs captured in %.1f s%s, graph pool %.0f MiB%s", name, report.buckets,
                 report.seconds, " (layers compiled)" if report.compiled else "", report.pool_bytes / 2**20,
                 f"; {len(report.failed)} buckets failed and run eagerly" if report.failed else "")

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

    # ------------------------------------------------------------------ warming up
    def warm_up(self) -> int:
        """Runs a few requests of the engine's own before it serves (``warm_up``; ``auto``: on CUDA):
        one greedy sequence, one sampled, then a batch of both, each with the configured speculation.
        What a process sets up at its first use of each kernel and size (CUDA's modules, the pinned and
        device memory pools, a compiled function's first calls) is then paid here rather than by the
        first requests: on an H200 the first round of engine steps of a process ran 2.6-4.3x slower
        than the next ones (``docs/gpu.md``).  The steps leave no trace: the planner and the drafters
        learn nothing from them, what planning moved (probe counters, the requests chosen to explore)
        is put back, the prefix caches keep none of their prompts, their statistics are dropped, and
        the engine ends as idle as it started.  Returns the number of steps run."""
        if not _chosen(self.config.warm_up, self.target.model.device):
            return 0
        if self.has_unfinished():
            raise RuntimeError("warm up an engine before it takes requests")
        t0, steps, errors = time.perf_counter(), 0, []
        width = min(self.config.max_batch, 4)
        prompt_len = max(1, min(48, self.max_model_len // 4))
        new_tokens = max(1, min(16, self.max_model_len - prompt_len))
        phases = [[0.0], [0.7], [0.0 if i % 2 else 0.7 for i in range(width)]]
        prefix = [c for c in (self.scheduler.prefix, self.scheduler.draft_prefix) if c is not None]
        was_enabled = [c.enabled for c in prefix]
        planning = self.planner.planning_state()
        self._learning = False
        for c in prefix:
            c.enabled = False  # the warm-up's prompts are nobody's prefix, and each phase prefills anew
        try:
            for p, temperatures in enumerate(phases):
                for i, temperature in enumerate(temperatures):
                    # a run of ids repeating every 12 (Max-Gram finds matches), other for every request
                    ids = [1 + (7 * (j % 12) + 13 * p + i) % (self.vocab_size - 1) for j in range(prompt_len)]
                    params = SamplingParams(max_tokens=new_tokens, temperature=temperature, ignore_eos=True,
                                            seed=i if temperature else None)
                    self.add_request(GenerationRequest(f"warm-up-{p}-{i}", ids, params))
                while self.has_unfinished():
                    errors += [o.error for o in self.step() if o.error]
                    steps += 1
        finally:
            for seq in list(self.scheduler.running) + list(self.scheduler.waiting):  # (only if a step raised)
                self.scheduler.finish(seq, reusable=False)
            self.runner.drop_ahead()
            for c, enabled in zip(prefix, was_enabled):
                c.enabled = enabled
            self.planner.restore_planning(planning)
            self._learning = True
            self.drain_step_stats()
        if errors:
            log.warning("warming up: %d requests failed: %s", len(errors), errors[0])
        log.info("warmed up: %d engine steps in %.1f s", steps, time.perf_counter() - t0)
        return steps

    # ------------------------------------------------------------------ requests
    def add_request(self, req: GenerationRequest) -> None:
        """Queues a request; raises ``ValueError`` with a user-facing message if it cannot run."""
        self._validate(req)
        stream = TextStream.create(self.tokenizer, req.prompt_token_ids, req.sampling, self.eos_token_ids)
        seq = Sequence.create(req, stream, self.vocab_size, self.target.model.device)
        seq.spec.note = self._settle_speculation(req)
        self.scheduler.add(seq)

    def _settle_speculation(self, req: GenerationRequest) -> Optional[str]:
        """Fills in the request's method (the server's default) and turns its speculation off where this
        engine cannot run it as asked; returns the note its response carries about that (or None)."""
        note = None
        if req.spec.method is None:
            req.spec.method = self.config.spec_method
        m = method(req.spec.method)
        if req.spec.enabled and m.lossy_note and self.runner.proposer:
            note = m.lossy_note
        if req.grammar is not None and req.spec.enabled and not m.grammar:
            req.spec.enabled = False  # the server's default method cannot verify under a grammar
            note = f"speculation is off: method {req.spec.method!r} does not verify under a grammar"
        if req.spec.enabled and req.spec.adaptive and not isinstance(self.policy, AdaptiveSpeculation):
            note = "adaptive speculation is off on this server (start it with --adaptive); the tree is fixed"
        if not self.runner.proposer and req.spec.enabled and m.needs_draft:
            req.spec.enabled = False
            free = ", ".join(repr(m.name) for m in methods() if not m.needs_draft)
            note = (f"speculation is off: the server runs without a draft model, which method "
                    f"{req.spec.method!r} needs" + (f" (these need none: {free})" if free else ""))
        return note

    def check_request(self, req: GenerationRequest) -> None:
        """Raises :class:`RequestRejected` if this engine cannot run ``req`` as asked.  Reads only the
        engine's fixed configuration, so the server calls it from its own thread before answering
        (a streaming request is refused with a 400, not an error after the first byte)."""
        n = len(req.prompt_token_ids)
        if n == 0:
            raise RequestRejected("the prompt is empty", "prompt")
        if min(req.prompt_token_ids) < 0 or max(req.prompt_token_ids) >= self.vocab_size:
            raise RequestRejected(f"prompt token ids must be in [0, {self.vocab_size})", "prompt",
                                  "token_id_out_of_range")
        if n + req.sampling.max_tokens > self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {n + req.sampling.max_tokens} tokens ({n} in the prompt, "
                f"{req.sampling.max_tokens} in the completion). Please reduce the prompt or max_tokens.",
                "max_tokens", "context_length_exceeded")
        if max(req.sampling.logit_bias, default=-1) >= self.vocab_size:
            raise RequestRejected(f"logit_bias token ids must be < {self.vocab_size}", "logit_bias",
                                  "token_id_out_of_range")
        if req.spec.method is not None and not method(req.spec.method).penalties and req.sampling.needs_history:
            raise RequestRejected(f"speculative.method {req.spec.method!r} does not support presence/frequency/"
                                  "repetition penalties", "speculative.method")
        if req.grammar is not None and req.spec.method is not None and req.spec.enabled \
                and not method(req.spec.method).grammar:
            raise RequestRejected(f"speculative.method {req.spec.method!r} is lossy and does not support structured "
                                  "outputs (response_format, tools); use a lossless method", "speculative.method")
        if req.spec.tree is not None and req.spec.enabled:
            try:
                self.topology.subtree(req.spec.tree)
            except ValueError as exc:
                raise RequestRejected(str(exc), "speculative.tree", "speculation_does_not_fit") from None

    def _validate(self, req: GenerationRequest) -> None:
        self.check_request(req)
        if self.scheduler.find(req.request_id) is not None:
            raise ValueError(f"request id {req.request_id!r} is already running")

    def abort_request(self, request_id: str) -> None:
        seq = self.scheduler.find(request_id)
        if seq is not None:
            self.scheduler.finish(seq)
            if not self.scheduler.running:
                self.runner.drop_ahead()  # a forward queued for the batch has no one left to serve

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def free_batch_slots(self) -> int:
        """Sequences the next step could still admit to the running batch."""
        return self.scheduler.free_slots

    @property
    def kv_cache_usage(self) -> float:
        return self.cache.usage()

    @property
    def kv_blocks(self) -> tuple[int, int, int]:
        """The target pool's blocks: (in use, unused but holding a cached prefix, all)."""
        return self.cache.used_blocks, self.cache.cached_blocks, self.cache.num_blocks

    def drain_step_stats(self) -> list[StepStats]:
        self.run_deferred()  # the last step's accounting, if it waits for the next step
        out, self._stats = self._stats, []
        return out

    # ------------------------------------------------------------------ host work off the step's path
    def defer(self, work: Callable[[], None]) -> None:
        """Queues host work that the next step does not depend on (a step's statistics, metrics) to run
        while the device works: with ``defer_host_work`` (on CUDA), just before the next step's read of
        the device, when that step's forwards are queued already, so on a GPU it adds nothing to the
        time between two steps' device work.  Otherwise, and at the latest, at the end of the next step
        (on the CPU, where the host is the device, overlapping gains nothing, and there the work stays
        out of the verification time the cost model learns); also when :meth:`drain_step_stats` or
        :meth:`run_deferred` is called."""
        self._later.append((self._steps, work))

    def run_deferred(self, before_step: Optional[int] = None) -> None:
        """Runs the deferred work, in the order it was queued (``before_step``: only what steps before
        that one queued).  Work that raises is logged; it fails nothing else."""
        while self._later and (before_step is None or self._later[0][0] < before_step):
            _, work = self._later.pop(0)
            try:
                work()
            except Exception:  # noqa: BLE001 - statistics and metrics must never fail a step
                log.exception("host work deferred from an earlier step failed")

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self._steps += 1
        ahead = self.runner.ahead is not None  # this step's forward is queued already: no one joins it
        plan = self.scheduler.schedule(admit=not ahead)
        stats = StepStats()
        stats.prefix_queried_tokens, stats.prefix_hit_tokens, stats.preemptions = self.scheduler.take_counts()
        outputs = []
        decode = plan.decode
        if plan.prefill:
            stats.prefill_tokens = sum(end - s.target_cached for s, end in plan.prefill)
            failed = self.runner.prefill(plan.prefill)
            if failed:
                outputs += [self._fail(seq, exc) for seq, exc in failed]
                gone = {id(seq) for seq, _ in failed}
                decode = [s for s in decode if id(s) not in gone]
        if not decode or plan.prefill:
            self.runner.drop_ahead()
        if decode:
            # the planner is asked every step; when the step's forward already ran ahead, its plans wait
            # a step (the step decodes plainly), and the next forward is queued ahead only if it too
            # planned plain decoding
            wish = self._plan(decode)
            plans = self.planner.plain(decode) if self.runner.ahead is not None else wish
            stats.budget = max(p.sub.num_nodes for p in plans)
            step = self.runner.step(decode, plans, stats, ahead=self._may_go_ahead(plan, wish),
                                    while_waiting=self.run_deferred if self.overlap_host_work else None)
            results, failed = step.results, step.failed
            for seq in step.stopped:
                self.scheduler.stop_drafting(seq)
            stats.speculation_failures = len(step.stopped)
            if self._learning:
                try:  # learning from the step: its tokens are already decided
                    self.planner.observe(results, step.plans,
                                         stats.verify_seconds if step.whole and not failed else None)
                except Exception:  # noqa: BLE001 - a failure to learn fails no request
                    log.exception("the planner failed to learn from the step")
                self.runner.observe(results, step.plans)
            # the step's accounting runs while the next step's device work does (defer)
            self.defer(lambda: _record_all(stats, results))
            for res in results:
                try:
                    outputs.append(self._postprocess(res, stats))
                except Exception as exc:  # noqa: BLE001 - e.g. detokenization: this request alone fails
                    log.exception("postprocessing failed for request %s", res.seq.request_id)
                    failed.append((res.seq, exc))
            outputs += [self._fail(seq, exc) for seq, exc in failed]
        if self.runner.ahead is not None and not self.scheduler.running:
            self.runner.drop_ahead()  # every sequence it ran has ended
        self.run_deferred(before_step=self._steps)  # what no read of this step ran
        stats.step_seconds = time.perf_counter() - t0
        if not plan.empty:
            self._stats.append(stats)
        return outputs

    def _may_go_ahead(self, plan: SchedulerOutput, plans: list[DraftPlan]) -> bool:
        """Whether the step may queue the next step's forward before reading its tokens
        (``decode_ahead``): the whole batch decodes plainly, without a grammar, none of it ends by its
        token count this step, and no waiting request could join now."""
        if not self.decode_ahead or plan.prefill or (self.scheduler.waiting and self.scheduler.free_slots):
            return False  # (a request that could join now would wait a step)
        if len(plan.decode) != len(self.scheduler.running):
            return False
        return all(p.plain for p in plans) and all(
            s.grammar is None and s.num_output + 1 < s.request.sampling.max_tokens for s in plan.decode)

    def _plan(self, seqs: list[Sequence]) -> list[DraftPlan]:
        """The step's plans; if planning fails, plain decoding for the step (speculation only saves
        time: its failure must not cost a request its output)."""
        try:
            return self.planner.plan(seqs)
        except Exception:  # noqa: BLE001 - the step goes on without speculation
            log.exception("planning the step failed; the batch decodes without speculation this step")
            return self.planner.plain(seqs)

    def _fail(self, seq: Sequence, exc: Exception) -> RequestOutput:
        """Ends ``seq`` with an error (its slots freed); the batch's other requests are untouched."""
        self.scheduler.finish(seq, reusable=False)
        return RequestOutput(request_id=seq.request_id, new_token_ids=[], new_text="", finished=True,
                             finish_reason="error", error=f"generation failed: {type(exc).__name__}: {exc}",
                             prompt_tokens=seq.num_prompt, cached_tokens=seq.cached_prompt_tokens,
                             completion_tokens=seq.num_output, spec=seq.spec)

    def _postprocess(self, res: SeqStepResult, stats: StepStats) -> RequestOutput:
        seq, result = res.seq, res.result
        tokens = result.tokens
        if seq.grammar is not None:  # the grammar advances by what is output; its end ends the request
            tokens = tokens[: seq.grammar.commit(tokens)]
        update = seq.stream.feed(tokens)
        if seq.grammar is not None and seq.grammar.terminated and not update.finished:
            update = replace(update, text=update.text + seq.stream.end(), finished=True, finish_reason="stop")
        new = tokens[: update.consumed]
        seq.tokens.extend(new)
        if seq.output_counts is not None and new:
            dev = seq.output_counts.device
            seq.output_counts.index_add_(0, device_tensor(new, dev), torch.ones(len(new), dtype=torch.int32, device=dev))
        if res.carry:
            seq.carry.update(res.carry)
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
            prompt_tokens=seq.num_prompt, cached_tokens=seq.cached_prompt_tokens,
            completion_tokens=seq.num_output, spec=seq.spec,
        )


def _record_all(stats: StepStats, results: list[SeqStepResult]) -> None:
    for res in results:
        record_step(stats, res)


def _chosen(mode: str, device: torch.device) -> bool:
    """An ``auto`` / ``on`` / ``off`` setting (``decode_ahead``, ``warm_up``) for an engine on ``device``:
    ``auto`` is on with CUDA."""
    return mode == "on" or (mode == "auto" and device.type == "cuda")


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
