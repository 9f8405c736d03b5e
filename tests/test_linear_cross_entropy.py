"""The fused LM head + summed cross entropy (kernels/linear_cross_entropy.py: gradients taken chunk by chunk in the
forward) against F.linear then F.cross_entropy: loss and gradients at tp 1 and 2, sequence parallel on and off, on
the torch and the Triton path (interpreted on CPU); its peak memory, counted; and the model heads that take it, in
training mode by default, against transformers."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from colozoo.kernels.linear_cross_entropy import linear_cross_entropy_reference
from colozoo.layers.vocab import LogitsRequest, VocabParallelLMHead
from distributed import run_distributed
from live_bytes import LiveBytes
from parity import close

ATOL = 1e-5
RTOL = 1e-5


def _inputs(dtype, bias, tokens=(3, 7), hidden=24, vocab=101):
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(*tokens, hidden, generator=g) * 2).to(dtype)
    weight = torch.randn(vocab, hidden, generator=g).to(dtype)
    b = (torch.randn(vocab, generator=g) * 0.5).to(dtype) if bias else None
    target = torch.randint(0, vocab, tokens, generator=g)
    target.view(-1)[:3] = -100
    target.view(-1)[-1] = -100
    return h, weight, b, target


def unfused(hidden, weight, bias, target, label_smoothing=0.0, softcap=None):
    """The summed loss the fused op stands for: the logits, capped, then torch's cross entropy."""
    logits = F.linear(hidden, weight, bias).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.flatten(0, -2), target.flatten(), reduction="sum", label_smoothing=label_smoothing)


def _loss_and_grads(fn, tensors, scale=0.37):
    leaves = [t.clone().requires_grad_() if t is not None else None for t in tensors]
    loss = fn(*leaves)
    (loss * scale).backward()
    return loss, [t.grad if t is not None else None for t in leaves]


CASES = {  # (label smoothing, softcap, bias, rows per chunk): 21 tokens in chunks of 4 leave a last chunk of 1
    "plain": (0.0, None, False, None), "smoothing_bias": (0.1, None, True, None),
    "chunks_of_4": (0.1, None, True, 4), "softcap_chunks_of_4": (0.1, 2.0, True, 4)}


@pytest.mark.parametrize("case", CASES)
def test_fused_head_matches_unfused(case):
    eps, cap, bias, rows = CASES[case]
    hidden, weight, b, target = _inputs(torch.float32, bias)
    expected, ref_grads = _loss_and_grads(lambda h, w, b: unfused(h, w, b, target, eps, cap), (hidden, weight, b))
    loss, grads = _loss_and_grads(lambda h, w, b: linear_cross_entropy_reference(
        h, w, target, 101, b, label_smoothing=eps, softcap=cap, chunk_size=rows), (hidden, weight, b))
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)
    for name, mine, ref in zip(("hidden", "weight", "bias"), grads, ref_grads):
        if ref is not None:
            torch.testing.assert_close(mine, ref, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} gradient: {m}")


def test_fused_head_bf16_keeps_the_dtypes():
    hidden, weight, b, target = _inputs(torch.bfloat16, True)
    expected, ref_grads = _loss_and_grads(lambda h, w, b: unfused(h, w, b, target, 0.1), (hidden, weight, b))
    loss, grads = _loss_and_grads(lambda h, w, b: linear_cross_entropy_reference(h, w, target, 101, b,
                                                                                 label_smoothing=0.1),
                                  (hidden, weight, b))
    close(loss, expected, 1e-2, "summed loss")
    for mine, ref in zip(grads, ref_grads):
        assert mine.dtype == torch.bfloat16
        close(mine, ref, 1e-2, "gradient")


def test_fused_head_all_ignored():
    hidden, weight, _, target = _inputs(torch.float32, False)
    loss, (grad, _) = _loss_and_grads(lambda h, w: linear_cross_entropy_reference(h, w, torch.full_like(target, -100),
                                                                                  101), (hidden, weight))
    assert loss.item() == 0 and not grad.any()


class _Matmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count, self.dtypes = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.count += 1
            self.dtypes |= {a.dtype for a in args if isinstance(a, torch.Tensor)}
        return func(*args, **(kwargs or {}))


def test_autocast_multiplies_in_its_dtype():
    """fp32 weights under bf16 autocast: every matmul of the head in bf16, as F.linear's would be; the gradients come
    back in fp32, as the unfused path's."""
    hidden, weight, b, target = _inputs(torch.float32, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, ref_grads = _loss_and_grads(lambda h, w, b: unfused(h, w, b, target, 0.1), (hidden, weight, b))
        with _Matmuls() as matmuls:
            loss, grads = _loss_and_grads(lambda h, w, b: linear_cross_entropy_reference(
                h, w, target, 101, b, label_smoothing=0.1, chunk_size=8), (hidden, weight, b))
    assert matmuls.dtypes == {torch.bfloat16}, matmuls.dtypes
    close(loss, expected, 1e-2, "summed loss")
    for mine, ref in zip(grads, ref_grads):  # fp32 gradients of bf16 products: bf16's tolerance
        assert mine.dtype == torch.float32
        torch.testing.assert_close(mine, ref, rtol=1.6e-2, atol=1e-2)


def test_gradients_only_where_wanted():
    """A chunk costs its one logits matmul without gradients (torch.no_grad; nothing requiring them), two with a
    frozen head (the hidden states' gradient alone), three in training; the backward none."""
    hidden, weight, _, target = _inputs(torch.float32, False, tokens=(2, 10))
    run = lambda h, w: linear_cross_entropy_reference(h, w, target, 101, chunk_size=8)  # noqa: E731 (3 chunks)
    expected = unfused(hidden, weight, None, target)
    for grad_mode, wants, per_chunk in ((False, (True, True), 1), (True, (False, False), 1), (True, (True, False), 2),
                                        (True, (True, True), 3)):
        h, w = (t.clone().requires_grad_(want) for t, want in zip((hidden, weight), wants))
        with _Matmuls() as matmuls, torch.set_grad_enabled(grad_mode):
            loss = run(h, w)
        assert matmuls.count == 3 * per_chunk, (grad_mode, wants, matmuls.count)
        assert loss.requires_grad == (grad_mode and any(wants))
        close(loss, expected, ATOL, "loss")
        if loss.requires_grad:
            with _Matmuls() as matmuls:
                loss.backward()
            assert matmuls.count == 0 and (w.grad is not None) == wants[1]


def test_a_second_backward_is_refused_by_name():
    """The gradients taken in the forward are scaled in place by the one backward: a second one is refused."""
    hidden, weight, _, target = _inputs(torch.float32, False)
    loss = linear_cross_entropy_reference(hidden.requires_grad_(), weight.requires_grad_(), target, 101)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward through the fused LM head"):
        loss.backward()


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_peak_memory_is_a_chunk_of_logits_plus_the_gradients(softcap):
    """Forward and backward of the fused head on 2048 tokens x 2048 vocab (hidden 16) at the default chunking (4
    chunks of 512 rows). Alive at once besides the inputs: the gradients (hidden, weight) and one chunk of fp32 logits
    turned into their gradient in place (a soft-cap keeps its slope beside it: two), plus per-row statistics, under
    1/8 of a chunk. The logits alone of the unfused path (16 MiB) pass that bound; the bound is checked on it too."""
    tokens, hidden_size, vocab = 2048, 16, 2048
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=g).requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=g).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=g)
    chunk = 512 * vocab * 4  # the rule's 16 rows (2048 tokens / (vocab / hidden)), raised to the 512-row floor
    bound = (1 + (softcap is not None)) * chunk + (hidden.numel() + weight.numel()) * 4 + chunk // 8
    peaks = {}
    for name, fn in (("fused", linear_cross_entropy_reference), ("unfused", None)):
        with LiveBytes() as counted:
            if fn is None:
                loss = unfused(hidden, weight, None, target, softcap=softcap)
            else:
                loss = fn(hidden, weight, target, vocab, softcap=softcap)
            loss.backward()
            del loss
        peaks[name] = counted.peak
        hidden.grad = weight.grad = None
    assert peaks["fused"] <= bound < peaks["unfused"], (peaks, bound)


# --------------------------------------------------------------------------------- tensor and sequence parallel


def _tp_parity_task():
    """On 2 ranks, the op as the LM head calls it (hidden states entering the tensor-parallel region, copied or
    gathered along the sequence) against the full-vocabulary unfused loss, on both paths; vocab 37 pads one row."""
    import torch.distributed as dist

    from colozoo.core.groups import vocab_range
    from colozoo.kernels import dispatch
    from colozoo.kernels.linear_cross_entropy import linear_cross_entropy
    from colozoo.layers.linear import enter_parallel
    from test_kernels import kernel_module

    kernel_module("cross_entropy_triton")
    group, rank, vocab = dist.group.WORLD, dist.get_rank(), 37
    start, stop, per = vocab_range(vocab, group)
    hidden, weight, b, target = _inputs(torch.float32, True, tokens=(2, 6), hidden=16, vocab=vocab)
    for eps, cap, mode, sp in [(0.1, None, "torch", False), (0.0, 2.0, "torch", True), (0.1, 2.0, "triton", True),
                               (0.1, None, "triton", False)]:
        expected, ref = _loss_and_grads(lambda h, w, b: unfused(h, w, b, target, eps, cap), (hidden, weight, b))
        local_weight, local_bias = torch.zeros(per, 16), torch.zeros(per)
        local_weight[: stop - start], local_bias[: stop - start] = weight[start:stop], b[start:stop]
        mine = hidden[:, 3 * rank: 3 * rank + 3] if sp else hidden  # the rank's share of the sequence
        enter = lambda x: enter_parallel(x, group, sp)  # noqa: E731
        with dispatch.use_kernels(mode):
            loss, grads = _loss_and_grads(lambda h, w, b: linear_cross_entropy(
                h, w, target, vocab, b, group, -100, eps, cap, enter_parallel=enter, chunk_size=5),
                (mine, local_weight, local_bias))
        what = f"{mode}, sp={sp}, smoothing={eps}, softcap={cap}"
        torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"loss ({what}): {m}")
        ref_hidden = ref[0][:, 3 * rank: 3 * rank + 3] if sp else ref[0]
        mine_rows = slice(0, stop - start)
        for name, got, want in (("hidden", grads[0], ref_hidden), ("weight", grads[1][mine_rows], ref[1][start:stop]),
                                ("bias", grads[2][mine_rows], ref[2][start:stop])):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} grad ({what}): {m}")
        assert not grads[1][stop - start:].any() and not grads[2][stop - start:].any(), "padded rows got gradient"
    return True


def test_fused_head_tp2_sequence_parallel_both_paths():
    assert run_distributed(_tp_parity_task, 2, timeout=120) == [True, True]


# --------------------------------------------------------------------------------- the model heads


@pytest.mark.parametrize("return_logits", [False, True])
def test_lm_head_fuses_the_loss_only_without_logits(monkeypatch, return_logits):
    """The head takes the fused path exactly when no logits are asked for, and both paths give the same loss."""
    import colozoo.kernels.linear_cross_entropy as op

    calls = []
    fused = op.linear_cross_entropy_reference
    monkeypatch.setattr(op, "linear_cross_entropy_reference", lambda *a, **k: calls.append(1) or fused(*a, **k))
    torch.manual_seed(0)
    head = VocabParallelLMHead(24, 101, softcap=3.0)
    hidden, _, _, labels = _inputs(torch.float32, False)
    loss, logits = head.loss_and_logits(hidden, labels, LogitsRequest("full" if return_logits else "none"))
    assert len(calls) == (0 if return_logits else 1)
    assert (logits is not None) == return_logits
    reference = head.loss(head(hidden), labels)
    close(loss, reference, ATOL, "mean loss")


NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
FAMILIES = {  # tiny configs, no dropout (so that training mode is deterministic); GPT-2 and OPT tie the head to the
    # embedding, this LLaMA does not; Gemma 2 caps its logits
    "gpt2": dict(vocab_size=101, n_positions=32, n_embd=64, n_layer=2, n_head=4, **NO_DROPOUT),
    "opt": dict(vocab_size=101, hidden_size=64, num_hidden_layers=2, ffn_dim=96, num_attention_heads=4,
                max_position_embeddings=32, dropout=0.0, attention_dropout=0.0),
    "llama": dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False),
    "gemma2": dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0,
                   query_pre_attn_scalar=24, final_logit_softcapping=2.0, initializer_range=0.2),
}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_fused_head_matches_transformers(monkeypatch, model_type):
    """A training forward with labels takes the fused head by default: no logits, the loss and every gradient as in
    transformers, padding and ignored labels included."""
    import colozoo.kernels.linear_cross_entropy as op
    from colozoo.api import build_model
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.readers import GlobalTensor, StateDictReader
    from parity import batch, hf_causal_lm, resolved_sources

    calls = []
    fused = op.linear_cross_entropy_reference
    monkeypatch.setattr(op, "linear_cross_entropy_reference", lambda *a, **k: calls.append(1) or fused(*a, **k))
    config, hf = hf_causal_lm(model_type, FAMILIES[model_type],
                              attn_implementation="eager" if model_type == "gemma2" else "sdpa")
    ids, mask, labels = batch(config.vocab_size, 12)
    assert (labels == -100).any()
    ref = hf.train()(ids, attention_mask=mask, labels=labels)
    ref.loss.backward()
    model = build_model(config, device="meta")
    weights = StateDictReader(hf.state_dict())
    load_hf_weights(model, weights, device="cpu")
    out = model.train()(ids, attention_mask=mask, labels=labels)
    assert out.logits is None and calls == [1]
    out.loss.backward()
    close(out.loss, ref.loss, ATOL, "loss")
    sources = resolved_sources(model, weights)
    hf_grads = StateDictReader({n: p.grad for n, p in hf.named_parameters()})
    for name, p in model.named_parameters():
        close(p.grad, GlobalTensor(hf_grads, sources[name], name).read(), ATOL, f"gradient of {name}")
