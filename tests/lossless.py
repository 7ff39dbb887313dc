"""End-to-end distribution harness: many seeded runs of the real engine on toy table-driven models
(through caches, masks, position ids and the drafters), compared by chi-square with the exactly
enumerated target joint of the generated tokens.  The verification rule itself is checked exactly,
without sampling, by ``tests/exact_law.py``."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from scipy import stats

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.grammar import REGEX, GrammarSpec, GrammarState, Grammars, apply_mask, unpack
from engine.models.loader import LoadedModel
from engine.models.vocab import save_token_ranking
from engine.request import GenerationRequest, SamplingParams, SpecOptions
from engine.sampler import SamplingTensors, compute_probs
from engine.speculative.adaptive import AdaptiveSpeculation, SpecPolicy
from engine.speculative.maxgram import BigramTable
from engine.speculative.tree import TreeTopology
from tests.tiny import tiny_tokenizer
from tests.toy import ToyModel, random_table

VOCAB = 6
PROMPT = [2, 3]
NEW_TOKENS = 3


@dataclass(frozen=True)
class Case:
    name: str
    tree: tuple[int, ...]
    without_replacement: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    runs: int = 200_000
    sabotage: str = ""  # a planted bug, see ``apply_sabotage``
    stop: str = ""  # drafting stops early: "random" (RandomStop) or "calibrated" (the engine's adaptive policy)
    method: str = "mcsd"  # engine.speculative.methods
    bigram: tuple[tuple[int, int], ...] = ()  # Max-Gram's bigram table (token -> successor)
    grammar: str = ""  # a regular expression over the toy tokens ("w1".."w5") the output must match (xgrammar)
    extra: dict = field(default_factory=dict, hash=False, compare=False)


def loaded(seed: int) -> LoadedModel:
    return loaded_table(random_table(VOCAB, seed), f"toy-{seed}")


def loaded_table(table: torch.Tensor, name: str = "toy", max_len: int = 64) -> LoadedModel:
    """A :class:`ToyModel` of ``table`` (positions up to ``max_len``) as the loader returns a model."""
    model = ToyModel(table, max_len)
    return LoadedModel(model, model.cfg, tiny_tokenizer(table.shape[0]), name, path=None)


def params(case: Case, seed: int) -> SamplingParams:
    return SamplingParams(temperature=case.temperature, top_p=case.top_p, max_tokens=NEW_TOKENS,
                          ignore_eos=True, seed=seed)


def exact_joint(case: Case) -> dict[tuple[int, ...], float]:
    """Target joint of the NEW_TOKENS generated tokens, by enumeration; under ``case.grammar`` the
    masked target's (each position's logits masked by what the grammar allows after the tokens before
    it, before temperature and top-p)."""
    table = random_table(VOCAB, 0)
    st = SamplingTensors.from_params([params(case, 0)], VOCAB)
    logits = table.clamp_min(1e-30).log()  # [cur, prev, next]
    state = grammar_state(case)
    joint = {}
    for seq in itertools.product(range(VOCAB), repeat=NEW_TOKENS):
        ctx, pr = list(PROMPT), 1.0
        for i, x in enumerate(seq):
            row = logits[ctx[-1], ctx[-2]][None]
            if state is not None:
                row = apply_mask(row, unpack(state.masks([list(seq[:i])]).bitmask, VOCAB))
            pr *= float(compute_probs(row, st)[0].double()[x])
            ctx.append(x)
        joint[seq] = pr
    return joint


def grammar_state(case: Case):
    """A fresh state of the case's grammar (None without one), compiled as the engine compiles it."""
    if not case.grammar:
        return None
    grammars = Grammars(tiny_tokenizer(VOCAB), VOCAB, [0])
    return GrammarState(grammars.compile(GrammarSpec(REGEX, case.grammar)))


class RandomStop(SpecPolicy):
    """Stops drafting after each depth with probability 1/2, from its own seeded generator: a stopping
    rule driven by draft-side randomness only, so the output must stay exact."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def keep_drafting(self, seqs, trees, depth, step=None):
        return (torch.rand(len(trees), generator=self.gen) < 0.5).tolist()


def stop_policy(case: Case, seed: int):
    if case.stop == "random":
        return RandomStop(seed)
    if case.stop == "calibrated":  # threshold stopping on the online calibrator, full budget
        return AdaptiveSpeculation(TreeTopology(case.tree), threshold=0.5)
    if case.stop:
        raise ValueError(case.stop)
    return None


def apply_sabotage(name: str) -> None:
    """Planted engine bugs the exact law of the rule cannot see; each must make the harness fail."""
    import engine.runner as runner

    if name == "positions_off_by_one":
        runner.block_positions = lambda root_pos, depths: [root_pos] + [root_pos + d + 1 for d in depths]
    elif name == "bonus_cached":
        def broken_kept(result):
            rows = [0] + [1 + i for i in result.accepted]
            return rows + [rows[-1]] if result.bonus else rows  # an extra entry stands for the bonus
        runner.kept_block_rows = broken_kept
    elif name == "draft_unmasked":  # the draft samples from its unmasked q; forbidden nodes are pruned
        import engine.speculative.proposer as proposer
        proposer.mask_rows = lambda x, allowed: x
    elif name:
        raise ValueError(name)


def _worker(args) -> Counter:
    case, start, count, batch = args
    torch.set_num_threads(1)
    apply_sabotage(case.sabotage)
    counts: Counter = Counter()
    target, draft = loaded(0), loaded(1)
    cut = {}
    if case.extra.get("draft_vocab"):  # the draft's output layer cut to its most "frequent" tokens
        path = Path(tempfile.mkdtemp()) / "ranking.safetensors"
        save_token_ranking(path, list(case.extra["ranking"]), {"vocab_size": str(VOCAB)})
        cut = dict(draft_vocab=case.extra["draft_vocab"], draft_vocab_file=str(path))
    for lo in range(start, start + count, batch):
        n = min(batch, start + count - lo)
        config = EngineConfig.from_settings(max_batch=n, max_model_len=8, tree=case.tree or (1,),
                                            without_replacement=case.without_replacement,
                                            maxgram_len=2, maxgram_branches=2, maxgram_tail=1,
                                            cascade_depth=2, load_aware=False,
                                            target_init_k=case.extra.get("target_init_k", 2),
                                            target_init_depth=2,
                                            maxgram_read_tree=case.extra.get("maxgram_read_tree", True), **cut)
        core = EngineCore(target, draft, config, policy=stop_policy(case, seed=lo))
        core.planner.maxgram.bigram = BigramTable(dict(case.bigram)) if case.bigram else None
        grammar = core.grammars.compile(GrammarSpec(REGEX, case.grammar)) if case.grammar else None
        for i in range(n):
            core.add_request(GenerationRequest(f"r{lo + i}", PROMPT, params(case, seed=lo + i),
                                               SpecOptions(method=case.method), grammar))
        outs: dict[str, list[int]] = {}
        while core.has_unfinished():
            for o in core.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        counts.update(tuple(v) for v in outs.values())
    return counts


def sample_counts(case: Case, workers: int = 2, batch: int = 2500) -> Counter:
    per = -(-case.runs // workers)
    jobs = [(case, w * per, min(per, case.runs - w * per), batch) for w in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        parts = pool.map(_worker, jobs)
    return sum(parts, Counter())


def total_variation(counts: Counter, joint: dict) -> float:
    """Half the L1 distance between the empirical and the exact joint."""
    n = sum(counts.values())
    keys = set(joint) | set(counts)
    return 0.5 * sum(abs(counts.get(k, 0) / n - joint.get(k, 0.0)) for k in keys)


def chi_square(counts: Counter, joint: dict) -> float:
    """p-value; cells expecting fewer than 5 observations are pooled into one."""
    n = sum(counts.values())
    obs, exp, pooled_o, pooled_e = [], [], 0, 0.0
    for seq, pr in joint.items():
        if pr * n >= 5:
            obs.append(counts.get(seq, 0))
            exp.append(pr * n)
        else:
            pooled_o += counts.get(seq, 0)
            pooled_e += pr * n
    if pooled_e > 0:
        obs.append(pooled_o)
        exp.append(pooled_e)
    unexpected = sum(c for s, c in counts.items() if s not in joint)
    if unexpected:
        return 0.0
    exp_t = torch.tensor(exp, dtype=torch.float64)
    exp_t *= n / exp_t.sum()  # absorb float rounding of the enumerated probabilities
    return float(stats.chisquare(obs, exp_t.numpy()).pvalue)
