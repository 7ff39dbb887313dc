"""The draft's output layer cut to its most frequent tokens (engine.models.vocab): exact logits on the
kept tokens, -inf elsewhere, greedy output still equal to plain decoding, drafts only from the kept
tokens (the chi-square case ``tree-2x2-draft-vocab-cut-T0.6`` in test_lossless.py covers sampling)."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.models.vocab import OutputVocab, frequent_vocab, load_token_ranking, save_token_ranking
from tools.rank_vocab import rank_tokens
from engine.request import GenerationRequest, SamplingParams, SpecOptions
from tests.engine_utils import run_engine
from tests.tiny import VOCAB, tiny_loaded, tiny_tokenizer

PROMPTS = [[5, 17, 33, 8], [90, 2, 41], [7, 7, 7, 12, 60]]


@pytest.fixture(scope="module")
def pair():
    return tiny_loaded("qwen2", seed=0), tiny_loaded("qwen2", seed=0)  # draft = target: high acceptance


def plain(target, prompts, **kw):
    outs, _ = run_engine(target, None, prompts, tree=(), **kw)
    return [o.tokens for o in outs]


def ranking_file(tmp_path, ranked, vocab=VOCAB):
    path = tmp_path / "ranking.safetensors"
    save_token_ranking(path, list(ranked), {"vocab_size": str(vocab)})
    return path


def test_cut_logits_equal_the_full_layer_on_kept_tokens_and_are_minus_inf_elsewhere(pair):
    target, _ = pair
    model = target.model
    hidden = torch.randn(2, 3, model.cfg.hidden_size)
    full = (hidden @ model.lm_head.weight.T).float()
    kept = [0, 3, 7, 50, 100]
    vocab = OutputVocab([7, 3, 100, 0, 50, 3], VOCAB, model.lm_head.weight)  # any order, duplicates
    out = vocab.logits(hidden)
    assert out.shape == full.shape and vocab.size == len(kept)
    torch.testing.assert_close(out[..., kept], full[..., kept])
    others = [i for i in range(VOCAB) if i not in kept]
    assert torch.isneginf(out[..., others]).all()
    torch.testing.assert_close(vocab.restrict(full), out)
    with pytest.raises(ValueError, match="subset"):
        OutputVocab([VOCAB], VOCAB, model.lm_head.weight)


def test_frequent_vocab_takes_the_top_of_the_ranking_plus_specials_and_fills_short_rankings(tmp_path):
    path = ranking_file(tmp_path, [9, 4, 7, 2, 5])
    assert frequent_vocab(path, 3, VOCAB) == [4, 7, 9]
    assert frequent_vocab(path, 3, VOCAB, always=[0, 1]) == [0, 1, 4, 7, 9]
    assert frequent_vocab(path, 7, VOCAB) == [0, 1, 2, 4, 5, 7, 9]  # all 5 ranked, then the lowest unseen
    with pytest.raises(ValueError, match="vocabulary of"):
        frequent_vocab(ranking_file(tmp_path, [1, 2], vocab=VOCAB + 5), 2, VOCAB)


def test_rank_tokens_orders_by_count_and_round_trips(tmp_path):
    tok = tiny_tokenizer()
    ranked = rank_tokens(tok, ["w3 w5 w3", "w5 w3 w9"])
    assert ranked == [3, 5, 9]
    path = ranking_file(tmp_path, ranked)
    assert load_token_ranking(path)[0] == ranked


@pytest.mark.parametrize("tree", [(1, 1, 1), (3, 2)])
def test_greedy_with_a_cut_draft_vocabulary_equals_plain_decoding(pair, tmp_path, tree):
    target, draft = pair
    expected = plain(target, PROMPTS, ignore_eos=True)
    produced = sorted({t for toks in expected for t in toks})
    # keep half of what plain decoding writes, so that some positions cannot be drafted
    path = ranking_file(tmp_path, produced[::2])
    cut = dict(draft_vocab=len(produced[::2]), draft_vocab_file=str(path))
    outs, core = run_engine(target, draft, PROMPTS, tree=tree, ignore_eos=True, config=cut)
    assert [o.tokens for o in outs] == expected
    assert core.draft_vocab is not None
    kept = set(core.draft_vocab.ids.tolist())
    assert kept == set(produced[::2]) | {0, 1}  # + the tokenizer's specials (</s>, unk)
    full, _ = run_engine(target, draft, PROMPTS, tree=tree, ignore_eos=True)
    cut_acc = sum(o.spec.accepted_tokens for o in outs)
    full_acc = sum(o.spec.accepted_tokens for o in full)
    assert 0 < cut_acc < full_acc  # the self-draft loses exactly the positions whose token was cut


def test_the_cut_draft_proposes_only_kept_tokens(pair, tmp_path):
    target, draft = pair
    path = ranking_file(tmp_path, list(range(2, VOCAB, 3)))
    core = EngineCore(target, draft, EngineConfig(max_batch=2, max_model_len=128, tree=(4, 2),
                                                  draft_vocab=10, draft_vocab_file=str(path)))
    kept = set(core.draft_vocab.ids.tolist())
    assert len(kept) == 10 + 2
    seen = []
    propose = core.runner.proposer.propose

    def spy(seqs, subs, forced=None, step=None):
        trees = propose(seqs, subs, forced, step)
        seen.extend(t for tree in trees for t in tree.tokens if t >= 0)
        return trees
    core.runner.proposer.propose = spy
    for i, p in enumerate(PROMPTS[:2]):
        core.add_request(GenerationRequest(f"r{i}", p, SamplingParams(temperature=0.8, seed=i, max_tokens=16,
                                                                      ignore_eos=True), SpecOptions()))
    while core.has_unfinished():
        core.step()
    assert seen and set(seen) <= kept


def test_config_needs_a_ranking_file_for_a_cut():
    with pytest.raises(ValueError, match="ranking file"):
        EngineConfig(draft_vocab=1000)
    with pytest.raises(ValueError, match=">= 0"):
        EngineConfig(draft_vocab=-1)
    assert EngineConfig(draft_vocab=0).draft_vocab_file is None
