"""The LM head priced as the software runs it (Software.fused_head): colozoo's fused linear cross-entropy takes the
gradients chunk by chunk in the forward and keeps no logits; Megatron, DeepSpeed and llm-foundry project the logits,
take the loss from them (Megatron upcasting them to fp32 and keeping their softmax) and run the head's gradients in
the backward."""
from dataclasses import replace

import pytest
from transformers import GPT2Config

from colozoo.core.mesh import ParallelConfig
from colozoo.cost.hardware import get_hardware
from colozoo.cost.model_trace import trace_model
from colozoo.cost.planner import SearchSpace, plan
from colozoo.cost.published import published_runs
from colozoo.cost.setup import Workload
from colozoo.cost.software import COLOZOO, Software
from colozoo.cost.validate import TOLERANCE, validate

HIDDEN, VOCAB, BATCH, SEQ = 64, 1024, 2, 128
CONFIG = GPT2Config(n_embd=HIDDEN, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=256, bos_token_id=0,
                    eos_token_id=0)


def _head(tp: int, fused: bool):
    traced = trace_model(CONFIG, BATCH, SEQ, ParallelConfig(tp=tp, sequence_parallel=tp > 1), "bfloat16", "cuda",
                         fused_head=fused)
    return traced.units["head"]


@pytest.mark.parametrize("tp", [1, 2])
def test_an_unfused_head_keeps_its_logits_and_takes_its_gradients_in_the_backward(tp):
    fused, unfused = _head(tp, True), _head(tp, False)
    logits_gemm = 2 * BATCH * SEQ * (VOCAB // tp) * HIDDEN
    assert unfused.fwd_flops == logits_gemm and unfused.bwd_flops == 2 * logits_gemm
    assert fused.fwd_flops == 3 * logits_gemm and fused.bwd_flops == 0
    fp32_logits = BATCH * SEQ * (VOCAB // tp) * 4
    assert unfused.saved_bytes >= fp32_logits > fused.saved_bytes
    assert unfused.comm == fused.comm  # the rank's vocabulary slice: no logits gathered over tp


@pytest.mark.parametrize("tp", [1, 2])
def test_an_unfused_head_turns_its_fp32_copy_into_the_softmax(tp):
    """Megatron's cross entropy upcasts the logits and writes the softmax into that copy ("in-place subtraction
    reduces memory pressure"): at its fullest the head's forward holds the bf16 logits and one fp32 copy, never a
    second vocab-sized fp32 tensor beside it."""
    head = _head(tp, False)
    logits = BATCH * SEQ * (VOCAB // tp)
    assert head.saved_bytes + head.fwd_transient_bytes < logits * (2 + 4 + 4)
    assert head.saved_bytes >= logits * 4


def test_the_softmax_written_into_the_copy_is_the_loss_and_gradient_of_torch():
    """The reference cross entropy on half-precision logits (the softmax written into their fp32 copy) against torch's
    on the same logits upcast (tp 1: one rank holds the whole vocabulary); fp32 logits are left as they were."""
    import torch

    from colozoo.kernels.cross_entropy import vocab_parallel_cross_entropy_reference

    torch.manual_seed(0)
    for vocab in (50, 3000):
        logits = torch.randn(3, 7, vocab, dtype=torch.bfloat16, requires_grad=True)
        target = torch.randint(0, vocab, (3, 7))
        target[0, 0] = -100
        loss = vocab_parallel_cross_entropy_reference(logits, target, vocab)
        loss.sum().backward()
        upcast = logits.detach().float().requires_grad_()
        expected = torch.nn.functional.cross_entropy(upcast.transpose(1, 2), target, reduction="none")
        expected.sum().backward()
        torch.testing.assert_close(loss, expected)
        torch.testing.assert_close(logits.grad.float(), upcast.grad, atol=1e-2, rtol=1e-2)
        full = logits.detach().float()
        kept = full.clone()
        vocab_parallel_cross_entropy_reference(full, target, vocab)
        assert torch.equal(full, kept)


def test_published_frameworks_project_the_logits_where_colozoo_fuses_them():
    assert COLOZOO.fused_head
    assert not any(r.software.fused_head for r in published_runs())


def test_the_head_decides_a_small_model_with_a_large_vocabulary():
    """Megatron-Core's 1.7B (hidden 2048, vocabulary 131072): priced with colozoo's fused head, whose chunks of 512
    tokens make GEMMs of 512 x 2048 outputs over a 131072-long sum (a part-wave of cuBLAS's large tiles, a whole one
    of its small tiles at their lower rate), it lands about 6 points slower than as Megatron-Core runs its head
    (+9.5% against +3.2%). The two share no trace."""
    run = next(r for r in published_runs() if r.id == "megatron-core-weak-1.7b-48gpu")
    as_published, fused = validate([run, replace(run, software=replace(run.software, fused_head=True))])
    assert abs(as_published.error) <= TOLERANCE
    assert fused.error > as_published.error + 0.05


def test_the_planner_traces_the_head_its_software_runs():
    """One trace cache across plan calls: each call prices the head its software runs, as with a cache of its own."""
    hw = get_hardware("A100-80GB", gpus=1)
    search = SearchSpace(micro_batch_sizes=(BATCH,), zero_levels=(0,), allow_offload=False)

    def best(fused: bool, traces: dict):
        return plan(CONFIG, hw, Workload(seq_len=SEQ), search, global_batch=BATCH, traces=traces,
                    software=Software(fused_head=fused)).best

    shared = {}
    for fused in (True, False):
        alone = best(fused, {})
        assert best(fused, shared).memory == alone.memory
        assert best(fused, shared).step_seconds == alone.step_seconds
    assert best(False, {}).memory != best(True, {}).memory
