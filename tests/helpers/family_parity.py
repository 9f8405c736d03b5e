"""Parity with transformers for any family of the table, on any mesh: transformers' model of the family's tiny config
(family_cases) and ours loaded from its weights give the same logits, loss (and load-balancing loss), hidden states
and gathered gradients. Runs on every rank of a job, or on one process."""
from __future__ import annotations

import shutil
import tempfile

import torch
import torch.distributed as dist
from family_cases import attention, model_type, tiny_kwargs
from parity import (batch, check_hidden_states, check_sequence_sharding, close, hf_causal_lm, layer_input_lengths,
                    resolved_sources)

ATOL = 1e-5


class RecordingReader:
    """A SafetensorsReader that remembers which tensors had data read."""

    def __init__(self, inner):
        self.inner, self.read_names, self.reads = inner, set(), []

    def names(self):
        return self.inner.names()

    def __contains__(self, name):
        return name in self.inner

    def shape(self, name):
        return self.inner.shape(name)

    def dtype(self, name):
        return self.inner.dtype(name)

    def read(self, name, index=None):
        self.read_names.add(name)
        self.reads.append((name, index))
        return self.inner.read(name, index)

    def experts_read(self) -> set[int]:
        """The experts whose weights had data read: one tensor per expert (`.experts.{e}.`), or slices of a stacked
        tensor (gpt-oss's `.experts.gate_up_proj`: the expert index first)."""
        experts = set()
        for name, index in self.reads:
            if ".experts." not in name:
                continue
            tail = name.split(".experts.")[1].split(".")[0]
            if tail.isdigit():
                experts.add(int(tail))
            else:
                first = index[0] if index else slice(None)
                experts |= set(range(*first.indices(self.shape(name)[0])))
        return experts


def load_saved(hf, config, parallel):
    """Our model loaded from what transformers' save_pretrained writes (per-expert tensors; saved by global rank 0
    only), and the reader that recorded which tensors were read."""
    from colozoo.api import build_model
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.safetensors_io import SafetensorsReader

    distributed = dist.is_initialized()
    first = not distributed or dist.get_rank() == 0
    directory = [tempfile.mkdtemp(prefix="colozoo-saved-") if first else None]
    if distributed:
        dist.broadcast_object_list(directory)
    if first:
        hf.save_pretrained(directory[0])
    if distributed:
        dist.barrier()
    reader = RecordingReader(SafetensorsReader(directory[0]))
    model = build_model(config, parallel=parallel, device="meta")
    load_hf_weights(model, reader, device="cpu")
    if distributed:
        dist.barrier()
    if first:
        shutil.rmtree(directory[0])
    return model, reader


def reference(name: str, overrides: dict | None = None, seed: int = 0):
    """(config, transformers' model) of family `name`'s tiny config, `overrides` on top."""
    return hf_causal_lm(model_type(name), tiny_kwargs(name, **(overrides or {})), seed=seed,
                        attn_implementation=attention(name))


def load(hf, config, parallel):
    """Ours on `parallel` with `hf`'s weights, and the sources its gradients are compared by (transformers' in-memory
    names). A model whose experts transformers stacks in memory but saves one per expert is read from what its
    save_pretrained writes, each ep rank checked to read only its own experts."""
    from colozoo.api import build_model
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.readers import StateDictReader
    from colozoo.converters import family_module

    converter = family_module(config.model_type)
    if hasattr(converter, "module_sources"):
        model, reader = load_saved(hf, config, parallel)
        if any(".experts." in name for name, _ in model.named_parameters()):  # this stage holds MoE layers
            ep, rank = parallel.size("ep"), parallel.rank("ep")
            owned = set(range(rank * model.num_experts // ep, (rank + 1) * model.num_experts // ep))
            assert reader.experts_read() == owned, f"ep rank {rank} read experts {sorted(reader.experts_read())}"
        return model, converter.module_sources(config)
    model = build_model(config, parallel=parallel, device="meta")
    weights = StateDictReader(hf.state_dict())
    load_hf_weights(model, weights, device="cpu")
    return model, resolved_sources(model, weights)


def check_gradients(model, sources, hf_grads, whole_batch: bool = True) -> float:
    """Every gradient, gathered over tp, ep and pp's stages, equals transformers' (a frozen parameter has none);
    returns the worst difference. `whole_batch`: every rank ran the whole batch outside any data-parallel wrapper, so
    the gradients that are not split over ep are summed over dp x cp here, and all divided by dp."""
    from colozoo.checkpoint.readers import GlobalTensor
    from colozoo.core.mesh import coords_of
    from colozoo.layers.shard import gather_tensor, spec_of

    parallel, worst = model.parallel, 0.0
    dp = parallel.size("dp") if whole_batch else 1
    for name, p in model.named_parameters():
        if not p.requires_grad:  # DeepSeek-V3's routing bias: a buffer in transformers
            assert p.grad is None, f"frozen {name} got a gradient"
            continue
        spec, grad = spec_of(p), p.grad.clone()
        # summed over ep by the all-to-all
        by_expert = parallel.size("ep") > 1 and any(s.mesh_dim == "ep" for s in spec)
        if whole_batch and not by_expert and parallel.group("dp_cp") is not None:
            dist.all_reduce(grad, group=parallel.group("dp_cp"))
        expected = GlobalTensor(hf_grads, sources[name], name).read()
        full = gather_tensor(grad / dp, spec, expected.shape, parallel.groups, coords_of(parallel))
        close(full, expected, ATOL, f"gradient of {name}")
        worst = max(worst, (full - expected).abs().max().item())
    return worst


def family_parity(family: str, tp: int = 1, ep: int = 1, cp: int = 1, sequence_parallel: bool = False,
                  cp_mode: str = "ring", overrides: dict | None = None, seq_len: int = 16) -> dict:
    """Logits, loss, the load-balancing loss where the config asks for it, hidden states (but under cp) and every
    gradient against transformers, on the mesh (tp x cp, ep folded over dp x cp); a left- and a right-padded row."""
    from colozoo.checkpoint.readers import StateDictReader
    from colozoo.core.mesh import init_parallel

    parallel = init_parallel(tp=tp, cp=cp, ep=ep, sequence_parallel=sequence_parallel)
    config, hf = reference(family, overrides)
    ids, mask, labels = batch(config.vocab_size, seq_len)
    ref = hf(ids, attention_mask=mask, labels=labels, output_hidden_states=True)
    ref.loss.backward()
    hf_grads = StateDictReader({n: p.grad for n, p in hf.named_parameters() if p.grad is not None})

    model, sources = load(hf, config, parallel)
    model.eval()
    with layer_input_lengths(model) as lengths:
        out = model(ids, attention_mask=mask, labels=labels, return_logits=True, output_hidden_states=cp == 1,
                    **({"cp_mode": cp_mode} if cp > 1 else {}))
    check_sequence_sharding(lengths, seq_len // cp, tp, sequence_parallel)
    keep = mask.bool()
    where = f"{family} (tp={tp} ep={ep} cp={cp})"
    close(out.logits[keep], ref.logits[keep], ATOL, f"logits of {where}")
    close(out.loss, ref.loss, ATOL, f"loss of {where}")
    assert (getattr(ref, "aux_loss", None) is None) == (out.aux_loss is None), where
    if out.aux_loss is not None:
        close(out.aux_loss, ref.aux_loss, ATOL, f"load-balancing loss of {where}")
    report = {"logits": (out.logits - ref.logits)[keep].abs().max().item()}
    if cp == 1:
        report["hidden_states"] = check_hidden_states(out.hidden_states, ref.hidden_states, keep)
    out.loss.backward()
    report["grad"] = check_gradients(model, sources, hf_grads)
    if getattr(config, "output_router_logits", False):  # the forward's keyword overrides the config's (transformers)
        with torch.no_grad():
            plain = model(ids, attention_mask=mask, labels=labels, output_router_logits=False,
                          **({"cp_mode": cp_mode} if cp > 1 else {}))
            ref_plain = hf(ids, attention_mask=mask, labels=labels, output_router_logits=False)
        assert plain.aux_loss is None, where
        close(plain.loss, ref_plain.loss, ATOL, f"loss of {where} without router logits")
    return report


def _microbatched_reference(hf, config, ids, mask, labels, dp: int, microbatches: int):
    """transformers' loss as forward_backward defines it with router losses: the token loss averaged over the whole
    batch, plus each micro-batch's router loss (over that micro-batch's rows of every data rank) / microbatches."""
    per_rank = ids.shape[0] // dp
    per_micro = per_rank // microbatches
    total_tokens = (labels[:, 1:] != -100).sum()
    loss = 0.0
    for i in range(microbatches):
        rows = [r * per_rank + i * per_micro + j for r in range(dp) for j in range(per_micro)]
        out = hf(ids[rows], attention_mask=mask[rows], labels=labels[rows])
        router = config.router_aux_loss_coef * out.aux_loss
        loss = loss + (out.loss - router) * (labels[rows, 1:] != -100).sum() / total_tokens + router / microbatches
    return loss


def family_pipeline_parity(family: str, pp: int = 2, tp: int = 1, ep: int = 1, sequence_parallel: bool = False,
                           overrides: dict | None = None) -> list[str]:
    """The family over pp stages: the eval forward's logits, loss (and load-balancing loss) on every rank, then a
    forward_backward over 2 micro-batches under DDP (each dp rank its rows): its loss and every gathered gradient.
    Returns this rank's parameter names."""
    from colozoo.checkpoint.readers import StateDictReader
    from colozoo.core.mesh import init_parallel
    from colozoo.runtime.training import parallelize

    parallel = init_parallel(pp=pp, tp=tp, ep=ep, sequence_parallel=sequence_parallel)
    config, hf = reference(family, overrides)
    model, sources = load(hf, config, parallel)
    model.eval()
    ids, mask, labels = batch(config.vocab_size, 16, batch_size=4)
    where = f"{family} (pp rank {parallel.rank('pp')})"
    with torch.no_grad(), layer_input_lengths(model) as lengths:
        ref = hf(ids, attention_mask=mask, labels=labels)
        out = model(ids, attention_mask=mask, labels=labels, return_logits=True)
        close(out.logits[mask.bool()], ref.logits[mask.bool()], ATOL, f"logits of {where}")
        close(out.loss, ref.loss, ATOL, f"loss of {where}")
        if getattr(ref, "aux_loss", None) is not None:
            close(out.aux_loss, ref.aux_loss, ATOL, f"load-balancing loss of {where}")
    check_sequence_sharding(lengths, ids.shape[1], tp, sequence_parallel)
    if getattr(ref, "aux_loss", None) is not None:
        ref_loss = _microbatched_reference(hf, config, ids, mask, labels, parallel.size("dp"), 2)
    else:
        ref_loss = hf(ids, attention_mask=mask, labels=labels).loss
    ref_loss.backward()
    hf_grads = StateDictReader({n: p.grad for n, p in hf.named_parameters() if p.grad is not None})
    parallelize(model.train(), data_parallel="ddp")
    close(model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=2), ref_loss, ATOL,
          f"forward_backward loss of {where}")
    check_gradients(model, sources, hf_grads, whole_batch=False)
    return sorted(n for n, _ in model.named_parameters())
