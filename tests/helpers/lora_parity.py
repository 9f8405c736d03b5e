"""LoRA parity with PEFT on transformers: the same base weights and the same adapters (ours initialised by
apply_lora, PEFT's set to the same values; B random so every gradient is non-trivial) give the same loss, logits
and adapter gradients. Runs on every rank of a job, or on one process."""
from __future__ import annotations

import math
import zlib

import torch
import transformers
from family_cases import ENCODERS, NAMES, TABLE, attention, encoder_inputs, model_type, tiny_kwargs
from parity import batch, close, hf_causal_lm, hf_model, layer_input_lengths

from colozoo.api import build_model
from colozoo.checkpoint.load import load_hf_weights
from colozoo.checkpoint.readers import StateDictReader
from colozoo.checkpoint.readers import GlobalTensor
from colozoo.converters import family_module
from colozoo.core.mesh import coords_of, init_parallel, single_process
from colozoo.layers.shard import gather_tensor, local_part, materialize, shard_tensor, spec_of
from colozoo.runtime.lora import apply_lora, b_from_hf, b_to_hf, lora_modules, trained_modules
from colozoo.runtime.training import build_optimizer, parallelize

R, ALPHA, ATOL = 4, 8, 1e-5
# name: (transformers model type, config, targets): every family of the table, its declared config and LoRA targets
# (every kind of linear and fused chunk, a subset of a fused qkv somewhere); BERT with a classifier, trained whole
# beside the adapters (PEFT's modules_to_save)
TASK = {"bert": dict(architectures=["BertForSequenceClassification"])}
CASES = {name: (model_type(name), tiny_kwargs(name, **TASK.get(name, {})), TABLE[name].tiny.lora) for name in NAMES}
FAMILIES = ("gpt2", "opt", "llama", "bert")  # the meshes of tests/test_lora.py: one of every kind of linear
MORE = tuple(name for name in CASES if name not in FAMILIES)  # tests/test_lora_families.py


def hf_and_batch(family: str, overrides: dict | None = None):
    """(config, transformers model, inputs, labels)."""
    model_type, kwargs, _ = CASES[family]
    config = transformers.AutoConfig.for_model(model_type, **{**kwargs, **(overrides or {})})
    if family in ENCODERS:
        inputs, labels = encoder_inputs(config, batch_size=4)
        return config, hf_model(config.architectures[0], config), inputs, labels
    config, hf = hf_causal_lm(model_type, {**kwargs, **(overrides or {})}, attn_implementation=attention(model_type))
    ids, mask, labels = batch(config.vocab_size, 12, batch_size=4)
    return config, hf, dict(input_ids=ids, attention_mask=mask), labels


def expected_b(hf_module: str, out: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(hf_module.encode()) + 1)
    return torch.randn(out, R, generator=g) * 0.3


def expected_a(hf_module: str, in_features: int) -> torch.Tensor:
    from colozoo.runtime.lora import _generator

    return torch.nn.init.kaiming_uniform_(torch.empty(R, in_features), a=math.sqrt(5), generator=_generator(0, hf_module))


@torch.no_grad()
def randomize_b(model):
    """Every B set to its expected_b (sliced for this rank), so the gradients of A are not zero."""
    for lora in lora_modules(model).values():
        full = torch.cat([b_from_hf(lora, expected_b(n, s)) for n, s in zip(lora.hf_modules, lora.pair_sizes)], 0)
        lora.B.copy_(shard_tensor(full, lora.b_spec, lora.coords))


def peft_model(family: str, hf, use_rslora: bool = False):
    import peft

    model_type, _, targets = CASES[family]
    classifier = (hf.config.architectures or [""])[0].endswith("ForSequenceClassification")  # trained whole too
    config = peft.LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, fan_in_fan_out=model_type == "gpt2",
                             task_type="SEQ_CLS" if classifier else None,
                             use_rslora=use_rslora,
                             target_modules=targets if isinstance(targets, str) else list(targets))
    model = peft.get_peft_model(hf, config)
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                hf_name = name.removeprefix("base_model.model.")
                module.lora_A["default"].weight.copy_(expected_a(hf_name, module.lora_A["default"].weight.shape[1]))
                module.lora_B["default"].weight.copy_(expected_b(hf_name, module.lora_B["default"].weight.shape[0]))
    return model


def peft_grads(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {name.removeprefix("base_model.model."): (m.lora_A["default"].weight.grad, m.lora_B["default"].weight.grad)
            for name, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}


def peft_saved_grads(model) -> dict[str, torch.Tensor]:
    """{HF parameter name: gradient} of PEFT's modules_to_save copies."""
    return {name.removeprefix("base_model.model.").replace("modules_to_save.default.", ""): p.grad
            for name, p in model.named_parameters() if "modules_to_save.default." in name}


def full_adapter(model, lora, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The adapter's (A, B) or their gradients, gathered over FSDP's dp shards and tp."""
    out = []
    for p, spec, shape in ((lora.A, lora.a_spec, lora.global_shapes[0]), (lora.B, lora.b_spec, lora.global_shapes[1])):
        t = p.grad if grad else p
        assert t is not None, "an adapter got no gradient"
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        out.append(gather_tensor(t.detach(), spec, shape, model.parallel.groups, coords_of(model.parallel)))
    return tuple(out)


def chunks_of(lora, a, b):
    """{HF module: (A, B)} of one adapter's global tensors, B in the HF module's row order."""
    return {n: (a_i, b_to_hf(lora, b_i))
            for n, a_i, b_i in zip(lora.hf_modules, a.split(lora.r, 0), b.split(lora.pair_sizes, 0))}


def load_base(model, hf, parallel):
    """The transformers model's weights into ours (MoE families: from its stacked in-memory experts)."""
    conv = family_module(model.config.model_type)
    if not hasattr(conv, "module_sources"):
        return load_hf_weights(model, StateDictReader(hf.state_dict()), device="cpu")
    materialize(model, "cpu")
    model.reset_buffers()
    reader, sources = StateDictReader(hf.state_dict()), conv.module_sources(model.config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(shard_tensor(GlobalTensor(reader, sources[name], name).read(), spec_of(p), coords_of(parallel)))
    return model


def lora_parity(family: str, tp: int = 1, pp: int = 1, dp: int = 1, data_parallel: str | None = None,
                use_rslora: bool = False, cp: int = 1, ep: int = 1, overrides: dict | None = None,
                sequence_parallel: bool = False) -> int:
    """Loss (and logits where the model gives them), every adapter and its gradient against PEFT; base weights
    without gradient, the optimizer holding adapters only. Returns how many HF modules this rank checked."""
    parallel = init_parallel(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, sequence_parallel=sequence_parallel) \
        if tp * pp * dp * cp > 1 else single_process()
    config, hf, inputs, labels = hf_and_batch(family, overrides)
    model = load_base(build_model(config, parallel=parallel, device="meta"), hf, parallel)
    if ep > 1:  # each rank holds its share of the experts
        experts = model.experts(config)
        stacked = [p for n, p in model.named_parameters() if n.endswith("experts.down_proj")]
        assert stacked and all(p.shape[0] == experts // ep for p in stacked), "experts are not split over ep"
    apply_lora(model, r=R, alpha=ALPHA, targets=CASES[family][2], use_rslora=use_rslora)
    randomize_b(model)
    reference = peft_model(family, hf, use_rslora)
    ref = reference(**inputs, labels=labels)
    ref.loss.backward()
    expected, expected_saved = peft_grads(reference), peft_saved_grads(reference)

    if data_parallel or pp * cp * ep > 1:
        parallelize(model, data_parallel=data_parallel or "ddp")
        ids = inputs.pop("input_ids")
        with layer_input_lengths(model) as lengths:
            loss = model.forward_backward(ids, labels, num_microbatches=2, **inputs)
        assert set(lengths) == {ids.shape[1] // cp}, f"layers saw {set(lengths)} positions at cp={cp}"
    else:
        out = model(**inputs, labels=labels, return_logits=True)
        close(out.logits, ref.logits, ATOL, "logits")
        loss = out.loss
        loss.backward()
    close(loss, ref.loss, ATOL, "loss")

    checked = 0
    for name, lora in lora_modules(model).items():
        values = chunks_of(lora, *full_adapter(model, lora, grad=False))
        grads = chunks_of(lora, *full_adapter(model, lora, grad=True))
        for hf_name, (a, b) in values.items():
            assert torch.equal(a, expected_a(hf_name, a.shape[1])), f"A of {hf_name} is not PEFT's init"
            assert torch.equal(b, expected_b(hf_name, b.shape[0])), f"B of {hf_name} was not set"
            close(grads[hf_name][0], expected[hf_name][0], ATOL, f"gradient of {hf_name}.lora_A")
            close(grads[hf_name][1], expected[hf_name][1], ATOL, f"gradient of {hf_name}.lora_B")
            checked += 1
    if pp == 1:
        assert checked == len(expected), f"PEFT adapted {sorted(expected)}, ours {checked} of them"
    trained, params = trained_modules(model), dict(model.named_parameters())
    for name, hf_name in trained.items():
        grad = params[name].grad
        grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        close(grad, expected_saved[hf_name], ATOL, f"gradient of {hf_name} (modules_to_save)")
    if pp == 1 or model.is_last:
        assert set(trained.values()) == set(expected_saved), f"trained whole: ours {trained}, PEFT {expected_saved}"
    for name, p in model.named_parameters():
        if ".lora." not in f".{name}" and name not in trained:
            assert not p.requires_grad and p.grad is None, f"base parameter {name} is trainable or got a gradient"
    optimizer = build_optimizer(model)
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    adapters = {id(p) for lora in lora_modules(model).values() for p in (lora.A, lora.B)}
    adapters |= {id(params[name]) for name in trained}
    assert held == adapters, "the optimizer must hold the adapters (and modules_to_save) and nothing else"
    assert all(local_part(p).dtype == torch.float32 for lora in lora_modules(model).values() for p in (lora.A, lora.B))
    return checked
