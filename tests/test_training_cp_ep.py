"""The training step (forward_backward + global-norm clipping + AdamW) with context parallelism (GPT-2) and expert
parallelism (Mixtral with its router aux loss), alone and with dp / tp, under FSDP2 and DDP, against transformers
trained the same way on one process: loss, gradient norm, every clipped gradient and every updated parameter."""
import pytest
import torch

from distributed import run_distributed
from parity import RTOL, batch, hf_causal_lm

from colozoo.checkpoint.load import load_hf_weights
from colozoo.checkpoint.readers import GlobalTensor, StateDictReader
from colozoo.converters import family_module
from colozoo.layers.shard import gather_tensor, materialize, shard_tensor, spec_of
from colozoo.api import build_model
from colozoo.core.mesh import coords_of, init_parallel, single_process
from colozoo.runtime.training import TrainingError, build_optimizer, clip_grad_norm_, parallelize

GPT2 = dict(vocab_size=101, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0)
MIXTRAL = dict(vocab_size=101, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
               output_router_logits=True, router_aux_loss_coef=0.05)
# layer 0 sparse with a gated shared expert and un-normalised top-k weights, layer 1 dense
QWEN2_MOE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1], max_position_embeddings=64,
                 output_router_logits=True, router_aux_loss_coef=0.05)
CONFIGS = {"gpt2": GPT2, "mixtral": MIXTRAL, "qwen2_moe": QWEN2_MOE}
LR, EPS, MAX_NORM, SEQ, BATCH = 1e-3, 1e-6, 0.5, 12, 4  # Adam's eps: its step is ~sign(g) for |g| >> eps
LOSS_ATOL, NORM_RTOL, GRAD_ATOL, PARAM_ATOL = 1e-5, 1e-5, 1e-6, 2e-6
TIMEOUT = 150


def hf_module_sources(family, config, reader=None):
    """Our names -> the in-memory transformers parameter names (Mixtral's experts are stacked there; GPT-NeoX's
    embed_out is lm_head in memory, which the converter's NAME_ALIASES resolve against `reader`)."""
    from colozoo.checkpoint.load import resolve_sources

    conv = family_module(family)
    sources = getattr(conv, "module_sources", conv.hf_sources)(config)
    if reader is not None and getattr(conv, "NAME_ALIASES", ()):
        sources = resolve_sources(reader, conv, sources)
    return sources


def build(parallel, family, config, hf, options):
    model = build_model(config, parallel=parallel, device="meta")
    if family == "gpt2":
        load_hf_weights(model, StateDictReader(hf.state_dict()), device="cpu")
    else:  # from transformers' modules (stacked experts), not a checkpoint's per-expert tensors
        materialize(model, "cpu")
        model.reset_buffers()
        reader = StateDictReader(hf.state_dict())
        sources = hf_module_sources(family, config, reader)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(shard_tensor(GlobalTensor(reader, sources[name], name).read(), spec_of(p), coords_of(parallel)))
    model.train()
    options.pop("cp_mode", None)  # an argument of each step (step_against_hf's)
    parallelize(model, **options)
    return model


def compare(model, reference, sources, atol, what, grad=False):
    """Every local gradient/parameter gathered (over FSDP's shards, then tp/ep) equals transformers'."""
    diffs, bad = {}, {}
    for name, p in model.named_parameters():
        if grad and not p.requires_grad:  # a frozen parameter (DeepSeek-V3's routing bias) has no gradient
            assert p.grad is None, name
            continue
        expected = GlobalTensor(reference, sources[name], name).read()
        local = p.grad if grad else p
        local = local.full_tensor() if hasattr(local, "full_tensor") else local
        full = gather_tensor(local.detach(), spec_of(p), expected.shape, model.parallel.groups,
                             coords_of(model.parallel))
        diffs[name] = (full - expected).abs().max().item()
        if not torch.allclose(full, expected, rtol=RTOL[expected.dtype], atol=atol):
            bad[name] = diffs[name]
    assert not bad, f"{what}: differences over atol {atol} + rtol: {bad}"
    return max(diffs.values())


def step_against_hf(family, dp=1, cp=1, ep=1, tp=1, microbatches=1, options=None, steps=1, pp=1, param_atol=PARAM_ATOL):
    """Runs on every rank: `steps` training steps of ours and of transformers' model; returns the worst differences."""
    distributed = dp * cp * tp * pp > 1
    parallel = init_parallel(tp=tp, dp=dp, cp=cp, ep=ep, pp=pp) if distributed else single_process()
    config, hf = hf_causal_lm(family, CONFIGS[family])
    hf.train()
    model = build(parallel, family, config, hf, dict(options or {}))
    optimizer = build_optimizer(model, lr=LR, eps=EPS)
    hf_optimizer = torch.optim.AdamW(hf.parameters(), lr=LR, eps=EPS)
    sources = hf_module_sources(family, config, StateDictReader(hf.state_dict()))
    ids, mask, labels = batch(config.vocab_size, SEQ, batch_size=BATCH)

    worst = {"loss": 0.0, "norm": 0.0, "grad": 0.0}  # norm: relative
    for step in range(steps):
        loss = model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=microbatches,
                                      cp_mode=(options or {}).get("cp_mode", "ring"))
        norm = clip_grad_norm_(model, MAX_NORM)
        ref = hf(ids, attention_mask=mask, labels=labels).loss  # Mixtral: with the aux loss of the whole batch
        ref.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), MAX_NORM)
        assert ref_norm > MAX_NORM  # clipping is exercised
        worst["loss"] = max(worst["loss"], abs(loss.item() - ref.item()))
        worst["norm"] = max(worst["norm"], abs(norm.item() / ref_norm.item() - 1))
        assert worst["loss"] < LOSS_ATOL, f"step {step}: loss {loss.item()}, transformers' {ref.item()}"
        assert worst["norm"] < NORM_RTOL, f"step {step}: gradient norm {norm.item()}, transformers' {ref_norm.item()}"
        if step == 0:
            worst["grad"] = compare(model, StateDictReader({n: p.grad for n, p in hf.named_parameters()}), sources,
                                    GRAD_ATOL, "clipped gradient of", grad=True)
        for opt in (optimizer, hf_optimizer):
            opt.step()
            opt.zero_grad()
    worst["param"] = compare(model, StateDictReader(hf.state_dict()), sources, param_atol,
                             f"after {steps} step(s), parameter")
    return worst


@pytest.mark.parametrize("dp,cp,tp,microbatches,options", [
    (2, 2, 1, 2, {}),                                           # FSDP over dp x cp
    (1, 2, 2, 1, dict(data_parallel="ddp")),                    # DDP over the cp ranks, tp inside
    (1, 2, 2, 2, dict(cp_mode="all_to_all")),                   # Ulysses attention, FSDP over cp only
])
def test_context_parallel_step_matches_single_process(dp, cp, tp, microbatches, options):
    run_distributed(step_against_hf, dp * cp * tp, family="gpt2", dp=dp, cp=cp, ep=1, tp=tp, microbatches=microbatches,
                    options=options, timeout=TIMEOUT)


@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
def test_context_parallel_on_pipeline_stages_step_matches_single_process(mode):
    # cp=2 x pp=2: every stage shards its micro-batch's sequence; the tied embedding spans the stages
    options = dict(cp_mode=mode) if mode == "all_to_all" else {}
    run_distributed(step_against_hf, 4, family="gpt2", dp=1, cp=2, ep=1, tp=1, microbatches=2, options=options,
                    steps=1, pp=2, timeout=TIMEOUT)


@pytest.mark.parametrize("family,dp,cp,ep,tp,options", [
    ("mixtral", 2, 1, 2, 1, {}),              # experts on every data rank: each expert's FSDP group is one rank
    ("mixtral", 4, 1, 2, 1, {}),              # experts FSDP-sharded over 2 ranks holding the same experts
    ("mixtral", 2, 1, 2, 2, dict(data_parallel="ddp")),
    ("mixtral", 2, 2, 2, 1, dict(data_parallel="ddp")),  # ep folded over dp x cp; experts reduced over edp by hand
    ("qwen2_moe", 4, 1, 2, 1, {}),            # shared expert and a dense layer beside the experts
])
def test_expert_parallel_step_matches_single_process(family, dp, cp, ep, tp, options):
    run_distributed(step_against_hf, dp * cp * tp, family=family, dp=dp, cp=cp, ep=ep, tp=tp, microbatches=1,
                    options=options, timeout=TIMEOUT)


def test_two_steps_of_mixtral_with_fsdp_over_dp_and_cp():
    run_distributed(step_against_hf, 4, family="mixtral", dp=2, cp=2, ep=2, tp=1, microbatches=1, options={}, steps=2,
                    timeout=TIMEOUT)


def bad_sequence_length(mesh: dict, seq: int, multiple: int):
    parallel = init_parallel(**mesh)
    config, hf = hf_causal_lm("gpt2", GPT2)
    model = build(parallel, "gpt2", config, hf, {})
    ids, mask, labels = batch(config.vocab_size, seq, batch_size=2)
    with pytest.raises(TrainingError, match=f"sequence length {seq} is not a multiple of {multiple}"):
        model.forward_backward(ids, labels, attention_mask=mask)
    return True


@pytest.mark.parametrize("mesh, seq, multiple", [
    (dict(cp=2), 10, 4),                              # 2 x cp zigzag chunks
    (dict(tp=2, sequence_parallel=True), 9, 2),       # the sequence over the tp ranks
])
def test_sequence_the_mesh_cannot_split_is_a_clear_error(mesh, seq, multiple):
    assert all(run_distributed(bad_sequence_length, 2, mesh=mesh, seq=seq, multiple=multiple, timeout=TIMEOUT))


def test_router_loss_counts_once_per_micro_batch():
    """With micro-batches the router loss is that of each micro-batch, weighted 1/num_microbatches, while the token
    loss stays the mean over the whole batch: transformers' per-micro-batch outputs recombined that way."""
    config, hf = hf_causal_lm("mixtral", MIXTRAL)
    hf.train()
    model = build(single_process(), "mixtral", config, hf, {})
    ids, mask, labels = batch(config.vocab_size, SEQ, batch_size=BATCH)
    loss = model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=2)
    total_tokens = (labels[:, 1:] != -100).sum()
    ref = 0.0
    for rows in (slice(0, 2), slice(2, 4)):
        out = hf(ids[rows], attention_mask=mask[rows], labels=labels[rows])
        router = config.router_aux_loss_coef * out.aux_loss
        ref = ref + (out.loss - router) * (labels[rows, 1:] != -100).sum() / total_tokens + router / 2
    ref.backward()
    assert abs(loss.item() - ref.item()) < LOSS_ATOL, (loss.item(), ref.item())
    compare(model, StateDictReader({n: p.grad for n, p in hf.named_parameters()}),
            hf_module_sources("mixtral", config), GRAD_ATOL, "gradient of", grad=True)
