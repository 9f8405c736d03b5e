"""LoRA adapters in PEFT's format: a directory with `adapter_config.json` and `adapter_model.safetensors`, whose
tensors carry the names PEFT gives them on the transformers model (`base_model.model.<HF module>.lora_A.weight`,
`...lora_B.weight`; A (r, in) and B (out, r) whatever the module, GPT-2's Conv1D too: fan_in_fan_out only says how
PEFT merges them).

    model.save_pretrained(path, format="peft")      # gathered from the shards, rank 0 writes (temp dir, rename)
    colozoo.from_pretrained(base, adapter=path, tp=4)   # any mesh, each rank reading only its slices
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from colozoo.checkpoint.collective import collective, world
from colozoo.checkpoint.atomic import atomic_directory, check_destination
from colozoo.checkpoint.load import copy_slices
from colozoo.checkpoint.safetensors_io import SafetensorsReader
from colozoo.checkpoint.readers import GlobalTensor
from colozoo.converters import family_module
from colozoo.converters.source import Source
from colozoo.core.errors import CheckpointError
from colozoo.core.mesh import coords_of
from colozoo.layers.shard import gather_tensor, spec_of
from colozoo.runtime.lora import (LoraSettings, b_to_hf, hf_linear_modules, hf_parameter_names, lora_modules,
                                  lora_settings, trained_modules)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
# PEFT options colozoo does not implement: a directory using one is refused rather than loaded wrongly
UNSUPPORTED = {"use_dora": False, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
               "bias": "none", "lora_bias": False}
TASK_TYPES = (("ForCausalLM", "CAUSAL_LM"), ("LMHeadModel", "CAUSAL_LM"), ("ForSequenceClassification", "SEQ_CLS"))


def peft_names(hf_module: str) -> tuple[str, str]:
    return f"{PREFIX}{hf_module}.lora_A.weight", f"{PREFIX}{hf_module}.lora_B.weight"


def _full(t: torch.Tensor, spec, shape, parallel) -> torch.Tensor:
    t = t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP: the dp shards first
    return gather_tensor(t.detach(), spec, shape, parallel.groups, coords_of(parallel)).cpu()


def gather_adapters(model) -> dict[str, torch.Tensor]:
    """This stage's adapters under PEFT's names, on the rank that owns them (tp rank 0 of the first data rank);
    collective over tp and FSDP's data ranks."""
    parallel, out = model.parallel, {}
    owner = parallel.rank("tp") == 0 and parallel.rank("dp_cp") == 0
    for lora in lora_modules(model).values():
        (a_shape, b_shape) = lora.global_shapes
        a, b = _full(lora.A, lora.a_spec, a_shape, parallel), _full(lora.B, lora.b_spec, b_shape, parallel)
        if owner:
            for hf, a_i, b_i in zip(lora.hf_modules, a.split(lora.r, 0), b.split(lora.pair_sizes, 0)):
                name_a, name_b = peft_names(hf)
                out[name_a], out[name_b] = a_i.contiguous(), b_to_hf(lora, b_i).contiguous()
    params = dict(model.named_parameters())
    for name, hf in sorted(trained_modules(model).items()):  # modules_to_save, under the module's own names
        p = params[name]  # replicated over tp (apply_lora refuses others); FSDP: gathered over dp
        full = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
        if owner:
            out[f"{PREFIX}{hf}"] = full.contiguous()
    return out


def adapter_config(model, settings: LoraSettings, targets: list[str]) -> dict:
    sources = family_module(model.config.model_type).hf_sources(model.config)
    conv1d = {n.removesuffix(".weight") for s in sources.values() if s.transpose for n in s.names}
    architecture = (getattr(model.config, "architectures", None) or [""])[0]
    task = next((task for suffix, task in TASK_TYPES if architecture.endswith(suffix)), None)
    return {"peft_type": "LORA", "task_type": task, "base_model_name_or_path": getattr(model.config, "_name_or_path", None) or None,
            "r": settings.r, "lora_alpha": settings.alpha, "lora_dropout": settings.dropout,
            "use_rslora": settings.use_rslora, "target_modules": targets,
            "fan_in_fan_out": any(t in conv1d for t in targets), "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": list(settings.modules_to_save) or None, **UNSUPPORTED}


def save_peft(model, path):
    """Write the model's adapters as a PEFT adapter directory (collective; rank 0 writes, atomically)."""
    dst = Path(path)
    rank, size = world()
    collective(f"preparing {dst}", lambda: check_destination(dst))
    mine = gather_adapters(model)
    settings = lora_settings(model)
    everything = [(mine, settings)]
    if size > 1:
        everything = [None] * size
        dist.all_gather_object(everything, (mine, settings))

    def write():
        if rank != 0:
            return
        tensors = {k: v for part, _ in everything for k, v in part.items()}
        found = [s for _, s in everything if s is not None]
        if not tensors or not found:
            raise CheckpointError("the model has no LoRA adapters to save (colozoo.runtime.lora.apply_lora adds them)")
        targets = sorted({k.removeprefix(PREFIX).removesuffix(".lora_A.weight") for k in tensors if k.endswith("A.weight")})
        saved = tuple(sorted({m for s in found for m in s.modules_to_save}))
        config = adapter_config(model, dataclasses.replace(found[0], modules_to_save=saved), targets)
        with atomic_directory(dst) as tmp:
            save_file(dict(sorted(tensors.items())), tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
            (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))

    collective(f"writing the adapter {dst}", write)


def read_adapter_config(path) -> LoraSettings:
    """The LoRA settings of a PEFT adapter directory, refused with a clear error where colozoo cannot honour them."""
    path = Path(path)
    file = path / ADAPTER_CONFIG
    if not file.is_file():
        raise CheckpointError(f"{path} is not a PEFT adapter directory (no {ADAPTER_CONFIG})")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is corrupted: {e}") from None
    if config.get("peft_type") != "LORA":
        raise CheckpointError(f"{file}: only LoRA adapters are supported, this one is {config.get('peft_type')!r}")
    for key, default in UNSUPPORTED.items():
        if config.get(key, default) not in (default, None, {}, "none", False):
            raise CheckpointError(f"{file}: {key}={config[key]!r} is not supported by colozoo's LoRA")
    targets = config.get("target_modules")
    if not targets:
        raise CheckpointError(f"{file} names no target_modules")
    return LoraSettings(int(config["r"]), config.get("lora_alpha", 8), config.get("lora_dropout", 0.0),
                        targets if isinstance(targets, str) else tuple(targets), bool(config.get("use_rslora", False)),
                        tuple(config.get("modules_to_save") or ()))


@torch.no_grad()
def load_peft(model, path):
    """Attach the adapters of a PEFT directory to `model` (apply_lora with its settings) and fill them with this
    rank's slices, read straight from the file."""
    path = Path(path)
    settings = read_adapter_config(path)
    if not (path / ADAPTER_WEIGHTS).is_file():
        raise CheckpointError(f"{path} has no {ADAPTER_WEIGHTS} (adapters saved as .bin are not read)")
    reader = SafetensorsReader(path / ADAPTER_WEIGHTS)
    known = {n for names in hf_linear_modules(model.config).values() for n in names}
    adapters = [k for k in reader.names() if ".lora_" in k]
    stray = [k for k in adapters if k.rsplit(".lora_", 1)[0].removeprefix(PREFIX) not in known]
    if stray:
        raise CheckpointError(f"{path / ADAPTER_WEIGHTS}: tensors for modules this {model.config.model_type} model "
                              f"does not have: {stray[:4]}")
    try:
        settings.apply(model)
    except ValueError as e:
        raise CheckpointError(f"{path / ADAPTER_CONFIG}: {e}") from None
    _load_trained_modules(model, reader, path)
    adapted = {hf for lora in lora_modules(model).values() for hf in lora.hf_modules}
    left = sorted({k.rsplit(".lora_", 1)[0].removeprefix(PREFIX) for k in adapters} - adapted)
    if left and model.parallel.config.pp == 1:  # (a pipeline stage sees only its own layers' adapters)
        raise CheckpointError(f"{path}: adapters of {left[:4]} have no tensor-parallel linear to attach to in colozoo "
                              f"(a pooler or head is a plain linear here)")
    coords = coords_of(model.parallel)
    for lora in lora_modules(model).values():
        names = [peft_names(hf) for hf in lora.hf_modules]
        for param, spec, shape, which in ((lora.A, lora.a_spec, lora.global_shapes[0], 0),
                                          (lora.B, lora.b_spec, lora.global_shapes[1], 1)):
            regroup = lora.regroup if which == 1 else None  # one HF module (GPT-NeoX's query_key_value) per adapter
            tensor = GlobalTensor(reader, Source.of(*(n[which] for n in names), regroup=regroup), f"{lora.hf_modules}")
            if tuple(tensor.shape) != tuple(shape):
                raise CheckpointError(f"{path}: the adapter of {lora.hf_modules} has shape {tuple(tensor.shape)}, "
                                      f"the model expects {tuple(shape)} (r={settings.r})")
            copy_slices(tensor, param, spec, coords)
    return model



def _load_trained_modules(model, reader, path):
    """The modules_to_save tensors (saved under the module's own names) into this rank's parameters."""
    params, names = dict(model.named_parameters()), set(reader.names())
    trained = trained_modules(model)
    missing = [f"{PREFIX}{hf}" for hf in trained.values() if f"{PREFIX}{hf}" not in names]
    if missing:
        raise CheckpointError(f"{path / ADAPTER_WEIGHTS} lacks the modules_to_save tensors {missing[:4]}")
    stray = sorted(k for k in names if ".lora_" not in k and k.removeprefix(PREFIX) not in
                   {hf for hf in hf_parameter_names(model.config).values()})
    if stray:
        raise CheckpointError(f"{path / ADAPTER_WEIGHTS}: tensors for modules this {model.config.model_type} model "
                              f"does not have: {stray[:4]}")
    for name, hf in trained.items():
        copy_slices(GlobalTensor(reader, Source.of(f"{PREFIX}{hf}"), hf), params[name], spec_of(params[name]),
                    coords_of(model.parallel))
