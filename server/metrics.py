"""Prometheus export of the engine's statistics (the engine fills data, this module exports it).

Each app gets its own ``CollectorRegistry`` (no global default registry), so several servers can
live in one process (tests).  :class:`ServerMetrics` is the :class:`AsyncEngine` listener: it is
called on the engine thread with every step's :class:`StepStats` and with every finished request's
:class:`RequestRecord`; gauges are read from the engine's published snapshot at scrape time.

Names use our ``mcsd:`` prefix with vLLM's names and semantics where vLLM has the series
(counters get prometheus-client's ``_total`` suffix, as vLLM's do):

==============================================  ==============================================
mcsd:spec_decode_num_drafts                     vllm:spec_decode_num_drafts (sequence-steps that drafted)
mcsd:spec_decode_num_draft_tokens               vllm:spec_decode_num_draft_tokens
mcsd:spec_decode_num_accepted_tokens            vllm:spec_decode_num_accepted_tokens
mcsd:spec_decode_num_accepted_tokens_per_pos    vllm:spec_decode_num_accepted_tokens_per_pos
                                                (label position=i: sequence-steps accepting >= i+1)
mcsd:prompt_tokens / mcsd:generation_tokens     vllm:prompt_tokens / vllm:generation_tokens
mcsd:prefix_cache_queries / _hits               vllm:prefix_cache_queries / vllm:prefix_cache_hits (tokens,
                                                counted when a request is admitted)
mcsd:request_success{finished_reason}           vllm:request_success{finished_reason}
mcsd:num_requests_running / _waiting            vllm:num_requests_running / vllm:num_requests_waiting
mcsd:kv_cache_usage_perc                        vllm:kv_cache_usage_perc (fraction 0..1 of the target pool's blocks)
mcsd:num_preemptions                            vllm:num_preemptions (sequences preempted for blocks, recomputed)
mcsd:time_to_first_token_seconds                vllm:time_to_first_token_seconds
mcsd:inter_token_latency_seconds                vllm:inter_token_latency_seconds, but PER TOKEN:
                                                a delta of k tokens after dt gives k samples dt/k
mcsd:e2e_request_latency_seconds                vllm:e2e_request_latency_seconds
mcsd:request_queue_time_seconds                 vllm:request_queue_time_seconds
==============================================  ==============================================

Series no incumbent has: ``mcsd:kv_cache_blocks{state}`` (the target pool's blocks: ``used`` by
sequences, ``cached``: unused but holding a prefix the cache can still hand out, ``free``),
``mcsd:spec_decode_budget`` (tree budget chosen in the last step),
``mcsd:spec_decode_accepted_length`` (per sequence-step: 1 + accepted drafted tokens, so its mean
is the "mean acceptance length"), ``mcsd:spec_decode_tree_nodes`` (nodes verified per step over the
batch), ``mcsd:spec_decode_{draft,accepted}_tokens_by_depth{depth}`` (1-based) and ``..._by_rank
{rank}`` (0-based sibling order), ``mcsd:spec_decode_draft_seconds`` / ``_verify_seconds``,
``mcsd:spec_decode_{draft,accepted}_tokens_by_method{method}`` (the node's source, as the drafters
name it: ``engine.speculative.draft_tree``; a node several drafters proposed counts for each).
Derived: acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts.

Token and request counters are counted when a request finishes, from the same numbers its
``usage`` reports (``prompt_tokens`` counts each of the n choices, which all prefill the prompt).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401 - re-exported for the route

from engine.async_engine import AsyncEngine, RequestRecord
from engine.stats import StepStats

P = "mcsd:"
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
LENGTH_BUCKETS = tuple(float(i) for i in range(1, 17))
NODE_BUCKETS = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0)


class ServerMetrics:
    """All series of one server; thread-safe (prometheus-client metrics are)."""

    def __init__(self) -> None:
        disable_created_metrics()  # no `*_created` series (as vLLM); a process-wide client switch
        self.registry = CollectorRegistry()
        r = self.registry
        c = lambda name, doc, labels=(): Counter(P + name, doc, labels, registry=r)  # noqa: E731
        self.num_drafts = c("spec_decode_num_drafts", "Sequence-steps that speculated.")
        self.draft_tokens = c("spec_decode_num_draft_tokens", "Drafted (and verified) tokens.")
        self.accepted_tokens = c("spec_decode_num_accepted_tokens", "Accepted drafted tokens.")
        self.accepted_per_pos = c("spec_decode_num_accepted_tokens_per_pos",
                                  "Sequence-steps that accepted at least position+1 tokens.", ["position"])
        self.draft_by_depth = c("spec_decode_draft_tokens_by_depth", "Drafted nodes by tree depth.", ["depth"])
        self.accepted_by_depth = c("spec_decode_accepted_tokens_by_depth", "Accepted nodes by depth.", ["depth"])
        self.draft_by_rank = c("spec_decode_draft_tokens_by_rank", "Drafted nodes by sibling rank.", ["rank"])
        self.accepted_by_rank = c("spec_decode_accepted_tokens_by_rank", "Accepted nodes by rank.", ["rank"])
        self.draft_by_method = c("spec_decode_draft_tokens_by_method",
                                 "Drafted nodes by drafter (a node several drafters proposed counts for each).",
                                 ["method"])
        self.accepted_by_method = c("spec_decode_accepted_tokens_by_method", "Accepted nodes by drafter.",
                                    ["method"])
        self.draft_seconds = c("spec_decode_draft_seconds", "Seconds spent drafting.")
        self.verify_seconds = c("spec_decode_verify_seconds", "Seconds spent verifying.")
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens of finished requests.")
        self.prefix_queries = c("prefix_cache_queries", "Prompt tokens looked up in the prefix cache (admitted).")
        self.prefix_hits = c("prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled).")
        self.preemptions = c("num_preemptions", "Sequences preempted when the KV cache pool ran out (recomputed).")
        self.spec_failures = c("spec_decode_failures",
                               "Requests whose speculation failed with an engine error (they went on without it).")
        self.generation_tokens = c("generation_tokens", "Generated tokens of finished requests.")
        self.request_success = c("request_success", "Finished requests.", ["finished_reason"])
        g = lambda name, doc: Gauge(P + name, doc, registry=r)  # noqa: E731
        self.running = g("num_requests_running", "Requests in the running batch.")
        self.waiting = g("num_requests_waiting", "Requests queued, not yet running.")
        self.kv_usage = g("kv_cache_usage_perc", "KV cache usage, 0..1 of the pool's blocks.")
        self.kv_blocks = Gauge(P + "kv_cache_blocks", "KV cache pool blocks by state (used, cached, free).",
                               ["state"], registry=r)
        self.budget = g("spec_decode_budget", "Tree budget (nodes per sequence) of the last step.")
        graph = lambda name, doc: Gauge(P + name, doc, ["model"], registry=r)  # noqa: E731
        self.cuda_graphs = graph("cuda_graphs", "CUDA graphs captured at start-up, by model (target, draft).")
        self.cuda_graph_pool = graph("cuda_graph_pool_bytes", "Device memory capturing the CUDA graphs took.")
        self.cuda_graph_seconds = graph("cuda_graph_capture_seconds", "Seconds capturing the CUDA graphs took.")
        h = lambda name, doc, buckets: Histogram(P + name, doc, buckets=buckets, registry=r)  # noqa: E731
        self.ttft = h("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = h("inter_token_latency_seconds", "Per-token interval after the first token.", ITL_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self.queue_time = h("request_queue_time_seconds", "Arrival to admission into the engine.", E2E_BUCKETS)
        self.accepted_length = h("spec_decode_accepted_length",
                                 "Tokens per speculating sequence-step (1 + accepted).", LENGTH_BUCKETS)
        self.tree_nodes = h("spec_decode_tree_nodes", "Tree nodes verified per step (batch).", NODE_BUCKETS)

    # ------------------------------------------------------------------ listener (engine thread)
    def on_step_stats(self, stats: list[StepStats]) -> None:
        for s in stats:
            self._observe_step(s)

    def _observe_step(self, s: StepStats) -> None:
        self.num_drafts.inc(s.num_spec_seqs)
        self.prefix_queries.inc(s.prefix_queried_tokens)
        self.prefix_hits.inc(s.prefix_hit_tokens)
        self.preemptions.inc(s.preemptions)
        self.spec_failures.inc(s.speculation_failures)
        self.draft_tokens.inc(s.drafted_tokens)
        self.accepted_tokens.inc(s.accepted_tokens)
        self.draft_seconds.inc(s.draft_seconds)
        self.verify_seconds.inc(s.verify_seconds)
        self.budget.set(s.budget)
        for series, counts, label, base in (
            (self.accepted_per_pos, s.accepted_per_position, "position", 0),
            (self.draft_by_depth, s.drafted_by_depth, "depth", 1),
            (self.accepted_by_depth, s.accepted_by_depth, "depth", 1),
            (self.draft_by_rank, s.drafted_by_rank, "rank", 0),
            (self.accepted_by_rank, s.accepted_by_rank, "rank", 0),
        ):
            for i, n in enumerate(counts):
                series.labels(**{label: str(i + base)}).inc(n)
        for series, by in ((self.draft_by_method, s.drafted_by_method), (self.accepted_by_method, s.accepted_by_method)):
            for method, n in by.items():
                series.labels(method=method).inc(n)
        if s.num_spec_seqs:
            self.tree_nodes.observe(s.drafted_tokens)
            for length, seqs in enumerate(accepted_length_counts(s)):
                for _ in range(seqs):
                    self.accepted_length.observe(length + 1)

    def on_request_finished(self, rec: RequestRecord) -> None:
        self.request_success.labels(finished_reason=rec.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(rec.prompt_tokens)
        self.generation_tokens.inc(rec.completion_tokens)
        if rec.finished is not None:
            self.e2e.observe(rec.finished - rec.arrival)
        if rec.admitted is not None:
            self.queue_time.observe(rec.admitted - rec.arrival)
        if rec.first_token is not None:
            self.ttft.observe(rec.first_token - rec.arrival)
        for interval, tokens in rec.token_gaps:
            for _ in range(tokens):
                self.itl.observe(interval / tokens)

    # ------------------------------------------------------------------ scrape
    def render(self, engine: AsyncEngine) -> bytes:
        g = engine.gauges
        self.running.set(g.num_running)
        self.waiting.set(g.num_waiting)
        self.kv_usage.set(g.kv_cache_usage)
        used, cached, total = g.kv_blocks
        for state, n in (("used", used), ("cached", cached), ("free", total - used - cached)):
            self.kv_blocks.labels(state=state).set(n)
        core = engine.core  # set once the models are loaded; its capture reports never change after
        for model, report in (getattr(core, "capture_reports", None) or {}).items():
            self.cuda_graphs.labels(model=model).set(report.buckets)
            self.cuda_graph_pool.labels(model=model).set(report.pool_bytes)
            self.cuda_graph_seconds.labels(model=model).set(report.seconds)
        return generate_latest(self.registry)


def accepted_length_counts(s: StepStats) -> list[int]:
    """``[n_0, n_1, ...]``: speculating sequences that accepted exactly k drafted tokens, from
    ``accepted_per_position`` (the count accepting at least k+1)."""
    at_least = [s.num_spec_seqs] + list(s.accepted_per_position) + [0]
    return [max(at_least[k] - at_least[k + 1], 0) for k in range(len(at_least) - 1)]
