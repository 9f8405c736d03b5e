"""The distributed training step (forward_backward + global-norm clipping + AdamW) at several (dp, pp, tp)
meshes against transformers' GPT-2 trained the same way on one process: loss, gradient norm and every updated
parameter, gathered over tp and FSDP's dp shards and compared stage by stage."""
from unittest import mock

import pytest
import torch

from distributed import run_distributed
from parity import (batch, check_recomputation, check_sequence_sharding, close, hf_causal_lm, layer_input_lengths,
                    matmul_dtypes, weight_calls)

from colozoo.checkpoint.load import load_hf_weights
from colozoo.checkpoint.readers import GlobalTensor, StateDictReader
from colozoo.converters import family_module
from colozoo.layers.shard import gather_tensor, spec_of
from colozoo.api import build_model
from colozoo.core.mesh import coords_of, init_parallel, single_process
from colozoo.core.partition import rank_layers
from colozoo.core.rng import model_parallel_seed
from colozoo.runtime import parallelize as parallelize_module, run as run_module
from colozoo.runtime.parallelize import sync_tied_embedding, tied_embedding
from colozoo.runtime.training import TrainingError, build_optimizer, clip_grad_norm_, parallelize

CONFIG = dict(vocab_size=101, n_positions=32, n_embd=64, n_layer=4, n_head=4,
              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
LR, EPS, MAX_NORM, SEQ, BATCH = 1e-3, 1e-6, 0.5, 12, 4  # Adam's eps: its step is ~sign(g) for |g| >> eps
LOSS_ATOL, NORM_RTOL, GRAD_ATOL, PARAM_ATOL = 1e-5, 1e-5, 1e-6, 2e-6
TIMEOUT = 150


def build(mesh, config, hf, virtual_stages=1, **parallelize_options):
    """This rank's shard of `hf` on `mesh` (a ParallelContext), in train mode, wrapped by
    parallelize(model, **parallelize_options)."""
    layer_ids = rank_layers(config.num_hidden_layers, mesh.config.pp, mesh.rank("pp"), virtual_stages)
    model = build_model(config, parallel=mesh, layer_ids=layer_ids, device="meta")
    load_hf_weights(model, StateDictReader(hf.state_dict()), device="cpu")
    model.train()
    parallelize(model, **parallelize_options)
    return model


def full_parameter(model, t, shape, spec=None):
    local = t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP: gather the dp shards first
    return gather_tensor(local.detach(), spec, shape, model.parallel.groups, coords_of(model.parallel))


def train_against_hf(dp, pp, tp, steps=1, microbatches=2, schedule="1f1b", virtual_stages=1, sp=False,
                     options=None):
    """Runs on every rank; returns the worst differences seen and the parameter names this rank checked."""
    parallel = init_parallel(tp=tp, pp=pp, dp=dp, sequence_parallel=sp) if dp * pp * tp > 1 else single_process()
    config, hf = hf_causal_lm("gpt2", CONFIG)
    hf.train()
    model = build(parallel, config, hf, virtual_stages, **(options or {}))
    optimizer = build_optimizer(model, lr=LR, eps=EPS)
    hf_optimizer = torch.optim.AdamW(hf.parameters(), lr=LR, eps=EPS)
    sources = family_module("gpt2").hf_sources(config)
    ids, mask, labels = batch(config.vocab_size, SEQ, batch_size=BATCH)

    worst = {"loss": 0.0, "norm": 0.0, "grad": 0.0, "param": 0.0}
    losses = []
    for step in range(steps):
        with layer_input_lengths(model) as lengths, weight_calls(model) as calls:
            loss = model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=microbatches,
                                          schedule=schedule)
        check_sequence_sharding(lengths, ids.shape[1], tp, sp)
        check_recomputation(calls, model, (options or {}).get("activation_checkpointing"), microbatches)
        norm = clip_grad_norm_(model, MAX_NORM)
        ref = hf(ids, attention_mask=mask, labels=labels).loss
        ref.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), MAX_NORM)
        if step == 0:
            worst["grad"] = compare(model, StateDictReader({n: p.grad for n, p in hf.named_parameters()}),
                                    sources, GRAD_ATOL, "clipped gradient of", grad=True)
        optimizer.step()
        optimizer.zero_grad()
        hf_optimizer.step()
        hf_optimizer.zero_grad()
        losses.append((loss.item(), ref.item()))
        worst["loss"] = max(worst["loss"], abs(loss.item() - ref.item()))
        worst["norm"] = max(worst["norm"], abs(norm.item() / ref_norm.item() - 1))

    worst["param"] = compare(model, StateDictReader(hf.state_dict()), sources, PARAM_ATOL,
                             f"after {steps} step(s), parameter")
    close([ours for ours, _ in losses], [theirs for _, theirs in losses], LOSS_ATOL, f"loss curve {losses}")
    assert worst["norm"] < NORM_RTOL, f"gradient norm differs by a factor {worst['norm']}"
    return dict(worst, names=[n for n, _ in model.named_parameters()], losses=losses,
                tied_equal=tied_copies_equal(model))


def compare(model, reference, sources, atol, what, grad=False):
    worst = 0.0
    for name, p in model.named_parameters():
        expected = GlobalTensor(reference, sources[name], name).read()
        actual = full_parameter(model, p.grad if grad else p, expected.shape, spec_of(p))
        close(actual, expected, atol, f"{what} {name} (pp rank {model.parallel.rank('pp')})")
        diff = (actual - expected).abs().max().item()
        worst = max(worst, diff)
    return worst


def tied_copies_equal(model):
    """On the first and last stage: is this rank's tied embedding bitwise equal to its partner's?"""
    tied = tied_embedding(model)
    if tied is None or not (model.is_first or model.is_last):
        return None
    p = dict(model.named_parameters())[tied[0]]
    mine = (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
    theirs = mine.clone()
    src = torch.distributed.get_global_rank(model.parallel.group("pp"), 0)
    torch.distributed.broadcast(theirs, src=src, group=tied[1])
    return torch.equal(mine, theirs)


def check_all_names(results, n_layer=CONFIG["n_layer"]):
    names = set().union(*(r["names"] for r in results))
    expected = {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"}
    expected |= {f"layers.{i}.{m}.{w}" for i in range(n_layer)
                 for m in ("ln_1", "ln_2", "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj") for w in ("weight", "bias")}
    assert names == expected, names ^ expected


@pytest.mark.parametrize("dp,pp,tp,microbatches", [(1, 2, 1, 2), (1, 2, 2, 2), (2, 2, 1, 2), (2, 1, 2, 2), (1, 4, 1, 4)])
def test_one_step_matches_single_process(dp, pp, tp, microbatches):
    results = run_distributed(train_against_hf, dp * pp * tp, dp=dp, pp=pp, tp=tp, steps=1, microbatches=microbatches,
                              timeout=TIMEOUT)
    check_all_names(results)
    assert {r["tied_equal"] for r in results} <= {None, True}


def tied_copies_through_build_and_step():
    """Each stage draws other initial values: the copies of the tied embedding are made equal once, at build, and
    stay equal through parallelize and a training step."""
    parallel = init_parallel(pp=2)
    config = hf_causal_lm("gpt2", CONFIG)[0]
    torch.manual_seed(parallel.rank("pp"))
    syncs = []
    count = lambda model: syncs.append(sync_tied_embedding(model))  # noqa: E731
    with mock.patch.object(run_module, "sync_tied_embedding", count), \
            mock.patch.object(parallelize_module, "sync_tied_embedding", count):
        model = build_model(config, parallel=parallel, layer_ids=rank_layers(config.num_hidden_layers, 2,
                                                                             parallel.rank("pp")))
        built = tied_copies_equal(model)
        parallelize(model)
    ids, mask, labels = batch(config.vocab_size, SEQ, batch_size=BATCH)
    optimizer = build_optimizer(model, lr=LR, eps=EPS)
    model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=2)
    optimizer.step()
    return len(syncs), built, tied_copies_equal(model)


def test_tied_embedding_synced_once_and_equal_after_a_step():
    assert run_distributed(tied_copies_through_build_and_step, 2, timeout=TIMEOUT) == [(1, True, True)] * 2


def test_single_process_training_step():
    check_all_names([train_against_hf(1, 1, 1, steps=2, microbatches=2)])


def test_loss_curve_pp2_tp2_sequence_parallel():
    results = run_distributed(train_against_hf, 4, dp=1, pp=2, tp=2, steps=3, microbatches=2, schedule="gpipe",
                              virtual_stages=1, sp=True, timeout=TIMEOUT)
    assert all(r["tied_equal"] in (None, True) for r in results)
    curve = results[0]["losses"]
    assert curve[-1][0] < curve[0][0]  # it trains


def test_loss_curve_ddp_dp2_pp2():
    results = run_distributed(train_against_hf, 4, dp=2, pp=2, tp=1, steps=3, microbatches=2, schedule="1f1b",
                              virtual_stages=1, sp=False, options=dict(data_parallel="ddp"),
                              timeout=TIMEOUT)
    assert all(r["tied_equal"] in (None, True) for r in results)


def test_ddp_with_tensor_parallel_matches_single_process():
    results = run_distributed(train_against_hf, 4, dp=2, pp=1, tp=2, steps=1, microbatches=2, schedule="1f1b",
                              virtual_stages=1, sp=False, options=dict(data_parallel="ddp"),
                              timeout=TIMEOUT)
    check_all_names(results)


@pytest.mark.parametrize("schedule,tp", [("interleaved_1f1b", 1), ("zero_bubble", 2)])
def test_virtual_stages_match_single_process(schedule, tp):
    results = run_distributed(train_against_hf, 2 * tp, dp=1, pp=2, tp=tp, steps=1, microbatches=2, schedule=schedule,
                              virtual_stages=2, timeout=TIMEOUT)
    check_all_names(results)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_matches_single_process(mode):
    options = dict(activation_checkpointing=mode)
    run_distributed(train_against_hf, 4, dp=2, pp=1, tp=2, steps=1, microbatches=2, schedule="1f1b", virtual_stages=1,
                    sp=True, options=options, timeout=TIMEOUT)


def full_model_gradients(model, config, hf):
    """Every parameter's gradient of the whole model, gathered over tp and the pipeline stages, on every rank."""
    reader, sources = StateDictReader(hf.state_dict()), family_module("gpt2").hf_sources(config)
    mine = {name: full_parameter(model, p.grad, GlobalTensor(reader, sources[name], name).shape, spec_of(p))
            for name, p in model.named_parameters()}
    every_stage = [None] * model.parallel.config.pp
    torch.distributed.all_gather_object(every_stage, mine, group=model.parallel.group("pp"))
    full = {}
    for grads in every_stage:
        for name, g in grads.items():
            if name in full:  # the tied embedding: both copies hold the summed gradient
                torch.testing.assert_close(g, full[name], rtol=0, atol=0, msg=name)
            full[name] = g
    return full


def schedules_agree(schedules, virtual_stages, tp=1, sp=False):
    """Loss and the whole model's gradients of one forward_backward per schedule, compared with the first
    schedule's (virtual stages place other layers on a rank, so only the gathered gradients compare)."""
    parallel = init_parallel(pp=2, tp=tp, sequence_parallel=sp)
    config, hf = hf_causal_lm("gpt2", CONFIG)
    ids, mask, labels = batch(config.vocab_size, SEQ, batch_size=BATCH)
    first = None
    for schedule in schedules:
        multi = schedule in ("interleaved_1f1b", "zero_bubble")
        model = build(parallel, config, hf, virtual_stages if multi else 1)
        loss = model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=4, schedule=schedule)
        grads = full_model_gradients(model, config, hf)
        check_all_names([dict(names=grads)])
        if first is None:
            first = schedule, loss, grads
            continue
        close(loss, first[1], 1e-6, f"loss of {schedule} vs {first[0]}")
        for name, g in grads.items():
            close(g, first[2][name], 1e-6, f"{schedule} vs {first[0]}: {name}")
    return True


def test_schedules_give_identical_results():
    assert all(run_distributed(schedules_agree, 2, schedules=["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"],
                               virtual_stages=2,
                               timeout=TIMEOUT))


def test_zero_bubble_with_tensor_parallel():
    assert all(run_distributed(schedules_agree, 4, schedules=["1f1b", "zero_bubble"], virtual_stages=2, tp=2, sp=True,
                               timeout=TIMEOUT))


def indivisible_batch():
    parallel = init_parallel(pp=2)
    config, hf = hf_causal_lm("gpt2", CONFIG)
    model = build(parallel, config, hf)
    ids, mask, labels = batch(config.vocab_size, SEQ, batch_size=3)
    with pytest.raises(TrainingError, match="not divisible by dp \\* num_microbatches"):
        model.forward_backward(ids, labels, num_microbatches=2)
    return True


def test_indivisible_batch_is_a_clear_error():
    assert all(run_distributed(indivisible_batch, 2, timeout=TIMEOUT))


def mixed_precision_step(dp, pp, tp):
    """bf16 compute (FSDP2's policy when dp > 1, autocast otherwise) over fp32 master weights."""
    parallel = init_parallel(tp=tp, pp=pp, dp=dp)
    config, hf = hf_causal_lm("gpt2", CONFIG)
    model = build(parallel, config, hf, mixed_precision="bf16")
    ids, mask, labels = batch(config.vocab_size, SEQ, batch_size=BATCH)
    with matmul_dtypes(model) as dtypes:
        loss = model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=2)
    assert dtypes == {torch.bfloat16}, f"the projections computed in {dtypes}, not bf16"
    ref = hf(ids, attention_mask=mask, labels=labels).loss
    ref.backward()
    assert abs(loss.item() - ref.item()) < 2e-2, (loss.item(), ref.item())
    norm = clip_grad_norm_(model, MAX_NORM)
    ref_norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), MAX_NORM)
    assert abs(norm.item() / ref_norm.item() - 1) < 5e-2, (norm.item(), ref_norm.item())
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, (name, p.dtype, p.grad.dtype)
    build_optimizer(model, lr=LR).step()
    return tied_copies_equal(model)


@pytest.mark.parametrize("dp,pp,tp", [(2, 2, 1), (1, 2, 2)])
def test_bf16_mixed_precision(dp, pp, tp):
    assert {r for r in run_distributed(mixed_precision_step, 4, dp=dp, pp=pp, tp=tp, timeout=TIMEOUT)} <= {None, True}


def saved_tensor_count(mode):
    config, hf = hf_causal_lm("gpt2", CONFIG)
    model = build(single_process(), config, hf, activation_checkpointing=mode)
    ids, mask, labels = batch(config.vocab_size, SEQ, batch_size=BATCH)
    count = [0]

    def pack(t):
        count[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.forward_backward(ids, labels, attention_mask=mask)
    return count[0]


def test_activation_checkpointing_saves_fewer_tensors():
    # tensors saved inside a checkpointed region go to the checkpoint's own hooks, not the outer ones
    none, selective, full = (saved_tensor_count(mode) for mode in (None, "selective", "full"))
    assert full < selective < none, (none, selective, full)


def test_bad_options_are_clear_errors():
    config, hf = hf_causal_lm("gpt2", CONFIG)
    for bad, match in [(dict(data_parallel="zero3"), "data_parallel"), (dict(mixed_precision="fp8"), "mixed_precision"),
                       (dict(activation_checkpointing="some"), "activation_checkpointing")]:
        with pytest.raises(TrainingError, match=match):
            build(single_process(), config, hf, **bad)
    model = build(single_process(), config, hf)
    ids, mask, labels = batch(config.vocab_size, SEQ, batch_size=BATCH)
    with pytest.raises(TrainingError, match="num_microbatches"):
        model.forward_backward(ids, labels, num_microbatches=0)
    with pytest.raises(TrainingError, match="labels must have the batch size"):
        model.forward_backward(ids, labels[:3])
    with pytest.raises(TrainingError, match="token_type_ids must have the batch size"):
        model.forward_backward(ids, labels, token_type_ids=ids[:3])


def dropout_gradients(mode, tp):
    """Gradients of one step with dropout everywhere, on seeded default and tensor-parallel generators."""
    parallel = init_parallel(tp=tp, sequence_parallel=True) if tp > 1 else single_process()
    config, hf = hf_causal_lm("gpt2", {**CONFIG, "resid_pdrop": 0.3, "embd_pdrop": 0.3, "attn_pdrop": 0.3})
    model = build(parallel, config, hf, activation_checkpointing=mode)
    ids, mask, labels = batch(config.vocab_size, SEQ, batch_size=BATCH)
    model_parallel_seed(1234, parallel)
    with weight_calls(model) as calls:
        loss = model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=2)
    check_recomputation(calls, model, mode, microbatches=2)
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def checkpointing_keeps_dropout_masks(tp):
    loss, grads = dropout_gradients(None, tp)
    for mode in ("full", "selective"):
        loss_ckpt, grads_ckpt = dropout_gradients(mode, tp)
        assert loss_ckpt == loss, (mode, loss_ckpt, loss)
        for name, g in grads.items():
            close(grads_ckpt[name], g, 1e-6, f"{mode}: {name}")
    return True


def test_checkpointing_recomputes_the_same_dropout_masks():
    assert checkpointing_keeps_dropout_masks(1)
    assert all(run_distributed(checkpointing_keeps_dropout_masks, 2, tp=2, timeout=2 * TIMEOUT))


def test_an_all_masked_batch_is_nan_as_in_transformers_and_weighs_nothing_within_a_step():
    """Labels all -100: the forward's loss is NaN with zero gradients, as transformers' (with and without
    num_items_in_batch), never a perfect 0.0; forward_backward of such a global batch returns NaN and leaves zero
    gradients; a micro-batch without labels beside one with labels weighs nothing (the loss is transformers' mean
    over the batch's labelled tokens, not NaN)."""
    config, hf = hf_causal_lm("gpt2", CONFIG)
    model = build(single_process(), config, hf)
    ids, mask, labels = batch(config.vocab_size, SEQ, batch_size=BATCH)
    masked = torch.full_like(labels, -100)
    theirs = [hf(ids, attention_mask=mask, labels=masked, **items).loss
              for items in ({}, {"num_items_in_batch": torch.tensor(0)})]
    ours = model(ids, attention_mask=mask, labels=masked).loss
    ours.backward()
    assert all(loss.isnan() for loss in [ours, *theirs])
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    assert model.forward_backward(ids, masked, attention_mask=mask, num_microbatches=2).isnan()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    half = labels.clone()
    half[: BATCH // 2] = -100  # the first of two micro-batches has no label
    loss = model.forward_backward(ids, half, attention_mask=mask, num_microbatches=2)
    close(loss, hf(ids, attention_mask=mask, labels=half).loss, LOSS_ATOL, "half-masked batch")


def test_optimizer_runs_the_fused_kernel_unless_told_otherwise():
    """build_optimizer's AdamW takes one fused pass over its states where the device has the kernel (the cost model
    prices it so: colozoo.cost.software.COLOZOO); its step is torch's single-tensor AdamW's to rounding."""
    config, hf = hf_causal_lm("gpt2", CONFIG)
    models = [build(single_process(), config, hf) for _ in range(2)]
    ids, _, labels = batch(config.vocab_size, SEQ, padded=False, batch_size=BATCH)
    optimizers = [build_optimizer(models[0], lr=LR, eps=EPS),
                  build_optimizer(models[1], lr=LR, eps=EPS, foreach=False)]
    assert optimizers[0].defaults["fused"] and not optimizers[1].defaults["fused"]
    assert not build_optimizer(models[1], lr=LR, foreach=True).defaults["fused"]  # the caller's choice stands
    for model, optimizer in zip(models, optimizers):
        model.forward_backward(ids, labels)
        optimizer.step()
    for (name, fused), (_, single) in zip(models[0].named_parameters(), models[1].named_parameters()):
        torch.testing.assert_close(fused, single, rtol=1e-6, atol=1e-7, msg=name)
