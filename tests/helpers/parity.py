"""Parity with transformers: the same weights in an HF model and a sharded colozoo model must give the same
logits, loss and (gathered) gradients. Runs on every rank of a job; also works on a single process."""
from __future__ import annotations

import collections
import contextlib

import torch
import transformers

from colozoo.checkpoint.load import load_hf_weights
from colozoo.checkpoint.readers import GlobalTensor, StateDictReader
from colozoo.converters import family_module
from colozoo.layers.shard import gather_tensor, spec_of
from colozoo.api import build_model
from colozoo.core.mesh import coords_of, init_parallel

LOGITS_ATOL = 1e-5
GRAD_ATOL = 1e-5
# relative tolerance per dtype, on top of the absolute one: reduction order differs between CPUs (Intel, AMD)
RTOL = {torch.float32: 1e-5, torch.float64: 1e-7, torch.bfloat16: 1.6e-2, torch.float16: 1e-3}


def close(actual, expected, atol: float, what: str):
    """actual == expected within atol + RTOL[dtype] * |expected| (torch.testing.assert_close), naming `what`."""
    actual, expected = torch.as_tensor(actual).detach(), torch.as_tensor(expected).detach()
    torch.testing.assert_close(actual, expected, rtol=RTOL.get(expected.dtype, 1e-5), atol=atol, check_dtype=False,
                               msg=lambda message: f"{what} differ: {message}")


@contextlib.contextmanager
def layer_input_lengths(model):
    """The sequence length of every layer input this rank sees while the block runs (activations are (batch, seq,
    hidden)): under sequence parallelism a tp rank holds seq_len / tp positions between the blocks."""
    lengths = []
    handles = [layer.register_forward_pre_hook(lambda module, args: lengths.append(args[0].shape[1]))
               for layer in model.layers.values()]
    try:
        yield lengths
    finally:
        for handle in handles:
            handle.remove()


def check_sequence_sharding(lengths, seq_len: int, tp: int, sequence_parallel: bool):
    """Sequence parallelism's observable effect: each tp rank's layers saw 1/tp of the positions (all without it)."""
    expected = seq_len // tp if sequence_parallel and tp > 1 else seq_len
    assert lengths and set(lengths) == {expected}, (
        f"layer inputs held {sorted(set(lengths))} positions on this rank, expected {expected} "
        f"(sequence_parallel={sequence_parallel}, tp={tp}, {seq_len} positions)")


@contextlib.contextmanager
def weight_calls(model):
    """How often each module holding a weight ran forward while the block runs, by module name: a block that
    activation checkpointing recomputes runs its projections and norms again in backward."""
    counts = collections.Counter()
    handles = [module.register_forward_pre_hook(lambda m, args, name=name: counts.update([name]))
               for name, module in model.named_modules() if isinstance(getattr(module, "weight", None), torch.Tensor)]
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def matmul_dtypes(model):
    """The dtypes of every linear layer's output while the block runs: mixed precision's observable effect (FSDP2
    casts the weights, autocast the matmuls; either way the projections compute in the low precision)."""
    from colozoo.layers.linear import ColumnParallelLinear, RowParallelLinear

    seen = set()
    handles = [module.register_forward_hook(lambda m, args, out: seen.add(out.dtype)) for module in model.modules()
               if isinstance(module, (ColumnParallelLinear, RowParallelLinear, torch.nn.Linear))]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def check_recomputation(counts, model, mode: str | None, microbatches: int):
    """Activation checkpointing's observable effect on `weight_calls`: every layer ("full") or its attention block
    ("selective") ran twice per micro-batch, everything else once."""
    from colozoo.runtime.checkpointing import attention_block

    recomputed = set()
    for index, layer in model.layers.items():
        if mode == "full":
            recomputed.add(f"layers.{index}.")
        elif mode == "selective":
            block = attention_block(layer, index)
            recomputed.add(f"layers.{index}.{next(n for n, m in layer.named_children() if m is block)}.")
    expected = {name: microbatches * (2 if any(name.startswith(p) for p in recomputed) else 1) for name in counts}
    assert counts and dict(counts) == expected, f"forward calls per module with {mode} checkpointing: " + str(
        {name: (n, expected[name]) for name, n in counts.items() if n != expected[name]})


def hf_causal_lm(model_type: str, config_kwargs: dict, seed: int = 0, attn_implementation: str = "sdpa"):
    config = transformers.AutoConfig.for_model(model_type, **config_kwargs)
    model_class = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    if attn_implementation == "sdpa" and not model_class._supports_sdpa:
        attn_implementation = "eager"  # gpt-oss: transformers has no SDPA path for its sinks
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()
    with torch.no_grad():  # random non-trivial norm weights and biases, so a misplaced one shows
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("_bias"):  # gpt-oss's stacked expert biases
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():  # DeepSeek-V3's routing bias: 0.5 apart changes the experts chosen
            if name.endswith("_bias") and b.is_floating_point():
                b.add_(torch.randn_like(b) * 0.5)
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
                     padded: bool = True, seq_len: int = 12, logits_atol=LOGITS_ATOL, grad_atol=GRAD_ATOL,
                     attn_implementation: str = "sdpa", device="cpu", dtype=torch.float32):
    """`device`/`dtype`: both models there (tests/test_gpu.py runs it on CUDA, where the Triton kernels compile)."""
    parallel = init_parallel(tp=tp, sequence_parallel=sequence_parallel, device=torch.device(device))
    config, hf = hf_causal_lm(model_type, config_kwargs, attn_implementation=attn_implementation)
    hf = hf.to(device, dtype)
    ids, mask, labels = (None if t is None else t.to(device) for t in batch(config.vocab_size, seq_len, padded=padded))

    ref = hf(ids, attention_mask=mask, labels=labels, output_hidden_states=True)
    ref.loss.backward()
    hf_grads = StateDictReader({n: p.grad for n, p in hf.named_parameters()})

    model = build_model(config, parallel=parallel, device="meta", dtype=dtype)
    weights = StateDictReader(hf.state_dict())
    load_hf_weights(model, weights, device=device)
    model.eval()
    with layer_input_lengths(model) as lengths:
        out = model(ids, attention_mask=mask, labels=labels, return_logits=True, output_hidden_states=True)
    check_sequence_sharding(lengths, seq_len, tp, sequence_parallel)
    out.loss.backward()

    keep = (mask if mask is not None else torch.ones_like(ids)).bool()
    report = {
        "logits": (out.logits - ref.logits)[keep].abs().max().item(),
        "loss": abs(out.loss.item() - ref.loss.item()),
    }
    assert out.logits.shape == ref.logits.shape, (out.logits.shape, ref.logits.shape)
    close(out.logits[keep], ref.logits[keep], logits_atol, "logits")
    close(out.loss, ref.loss, logits_atol, "loss")
    report["hidden_states"] = check_hidden_states(out.hidden_states, ref.hidden_states, keep, logits_atol)

    report["grad"] = check_gradients(model, parallel, weights, hf_grads, grad_atol, grows_past_one=False)
    return report


# --- encoders and task heads (BERT, ViT), converter round trips -------------------------------------------------

def hf_model(architecture: str, config, seed: int = 0):
    """A transformers model of class `architecture` on random weights with perturbed norms and biases."""
    torch.manual_seed(seed)
    cls = getattr(transformers, architecture)
    model = cls._from_config(config, attn_implementation="sdpa" if cls._supports_sdpa else "eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def resolved_sources(model, reader):
    """The family map as the loader applies it to this reader (task prefix, alternative names)."""
    from colozoo.checkpoint.load import resolve_sources

    conv = family_module(model.family)
    return resolve_sources(reader, conv, conv.hf_sources(model.config))


def check_gradients(model, parallel, weights, hf_grads, grad_atol=GRAD_ATOL, grows_past_one=True) -> float:
    """Every local gradient, gathered to its global HF layout, equals the HF gradient; returns the worst diff.
    `grows_past_one`: the absolute tolerance grows with the gradient past 1."""
    sources = resolved_sources(model, weights)  # as the loader read them (in-memory names, e.g. GPT-NeoX's lm_head)
    shapes = global_shapes(model, sources, weights)
    coords = coords_of(parallel)
    worst = 0.0
    for name, p in model.named_parameters():
        assert p.grad is not None, f"no gradient for {name}"
        full = gather_tensor(p.grad, spec_of(p), shapes[name], parallel.groups, coords)
        expected = GlobalTensor(hf_grads, sources[name], name).read()
        scale = max(1.0, expected.abs().max().item()) if grows_past_one else 1.0
        close(full, expected, grad_atol * scale, f"gradient of {name}")
        worst = max(worst, (full - expected).abs().max().item() / scale)
    return worst


def check_hidden_states(ours, theirs, keep=None, atol=LOGITS_ATOL) -> float:
    """Every entry of `hidden_states` (embeddings, then each layer) equals transformers' (at the `keep` positions);
    returns the worst difference."""
    assert ours is not None and len(ours) == len(theirs), (None if ours is None else len(ours), len(theirs))
    worst = 0.0
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape, (i, a.shape, b.shape)
        if keep is not None:
            a, b = a[keep], b[keep]
        close(a, b, atol, f"hidden_states[{i}]")
        worst = max(worst, (a - b).abs().max().item())
    return worst


def probe_loss(*tensors, seed: int = 7):
    """A loss that weighs every output element differently, for models without a loss of their own."""
    g = torch.Generator().manual_seed(seed)
    return sum((t * torch.randn(t.shape, generator=g)).sum() for t in tensors if t is not None)


def task_parity(architecture: str, config_kwargs: dict, inputs: dict, labels=None, task: str | None = None,
                tp: int = 1, sequence_parallel: bool = False, pp: int = 1, atol=LOGITS_ATOL, grad_atol=GRAD_ATOL):
    """HF `architecture` vs our model for `task` on the same weights and `inputs` (HF keyword names): logits,
    hidden states, pooled output and loss (a probe loss when there are no labels), then every gradient."""
    parallel = init_parallel(tp=tp, pp=pp, sequence_parallel=sequence_parallel)
    model_type = getattr(transformers, architecture).config_class.model_type
    config = transformers.AutoConfig.for_model(model_type, architectures=[architecture], **config_kwargs)
    hf = hf_model(architecture, config)
    ref = hf(**inputs, labels=labels, output_hidden_states=True)
    ref_hidden = getattr(ref, "last_hidden_state", None)
    ref_pooled = getattr(ref, "pooler_output", None)
    # without labels every output weighs in, each layer's hidden states too (their gradients through the gathers)
    ref_loss = ref.loss if labels is not None else probe_loss(ref_hidden, ref_pooled, *ref.hidden_states)
    ref_loss.backward()
    hf_grads = StateDictReader({n: p.grad for n, p in hf.named_parameters() if p.grad is not None})

    model = build_model(config, parallel=parallel, device="meta", task=task)
    weights = StateDictReader(hf.state_dict())
    load_hf_weights(model, weights, device="cpu")
    model.eval()
    with layer_input_lengths(model) as lengths:
        out = model(**inputs, labels=labels, return_logits=True, output_hidden_states=True)
    if "input_ids" in inputs:
        check_sequence_sharding(lengths, inputs["input_ids"].shape[1], tp, sequence_parallel)
    assert list(out.keys()) == [k for k in ref.keys() if k != "attentions"], (list(out.keys()), list(ref.keys()))
    report = {}
    for name, ours, theirs in (("logits", out.logits, getattr(ref, "logits", None)),
                               ("last_hidden_state", out.last_hidden_state, ref_hidden),
                               ("pooler_output", out.pooler_output, ref_pooled)):
        if theirs is None:
            continue
        assert ours is not None and ours.shape == theirs.shape, (name, None if ours is None else ours.shape, theirs.shape)
        report[name] = (ours - theirs).abs().max().item()
        close(ours, theirs, atol, name)
    report["hidden_states"] = check_hidden_states(out.hidden_states, ref.hidden_states, atol=atol)
    loss = out.loss if labels is not None else probe_loss(out.last_hidden_state, out.pooler_output, *out.hidden_states)
    report["loss"] = abs(loss.item() - ref_loss.item())
    close(loss, ref_loss, atol * max(1.0, abs(ref_loss.item())), "loss")
    loss.backward()
    report["grad"] = check_gradients(model, parallel, weights, hf_grads, grad_atol)
    return report


def hf_round_trip(model_type: str, config_kwargs: dict, tp: int = 1, architecture: str | None = None,
                  task: str | None = None, attn_implementation: str = "sdpa"):
    """Load a checkpoint transformers saved into a sharded model, gather every parameter back into HF names and
    layouts, and check the result equals the saved tensors bit for bit and covers all of them."""
    import tempfile

    from safetensors.torch import load_file

    from colozoo.checkpoint.safetensors_io import SafetensorsReader

    parallel = init_parallel(tp=tp)
    arch = dict(architectures=[architecture]) if architecture else {}
    config = transformers.AutoConfig.for_model(model_type, **arch, **config_kwargs)
    hf = (hf_model(architecture, config) if architecture else hf_causal_lm(model_type, config_kwargs, attn_implementation=attn_implementation)[1])
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    with tempfile.TemporaryDirectory() as directory:
        hf.save_pretrained(directory)  # under torch.distributed transformers writes on rank 0 only: share its path
        if distributed:
            shared = [directory]
            dist.broadcast_object_list(shared, src=0)
            directory = shared[0]
        saved = load_file(f"{directory}/model.safetensors")
        reader = SafetensorsReader(directory)
        model = build_model(config, parallel=parallel, device="meta", task=task)
        load_hf_weights(model, reader, device="cpu")
        sources = family_module(model.family).hf_sources(model.config)
        coords = coords_of(parallel)
        exported = {}
        for name, p in model.named_parameters():
            source = sources[name]
            tensor = GlobalTensor(reader, source, name)
            full = gather_tensor(p.data, spec_of(p), tensor.shape, parallel.groups, coords)
            first = tensor.items[0] if source.stack else tensor  # stacked experts: every item has these parts
            sizes = [shape[source.cat_dim] for shape in first.part_shapes]
            for hf_name, part in source.split(full, sizes).items():  # what the HF export does
                assert hf_name not in exported, f"{hf_name} is produced twice"
                exported[hf_name] = part
        if distributed:
            dist.barrier()  # rank 0 removes the directory on leaving
    assert sorted(exported) == sorted(saved), set(exported) ^ set(saved)
    for hf_name, part in exported.items():
        assert part.dtype == saved[hf_name].dtype and torch.equal(part, saved[hf_name]), f"{hf_name} differs"
    return len(exported)


def pipeline_parity(architecture: str, config_kwargs: dict, ids, mask, labels, pp: int = 2, tp: int = 1,
                    sequence_parallel: bool = False, num_microbatches: int = 2, atol=LOGITS_ATOL, grad_atol=GRAD_ATOL):
    """A token model with per-token labels (causal or masked LM) split into pp stages: the eval forward gives
    transformers' logits and loss on every rank, and a forward_backward through the schedule its gradients."""
    from colozoo.core.partition import rank_layers
    from colozoo.runtime.training import parallelize

    parallel = init_parallel(pp=pp, tp=tp, sequence_parallel=sequence_parallel)
    model_type = getattr(transformers, architecture).config_class.model_type
    config = transformers.AutoConfig.for_model(model_type, architectures=[architecture], **config_kwargs)
    hf = hf_model(architecture, config)
    ref = hf(ids, attention_mask=mask, labels=labels)
    ref.loss.backward()
    hf_grads = StateDictReader({n: p.grad for n, p in hf.named_parameters() if p.grad is not None})

    layer_ids = rank_layers(config.num_hidden_layers, pp, parallel.rank("pp"))
    model = build_model(config, parallel=parallel, layer_ids=layer_ids, device="meta")
    weights = StateDictReader(hf.state_dict())
    load_hf_weights(model, weights, device="cpu")
    parallelize(model)
    with layer_input_lengths(model) as lengths, torch.no_grad():  # pp evaluates without gradients
        out = model(ids, attention_mask=mask, labels=labels, return_logits=True)
    check_sequence_sharding(lengths, ids.shape[1], tp, sequence_parallel)
    keep = mask.bool()
    report = {"logits": (out.logits - ref.logits)[keep].abs().max().item(), "loss": abs(out.loss.item() - ref.loss.item())}
    close(out.logits[keep], ref.logits[keep], atol, "logits")
    close(out.loss, ref.loss, atol, "loss")
    loss = model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=num_microbatches)
    report["train_loss"] = abs(loss.item() - ref.loss.item())
    close(loss, ref.loss, atol, "forward_backward loss")
    report["grad"] = check_gradients(model, parallel, weights, hf_grads, grad_atol)
    return report


def task_pipeline_parity(architecture: str, config_kwargs: dict, inputs: dict, labels=None, pp: int = 2, tp: int = 1,
                         sequence_parallel: bool = False, num_microbatches: int = 2, atol=LOGITS_ATOL,
                         grad_atol=GRAD_ATOL):
    """An encoder or classifier (BERT, ViT) split into pp stages, fed `inputs` (HF keyword names, the first one
    the main input): the eval forward gives transformers' outputs on every rank; with labels, a forward_backward
    through the schedule (the other inputs split into micro-batches too) gives its loss and gradients."""
    from colozoo.core.partition import rank_layers
    from colozoo.runtime.training import parallelize

    parallel = init_parallel(pp=pp, tp=tp, sequence_parallel=sequence_parallel)
    model_type = getattr(transformers, architecture).config_class.model_type
    config = transformers.AutoConfig.for_model(model_type, architectures=[architecture], **config_kwargs)
    hf = hf_model(architecture, config)
    ref = hf(**inputs, labels=labels)

    layer_ids = rank_layers(config.num_hidden_layers, pp, parallel.rank("pp"))
    model = build_model(config, parallel=parallel, layer_ids=layer_ids, device="meta")
    weights = StateDictReader(hf.state_dict())
    load_hf_weights(model, weights, device="cpu")
    parallelize(model)
    with torch.no_grad():  # pp evaluates without gradients
        out = model(**inputs, labels=labels, return_logits=True)
    report = {}
    for name, ours, theirs in (("logits", out.logits, getattr(ref, "logits", None)),
                               ("last_hidden_state", out.last_hidden_state, getattr(ref, "last_hidden_state", None)),
                               ("pooler_output", out.pooler_output, getattr(ref, "pooler_output", None)),
                               ("loss", out.loss, getattr(ref, "loss", None))):
        assert (ours is None) == (theirs is None), (name, ours, theirs)
        if theirs is not None:
            assert ours.shape == theirs.shape, (name, ours.shape, theirs.shape)
            report[name] = (ours - theirs).abs().max().item()
            close(ours, theirs, atol, f"{name} (pp rank {parallel.rank('pp')})")
    if labels is None:
        return report
    ref.loss.backward()
    hf_grads = StateDictReader({n: p.grad for n, p in hf.named_parameters() if p.grad is not None})
    main, *others = inputs
    loss = model.forward_backward(inputs[main], labels, num_microbatches=num_microbatches,
                                  **{k: inputs[k] for k in others})
    report["train_loss"] = abs(loss.item() - ref.loss.item())
    close(loss, ref.loss, atol, "forward_backward loss")
    report["grad"] = check_gradients(model, parallel, weights, hf_grads, grad_atol)
    return report


def vary_weights(model, std: float = 0.5, seed: int = 3):
    """Redraw every matrix of a tiny random model with a large spread, so that its greedy continuations depend on the
    context (with transformers' small init a tiny model repeats one token whatever it reads) and beams diverge."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model
