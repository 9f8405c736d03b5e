"""The MoE layer against transformers' Qwen2-MoE block (no renormalisation, gated shared expert) at ep 1/2 and
tp 1/2 with sequence parallel; the capacity factor against a first-come-first-served reference; the losses."""
import math

import pytest
import torch
import torch.nn.functional as F

from distributed import run_distributed
from parity import close

HIDDEN, INNER, SHARED, EXPERTS, TOP_K = 64, 32, 48, 4, 2
ATOL = 1e-5
FP32 = dict(rtol=1e-5, atol=1e-5)  # relative too: reduction order differs between CPUs (Intel, AMD)


def qwen_block(seed=0):
    import transformers
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    config = transformers.Qwen2MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INNER,
                                         shared_expert_intermediate_size=SHARED, num_experts=EXPERTS,
                                         num_experts_per_tok=TOP_K, norm_topk_prob=False)
    torch.manual_seed(seed)
    block = Qwen2MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(std=0.2)
    return block


def hf_weights(block) -> dict[str, torch.Tensor]:
    """The block's weights under our names (global, unsharded)."""
    s = block.shared_expert
    return {"gate.weight": block.gate.weight,
            "experts.gate_up_proj": block.experts.gate_up_proj,
            "experts.down_proj": block.experts.down_proj,
            "shared_expert.gate_up.weight": torch.cat([s.gate_proj.weight, s.up_proj.weight]),
            "shared_expert.down_proj.weight": s.down_proj.weight,
            "shared_expert_gate.weight": block.shared_expert_gate.weight}


def hf_grads(block) -> dict[str, torch.Tensor]:
    s = block.shared_expert
    return {"gate.weight": block.gate.weight.grad,
            "experts.gate_up_proj": block.experts.gate_up_proj.grad,
            "experts.down_proj": block.experts.down_proj.grad,
            "shared_expert.gate_up.weight": torch.cat([s.gate_proj.weight.grad, s.up_proj.weight.grad]),
            "shared_expert.down_proj.weight": s.down_proj.weight.grad,
            "shared_expert_gate.weight": block.shared_expert_gate.weight.grad}


def moe_matches_qwen(tp, ep, sequence_parallel):
    from colozoo.layers.comm import gather_from_parallel, split_to_parallel
    from colozoo.layers.moe import MoE, MoESpec
    from colozoo.layers.shard import gather_tensor, shard_tensor, spec_of
    from colozoo.core.mesh import coords_of, init_parallel

    parallel = init_parallel(tp=tp, ep=ep, sequence_parallel=sequence_parallel)
    block = qwen_block()
    x = torch.randn(2, 8, HIDDEN, generator=torch.Generator().manual_seed(3))
    probe = torch.randn(2, 8, HIDDEN, generator=torch.Generator().manual_seed(4))
    x_ref = x.clone().requires_grad_()
    ref = block(x_ref)
    (ref * probe).sum().backward()

    moe = MoE(MoESpec(HIDDEN, INNER, EXPERTS, TOP_K, normalize_top_k=False, shared_expert_size=SHARED),
              ep_group=parallel.group("ep"), tp_group=parallel.tp_group, sequence_parallel=parallel.sequence_parallel)
    weights, coords = hf_weights(block), coords_of(parallel)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.copy_(shard_tensor(weights[name].detach(), spec_of(p), coords))
    x_local = x.clone()
    if parallel.sequence_parallel:
        x_local = split_to_parallel(x_local, parallel.tp_group, dim=1)
    x_local.requires_grad_()
    out, logits = moe(x_local)
    if parallel.sequence_parallel:
        out = gather_from_parallel(out, parallel.tp_group, dim=1)
    (out * probe).sum().backward()
    dx = gather_from_parallel(x_local.grad, parallel.tp_group, dim=1) if parallel.sequence_parallel else x_local.grad

    torch.testing.assert_close(out, ref, **FP32, msg=lambda m: f"output: {m}")
    torch.testing.assert_close(dx, x_ref.grad, **FP32, msg=lambda m: f"input gradient: {m}")
    expected = hf_grads(block)
    dp = parallel.size("dp")
    for name, p in moe.named_parameters():
        # every rank fed the same tokens: the expert owner summed them over its ep group
        grad = p.grad / dp if any(s.mesh_dim == "ep" for s in spec_of(p)) else p.grad
        full = gather_tensor(grad, spec_of(p), tuple(expected[name].shape), parallel.groups, coords)
        torch.testing.assert_close(full, expected[name], **FP32, msg=lambda m, name=name: f"gradient of {name}: {m}")
    return logits.shape


def test_moe_matches_qwen2_moe_block():
    moe_matches_qwen(tp=1, ep=1, sequence_parallel=False)  # one process: in this one


@pytest.mark.parametrize("tp,ep,sp", [(1, 2, False), (2, 1, True)])
def test_moe_parallel_matches_qwen2_moe_block(tp, ep, sp):
    run_distributed(moe_matches_qwen, tp * ep, tp=tp, ep=ep, sequence_parallel=sp, timeout=90)


def _reference_with_capacity(moe, x, factor):
    """Loop over assignments in token order; an expert takes at most `capacity` of them."""
    tokens = x.reshape(-1, HIDDEN)
    _, weights, experts = moe.gate(tokens)
    capacity = math.ceil(factor * experts.numel() / EXPERTS)
    taken = [0] * EXPERTS
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for j in range(TOP_K):
            e = int(experts[t, j])
            taken[e] += 1
            if taken[e] > capacity:
                continue
            gate, up = F.linear(tokens[t], moe.experts.gate_up_proj[e]).chunk(2)
            out[t] += weights[t, j] * F.linear(F.silu(gate) * up, moe.experts.down_proj[e])
    return out.view_as(x)


@pytest.mark.parametrize("factor", [0.5, 1.0, 100.0])
def test_capacity_factor_drops_late_assignments(factor):
    from colozoo.layers.moe import MoE, MoESpec

    torch.manual_seed(0)
    moe = MoE(MoESpec(HIDDEN, INNER, EXPERTS, TOP_K, capacity_factor=factor))
    with torch.no_grad():
        moe.gate.weight.normal_(std=1.0)  # skewed routing, so capacity bites
    x = torch.randn(2, 12, HIDDEN)
    out, _ = moe(x)
    ref = _reference_with_capacity(moe, x, factor)
    close(out, ref, ATOL, "MoE output with capacity")
    if factor == 100.0:  # nothing dropped: the same as dropless
        moe.capacity_factor = None
        assert torch.equal(moe(x)[0], out)


def test_bad_configurations_are_named():
    from colozoo.layers.moe import MoE, MoESpec, TopKRouter

    with pytest.raises(ValueError, match="capacity_factor"):
        MoE(MoESpec(HIDDEN, INNER, EXPERTS, TOP_K, capacity_factor=0.0))
    with pytest.raises(ValueError, match="top_k=5"):
        TopKRouter(HIDDEN, EXPERTS, 5)


@pytest.mark.parametrize("module, said", [
    ("router", dict(top_k=1)), ("router", dict(normalize_top_k=False)), ("router", dict(router_bias=True)),
    ("router", dict(num_experts=2)), ("experts", dict(inner_size=8)), ("experts", dict(activation="gelu")),
    ("experts", dict(num_experts=2)),
])
def test_a_module_given_to_moe_that_disagrees_with_the_spec_is_refused(module, said):
    """The spec's fields that build the default router and experts are not dropped when a module replaces them."""
    from colozoo.layers.moe import GroupedExperts, MoE, MoESpec, TopKRouter

    spec = MoESpec(HIDDEN, INNER, EXPERTS, TOP_K)
    agreeing = {"router": TopKRouter(HIDDEN, EXPERTS, TOP_K), "experts": GroupedExperts(EXPERTS, HIDDEN, INNER)}
    MoE(spec, **agreeing)  # the defaults' own settings agree
    fields = dict(num_experts=EXPERTS, top_k=TOP_K, normalize_top_k=True, router_bias=False) if module == "router" \
        else dict(num_experts=EXPERTS, inner_size=INNER, activation="silu")
    fields.update(said)
    if module == "router":
        given = TopKRouter(HIDDEN, fields["num_experts"], fields["top_k"], fields["normalize_top_k"],
                           fields["router_bias"])
    else:
        given = GroupedExperts(fields["num_experts"], HIDDEN, fields["inner_size"], fields["activation"])
    field = next(iter(said))
    with pytest.raises(ValueError, match=f"the {module} given has {field}="):
        MoE(spec, **{module: given})


def test_losses_match_their_formulas():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from colozoo.layers.moe import router_losses, router_statistics

    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(10, EXPERTS, generator=g) for _ in range(3)]
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[0, :2] = 0
    for m in (None, mask):
        expected = load_balancing_loss_func(tuple(logits), EXPERTS, TOP_K, m)
        balance, _ = router_losses(router_statistics(logits, EXPERTS, TOP_K, m), EXPERTS)
        close(balance, expected, 1e-6, "load-balancing loss")
    keep = mask.reshape(-1).bool()
    z = torch.cat([torch.logsumexp(l, -1)[keep] ** 2 for l in logits]).mean()
    _, z_loss = router_losses(router_statistics(logits, EXPERTS, TOP_K, mask), EXPERTS)
    close(z_loss, z, 1e-6, "router z-loss")


def test_grouped_gemm_equals_expert_loop():
    from colozoo.layers.moe import _grouped_mm_fits, grouped_linear

    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 16, generator=g).bfloat16().requires_grad_()
    w = torch.randn(3, 8, 16, generator=g).bfloat16().requires_grad_()
    counts = [5, 0, 7]  # an expert without tokens
    if not _grouped_mm_fits(x, w):
        pytest.skip("this torch has no bf16 grouped GEMM")
    out = grouped_linear(x, w, counts)
    out.sum().backward()  # an expanded gradient
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = torch.cat([F.linear(rows, weight) for rows, weight in zip(x2.split(counts), w2)])
    ref.sum().backward()
    assert torch.equal(out, ref) and torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)


def _capacity_under_expert_parallelism(factor):
    """At ep=2 each rank routes its own tokens: the capacity holds per sending rank, and every rank's output equals
    the one-process first-come-first-served reference over its tokens with all experts."""
    from colozoo.layers.moe import MoE, MoESpec
    from colozoo.layers.shard import shard_tensor, spec_of
    from colozoo.core.mesh import coords_of, init_parallel

    parallel = init_parallel(ep=2)
    torch.manual_seed(0)
    full = MoE(MoESpec(HIDDEN, INNER, EXPERTS, TOP_K, capacity_factor=factor))
    with torch.no_grad():
        full.gate.weight.normal_(std=1.0)  # skewed routing, so capacity bites
    moe = MoE(MoESpec(HIDDEN, INNER, EXPERTS, TOP_K, capacity_factor=factor), ep_group=parallel.group("ep"))
    weights = dict(full.named_parameters())
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.copy_(shard_tensor(weights[name], spec_of(p), coords_of(parallel)))
    x = torch.randn(2, 12, HIDDEN, generator=torch.Generator().manual_seed(10 + parallel.rank("dp")))
    out, _ = moe(x)
    close(out, _reference_with_capacity(full, x, factor), ATOL, f"MoE output at capacity factor {factor}")
    return (out - _reference_with_capacity(full, x, factor)).abs().max().item()


@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_capacity_factor_under_expert_parallelism(factor):
    assert max(run_distributed(_capacity_under_expert_parallelism, 2, factor=factor, timeout=90)) < ATOL
