"""The memory model's peak of a training step against a real one. A unit holds at its worst op only what it has saved
so far (forward) or not yet released (backward) beside the temporaries alive then: the attention's scores come and go
before the MLP saves anything, and the MLP's backward releases what it saved before the attention's begins."""
import contextlib
import gc

import pytest
import torch
import transformers
from distributed import run_distributed
from live_bytes import LiveBytes

from colozoo.api import build_model
from colozoo.core.mesh import init_parallel
from colozoo.cost.cost_model import assemble
from colozoo.cost.model_trace import trace_model
from colozoo.cost.profiler import profile_for
from colozoo.cost.setup import Workload
from colozoo.cost.software import Software
from colozoo.kernels.dispatch import use_kernels
from colozoo.runtime.plan import Plan
from colozoo.runtime.training import parallelize


def gpt2(layers, width, heads, vocab=101, dropout=0.1):
    return transformers.AutoConfig.for_model("gpt2", vocab_size=vocab, n_positions=512, n_embd=width, n_layer=layers,
                                             n_head=heads, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)


@contextlib.contextmanager
def no_collector():
    """The cyclic collector frees what reference cycles hold whenever its counts say, at no fixed point of a step
    (in a worker reused from earlier tests, at another one each time): held to the end instead."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def real_peak(config, batch, seq, microbatches=1) -> int:
    """The most a real CPU step (forward + backward of each micro-batch) holds at once beyond the parameters:
    activations, temporaries and the gradients it makes."""
    torch.manual_seed(0)
    model = build_model(config, device="cpu").train()
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    with use_kernels("torch"), no_collector(), LiveBytes() as counted:
        for _ in range(microbatches):
            model(ids, labels=ids).loss.backward()
    return counted.peak


def beyond_states(stage: dict) -> float:
    """A stage's predicted peak less the weights (a rank's shards), master weights and optimizer states it holds
    from before the step: what the real steps below count."""
    return stage["peak"] - stage["weights"] - stage["master"] - stage["optimizer"]


def predicted_peak(config, batch, seq, microbatches=1, **plan) -> float:
    """The profiler's peak of the same step (on the first stage of the mesh in `plan`), beyond the model states."""
    return beyond_states(profile_for(config, batch_size=batch, seq_len=seq, dtype="float32", target="cpu",
                                     num_microbatches=microbatches, **plan).stages[0])


@pytest.mark.parametrize("layers,width,heads,batch,seq", [(1, 64, 8, 2, 256), (2, 64, 16, 1, 512), (3, 64, 4, 4, 128)])
def test_a_steps_peak_is_what_a_real_step_holds(layers, width, heads, batch, seq, one_thread):
    """Shapes whose attention scores (batch x heads x seq^2) outweigh the rest of a layer: summing a layer's saved
    tensors with its worst temporaries put these 11-34% above the real peak."""
    config = gpt2(layers, width, heads)
    real = real_peak(config, batch, seq)
    assert predicted_peak(config, batch, seq) == pytest.approx(real, rel=0.03)


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("layers,width,heads,batch,seq", [(2, 256, 4, 1, 128), (1, 512, 8, 1, 64)])
def test_a_steps_peak_with_the_gradients_it_makes(layers, width, heads, batch, seq, microbatches, one_thread):
    """Shapes whose weights outweigh a layer's activations. A layer's backward makes its gradients one GEMM after
    another while it releases what it saved: the first micro-batch keeps them as made, a later one adds each into the
    gradient kept from before and lets it go. Priced as all of a layer's gradients made at its worst op, these were
    13-37% above the real peak; and the gradient of the tied embedding that the fused head computes in the forward
    is held to the embedding's backward, not released with the head's."""
    config = gpt2(layers, width, heads)
    real = real_peak(config, batch, seq, microbatches)
    assert predicted_peak(config, batch, seq, microbatches) == pytest.approx(real, rel=0.03)


def llama(vocab, tied):
    return transformers.AutoConfig.for_model("llama", vocab_size=vocab, hidden_size=128, intermediate_size=256,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                             max_position_embeddings=512, tie_word_embeddings=tied)


@pytest.mark.parametrize("config,microbatches", [(gpt2(2, 128, 4, vocab=4000), 1), (llama(4000, tied=True), 2),
                                                 (llama(4000, tied=False), 1), (llama(4000, tied=False), 2)],
                         ids=["gpt2", "tied", "untied", "untied-2"])
def test_the_heads_weight_gradient_is_held_where_autograd_holds_it(config, microbatches, one_thread):
    """The fused head computes its weight's gradient in its forward and saves it. Tied to the embedding, autograd
    holds it through every layer's backward until the embedding's own is added to it: released with the head's other
    saved tensors, these steps were priced 21-23% under the real peak. Untied, it becomes the weight's gradient, and
    is counted once: as saved, then as a gradient kept."""
    real = real_peak(config, 1, 32, microbatches)
    assert predicted_peak(config, 1, 32, microbatches) == pytest.approx(real, rel=0.03)


def ddp_step_peak(layers, width, heads, batch, seq, microbatches) -> int:
    """On each of 2 gloo ranks: the most a DDP training step holds beyond the parameters, once DDP's buckets exist
    (wrapped inside the count) and the step before it has run and its gradients were set to None."""
    config = gpt2(layers, width, heads, dropout=0.0)
    torch.manual_seed(0)
    model = build_model(config, parallel=init_parallel(dp=2), device="cpu").train()
    ids = torch.randint(0, config.vocab_size, (2 * batch * microbatches, seq))
    with use_kernels("torch"), no_collector(), LiveBytes() as counted:
        parallelize(model, data_parallel="ddp")
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            counted.peak = counted.live
            model.forward_backward(ids, ids, num_microbatches=microbatches)
    return counted.peak


@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_data_parallel_steps_peak_with_ddps_buckets(microbatches):
    """torch DDP keeps the gradients in buckets allocated when it wraps the model: colozoo's gradients are views of
    them, and the micro-batches before the last (under no_sync) accumulate gradients of their own beside them.
    Priced as autograd's gradients alone, these steps were 43% and 35% under the real peak; without the views, the
    first holds 10% more."""
    shape = (2, 256, 4, 1, 128)
    real = run_distributed(ddp_step_peak, 2, *shape, microbatches, timeout=120)
    predicted = predicted_peak(gpt2(*shape[:3], dropout=0.0), *shape[3:], microbatches, mesh="dp=2")
    assert predicted == pytest.approx(max(real), rel=0.03)


def fsdp_step_peak(layers, width, heads, batch, seq, microbatches, reshard_after_forward) -> list[int]:
    """On each of 2 gloo ranks, for two fresh models: the most an FSDP2 training step holds beyond the weights'
    shards (gathered in the count, FSDP2's resizes of them followed)."""
    config = gpt2(layers, width, heads, dropout=0.0)
    peaks = []
    for _ in range(2):
        torch.manual_seed(0)
        model = build_model(config, parallel=init_parallel(dp=2), device="cpu").train()
        parallelize(model, data_parallel="fsdp", reshard_after_forward=reshard_after_forward)
        ids = torch.randint(0, config.vocab_size, (2 * batch * microbatches, seq))
        with use_kernels("torch"), no_collector(), LiveBytes() as counted:
            model.forward_backward(ids, ids, num_microbatches=microbatches)
        peaks.append(counted.peak)
    return peaks


@pytest.mark.parametrize("shape,microbatches,reshard_after_forward", [
    ((2, 256, 4, 1, 128), 1, True), ((2, 256, 4, 1, 128), 1, False), ((2, 256, 4, 1, 128), 2, True),
    ((2, 256, 4, 1, 128), 2, False), ((4, 128, 4, 1, 64), 1, True)],
    ids=["2-layers", "kept-gathered", "2-microbatches", "kept-2-microbatches", "4-layers"])
def test_a_fully_sharded_steps_peak(shape, microbatches, reshard_after_forward):
    """FSDP2 gathers each layer into weights of their own beside the shard, through a collective output it keeps
    until the next gather is copied out; a layer's backward makes its gradients whole and reduce-scatters them from an
    input the next layer's backward still holds; the embedding and head stay gathered. Each micro-batch's gradients
    are reduce-scattered. Priced as a gathered layer's missing shards beside sharded gradients, these steps were
    37-46% under the real peak. On gloo a collective's buffers are let go by its worker thread, at a point that
    varies: some steps (1 in 4 to 1 in 20 here) hold 0.5 MB more, 3.7% at the first shape. What the model prices is
    the step without that delay, the least of 4 (2 ranks, 2 fresh models)."""
    real = min(min(peaks) for peaks in run_distributed(fsdp_step_peak, 2, *shape, microbatches,
                                                       reshard_after_forward, timeout=120))
    predicted = predicted_peak(gpt2(*shape[:3], dropout=0.0), *shape[3:], microbatches, mesh="dp=2", zero=3,
                               reshard_after_forward=reshard_after_forward)
    assert predicted == pytest.approx(real, rel=0.03)


def test_under_a_pipeline_fsdp_holds_what_ddp_holds():
    """torch's pipeline schedules keep an FSDP stage's gradients whole from the first backward to the last, and the
    weights each backward gathers. On 4 gloo ranks (pp 2 x dp 2, 4 micro-batches, this model) a real FSDP step's
    peaks were DDP's within 1% on both stages (24.79 and 19.15 MB against 24.79 and 19.28)."""
    config = gpt2(4, 256, 4, dropout=0.0)
    fsdp, ddp = (profile_for(config, batch_size=1, seq_len=128, mesh="pp=2,dp=2", zero=zero, dtype="float32",
                             target="cpu", num_microbatches=4, schedule="1f1b").stages for zero in (3, 0))
    for sharded, replicated in zip(fsdp, ddp):
        assert beyond_states(sharded) == pytest.approx(beyond_states(replicated), rel=0.02)


def test_a_layer_holds_less_at_its_worst_op_than_all_it_saves():
    layer = trace_model(gpt2(1, 64, 8), 2, 256, None, "float32", "cpu").units["layer:0"]
    # the scores peak in the attention, before the MLP has saved anything and after its backward released it all
    assert 0 < layer.fwd_unsaved_bytes < layer.saved_bytes
    assert 0 < layer.bwd_released_bytes < layer.saved_bytes
    twice = trace_model(gpt2(1, 64, 8), 4, 256, None, "float32", "cpu").units["layer:0"]
    assert twice.bwd_released_bytes == pytest.approx(2 * layer.bwd_released_bytes, rel=0.01)


def test_a_layers_backward_makes_its_gradients_as_it_runs():
    units = trace_model(gpt2(2, 256, 4), 1, 128, None, "float32", "cpu").units
    layer, head = units["layer:0"], units["head"]
    assert layer.grad_bytes == layer.param_bytes
    # at its worst op: one GEMM's gradient made beside it, or those made so far, not all of them
    assert 0 < layer.bwd_fresh_grad_bytes < layer.bwd_kept_grad_bytes < layer.grad_bytes
    assert head.bwd_outlived_bytes == 101 * 256 * 4  # the tied embedding's gradient, made in the fused head's forward
    untied = trace_model(llama(4000, tied=False), 1, 32, None, "float32", "cpu").units["head"]
    weight_grad = 4000 * 128 * 4  # made in the forward, saved until the backward hands it on: not made there again
    assert untied.bwd_kept_grad_bytes < weight_grad <= untied.grad_bytes and untied.bwd_outlived_bytes < weight_grad


def test_what_the_software_does_not_save_lowers_the_peak_only_where_it_was_held():
    """A fused SwiGLU keeps less of the MLP. The step's peak is in the last layer's attention backward, when that
    layer's MLP has released all it saved already: only the first layer, still whole, holds less."""
    config = transformers.AutoConfig.for_model("llama", vocab_size=101, hidden_size=64, intermediate_size=256,
                                               num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                                               max_position_embeddings=512)
    traced = trace_model(config, 2, 256, None, "float32", "cpu")
    plan, workload = Plan(micro_batch_size=2), Workload(seq_len=256, dtype="float32", target="cpu")
    whole, fused = (assemble(traced, plan, workload, Software(fused_swiglu=fused)) for fused in (False, True))
    per_layer = (whole.stages[0]["activations"] - fused.stages[0]["activations"]) / 2
    assert per_layer > 0
    assert whole.peak_memory - fused.peak_memory == pytest.approx(per_layer)
