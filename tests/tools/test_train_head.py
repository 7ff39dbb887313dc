"""Acceptance-head training: exact labels and AUC on hand-built cases, and the command end to end
on a tiny model pair (deterministic with a seed; the saved head drives the engine losslessly)."""

import json
from types import SimpleNamespace

import pytest
import torch

from engine.models.loader import load_model
from engine.request import SamplingParams
from engine.sampler import SamplingTensors
from engine.speculative.acceptance_head import AcceptanceHead
from engine.speculative.draft_tree import DraftTree
from tools.train_head import auc, main, node_labels
from engine.speculative.tree import TreeTopology
from tests.engine_utils import run_engine
from tests.tiny import tiny_hf, tiny_tokenizer


def test_auc_exact_cases():
    assert auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0.0, 0.0, 1.0, 1.0])) == pytest.approx(0.75)
    assert auc(torch.tensor([0.5, 0.5, 0.5]), torch.tensor([0.0, 1.0, 1.0])) == pytest.approx(0.5)
    # soft labels: sample 0 is half positive, half negative (a tie with itself counts 1/2)
    assert auc(torch.tensor([0.2, 0.9]), torch.tensor([0.5, 1.0])) == pytest.approx((0.5 * 0.5 * 0.5 + 1.0 * 0.5) / 0.75)


def fake_result(p_rows, q_root, tokens, widths, greedy=False):
    sub = TreeTopology(widths).subtree(widths)
    tree = DraftTree(sub, tokens, q={0: q_root})
    params = SamplingParams(temperature=0.0 if greedy else 1.0)
    seq = SimpleNamespace(request=SimpleNamespace(sampling=params),
                          sampling_tensors=SamplingTensors.from_params([params], p_rows.shape[1]))
    return SimpleNamespace(tree=tree, seq=seq, logits=p_rows.log())


def test_sampled_labels_follow_the_verifier_residuals():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.1, 0.6, 0.2, 0.1])
    res = fake_result(torch.stack([p, p, p]), q, tokens=[1, 3], widths=(2,))
    labels = node_labels(res)
    a0 = 0.3 / 0.6
    p1 = torch.tensor([0.4, 0.0, 0.0, 0.0]) / 0.4  # norm((p - q)+)
    q1 = torch.tensor([0.1, 0.0, 0.2, 0.1]) / 0.4  # q without token 1
    a1 = min(1.0, float(p1[3] / q1[3]))  # p1[3] = 0 -> 0
    assert labels.tolist() == pytest.approx([a0, (1 - a0) * a1])
    res = fake_result(torch.stack([p, p, p]), q, tokens=[2, 0], widths=(2,))
    a0 = 1.0  # p = q = .2 at token 2
    assert node_labels(res).tolist() == pytest.approx([a0, 0.0], abs=1e-6)


def test_greedy_labels_are_match_indicators_at_the_parent_row():
    p_rows = torch.tensor([[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.5, 0.4, 0.1], [0.3, 0.3, 0.4]])
    res = fake_result(p_rows, None, tokens=[1, 2, 0, 2], widths=(2, 1), greedy=True)
    # nodes 0, 1 (parent row 0, argmax 1); node 2 under node 0 (row 1, argmax 0); node 3 under node 1 (row 2, argmax 2)
    assert node_labels(res).tolist() == [1.0, 0.0, 1.0, 1.0]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target and a draft that is the target with weight noise: greedy acceptance is mixed."""
    root = tmp_path_factory.mktemp("pair")
    target = tiny_hf("llama", seed=0)
    draft = tiny_hf("llama", seed=0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for w in draft.parameters():
            w.add_(0.01 * torch.randn(w.shape, generator=g))
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tiny_tokenizer().save_pretrained(root / name)
    prompts = [{"id": f"p/{i}", "messages": [{"role": "user", "content": " ".join(f"w{3 + i + j}" for j in range(6))}]}
               for i in range(5)]
    (root / "prompts.json").write_text(json.dumps(prompts))
    return root


def train(pair, out, *extra):
    argv = ["--target", str(pair / "target"), "--draft", str(pair / "draft"), "--prompts", str(pair / "prompts.json"),
            "--out", str(out), "--max-new", "16", "--ignore-eos", "--epochs", "3", "--batch", "2", "--dtype", "fp32",
            "--units", "8", "--proj", "8", "--tree", "3,2", "--seed", "1", *extra]
    assert main(argv) == 0
    return AcceptanceHead.load(out)


def test_train_head_end_to_end(pair, tmp_path, capsys):
    head = train(pair, tmp_path / "heads" / "t0.safetensors")
    out = capsys.readouterr().out
    assert "held-out" in out and "AUC" in out and "saved" in out
    m = head.meta
    assert m.temperature == 0.0 and m.hidden_size == 64 and m.tree == [3, 2]
    assert m.target.endswith("target") and m.draft.endswith("draft")
    assert m.metrics["nodes"] > 0 and [r["depth"] for r in m.metrics["by_depth"]] == [1, 2]
    assert 0.0 < m.metrics["by_depth"][0]["label"] < 1.0 and 0.0 <= m.metrics["auc"] <= 1.0
    again = train(pair, tmp_path / "again.safetensors", "--save-data", str(tmp_path / "nodes.pt"))
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), again.state_dict().values()))  # seeded
    reused = train(pair, tmp_path / "reused.safetensors", "--data", str(tmp_path / "nodes.pt"))  # no model runs
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), reused.state_dict().values()))
    cheap = train(pair, tmp_path / "cheap.safetensors", "--data", str(tmp_path / "nodes.pt"), "--no-hidden")
    assert cheap.meta.hidden_size == 0 and cheap.meta.metrics["nodes"] == head.meta.metrics["nodes"]
    # the trained head drives adaptive drafting; greedy output stays identical to plain decoding
    target, draft = load_model(str(pair / "target"), "fp32"), load_model(str(pair / "draft"), "fp32")
    prompts = [[5, 6, 7, 8], [9, 10]]
    expected = [o.tokens for o in run_engine(target, None, prompts, tree=(), ignore_eos=True)[0]]
    config = dict(adaptive=True, load_aware=False, acceptance_heads=(str(tmp_path / "heads" / "t0.safetensors"),))
    outs, core = run_engine(target, draft, prompts, tree=(3, 2), ignore_eos=True, config=config)
    assert [o.tokens for o in outs] == expected and core.policy.heads[0].uses_hidden


def test_train_head_sampled_cheap_features_only(pair, tmp_path):
    head = train(pair, tmp_path / "t08.safetensors", "--temperature", "0.8", "--no-hidden", "--units", "0")
    assert head.meta.temperature == 0.8 and head.meta.hidden_size == 0 and not head.uses_hidden
    labels = [r["label"] for r in head.meta.metrics["by_depth"]]
    assert all(0.0 <= y <= 1.0 for y in labels)
