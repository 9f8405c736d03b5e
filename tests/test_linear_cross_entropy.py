"""The torch path's fused LM head + summed cross entropy (kernels/linear_cross_entropy.py) against F.linear +
F.cross_entropy, and the model heads that take it."""
import pytest
import torch
import torch.nn.functional as F

from colozoo.kernels.linear_cross_entropy import linear_cross_entropy_sum
from colozoo.layers.vocab import LogitsRequest, VocabParallelLMHead
from parity import close

ATOL = 1e-5


def _inputs(dtype, bias):
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(3, 7, 24, generator=g) * 2).to(dtype)
    weight = torch.randn(101, 24, generator=g).to(dtype)
    b = (torch.randn(101, generator=g) * 0.5).to(dtype) if bias else None
    target = torch.randint(0, 101, (3, 7), generator=g)
    target[0, :3] = -100
    target[2, -1] = -100
    return hidden, weight, b, target


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_sum(label_smoothing, bias, dtype):
    hidden, weight, b, target = _inputs(dtype, bias)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight) + ((b,) if bias else ())]
    logits = F.linear(leaves[0], leaves[1], leaves[2] if bias else None).float()
    expected = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum",
                               label_smoothing=label_smoothing)
    (expected * 0.37).backward()
    ours = [t.clone().requires_grad_() for t in (hidden, weight) + ((b,) if bias else ())]
    loss = linear_cross_entropy_sum(ours[0], ours[1], target, ours[2] if bias else None,
                                    label_smoothing=label_smoothing)
    (loss * 0.37).backward()
    atol = ATOL if dtype == torch.float32 else 1e-2
    close(loss, expected, atol * 10, "summed loss")
    for name, mine, ref in zip(("hidden", "weight", "bias"), ours, leaves):
        assert mine.grad.dtype == dtype
        close(mine.grad, ref.grad, atol, f"{name} gradient")


def test_linear_cross_entropy_sum_all_ignored():
    hidden, weight, _, target = _inputs(torch.float32, False)
    hidden.requires_grad_()
    loss = linear_cross_entropy_sum(hidden, weight, torch.full_like(target, -100))
    loss.backward()
    assert loss.item() == 0 and not hidden.grad.any()


@pytest.mark.parametrize("return_logits", [False, True])
def test_lm_head_fuses_the_loss_only_without_logits(monkeypatch, return_logits):
    """The head takes the fused path exactly when no logits are asked for, and both paths give the same loss."""
    import colozoo.kernels.linear_cross_entropy as op

    calls = []
    fused = op.linear_cross_entropy_sum
    monkeypatch.setattr(op, "linear_cross_entropy_sum", lambda *a, **k: calls.append(1) or fused(*a, **k))
    torch.manual_seed(0)
    head = VocabParallelLMHead(24, 101)
    hidden, _, _, labels = _inputs(torch.float32, False)
    loss, logits = head.loss_and_logits(hidden, labels, LogitsRequest("full" if return_logits else "none"))
    assert len(calls) == (0 if return_logits else 1)
    assert (logits is not None) == return_logits
    reference = head.loss(head(hidden), labels)
    close(loss, reference, ATOL, "mean loss")


FAMILIES = {  # tiny configs; GPT-2 and OPT tie the head to the embedding, this LLaMA does not
    "gpt2": dict(vocab_size=101, n_positions=32, n_embd=64, n_layer=2, n_head=4),
    "opt": dict(vocab_size=101, hidden_size=64, num_hidden_layers=2, ffn_dim=96, num_attention_heads=4,
                max_position_embeddings=32),
    "llama": dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False),
}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_fused_head_matches_transformers(model_type):
    """A training forward (labels, no logits asked for) takes the fused head: loss and every gradient as in
    transformers, padding and ignored labels included."""
    from colozoo.api import build_model
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.readers import GlobalTensor, StateDictReader
    from parity import batch, hf_causal_lm, resolved_sources

    config, hf = hf_causal_lm(model_type, FAMILIES[model_type])
    ids, mask, labels = batch(config.vocab_size, 12)
    assert (labels == -100).any()
    ref = hf(ids, attention_mask=mask, labels=labels)
    ref.loss.backward()
    model = build_model(config, device="meta")
    weights = StateDictReader(hf.state_dict())
    load_hf_weights(model, weights, device="cpu")
    out = model.eval()(ids, attention_mask=mask, labels=labels, return_logits=False)  # training's path, no dropout
    assert out.logits is None
    out.loss.backward()
    close(out.loss, ref.loss, ATOL, "loss")
    sources = resolved_sources(model, weights)
    hf_grads = StateDictReader({n: p.grad for n, p in hf.named_parameters()})
    for name, p in model.named_parameters():
        close(p.grad, GlobalTensor(hf_grads, sources[name], name).read(), ATOL, f"gradient of {name}")
