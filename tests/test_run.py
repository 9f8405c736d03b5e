"""A model's Run: the one object that holds how a model runs on its mesh. Models know only their layers; the
run holds stages, schedule runners, the data-parallel setup and the plan, and per-step values are arguments."""
import pytest
import torch

from distributed import run_distributed
from parity import batch, hf_causal_lm

from colozoo.api import build_model
from colozoo.checkpoint.load import load_hf_weights
from colozoo.checkpoint.readers import StateDictReader
from colozoo.core.mesh import init_parallel, single_process
from colozoo.models import build_shard
from colozoo.runtime.run import Run
from colozoo.runtime.training import TrainingError, build_optimizer, parallelize

CONFIG = dict(vocab_size=101, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0)
TIMEOUT = 120


def loaded(parallel, hf, config):
    model = build_model(config, parallel=parallel, device="meta")
    load_hf_weights(model, StateDictReader(hf.state_dict()), device="cpu")
    return model.train()


def test_build_model_attaches_a_run_and_parallelize_fills_it():
    config, hf = hf_causal_lm("gpt2", CONFIG)
    model = loaded(single_process(), hf, config)
    assert isinstance(model.run, Run) and model.run.model is model and model.run.setup is None
    run = parallelize(model, activation_checkpointing="full")
    assert run is model.run and run.setup.data_parallel is None and len(run.stages) == 1
    with pytest.raises(TrainingError, match="already called"):
        parallelize(model)
    ids, mask, labels = batch(config.vocab_size, 8, batch_size=2)
    kept = dict(vars(model.run))
    model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=2)
    model.generate(ids[:, :4], max_new_tokens=2)
    model(ids, labels=labels)
    per_step = ("loss_scale", "grad_scale", "router_loss_scale", "router_losses")
    assert not any(hasattr(m, name) for m in model.modules() for name in per_step)  # arguments, not module state
    assert vars(model.run) == kept  # results are returned, never kept on the run


def test_a_model_without_a_run_refuses_what_needs_one():
    config, hf = hf_causal_lm("gpt2", CONFIG)
    model = build_shard(config, device="meta")
    assert model.run is None
    with pytest.raises(RuntimeError, match="has no Run"):
        model.forward_backward(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(RuntimeError, match="has no Run"):
        model.save_pretrained("/nonexistent")


def _optimizer_before_data_parallel(mode):
    """The habit: an optimizer over model.parameters(), then forward_backward on a dp=2 mesh. Data parallelism
    would replace the parameters the optimizer holds, so the step refuses instead of training nothing."""
    parallel = init_parallel(dp=2)
    config, hf = hf_causal_lm("gpt2", CONFIG)
    model = loaded(parallel, hf, config)
    ids, mask, labels = batch(config.vocab_size, 8, batch_size=4)
    if mode == "refused":
        torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(TrainingError, match="call colozoo.runtime.training.parallelize"):
            model.forward_backward(ids, labels, attention_mask=mask)
        with pytest.raises(TrainingError, match="call colozoo.runtime.training.parallelize"):
            build_optimizer(model)
        return True
    parallelize(model, data_parallel="ddp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    model.forward_backward(ids, labels, attention_mask=mask)
    optimizer.step()
    return sum(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters())) / len(before)


def test_an_optimizer_built_before_data_parallelism_is_refused_not_silently_useless():
    assert run_distributed(_optimizer_before_data_parallel, 2, mode="refused", timeout=TIMEOUT) == [True, True]
    changed = run_distributed(_optimizer_before_data_parallel, 2, mode="after", timeout=TIMEOUT)
    assert all(fraction == 1.0 for fraction in changed), changed  # built after parallelize: every weight moves


def _pipeline_needs_a_run():
    parallel = init_parallel(pp=2)
    config, _ = hf_causal_lm("gpt2", CONFIG)
    with pytest.raises(RuntimeError, match="has no Run"):
        build_shard(config, parallel=parallel, device="meta")(torch.zeros(1, 4, dtype=torch.long))
    return True


def test_a_pipeline_model_without_a_run_says_how_to_get_one():
    assert run_distributed(_pipeline_needs_a_run, 2, timeout=TIMEOUT) == [True, True]
