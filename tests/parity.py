"""Parity with transformers: the same weights in an HF model and a sharded colozoo model must give the same
logits, loss and (gathered) gradients. Runs on every rank of a job; also works on a single process."""
from __future__ import annotations

import torch
import transformers

from colozoo.converters import GlobalTensor, StateDictReader, family_module, load_hf_weights
from colozoo.layers.shard import gather_tensor, spec_of
from colozoo.models import build_model
from colozoo.parallel import coords_of, init_parallel

LOGITS_ATOL = 1e-5
GRAD_ATOL = 1e-5


def hf_causal_lm(model_type: str, config_kwargs: dict, seed: int = 0):
    config = transformers.AutoConfig.for_model(model_type, **config_kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():  # random non-trivial norm weights and biases, so a misplaced one shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return config, model


def batch(vocab_size: int, seq_len: int, seed: int = 1, padded: bool = True, batch_size: int = 2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)
    mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    if padded:
        mask[0, :3] = 0            # left padding
        mask[-1, seq_len - 2:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    return ids, (mask if padded else None), labels


def global_shapes(model, sources, reader):
    return {name: GlobalTensor(reader, sources[name], name).shape for name, _ in model.named_parameters()}


def causal_lm_parity(model_type: str, config_kwargs: dict, tp: int = 1, sequence_parallel: bool = False,
                     padded: bool = True, seq_len: int = 12, logits_atol=LOGITS_ATOL, grad_atol=GRAD_ATOL):
    pc = init_parallel(tp=tp, sequence_parallel=sequence_parallel)
    config, hf = hf_causal_lm(model_type, config_kwargs)
    ids, mask, labels = batch(config.vocab_size, seq_len, padded=padded)

    ref = hf(ids, attention_mask=mask, labels=labels)
    ref.loss.backward()
    hf_grads = StateDictReader({n: p.grad for n, p in hf.named_parameters()})

    model = build_model(config, pc=pc, device="meta")
    weights = StateDictReader(hf.state_dict())
    load_hf_weights(model, weights, device="cpu")
    model.eval()
    out = model(ids, attention_mask=mask, labels=labels, return_logits=True)
    out.loss.backward()

    keep = (mask if mask is not None else torch.ones_like(ids)).bool()
    report = {
        "logits": (out.logits - ref.logits)[keep].abs().max().item(),
        "loss": abs(out.loss.item() - ref.loss.item()),
    }
    assert out.logits.shape == ref.logits.shape, (out.logits.shape, ref.logits.shape)
    assert report["logits"] < logits_atol, f"logits differ by {report['logits']}"
    assert report["loss"] < logits_atol, f"loss differs by {report['loss']}"

    sources = family_module(model.family).hf_sources(config)
    shapes = global_shapes(model, sources, weights)
    coords = coords_of(pc)
    worst = 0.0
    for name, p in model.named_parameters():
        assert p.grad is not None, f"no gradient for {name}"
        full = gather_tensor(p.grad, spec_of(p), shapes[name], pc.groups, coords)
        expected = GlobalTensor(hf_grads, sources[name], name).read()
        diff = (full - expected).abs().max().item()
        assert diff < grad_atol, f"gradient of {name} differs by {diff}"
        worst = max(worst, diff)
    report["grad"] = worst
    return report
