"""CPU offload wired into training (colozoo.runtime.offload through colozoo.runtime.training), and applying a planner's plan."""
import warnings
from dataclasses import replace

import pytest
import torch
from distributed import run_distributed
from parity import batch, hf_causal_lm

from colozoo.checkpoint.load import load_hf_weights
from colozoo.checkpoint.readers import StateDictReader
from colozoo.api import build_model
from colozoo.runtime.checkpointing import is_checkpointed
from colozoo.runtime.plan import Plan
from colozoo.runtime.offload import OffloadedAdamW
from colozoo.core.mesh import init_parallel, single_process
from colozoo.layers.shard import local_part
from colozoo.runtime.training import TrainingError, apply_plan, build_optimizer, clip_grad_norm_, parallelize

warnings.filterwarnings("ignore", category=FutureWarning)

CONFIG = dict(vocab_size=101, n_positions=32, n_embd=32, n_layer=2, n_head=4,
              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
SEQ, BATCH, STEPS, TIMEOUT = 8, 4, 2, 120


def build(parallel, hf, config):
    model = build_model(config, parallel=parallel, device="meta")
    load_hf_weights(model, StateDictReader(hf.state_dict()), device="cpu")
    return model.train()


def local(t):
    return local_part(t).detach().clone()


def train(model, optimizer, ids, labels, mask):
    losses = []
    for _ in range(STEPS):
        losses.append(model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=2).item())
        clip_grad_norm_(model, 0.5)  # offloaded gradients must be the clipped ones
        optimizer.step()
        if isinstance(optimizer, OffloadedAdamW):  # the CPU step used the final (reduced, clipped) gradients
            for p, buf in zip(optimizer.params, optimizer.grad_buffers):
                assert torch.equal(buf, local(p.grad).float())
        optimizer.zero_grad()
    return losses, {n: local(p) for n, p in model.named_parameters()}


def offloaded_step_matches(offload, data_parallel):
    """Two steps with `offload` equal two steps without it: same losses and updated local shards."""
    parallel = init_parallel(dp=2)
    config, hf = hf_causal_lm("gpt2", CONFIG)
    ids, mask, labels = batch(config.vocab_size, SEQ, batch_size=BATCH)
    results = []
    for level in (None, offload):
        model = build(parallel, hf, config)
        parallelize(model, data_parallel=data_parallel, offload=level)
        optimizer = build_optimizer(model, lr=1e-2, eps=1e-6)
        assert isinstance(optimizer, OffloadedAdamW) == (level == "optimizer")
        groups = [m._get_fsdp_state()._fsdp_param_group for m in model.run.stages[0].modules()
                  if hasattr(m, "_get_fsdp_state")]
        offloaded = {fp.offload_to_cpu for g in groups if g is not None for fp in g.fsdp_params}
        assert offloaded == ({level == "params"} if data_parallel == "fsdp" else set()), offloaded
        results.append(train(model, optimizer, ids, labels, mask))
    (ref_losses, ref), (losses, ours) = results
    assert losses == pytest.approx(ref_losses, rel=0, abs=1e-6), (losses, ref_losses)
    assert ours.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], rtol=0, atol=1e-6, msg=name)
    return losses


@pytest.mark.parametrize("data_parallel", ["fsdp", "ddp"])
def test_optimizer_offload_matches_on_device_adamw(data_parallel):
    losses = run_distributed(offloaded_step_matches, 2, offload="optimizer", data_parallel=data_parallel,
                             timeout=TIMEOUT)
    assert losses[0] == losses[1] and losses[0][1] < losses[0][0]  # the same on both ranks, and it trained


def test_params_offload_via_fsdp2_policy_matches():
    losses = run_distributed(offloaded_step_matches, 2, offload="params", data_parallel="fsdp", timeout=TIMEOUT)
    assert losses[0] == losses[1] and losses[0][1] < losses[0][0]


def test_offload_refused_where_it_cannot_apply():
    config, hf = hf_causal_lm("gpt2", CONFIG)
    with pytest.raises(TrainingError, match="offload='params' needs FSDP2"):
        parallelize(build(single_process(), hf, config), offload="params")  # one rank: nothing to shard
    with pytest.raises(TrainingError, match="offload must be one of"):
        parallelize(build(single_process(), hf, config), offload="disk")
    model = build(single_process(), hf, config)
    parallelize(model)
    with pytest.raises(TrainingError, match="needs parallelize"):
        build_optimizer(model, offload="params")
    assert isinstance(build_optimizer(model, offload="optimizer"), OffloadedAdamW)


def ddp_params_offload_refused():
    config, hf = hf_causal_lm("gpt2", CONFIG)
    with pytest.raises(TrainingError, match="data_parallel='ddp'"):
        parallelize(build(init_parallel(dp=2), hf, config), data_parallel="ddp", offload="params")
    return True


def test_params_offload_refused_under_ddp():
    assert all(run_distributed(ddp_params_offload_refused, 2, timeout=TIMEOUT))


def test_apply_plan_sets_checkpointing_offload_and_microbatching():
    config, hf = hf_causal_lm("gpt2", CONFIG)
    plan = Plan(tp=1, pp=1, dp=1, cp=1, ep=1, sequence_parallel=False, micro_batch_size=2, num_microbatches=2,
                schedule="1f1b", zero=0, checkpointing="full", checkpoint_layers=None, offload="optimizer")
    model = build(single_process(), hf, config)
    model.run.plan = plan  # as from_pretrained(plan="auto") leaves it
    step = apply_plan(model)
    assert step == {"num_microbatches": 2, "schedule": "1f1b"}
    setup = model.run.setup
    assert setup.offload == "optimizer" and isinstance(build_optimizer(model), OffloadedAdamW)
    assert all(is_checkpointed(layer) for layer in model.layers.values())  # checkpointed
    ids, mask, labels = batch(config.vocab_size, SEQ, batch_size=BATCH)
    ref_loss = hf(ids, attention_mask=mask, labels=labels).loss.item()
    assert model.forward_backward(ids, labels, attention_mask=mask, **step).item() == pytest.approx(ref_loss, abs=1e-5)
    partial = build(single_process(), hf, config)
    apply_plan(partial, replace(plan, checkpoint_layers=1))  # the planner's fewest layers that fit
    assert [is_checkpointed(layer) for layer in partial.layers.values()] == [True, False]
    with pytest.raises(TrainingError, match="differ from the model's mesh"):
        apply_plan(build(single_process(), hf, config), replace(plan, tp=2))
    with pytest.raises(TrainingError, match="needs a plan"):
        apply_plan(build(single_process(), hf, config))
