import pytest
import torch

from colozoo.layers import attention
from colozoo.models.base import dropout
from colozoo.core.mesh import init_parallel, single_process
from colozoo.core.rng import TENSOR_PARALLEL, get_rng_tracker, model_parallel_seed
from distributed import run_distributed

X = torch.ones(4, 64)


def _masks(degrees, seed=1234):
    """Dropout masks drawn on one rank: replicated (default generator) and sharded (tracked tp generator)."""
    parallel = init_parallel(**degrees)
    model_parallel_seed(seed, parallel)
    out = {"coords": {d: parallel.rank(d) for d in ("pp", "dp", "tp")}}
    out["replicated"] = dropout(X, 0.5, True, sharded=False) == 0
    before = torch.get_rng_state()
    out["sharded"] = dropout(X, 0.5, True, sharded=True) == 0
    out["default_restored"] = torch.equal(before, torch.get_rng_state())
    out["sharded_again"] = dropout(X, 0.5, True, sharded=True) == 0
    out["replicated_again"] = dropout(X, 0.5, True, sharded=False) == 0
    q = torch.ones(1, 2, 4, 8)
    out["attention"] = attention(q, q, q, causal=True, dropout_p=0.5)
    return out


def test_two_ranks_tp2():
    a, b = run_distributed(_masks, 2, degrees=dict(tp=2), timeout=60)
    assert a["replicated"].any() and not a["replicated"].all()
    assert torch.equal(a["replicated"], b["replicated"])  # replicated activations: same mask on every tp rank
    assert torch.equal(a["replicated_again"], b["replicated_again"])
    assert not torch.equal(a["sharded"], b["sharded"])  # sharded activations: each tp rank its own mask
    assert not torch.equal(a["attention"], b["attention"])  # attention dropout runs on the tracked generator
    for r in (a, b):
        assert r["default_restored"]
        assert not torch.equal(r["sharded"], r["sharded_again"])  # the tracked stream advances between forks
        assert not torch.equal(r["replicated"], r["sharded"])


def test_four_ranks_tp2_dp2():
    results = run_distributed(_masks, 4, degrees=dict(tp=2, dp=2), timeout=60)
    for key in ("sharded", "replicated", "attention"):
        masks = {}
        for r in results:
            masks.setdefault(r["coords"]["tp"], []).append(r[key])
        for same_tp in masks.values():  # dp replicas with the same tp rank draw the same masks
            assert len(same_tp) == 2 and torch.equal(*same_tp), key
        if key != "replicated":
            assert not torch.equal(masks[0][0], masks[1][0]), key
    assert all(torch.equal(r["replicated"], results[0]["replicated"]) for r in results)
    assert all(r["default_restored"] for r in results)


def test_four_ranks_tp4_all_sharded_masks_distinct():
    results = run_distributed(_masks, 4, degrees=dict(tp=4), timeout=60)
    sharded = [r["sharded"] for r in results]
    assert all(not torch.equal(sharded[i], sharded[j]) for i in range(4) for j in range(i + 1, 4))
    assert all(torch.equal(r["replicated"], results[0]["replicated"]) for r in results)


def test_four_ranks_pp2_tp2_stages_differ():
    results = run_distributed(_masks, 4, degrees=dict(pp=2, tp=2), timeout=60)
    replicated = {}
    for r in results:
        replicated.setdefault(r["coords"]["pp"], []).append(r["replicated"])
    for stage in replicated.values():
        assert torch.equal(*stage)
    assert not torch.equal(replicated[0][0], replicated[1][0])  # each pipeline stage its own stream


def test_fork_restores_default_generator_on_error():
    model_parallel_seed(7, single_process())
    before = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="inside"):
        with get_rng_tracker().fork():
            torch.rand(3)
            raise RuntimeError("inside")
    assert torch.equal(before, torch.get_rng_state())


def test_tracker_is_reproducible_and_rejects_duplicates():
    parallel = single_process()
    model_parallel_seed(7, parallel)
    first = [dropout(X, 0.5, True, sharded=s) for s in (False, True)]
    model_parallel_seed(7, parallel)
    second = [dropout(X, 0.5, True, sharded=s) for s in (False, True)]
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    with pytest.raises(ValueError, match="already exists"):
        get_rng_tracker().add(TENSOR_PARALLEL, 1)


def test_states_roundtrip():
    model_parallel_seed(3, single_process())
    tracker = get_rng_tracker()
    saved = tracker.get_states()
    with tracker.fork():
        first = torch.rand(5)
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(first, torch.rand(5))


def test_unseeded_fork_uses_default_generator():
    get_rng_tracker().reset()
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with get_rng_tracker().fork():
        assert torch.equal(torch.rand(3), expected)
