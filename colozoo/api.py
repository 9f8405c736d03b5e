"""`colozoo.from_pretrained`: a named model or a local checkpoint, built on meta, each rank loading only its slices.

    model = colozoo.from_pretrained("opt-1.3b", tp=2, pp=2)    # a registry name (or "facebook/opt-1.3b")
    model = colozoo.from_pretrained("/data/ckpt", tp=4)        # a local HF directory or colozoo checkpoint

Weights resolve from a local path, then from the local Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub,
else ~/.cache/huggingface/hub); nothing is downloaded.
"""
from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import torch
import transformers

from colozoo.checkpoint.convert import HF_WEIGHT_FILES, HFCheckpoint, open_checkpoint
from colozoo.checkpoint.save import save_pretrained
from colozoo.checkpoint.format import ColozooCheckpoint
from colozoo.checkpoint.layout import ModelLayout
from colozoo.checkpoint.load import load_global_tensors
from colozoo.checkpoint.peft import load_peft
from colozoo.core.dtypes import parse_dtype
from colozoo.core.mesh import init_parallel
from colozoo.models import build_shard
from colozoo.registry import config_from_dict, get_entry, lookup
from colozoo.runtime.compile import compile_layers
from colozoo.runtime.run import Run


def build_model(config, parallel=None, layer_ids=None, device=None, dtype=None, task: str | None = None,
                layers_per_stage: list[int] | None = None, balance: str | None = None, plan=None,
                compile: bool = False):
    """This rank's shard of a model of `config` (see colozoo.models.build_shard) with its Run attached, so it
    runs on its mesh: pipeline stages, cp sharding, forward_backward, generate, save_pretrained. `compile=True` compiles
    each layer with torch.compile (colozoo.runtime.compile)."""
    model = build_shard(config, parallel=parallel, layer_ids=layer_ids, device=device, dtype=dtype, task=task,
                         layers_per_stage=layers_per_stage, balance=balance)
    if model.can_generate():
        model.generation_config = transformers.GenerationConfig.from_model_config(config)
    Run(model, plan=plan, save=save_pretrained)
    if compile:
        compile_layers(model)
    return model


def hf_cache_dirs() -> list[Path]:
    if os.environ.get("HF_HUB_CACHE"):
        return [Path(os.environ["HF_HUB_CACHE"])]
    hf_home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return [hf_home / "hub"]


def find_in_cache(repo: str) -> tuple[Path | None, list[Path]]:
    """The snapshot directory of `repo` holding weights (refs/main first, else the newest), and where it looked."""
    looked = []
    for cache in hf_cache_dirs():
        root = cache / f"models--{repo.replace('/', '--')}"
        looked.append(root)
        snapshots = root / "snapshots"
        if not snapshots.is_dir():
            continue
        candidates = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
        main = root / "refs" / "main"
        if main.is_file():
            candidates.insert(0, snapshots / main.read_text().strip())
        for snapshot in candidates:
            if any((snapshot / f).exists() for f in HF_WEIGHT_FILES):
                return snapshot, looked
    return None, looked


def resolve(name_or_path: str | os.PathLike, allow_bin: bool = False, verify: bool = True):
    """The checkpoint to load: a local directory (HF or colozoo), else a registry name or a Hugging Face repo id
    ("HuggingFaceTB/SmolLM2-135M-Instruct") found in the local HF cache."""
    path = Path(name_or_path)
    if path.exists():
        return open_checkpoint(path, allow_bin=allow_bin, verify=verify)
    found = lookup(str(name_or_path))
    if found is None:
        text = str(name_or_path)
        if text.startswith((".", "/", "~")) or text.count("/") > 1:
            raise FileNotFoundError(f"no checkpoint at {path} (no such directory)")
        if text.count("/") == 1:  # a repo id the registry does not name: whatever the cache holds of it
            snapshot, looked = find_in_cache(text)
            if snapshot is not None:
                return HFCheckpoint(snapshot, allow_bin=allow_bin)
            raise FileNotFoundError(f"{text!r} is neither a local directory nor in the local Hugging Face cache "
                                    f"(looked in {', '.join(str(p) for p in looked)}; HF_HUB_CACHE and HF_HOME are "
                                    f"honoured); fetch it with `huggingface-cli download {text}`")
        get_entry(str(name_or_path))  # raises the unknown-name error with suggestions
    name, entry = found
    snapshot, looked = find_in_cache(entry["repo"])
    if snapshot is None:
        places = ", ".join(str(p) for p in [path.absolute(), *looked])
        raise FileNotFoundError(f"weights of {name!r} ({entry['repo']}) not found locally; looked in {places} "
                                f"(the HF cache honours HF_HUB_CACHE and HF_HOME). Fetch them with "
                                f"`huggingface-cli download {entry['repo']}`, or pass a local directory.")
    config = None if (snapshot / "config.json").exists() else config_from_dict(entry["config"], entry["architecture"])
    return HFCheckpoint(snapshot, config=config, allow_bin=allow_bin)


def from_pretrained(name_or_path, tp: int = 1, pp: int = 1, dp: int | None = None, cp: int = 1, ep: int = 1,
                    sequence_parallel: bool = False, dtype=None, device=None, allow_bin: bool = False,
                    verify: bool = True, plan: str | None = None, gpu_memory=None,
                    layers_per_stage: list[int] | None = None, balance: str | None = None, adapter=None,
                    compile: bool = False, torch_dtype=None):
    """Build this rank's shard of a model and load its slices. `dtype=None` keeps the checkpoint's dtype;
    `allow_bin` permits PyTorch .bin weights (read with weights_only=True); `verify` checks file checksums.
    `plan="auto"` replaces the degrees by the planner's best plan for the current world size (the whole plan,
    micro-batching, checkpointing and offload included, is left on `model.run.plan`; colozoo.runtime.training.apply_plan(model)
    applies it). Pipeline stages hold `layers_per_stage` layers each, or a partition balanced by `balance`
    ("params" by default, "flops", or "layers" for equal counts). `adapter`: a PEFT LoRA adapter directory (written
    by colozoo or by peft) attached on top, each rank reading only its slices; the base is then frozen. `compile=True`
    compiles each layer with torch.compile (one graph serves every layer; colozoo.runtime.compile). `torch_dtype`:
    transformers' name for `dtype`. The model's `generation_config` is the directory's generation_config.json when it
    has one, as in transformers."""
    dtype = parse_dtype(dtype)  # transformers' names only: "bf16" is refused, as transformers refuses it
    if torch_dtype is not None:
        if dtype is not None and dtype != parse_dtype(torch_dtype, "torch_dtype"):
            raise ValueError(f"dtype={dtype} and torch_dtype={torch_dtype!r} disagree; give one of them")
        dtype = parse_dtype(torch_dtype, "torch_dtype")
    device = torch.device(device) if device is not None else None
    source = resolve(name_or_path, allow_bin=allow_bin, verify=verify)
    config = source.config
    chosen = None
    if plan is not None:
        if plan != "auto":
            raise ValueError(f"plan must be None or 'auto', got {plan!r}")
        from colozoo.core.mesh import init_distributed
        from colozoo.cost.planner import best_plan_for_world

        chosen = best_plan_for_world(config, init_distributed(), gpu_memory=gpu_memory)
        tp, pp, dp, cp, ep, sequence_parallel = asdict(chosen.degrees).values()
    parallel = init_parallel(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, sequence_parallel=sequence_parallel, device=device)
    lora = source.lora if isinstance(source, ColozooCheckpoint) else None  # a checkpoint saved with adapters
    layout = ModelLayout(config, lora=lora)
    if isinstance(source, ColozooCheckpoint):
        source.check_against(layout)
    dtype = dtype or source.tensor(next(iter(layout.tensors))).dtype
    model = build_model(config, parallel=parallel, device="meta", dtype=dtype, layers_per_stage=layers_per_stage,
                        balance=balance,
                        plan=chosen)
    if lora is not None:
        lora.apply(model)
    load_global_tensors(model, source.tensor, device=parallel.device, layout=layout)
    if adapter is not None:
        load_peft(model, adapter)
    if compile:
        compile_layers(model)
    saved = getattr(source, "path", None)
    if model.can_generate() and saved is not None and (Path(saved) / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(saved)
    model.name_or_path = str(saved) if saved is not None else str(name_or_path)
    return model.eval()
