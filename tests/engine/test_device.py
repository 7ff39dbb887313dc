"""The engine under the device-check mode (``tests/device_check.py``): every method, with every
sampling feature, at batch 1 and 8, must never mix host tensors into device math, and a step's host
syncs are counted: one a step for the draft tree and its verification (more where the host must see
the tree's tokens before verifying: Max-Gram's tail, grammars), whatever the batch size."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import GenerationRequest, SamplingParams, SpecOptions
from engine.speculative.cost_model import CostCurve, CostModel
from engine.registry import method_names
from tests.device_check import DeviceCheck, mark_engine

#: one request per sampling feature (a batch of 8 mixes them all)
FEATURES = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.9),
    "top-p": dict(temperature=0.8, top_p=0.7, top_k=20, min_p=0.05),
    "seed": dict(temperature=1.0, seed=7),
    "logprobs": dict(temperature=0.7, logprobs=3),
    "penalties": dict(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
    "logit-bias": dict(temperature=0.0, logit_bias={5: 3.0, 9: -100.0}),
    "stop": dict(temperature=0.6, stop=["zz"]),
}


@pytest.fixture
def pair(tiny_pair):
    return tiny_pair


def run_checked(pair, method: str, features: list[str], tree=(2, 1, 1), max_tokens: int = 10, **config):
    target, draft = pair
    config = EngineConfig.from_settings(max_batch=8, max_model_len=128, tree=tree, spec_method=method, **config)
    core = EngineCore(target, draft, config)
    mark_engine(core)
    mode, per_step, errors = DeviceCheck(), [], []
    with mode:
        for i, name in enumerate(features):
            params = dict(FEATURES[name])
            if method == "mjsd-lossy" and name == "penalties":
                params = dict(temperature=0.8)  # refused for this method (a 400 at the server)
            core.add_request(GenerationRequest(f"r{i}", [3 + i, 6, 7, 8, 9, 10],
                                               SamplingParams(max_tokens=max_tokens, **params), SpecOptions()))
        while core.has_unfinished():
            mode.reset()
            outs = core.step()
            per_step.append((sum(mode.syncs.values()), dict(mode.syncs), list(mode.sync_stacks)))
            errors += [o.error for o in outs if o.error]
    assert not mode.violations, mode.violations[0]
    assert not errors, errors[0]
    return core, per_step


@pytest.mark.parametrize("method", method_names())
def test_a_mixed_batch_of_eight_never_mixes_host_and_device(pair, method):
    run_checked(pair, method, list(FEATURES))


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("method", method_names())
def test_each_feature_alone_never_mixes_host_and_device(pair, method, feature):
    run_checked(pair, method, [feature], max_tokens=6)


@pytest.mark.parametrize("method,bound", [("mcsd", 1), ("mcsd+maxgram", 1 + 1), ("maxgram", 1),
                                          ("cascade", 1 + 4), ("mjsd-lossy", 1), ("target-init-lossy", 1)])
@pytest.mark.parametrize("features", [["greedy"], ["sampled"], ["greedy"] * 8, ["sampled"] * 8, list(FEATURES)],
                         ids=["greedy-1", "sampled-1", "greedy-8", "sampled-8", "mixed-8"])
def test_host_syncs_per_step(pair, method, bound, features):
    """Tree (2, 1, 1): the draft tree's tokens stay on the device, verification gathers them there and
    reads them back with its decisions: one read a step for mcsd, nothing else (no per-level,
    per-sequence or per-layer reads), at batch 1 as at 8.  Max-Gram's tail below the deepest drafted
    path needs the tree's tokens on the host: mcsd+maxgram reads twice.  A batch with penalties reads
    no more: their histories count each row's path on the device.  The lossy modes read once too:
    MJSD's beams are chosen on the device and its best beam comes back with the joint rule's decisions,
    the target-initialised mode's forced first level (last step's candidates) is copied to the device,
    and both read logprobs with their decisions.  The cascade reads once per review round (up to
    ``cascade_depth`` 4): each round's Max-Gram guess continues the tokens the last round kept."""
    _, steps = run_checked(pair, method, features)
    for count, kinds, stacks in steps:
        assert set(kinds) <= {"to_host"} and count <= bound, (kinds, "\n".join(stacks[:2]))
    assert max(count for count, _, _ in steps) == bound  # the bound is reached: the counter counts


@pytest.mark.parametrize("method", ["mcsd", "mcsd+maxgram", "cascade"])
def test_adaptive_speculation_reads_its_features_with_the_level(pair, method, monkeypatch):
    """The adaptive policy (threshold stopping, calibration, load-aware budget) runs on the host from
    features read back with each level's tokens: still one read per draft level plus one for
    verification, no mixing.  The cost curves are fixed (a flat target forward, a cheap draft) rather
    than measured: a curve timed on a busy machine can make the budget choose plain decoding, and
    then nothing is drafted for the calibrator to see."""
    flat = CostModel(target=CostCurve((1.0, 64.0), (0.010, 0.011)), draft=CostCurve((1.0, 64.0), (0.001, 0.002)))
    monkeypatch.setattr(CostModel, "measure", classmethod(lambda cls, *args, **kwargs: flat))
    core, steps = run_checked(pair, method, list(FEATURES), adaptive=True)
    policy = core.planner.policy
    assert policy is not None
    if method != "cascade":  # the cascade's chains carry no draft-tree features to learn from
        assert policy.calibrators[False].seen.sum() > 0
    bound = 1 + (3 if method != "cascade" else 4)
    for count, kinds, stacks in steps:
        assert set(kinds) <= {"to_host"} and count <= bound, (kinds, "\n".join(stacks[:2]))


@pytest.mark.parametrize("features", [["sampled"], list(FEATURES)], ids=["sampled-1", "mixed-8"])
def test_maxgram_without_reading_the_tree_reads_once(pair, features, monkeypatch):
    """``maxgram_read_tree=False`` (the GPU preset): Max-Gram's branches join the held tree as nodes of
    their own and its tail is proposed on the device, so mcsd+maxgram reads once a step, penalties
    included."""
    from engine.speculative.device_maxgram import DeviceMaxGram

    tails = []
    original = DeviceMaxGram.tails
    monkeypatch.setattr(DeviceMaxGram, "tails", lambda self, seqs, trees, lengths:
                        tails.append(sum(lengths)) or original(self, seqs, trees, lengths))
    core, steps = run_checked(pair, "mcsd+maxgram", features, maxgram_read_tree=False)
    for count, kinds, stacks in steps:
        assert set(kinds) <= {"to_host"} and count <= 1, (kinds, "\n".join(stacks[:2]))
    assert max(count for count, _, _ in steps) == 1
    assert tails and sum(tails) > 0  # the tails were there
    stats = core.drain_step_stats()
    assert sum(s.drafted_tokens for s in stats) > 0


@pytest.mark.parametrize("features", [["sampled"], list(FEATURES)], ids=["sampled-1", "mixed-8"])
@pytest.mark.parametrize("method", method_names())
def test_with_the_gpu_presets_settings_every_method_reads_once(pair, method, features, monkeypatch):
    """``configs/gpu.toml``'s speculation settings (adaptive, load-aware, no level-by-level stop, Max-Gram
    not reading the draft's tree): one read a step for every method, every sampling feature in the
    batch (the cost curves fixed, as above)."""
    flat = CostModel(target=CostCurve((1.0, 64.0), (0.010, 0.011)), draft=CostCurve((1.0, 64.0), (0.001, 0.002)))
    monkeypatch.setattr(CostModel, "measure", classmethod(lambda cls, *args, **kwargs: flat))
    _, steps = run_checked(pair, method, features, adaptive=True, load_aware=True, adaptive_level_stop=False,
                           maxgram_read_tree=False)
    for count, kinds, stacks in steps:
        assert set(kinds) <= {"to_host"} and count <= 1, (kinds, "\n".join(stacks[:2]))
    assert max(count for count, _, _ in steps) == 1


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("features", [["greedy"], ["sampled"] * 8, list(FEATURES)], ids=["greedy-1", "sampled-8",
                                                                                          "mixed-8"])
def test_the_cascade_without_reading_its_rounds_reads_once(pair, features, adaptive, monkeypatch):
    """``maxgram_read_tree=False``: the cascade's review rounds run on the device
    (``device_cascade``), each guess continuing the chain there, and the chains, their draft-cache
    entries and the rounds they needed come back with verification's one read, penalties included,
    and with the adaptive budget (its cost curves fixed, as above)."""
    flat = CostModel(target=CostCurve((1.0, 64.0), (0.010, 0.011)), draft=CostCurve((1.0, 64.0), (0.001, 0.002)))
    monkeypatch.setattr(CostModel, "measure", classmethod(lambda cls, *args, **kwargs: flat))
    core, steps = run_checked(pair, "cascade", features, maxgram_read_tree=False, adaptive=adaptive, max_tokens=14)
    for count, kinds, stacks in steps:
        assert set(kinds) <= {"to_host"} and count <= 1, (kinds, "\n".join(stacks[:2]))
    assert max(count for count, _, _ in steps) == 1
    if not adaptive:  # (the budget may leave the draft idle: with its timings, drafting may not pay)
        assert sum(s.drafted_tokens for s in core.drain_step_stats()) > 0


@pytest.mark.parametrize("method,bound,config", [("mcsd", 1, {}), ("mcsd+maxgram", 2, {}),
                                                 ("mcsd+maxgram", 1, {"maxgram_read_tree": False})],
                         ids=["mcsd", "mcsd+maxgram", "mcsd+maxgram-unread"])
def test_adaptive_speculation_without_the_level_stop_reads_once(pair, method, bound, config, monkeypatch):
    """``adaptive_level_stop=False`` (the GPU preset): the budget plans each step's depth, the tree is
    not cut level by level, and its features come back with the tree in verification's read, so the
    calibrator still learns; penalties included (their histories are counted on the device)."""
    flat = CostModel(target=CostCurve((1.0, 64.0), (0.010, 0.011)), draft=CostCurve((1.0, 64.0), (0.001, 0.002)))
    monkeypatch.setattr(CostModel, "measure", classmethod(lambda cls, *args, **kwargs: flat))
    core, steps = run_checked(pair, method, list(FEATURES), adaptive=True, adaptive_level_stop=False, **config)
    policy = core.planner.policy
    assert policy is not None and not policy.level_stop
    assert policy.calibrators[False].seen.sum() > 0  # the features were read and learned from
    for count, kinds, stacks in steps:
        assert set(kinds) <= {"to_host"} and count <= bound, (kinds, "\n".join(stacks[:2]))
    assert max(count for count, _, _ in steps) == bound


@pytest.mark.parametrize("seed", range(20))
def test_packed_bytes_unpack_to_the_same_tensors(seed):
    """``to_host``'s and ``to_device_many``'s one copy on CUDA (``pack_bytes``, ``unpack_bytes`` of the copy): any
    mix of dtypes, shapes (0-dim, empty) and layouts (transposed) unpacks to equal tensors, each a view
    aligned to its item size."""
    import torch

    from engine.device import pack_bytes, unpack_bytes

    gen = torch.Generator().manual_seed(seed)
    dtypes = [torch.long, torch.int32, torch.bool, torch.float32, torch.float64, torch.bfloat16, torch.uint8]
    shapes = [(), (0,), (1,), (3,), (2, 5), (4, 3, 2)]
    tensors = []
    for _ in range(1 + seed % 7):
        dtype = dtypes[int(torch.randint(len(dtypes), (1,), generator=gen))]
        shape = shapes[int(torch.randint(len(shapes), (1,), generator=gen))]
        t = (torch.randn(shape, generator=gen) * 100).to(dtype) if dtype != torch.bool else torch.rand(shape, generator=gen) < 0.5
        tensors.append(t.t() if t.dim() == 2 else t)
    packed, layout = pack_bytes(tensors)
    assert packed.dtype == torch.uint8 and packed.numel() == sum(t.numel() * t.element_size() for t in tensors)
    # into a buffer of its own, as to_device_many packs host tensors into pinned memory on CUDA
    staging = torch.empty(packed.numel(), dtype=torch.uint8)
    into, same_layout = pack_bytes(tensors, out=staging)
    assert into.data_ptr() == staging.data_ptr() and same_layout == layout and torch.equal(into, packed)
    out = unpack_bytes(packed.clone(), layout)
    for t, u in zip(tensors, out):
        assert u.dtype == t.dtype and u.shape == t.shape and torch.equal(u, t)
        assert (u.data_ptr() - u.untyped_storage().data_ptr()) % t.element_size() == 0  # aligned: a view
    # a bucket's persistent buffer laid out in advance takes the same tensors in one copy
    from engine.device import copy_packed, staged_layout

    nbytes, planned = staged_layout([(t.shape, t.dtype) for t in tensors])
    assert (nbytes, planned) == (packed.numel(), layout)
    buffer = torch.full((nbytes,), 7, dtype=torch.uint8)
    views = unpack_bytes(buffer, planned)
    copy_packed(buffer, tensors, planned)
    assert all(torch.equal(u, t) for t, u in zip(tensors, views))
    with pytest.raises(ValueError, match="layout"):
        copy_packed(buffer, tensors[::-1] + [torch.zeros(1)], planned)


def test_the_device_timer_reads_the_host_clock_off_cuda():
    import time

    from engine.device import DeviceTimer
    import torch

    timer = DeviceTimer(torch.device("cpu")).start()
    time.sleep(0.01)
    timer.stop()
    assert timer.seconds() == timer.host_seconds() >= 0.01
