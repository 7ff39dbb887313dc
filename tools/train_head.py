"""Train an acceptance head for a target/draft pair (docs/algorithms.md §5.2).

    python -m tools.train_head --target qwen2.5-coder-1.5b-instruct \\
        --draft qwen2.5-coder-0.5b-instruct --prompts benchmarks/prompts/train.json \\
        --temperature 0 --out configs/heads/qwen2.5-coder-1.5b-0.5b-t0.safetensors

1. Runs the pair through our engine with a fixed tree (``--tree``) on every prompt, recording for
   every drafted node its draft-side features (``engine.speculative.features``) and its label
   ``P(accepted | parent reached)``: at temperature 0 the match indicator (target argmax at the
   parent == token); when sampling, ``prod_{j<i}(1 - a_j) * a_i`` over the node's earlier siblings
   with ``a = min(1, p(x) / q(x))`` on the residual ``p`` / renormalised ``q`` the verifier would
   use (for the first child simply ``min(1, p/q)``).  Labels are computed for every node, also
   those the walk did not reach (the target scored the whole tree).
2. Splits *prompts* (not nodes) into train / held-out, trains the head with class-weighted BCE
   (rejections weighted ``--rejection-weight``), then fits the Platt recalibration unweighted.
3. Prints held-out AUC and calibration by depth (with draft confidence ``q(x)`` alone as the
   baseline) and saves the head with its metadata.  Deterministic for a given ``--seed``.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import GenerationRequest, SamplingParams
from engine.sampler import compute_probs
from engine.speculative.acceptance_head import AcceptanceHead, HeadMeta
from engine.speculative.adaptive import SpecPolicy
from engine.speculative.features import NodeFeatures
from engine.speculative.tree import parse_widths
from engine.speculative.walk import DEAD, children_of, remove_candidate, residual


@dataclass
class Dataset:
    cheap: torch.Tensor  # [n, F] float32
    hidden: Optional[torch.Tensor]  # [n, H] float16
    label: torch.Tensor  # [n] float32 in [0, 1]
    depth: torch.Tensor  # [n] int64
    q_token: torch.Tensor  # [n] float32
    prompt: torch.Tensor  # [n] int64 prompt index

    def select(self, mask: torch.Tensor) -> "Dataset":
        return Dataset(*(None if t is None else t[mask] for t in
                         (self.cheap, self.hidden, self.label, self.depth, self.q_token, self.prompt)))

    @property
    def size(self) -> int:
        return int(self.label.numel())


def node_labels(res) -> torch.Tensor:
    """[n] ``P(accepted | parent reached)`` of every node of one verified tree (see the module doc)."""
    tree, logits, seq = res.tree, res.logits, res.seq
    tokens, parent = tree.tokens, tree.sub.parent
    labels = torch.zeros(len(tokens))
    if seq.request.sampling.greedy:
        best = logits.argmax(dim=-1)  # [1+n]
        tok = torch.tensor(tokens)
        return (best[parent + 1] == tok).float()
    children = children_of(tree.sub)
    rows = [r for r, kids in enumerate(children) if any(tokens[c] != DEAD for c in kids)]
    p_rows = compute_probs(logits[rows], seq.sampling_tensors.repeat_rows(len(rows))).double()
    for row, p in zip(rows, p_rows):
        q, survive = tree.q[row].double(), 1.0
        for c in (c for c in children[row] if tokens[c] != DEAD):
            x = tokens[c]
            a = min(1.0, float(p[x]) / float(q[x])) if float(q[x]) > 0 else 0.0
            labels[c] = survive * a
            survive *= 1.0 - a
            p, q = residual(p, q), remove_candidate(q, x)
    return labels


class Recorder(SpecPolicy):
    """Drafts the whole fixed tree and records (features, label) of every live node."""

    wants_features = True
    wants_full_features = True

    def __init__(self, use_hidden: bool) -> None:
        self.use_hidden = use_hidden
        self.parts: list[tuple[NodeFeatures, torch.Tensor, int]] = []

    def observe(self, results) -> None:
        for res in results:
            if not res.tree.features:
                continue
            feats = NodeFeatures.cat(res.tree.features)
            live = feats.live
            if not self.use_hidden:
                feats.hidden = None
            elif feats.hidden is not None:
                feats.hidden = feats.hidden.half()
            idx = int(res.seq.request_id.split("-")[1])
            self.parts.append((select_nodes(feats, live), node_labels(res)[live], idx))

    def dataset(self) -> Dataset:
        if not self.parts:
            raise ValueError("no drafted tokens were recorded: use more prompts or a larger --max-new")
        feats = NodeFeatures.cat([f for f, _, _ in self.parts])
        prompt = torch.cat([torch.full((f.num_nodes,), i) for f, _, i in self.parts])
        return Dataset(feats.cheap_matrix(), feats.hidden, torch.cat([y for _, y, _ in self.parts]),
                       feats.depth, feats.q_token, prompt)


def select_nodes(f: NodeFeatures, mask: torch.Tensor) -> NodeFeatures:
    return NodeFeatures(*(None if t is None else t[mask] for t in
                          (f.depth, f.rank, f.q_token, f.live, f.entropy, f.top_probs, f.hidden)))


# ------------------------------------------------------------------ collecting data
def render_prompts(tokenizer, path: str, limit: Optional[int], max_prompt: int) -> list[list[int]]:
    from tools.prompts import interleave_sources, load_prompts_file

    out = []
    for p in interleave_sources(load_prompts_file(path), limit):
        messages = [dict(m) for m in p.messages]
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode("\n\n".join(m["content"] for m in messages))
        out.append(ids[-max_prompt:])
    return out


def collect(target, draft, prompts: list[list[int]], args) -> Dataset:
    recorder = Recorder(use_hidden=not args.no_hidden)
    # (a joining sequence's prompt catch-up runs in its own draft forward, so no padding margin is needed)
    config = EngineConfig.from_settings(max_batch=args.batch, tree=parse_widths(args.tree),
                          max_model_len=max(len(p) for p in prompts) + args.max_new + 1)
    core = EngineCore(target, draft, config, policy=recorder)
    for i, ids in enumerate(prompts):
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_new, seed=args.seed * 1_000_003 + i,
                                ignore_eos=args.ignore_eos)
        core.add_request(GenerationRequest(f"train-{i}", ids, params))
    with tqdm(total=len(prompts) * args.max_new, desc="drafting", unit="tok", file=sys.stderr) as bar:
        while core.has_unfinished():
            for o in core.step():
                bar.update(len(o.new_token_ids))
    return recorder.dataset()


# ------------------------------------------------------------------ training and evaluation
def train(data: Dataset, meta: HeadMeta, args) -> AcceptanceHead:
    torch.manual_seed(args.seed)
    head = AcceptanceHead(meta)
    head.feat_mean.copy_(data.cheap.mean(0))
    head.feat_std.copy_(data.cheap.std(0).clamp_min(1e-3))
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(args.seed)
    w = args.rejection_weight
    for _ in tqdm(range(args.epochs), desc="training", unit="epoch", file=sys.stderr):
        for idx in torch.randperm(data.size, generator=gen).split(args.batch_size):
            z = head.raw_logits(data.cheap[idx], None if data.hidden is None else data.hidden[idx].float())
            y = data.label[idx]
            loss = -(y * F.logsigmoid(z) + w * (1 - y) * F.logsigmoid(-z)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    fit_platt(head, data)
    return head.eval()


def raw_scores(head: AcceptanceHead, data: Dataset) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([head.raw_logits(data.cheap[i], None if data.hidden is None else data.hidden[i].float())
                          for i in torch.arange(data.size).split(8192)])


def fit_platt(head: AcceptanceHead, data: Dataset) -> None:
    """Recalibrates the weighted-BCE logits: ``sigmoid(a * z + b)`` fitted by unweighted BCE."""
    z, y = raw_scores(head, data), data.label
    ab = torch.tensor([1.0, 0.0], requires_grad=True)
    opt = torch.optim.LBFGS([ab], max_iter=100)

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(ab[0] * z + ab[1], y)
        loss.backward()
        return loss

    opt.step(closure)
    head.platt.copy_(ab.detach())


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC with soft labels (a node counts as positive with weight y, negative with 1 - y); ties
    count one half."""
    s, order = scores.double().sort()
    pos = labels.double()[order]
    neg = 1.0 - pos
    _, inv = torch.unique_consecutive(s, return_inverse=True)
    groups = int(inv.max()) + 1 if inv.numel() else 0
    pos_g = torch.zeros(groups, dtype=torch.float64).index_add_(0, inv, pos)
    neg_g = torch.zeros(groups, dtype=torch.float64).index_add_(0, inv, neg)
    below = neg_g.cumsum(0) - neg_g
    denom = float(pos.sum() * neg.sum())
    return float((pos_g * (below + 0.5 * neg_g)).sum()) / denom if denom > 0 else float("nan")


def evaluate(head: AcceptanceHead, data: Dataset) -> dict:
    pred = torch.sigmoid(head.platt[0] * raw_scores(head, data) + head.platt[1])
    y = data.label
    rows = []
    for d in sorted(set(data.depth.tolist())):
        m = data.depth == d
        rows.append(dict(depth=d, nodes=int(m.sum()), label=float(y[m].mean()), predicted=float(pred[m].mean()),
                         auc=auc(pred[m], y[m]), auc_q=auc(data.q_token[m], y[m])))
    return dict(nodes=data.size, auc=auc(pred, y), auc_q=auc(data.q_token, y),
                brier=float(((pred - y) ** 2).mean()), by_depth=rows)


def print_table(metrics: dict, file=None) -> None:
    print(f"held-out: {metrics['nodes']} nodes, AUC {metrics['auc']:.3f} (q(x) alone {metrics['auc_q']:.3f}), "
          f"Brier {metrics['brier']:.4f}", file=file)
    print(f"{'depth':>5} {'nodes':>8} {'mean label':>10} {'mean pred':>10} {'AUC':>6} {'AUC q(x)':>8}", file=file)
    for r in metrics["by_depth"]:
        print(f"{r['depth']:>5} {r['nodes']:>8} {r['label']:>10.3f} {r['predicted']:>10.3f} {r['auc']:>6.3f} "
              f"{r['auc_q']:>8.3f}", file=file)


# ------------------------------------------------------------------ command line
def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.train_head", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", required=True, help="benchmark prompts file (JSON list of {id, messages})")
    ap.add_argument("--out", required=True, help="output .safetensors file")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--tree", default="4,2,2", help="fixed tree the data is drafted with")
    ap.add_argument("--max-new", type=int, default=128, help="tokens generated per prompt")
    ap.add_argument("--limit", type=int, default=None, help="use N prompts, taken round-robin over the sources (HumanEval, ShareGPT, ...)")
    ap.add_argument("--max-prompt", type=int, default=1024, help="keep the last N prompt tokens")
    ap.add_argument("--holdout", type=float, default=0.2, help="fraction of prompts held out for evaluation")
    ap.add_argument("--batch", type=int, default=4, help="sequences decoding together while collecting")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--no-hidden", action="store_true", help="cheap features only (no draft hidden state)")
    ap.add_argument("--units", type=int, default=64, help="MLP width; 0 = logistic regression")
    ap.add_argument("--proj", type=int, default=32, help="hidden-state projection width")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--rejection-weight", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-data", help="also save the recorded nodes here (torch file), to retrain with --data")
    ap.add_argument("--data", help="train on nodes saved by --save-data instead of running the models")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = ap.parse_args(argv)
    if not 0.0 < args.holdout < 1.0:
        ap.error("--holdout must be in (0, 1)")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.models.loader import load_model

    if args.data:  # nodes recorded by an earlier run (--save-data): train only
        saved = torch.load(args.data)
        data, num_prompts, hidden_size = Dataset(**saved["data"]), saved["num_prompts"], saved["hidden_size"]
        if args.no_hidden:
            data.hidden = None
    else:
        target = load_model(args.target, args.dtype, args.device)
        draft = load_model(args.draft, args.dtype, args.device)
        prompts = render_prompts(target.tokenizer, args.prompts, args.limit, args.max_prompt)
        num_prompts, hidden_size = len(prompts), draft.config.hidden_size
        data = collect(target, draft, prompts, args)
        if args.save_data:
            torch.save({"data": vars(data), "num_prompts": num_prompts, "hidden_size": hidden_size}, args.save_data)
    order = list(range(num_prompts))
    random.Random(args.seed).shuffle(order)
    held = set(order[: max(1, round(args.holdout * num_prompts))])
    if len(held) >= num_prompts:
        raise SystemExit("need at least two prompts (one to train on, one to hold out)")
    is_held = torch.tensor([int(i) in held for i in data.prompt.tolist()], dtype=torch.bool)
    train_set, test_set = data.select(~is_held), data.select(is_held)
    meta = HeadMeta(target=args.target, draft=args.draft, temperature=args.temperature,
                    hidden_size=0 if data.hidden is None else hidden_size, proj_dim=args.proj,
                    units=args.units, tree=list(parse_widths(args.tree)))
    print(f"{train_set.size} training nodes from {num_prompts - len(held)} prompts, "
          f"{test_set.size} held-out nodes from {len(held)} prompts")
    head = train(train_set, meta, args)
    head.meta.metrics = evaluate(head, test_set)
    print_table(head.meta.metrics)
    head.save(args.out)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
