"""fp16 dynamic loss scaling (colozoo.runtime.amp): the scale's update rule; forward_backward's grad_scale scales every
gradient (router losses and pipeline schedules included) but not the returned loss; an overflow on one rank
skips the step on every rank; gradients that fp16 flushes to zero survive scaling; fine-tuning in fp16 trains
and resumes with its scale."""
import functools
import json

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed
from parity import batch, hf_causal_lm, matmul_dtypes
from test_finetune import losses, small_run, tiny  # noqa: F401 (tiny is a fixture)
from test_training import build as gpt2
from test_training_cp_ep import MIXTRAL, build as build_from_hf

from colozoo.runtime.amp import DynamicLossScaler
from colozoo.finetune import loop, state
from colozoo.finetune.loop import finetune
from colozoo.finetune.metrics import read_metrics
from colozoo.layers.shard import local_part
from colozoo.core.mesh import init_parallel, single_process
from colozoo.runtime.training import build_optimizer, clip_grad_norm_

GPT2 = dict(vocab_size=101, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0)
SEQ, BATCH, TIMEOUT = 12, 4, 150


def test_scale_halves_on_overflow_and_doubles_after_growth_interval():
    default = DynamicLossScaler()
    assert (default.scale, default.growth_factor, default.backoff_factor, default.growth_interval) == \
        (2.0 ** 16, 2.0, 0.5, 2000)
    scaler = DynamicLossScaler(growth_interval=3)
    for _ in range(2):
        scaler.update(False)
    assert scaler.scale == 2.0 ** 16
    scaler.update(False)
    assert scaler.scale == 2.0 ** 17
    scaler.update(False)
    scaler.update(True)
    assert (scaler.scale, scaler.good_steps, scaler.skipped_steps) == (2.0 ** 16, 0, 1)
    for _ in range(2):
        scaler.update(False)
    assert scaler.scale == 2.0 ** 16  # the overflow restarted the count of good steps
    restored = DynamicLossScaler(growth_interval=3)
    restored.load_state_dict(scaler.state_dict())
    restored.update(False)
    assert restored.scale == 2.0 ** 17
    off = DynamicLossScaler(enabled=False)
    off.update(True)
    assert off.scale == 1.0 and not off.unscale_(torch.nn.Linear(2, 2))


def _gradients(config, hf, mixed_precision, scaler=None):
    model = gpt2(single_process(), config, hf, mixed_precision=mixed_precision)
    ids, mask, labels = batch(config.vocab_size, SEQ, batch_size=BATCH)
    model.forward_backward(ids, labels, attention_mask=mask, grad_scale=scaler.scale if scaler else 1.0)
    if scaler is not None:
        assert not scaler.unscale_(model)
    return {n: p.grad for n, p in model.named_parameters()}


def test_loss_scaling_keeps_gradients_that_fp16_flushes_to_zero():
    """Weights initialised with std 1e-3 give the layer norms gradients of ~1e-8, below fp16's smallest subnormal
    (6e-8): unscaled fp16 loses them entirely; scaled by 2**16 and unscaled in fp32 they match fp32 training."""
    config, hf = hf_causal_lm("gpt2", {**GPT2, "initializer_range": 1e-3})
    fp32 = _gradients(config, hf, None)
    fp16 = _gradients(config, hf, "fp16")
    scaled = _gradients(config, hf, "fp16", DynamicLossScaler())
    norms = [n for n in fp32 if ".ln_" in n]
    assert len(norms) == 8 and all(fp32[n].norm() > 0 for n in norms)
    assert all(torch.count_nonzero(fp16[n]) == 0 for n in norms)
    for name, ref in fp32.items():
        assert (scaled[name] - ref).norm() <= 1e-2 * ref.norm(), name


def _local_parameters(model):
    return {n: local_part(p).detach().clone() for n, p in model.named_parameters()}


def overflow_on_one_rank(degrees, options):
    """Two fp16 steps on every rank; in the first, rank 1 alone finds an inf in one of its gradients."""
    config, hf = hf_causal_lm("gpt2", GPT2)
    model = gpt2(init_parallel(**degrees), config, hf, mixed_precision="fp16", **options)
    optimizer = build_optimizer(model, lr=1e-2)
    scaler = DynamicLossScaler()
    ids, mask, labels = batch(config.vocab_size, SEQ, batch_size=BATCH)

    def step(inject: bool) -> bool:
        optimizer.zero_grad()
        with matmul_dtypes(model) as dtypes:
            model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=2, grad_scale=scaler.scale)
        assert dtypes == {torch.float16}, f"the projections computed in {dtypes}, not fp16"
        if inject:
            grad = max((local_part(p.grad) for p in model.parameters() if p.grad is not None), key=torch.numel)
            grad.view(-1)[0] = float("inf")
        overflow = scaler.unscale_(model)
        if not overflow:
            clip_grad_norm_(model, 1.0)
            optimizer.step()
        scaler.update(overflow)
        return overflow

    before = _local_parameters(model)
    skipped = step(inject=dist.get_rank() == 1)
    after_skip, scale_after_skip = _local_parameters(model), scaler.scale
    stepped = not step(inject=False)
    after_step = _local_parameters(model)
    return dict(skipped=skipped, scale_after_skip=scale_after_skip, stepped=stepped, scale=scaler.scale,
                unchanged=all(torch.equal(before[n], after_skip[n]) for n in before),
                moved=any(not torch.equal(before[n], after_step[n]) for n in before),
                offloaded=type(optimizer).__name__ == "OffloadedAdamW")


@pytest.mark.parametrize("degrees,options", [
    (dict(pp=2), {}),
    (dict(tp=2), {}),
    (dict(dp=2), dict(data_parallel="fsdp", offload="optimizer")),
], ids=["pp2", "tp2", "dp2_fsdp_offloaded_adamw"])
def test_overflow_on_one_rank_skips_the_step_on_every_rank(degrees, options):
    results = run_distributed(overflow_on_one_rank, 2, degrees=degrees, options=options, timeout=TIMEOUT)
    for rank, r in enumerate(results):
        assert r["skipped"] and r["scale_after_skip"] == 2.0 ** 15 and r["unchanged"], (rank, r)
        assert r["stepped"] and r["moved"] and r["scale"] == 2.0 ** 15, (rank, r)  # the next clean step goes on
    assert results[0]["offloaded"] == ("offload" in options)


def scaled_backward_through_pipeline_with_router_losses():
    """Mixtral on pp=2 with its router aux loss: grad_scale multiplies every gradient, the loss stays as it was."""
    config, hf = hf_causal_lm("mixtral", MIXTRAL)
    model = build_from_hf(init_parallel(pp=2), "mixtral", config, hf, {})
    ids, mask, labels = batch(config.vocab_size, SEQ, batch_size=BATCH)
    runs = []
    for scale in (1.0, 2.0 ** 10):
        for p in model.parameters():
            p.grad = None
        loss = model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=2, grad_scale=scale)
        runs.append((loss.item(), {n: p.grad / scale for n, p in model.named_parameters()}))
    (loss, grads), (scaled_loss, unscaled) = runs
    without_router = model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=2,
                                            output_router_logits=False).item()
    worst = max(((unscaled[n] - g).abs().max() / g.abs().max().clamp(min=1e-30)).item() for n, g in grads.items())
    return loss, scaled_loss, worst, without_router


def test_grad_scale_scales_pipeline_and_router_gradients_but_not_the_loss():
    results = run_distributed(scaled_backward_through_pipeline_with_router_losses, 2, timeout=TIMEOUT)
    for loss, scaled_loss, worst, without_router in results:
        assert scaled_loss == loss
        assert worst < 1e-6
        assert loss > without_router  # the router losses of the micro-batches were in the step


# ------------------------------------------------------------------------------------------- fine-tuning


def test_float16_fine_tuning_scales_the_loss_and_trains(tiny, tmp_path):  # noqa: F811
    out = tmp_path / "fp16"
    finetune(small_run(tiny, out, dtype="float16", lr=5e-3, eval_fraction=0.0))
    records = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    curve = [r["loss"] for r in records]
    assert len(curve) == 6 and curve[-1] < curve[0]
    assert all(r["loss_scale"] == 2.0 ** 16 and r["skipped"] is False for r in records)
    reference = tmp_path / "fp32"
    finetune(small_run(tiny, reference, lr=5e-3, eval_fraction=0.0))
    assert "loss_scale" not in read_metrics(reference / "metrics.jsonl")[0]
    assert curve == pytest.approx(losses(reference), abs=2e-2)


def test_skipped_steps_and_resume_restore_the_loss_scale(tiny, tmp_path, monkeypatch):  # noqa: F811
    """A scale of 2**20 overflows this model's fp16 gradients: the first steps are skipped (the learning rate waits
    for them), the scale halves until it fits, then doubles after every good step. Resuming restores the scale:
    a run that forgot it would log other scales and losses."""
    monkeypatch.setattr(loop, "DynamicLossScaler",
                        functools.partial(DynamicLossScaler, init_scale=2.0 ** 20, growth_interval=1))
    options = dict(dtype="float16", eval_fraction=0.0)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    finetune(small_run(tiny, straight, **options))
    records = [r for r in read_metrics(straight / "metrics.jsonl") if "loss" in r]
    assert records[0]["skipped"] and records[0]["grad_norm"] is None and not all(r["skipped"] for r in records)
    assert all(b["lr"] == a["lr"] for a, b in zip(records, records[1:]) if a["skipped"])
    assert records[-1]["skipped_steps"] == sum(r["skipped"] for r in records)

    finetune(small_run(tiny, resumed, stop_after=3, **options))
    saved = json.loads((state.latest_checkpoint(resumed / "checkpoints") / "meta.json").read_text())
    assert saved["scaler"]["scale"] < 2.0 ** 20 and saved["scaler"]["skipped_steps"] >= 1
    finetune(small_run(tiny, resumed, **options))
    resumed_records = [r for r in read_metrics(resumed / "metrics.jsonl") if "loss" in r]

    def fields(rs):
        return [(r["loss"], r["loss_scale"], r["skipped"], r["skipped_steps"], r["lr"]) for r in rs]

    assert fields(resumed_records) == fields(records)
