"""One forward path, no hidden modes: whatever ran before (generate, forward_backward, parallelize), a training forward
gives the gradients a fresh model gives; gradients follow the caller; nothing a call computes is kept on the model or
its run. Under pipeline parallelism a forward with labels under gradients is refused with the way to train."""
import pytest
import torch

from distributed import run_distributed
from family_parity import load, reference
from parity import batch, close

FAMILIES = ("gpt2", "llama", "mixtral")  # their declared configs (Mixtral's with the router losses on)
TIMEOUT = 180


def _fresh(family, parallel=None):
    from colozoo.core.mesh import init_parallel

    config, hf = reference(family)
    return config, load(hf, config, parallel or init_parallel())[0]


def _training_grads(model, ids, labels) -> dict:
    model.zero_grad(set_to_none=True)
    model.train()
    out = model(ids, labels=labels)
    assert out.logits is None  # training with labels: the head is fused with the loss
    out.loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _after(what, family, tp=1):
    from colozoo.core.mesh import init_parallel
    from colozoo.runtime.training import parallelize

    parallel = init_parallel(tp=tp)
    config, fresh = _fresh(family, parallel)
    ids, mask, labels = batch(config.vocab_size, 12, batch_size=4)
    expected = _training_grads(fresh, ids, labels)
    _, model = _fresh(family, parallel)
    if what == "generate":
        model.eval().generate(ids[:, :6], max_new_tokens=3, pad_token_id=0)
    elif what == "forward_backward":
        model.train().forward_backward(ids, labels, attention_mask=mask, num_microbatches=2)
    elif what == "parallelize":
        parallelize(model, data_parallel="ddp")
    grads = _training_grads(model, ids, labels)
    assert grads.keys() == expected.keys() and len(grads) == len(list(model.parameters()))
    for name, grad in grads.items():
        close(grad, expected[name], 1e-6, f"{name}'s gradient after {what}")
    return True


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("what", ["generate", "forward_backward", "parallelize"])
def test_a_training_forward_after_any_call_gives_a_fresh_models_gradients(what, family):
    assert _after(what, family)


def test_the_same_at_tp2():
    assert all(run_distributed(_after, 2, what="generate", family="llama", tp=2, timeout=TIMEOUT))
    assert all(run_distributed(_after, 2, what="forward_backward", family="llama", tp=2, timeout=TIMEOUT))


def test_gradients_follow_the_caller():
    config, model = _fresh("llama")
    ids, _, labels = batch(config.vocab_size, 8)
    model.eval()
    out = model(ids, labels=labels)
    assert out.loss.requires_grad and out.logits.requires_grad  # eval mode: logits too, with their graph
    with torch.no_grad():
        out = model(ids, labels=labels)
    assert not out.loss.requires_grad and not out.logits.requires_grad
    model.train()
    assert model(ids, labels=labels).loss.requires_grad and model(ids).logits.requires_grad


def test_calls_keep_nothing_on_the_run():
    config, model = _fresh("gpt2")
    ids, mask, labels = batch(config.vocab_size, 8, batch_size=2)
    kept = dict(vars(model.run))
    model.generate(ids[:, :4], max_new_tokens=2, pad_token_id=0)
    model(ids, labels=labels).loss.backward()
    assert vars(model.run) == kept
    assert not any(name.startswith("_built") or name == "cache" for name in vars(model))


def _pipeline_forwards():
    from colozoo.core.mesh import init_parallel

    config, model = _fresh("gpt2", init_parallel(pp=2))
    model.eval()
    ids, _, labels = batch(config.vocab_size, 8)
    with pytest.raises(RuntimeError, match="forward_backward"):
        model(ids, labels=labels)
    with torch.no_grad():
        evaluated = model(ids, labels=labels)
    plain = model(ids)  # no labels: logits, without a graph across the stages
    assert evaluated.loss is not None and plain.loss is None and not plain.logits.requires_grad
    close(plain.logits, evaluated.logits, 1e-6, "logits with and without labels")
    return True


def test_a_pipeline_refuses_a_training_forward_and_evaluates():
    assert all(run_distributed(_pipeline_forwards, 2, timeout=TIMEOUT))
