"""Global tensors -> a Hugging Face directory that transformers' `from_pretrained` loads.

The family map `converters/<family>.hf_sources(config)` says which HF tensors make up each of ours; here it
is read backwards (`Source.split`): fused tensors are split into their HF parts (sizes from the fused chunks of
the shard spec), stacked experts unstacked, GPT-2's Conv1D weights transposed back. The vocabulary is stored unpadded, so nothing is trimmed.
Shards are written one tensor at a time; the config keeps its `architectures`, so non-causal families work.
"""
from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from colozoo.checkpoint.atomic import atomic_directory
from colozoo.checkpoint.layout import ModelLayout
from colozoo.converters import family_module
from colozoo.core.errors import CheckpointError
from colozoo.checkpoint.safetensors_io import SafetensorsWriter

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


@dataclass
class HFPart:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def split_sizes(info, source) -> list[int] | None:
    """Part lengths along the concatenation dim when our tensor fuses several HF tensors (from the fused chunks
    of its shard spec); None for equal parts."""
    stacked = bool(getattr(source, "stack", 0))
    names = source.groups()[0].names if stacked else source.names
    dim = source.cat_dim + stacked  # stacked items add a leading dim to ours
    for split in info.spec:
        if len(names) > 1 and split.dim == dim and split.chunks and len(split.chunks) == len(names):
            return list(split.chunks)
    return None


def hf_plan(layout: ModelLayout, dtypes: dict[str, torch.dtype]):
    """[(our name, source, split sizes, [HFPart])] in model order; HF shapes found by splitting a meta tensor."""
    sources = family_module(layout.family).hf_sources(layout.config)
    plan = []
    for name, info in layout.tensors.items():
        source = sources.get(name)
        if source is None:
            raise CheckpointError(f"{layout.family}: no HF name for our tensor {name!r} (converter map incomplete)")
        sizes = split_sizes(info, source)
        try:
            parts = source.split(torch.empty(info.shape, device="meta"), sizes)
        except (RuntimeError, ValueError) as e:
            raise CheckpointError(f"cannot split {name!r} {info.shape} into the HF tensors {source.names}: {e}") from None
        plan.append((name, source, sizes, [HFPart(n, tuple(t.shape), dtypes[name]) for n, t in parts.items()]))
    return plan


def shard_parts(parts: list[HFPart], max_bytes: int) -> list[list[HFPart]]:
    shards, size = [[]], 0
    for part in parts:
        if shards[-1] and size + part.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(part)
        size += part.nbytes
    return shards


def write_hf_config(config, directory: Path, dtype: torch.dtype | None):
    config = copy.deepcopy(config)
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(directory)


def export_hf(tensors, layout: ModelLayout, dst, dtype: torch.dtype | None = None,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool = False, extra_files=(),
              replace: bool = False) -> dict:
    """Write the HF directory `dst` from `tensors[name]` (lazy global tensors: shape, dtype, read()), with copies of
    `extra_files` (tokenizer files...). `replace`: an existing directory is replaced as transformers' save_pretrained
    replaces it (colozoo.checkpoint.atomic)."""
    dtypes = {name: dtype if dtype is not None and t.dtype.is_floating_point else t.dtype
              for name, t in tensors.items()}
    plan = hf_plan(layout, dtypes)
    parts = [part for *_, ps in plan for part in ps]
    shards = shard_parts(parts, max_shard_bytes)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    shard_of = {part.name: i for i, shard in enumerate(shards) for part in shard}
    total = sum(p.nbytes for p in parts)
    with atomic_directory(dst, replace=replace) as tmp, tqdm(total=total, unit="B", unit_scale=True, disable=not progress,
                                            desc="export") as bar:
        writers: dict[int, SafetensorsWriter] = {}
        try:
            for name, source, sizes, hf_parts in plan:
                full = tensors[name].read()
                pieces = source.split(full, sizes)
                for part in hf_parts:
                    i = shard_of[part.name]
                    if i not in writers:
                        writers[i] = SafetensorsWriter(tmp / files[i], [(p.name, p.dtype, p.shape) for p in shards[i]],
                                                       metadata={"format": "pt"})
                    writers[i].write(part.name, pieces.pop(part.name).to(part.dtype))
                    if writers[i].next == len(shards[i]):
                        writers.pop(i).close()
                    bar.update(part.nbytes)
                del full, pieces
        except BaseException:
            for writer in writers.values():
                writer.abort()
            raise
        if len(files) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": {p: files[i] for p, i in shard_of.items()}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        float_dtypes = {d for d in dtypes.values() if d.is_floating_point}
        write_hf_config(layout.config, tmp, float_dtypes.pop() if len(float_dtypes) == 1 else None)
        for file in extra_files:
            shutil.copy2(file, tmp / Path(file).name)
    return {"tensors": len(parts), "bytes": total, "files": len(files),
            "largest_tensor_bytes": max((p.nbytes for p in parts), default=0)}
