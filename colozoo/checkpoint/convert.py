"""Convert and reshard checkpoints, offline and streaming; save a live sharded model collectively.

    convert("hf_dir", "ckpt", tp=2, pp=2)        # HF -> colozoo at a mesh
    convert("ckpt", "ckpt4", tp=4)               # colozoo -> colozoo at another mesh, no HF original needed
    convert("ckpt4", "hf_out", to_hf=True)       # colozoo (or HF) -> HF directory
    model.save_pretrained(path[, format=...])    # a live model: colozoo.checkpoint.save

One process converts tensor by tensor: each global tensor is read once (plain reads, no memory map), cut into
the pieces of every target rank and appended to their files, reads, hashing and writes overlapped in threads
with a bounded amount in flight (`streaming`), so memory stays near the largest tensor. Everything is written
into a temp dir beside the destination and renamed at the end.
"""
from __future__ import annotations

import resource
import shutil
import time
import warnings
import zipfile
from pathlib import Path

import torch
from tqdm import tqdm

from colozoo.checkpoint.checksums import write_checksums
from colozoo.checkpoint.atomic import atomic_directory, check_destination
from colozoo.checkpoint.format import (INDEX_NAME, ColozooCheckpoint, is_colozoo_checkpoint, make_index, plan_mesh,
                                       tensor_entry, write_index)
from colozoo.checkpoint.layout import ModelLayout, check_mesh
from colozoo.core.dtypes import parse_dtype
from colozoo.checkpoint.readers import GlobalTensor, StateDictReader
from colozoo.registry import hf_config
from colozoo.checkpoint.load import HFTensors
from colozoo.checkpoint.readers import index_files
from colozoo.core.errors import CheckpointError
from colozoo.checkpoint.hf_export import DEFAULT_MAX_SHARD_BYTES, export_hf
from colozoo.checkpoint.mxfp4 import MXFP4Reader, dequantized_config, is_mxfp4
from colozoo.checkpoint.safetensors_io import SafetensorsReader
from colozoo.checkpoint.streaming import nbytes, stream_pieces
from colozoo.models import text_config, text_model

HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                   "pytorch_model.bin.index.json")
# what a model directory holds beside its weights and config, carried along by convert in both directions
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
              "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
              "chat_template.jinja", "chat_template.json", "generation_config.json", "preprocessor_config.json")


def side_files(path) -> list[Path]:
    """The tokenizer, generation and preprocessor files of a model directory."""
    return [Path(path) / name for name in SIDE_FILES if (Path(path) / name).is_file()]


# --- sources: an HF directory or a colozoo checkpoint, both giving lazy global tensors by our names ----------

class BinReader(StateDictReader):
    """PyTorch pickles, loaded only on request and only with `weights_only=True`: memory-mapped, but for files in
    torch's legacy (pre-1.6, not zip) format, which torch maps no memory of: those are read whole."""

    def __init__(self, path: Path):
        if (path / "pytorch_model.bin.index.json").exists():
            files = index_files(path / "pytorch_model.bin.index.json")
        else:
            files = ["pytorch_model.bin"]
        state = {}
        for file in files:
            try:
                mappable = zipfile.is_zipfile(path / file)
                state.update(torch.load(path / file, map_location="cpu", weights_only=True, mmap=mappable))
            except Exception as e:
                raise CheckpointError(f"cannot read {path / file}: {e}") from None
        super().__init__(state)


class HFCheckpoint(HFTensors):
    """An HF directory: its config and its safetensors (or, allowed, .bin) weights under our global names."""

    def __init__(self, path, config=None, allow_bin: bool = False):
        self.path = Path(path)
        config = config or hf_config(self.path)
        if text_model(config.model_type) is not None:
            warnings.warn(f"{self.path} holds a {config.architectures[0]}: loading its text model, "
                          f"{text_model(config.model_type)[1]} ignored", stacklevel=2)
            config = text_config(config)
        if (self.path / "model.safetensors").exists() or (self.path / "model.safetensors.index.json").exists():
            reader = SafetensorsReader(self.path)
        elif (self.path / "pytorch_model.bin").exists() or (self.path / "pytorch_model.bin.index.json").exists():
            if not allow_bin:
                raise CheckpointError(f"{self.path} holds only PyTorch .bin weights; pass allow_bin=True (CLI: "
                                      f"--allow-bin) to read them with torch.load(weights_only=True), or convert "
                                      f"them to safetensors")
            reader = BinReader(self.path)
        else:
            raise CheckpointError(f"{self.path} has a config.json but no weights (looked for {', '.join(HF_WEIGHT_FILES)})")
        if is_mxfp4(config):  # gpt-oss as published: read dequantised, exported and resharded as bf16
            reader, config = MXFP4Reader(reader), dequantized_config(config)
        super().__init__(reader, config)


def open_checkpoint(path, allow_bin: bool = False, verify: bool = True, config=None):
    """A colozoo checkpoint or an HF directory, detected from its files."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if is_colozoo_checkpoint(path):
        return ColozooCheckpoint(path, verify=verify)
    if path.is_dir() and (path / "config.json").is_file():
        return HFCheckpoint(path, config=config, allow_bin=allow_bin)
    raise CheckpointError(f"{path} is not a checkpoint: found neither {INDEX_NAME} (colozoo) nor config.json "
                          f"with weights (Hugging Face)")


def global_tensors(source, layout: ModelLayout) -> dict:
    """Lazy global tensors of the source for every tensor of the layout, shapes checked against the config."""
    if isinstance(source, ColozooCheckpoint):
        source.check_against(layout)
    out = {}
    for name, info in layout.tensors.items():
        tensor = source.tensor(name)
        if tuple(tensor.shape) != info.shape:
            hf_names = f" (HF {', '.join(tensor.source.names)})" if isinstance(tensor, GlobalTensor) else ""
            raise CheckpointError(f"tensor {name!r}{hf_names} has shape {tuple(tensor.shape)}, but the config "
                                  f"gives {info.shape}")
        out[name] = tensor
    return out


# --- offline conversion ------------------------------------------------------------------------------------

def peak_rss_mb() -> float:
    """This process's peak resident memory: VmHWM where /proc has it (ru_maxrss would count the memory of the
    parent that started it, which Linux carries over fork and exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_colozoo(tensors: dict, layout: ModelLayout, dst, tp: int = 1, pp: int = 1, ep: int = 1,
                  dtype: torch.dtype | None = None, progress: bool = False, extra_files=()) -> dict:
    plan = plan_mesh(layout, tp, pp, ep)
    dtypes = {name: dtype if dtype is not None and t.dtype.is_floating_point else t.dtype
              for name, t in tensors.items()}
    entries: dict[str, list] = {}
    for name, pieces in plan.items():
        for p in pieces:
            entries.setdefault(p.file, []).append((p.key, dtypes[name], p.shape))
    total = sum(torch.Size(shape).numel() * d.itemsize for es in entries.values() for _, d, shape in es)
    largest = max((nbytes(t) for t in tensors.values()), default=0)
    with atomic_directory(dst) as tmp, tqdm(total=total, unit="B", unit_scale=True, disable=not progress,
                                            desc="convert") as bar:
        files = stream_pieces(plan, tensors, dtypes, entries, tmp, on_bytes=bar.update)
        mesh = {"tp": tp, "pp": pp, "ep": ep, "dp": 1, "cp": 1}
        index = make_index(layout, mesh, {n: tensor_entry(layout.tensors[n], dtypes[n], plan[n]) for n in plan},
                           files)
        write_index(tmp, index)
        for file in extra_files:
            shutil.copy2(file, tmp / file.name)
        write_checksums(tmp)
    return {"tensors": len(plan), "bytes": total, "files": len(entries), "largest_tensor_bytes": largest}


def convert(src, dst, tp: int = 1, pp: int = 1, ep: int = 1, dtype=None, to_hf: bool = False,
            allow_bin: bool = False, verify: bool = True, progress: bool = False,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, replace: bool = False) -> dict:
    """Convert an HF or colozoo checkpoint into a colozoo checkpoint at (tp, pp, ep), or with to_hf=True into an
    HF directory. One process, streaming; tokenizer and generation files come along. `replace` (HF only): an existing
    model directory is replaced as transformers' save_pretrained replaces it. Returns a summary (tensors, bytes,
    seconds, peak RSS)."""
    start = time.perf_counter()
    dst = Path(dst)
    if not (replace and to_hf):
        check_destination(dst)
    dtype = parse_dtype(dtype)
    source = open_checkpoint(src, allow_bin=allow_bin, verify=verify)
    config = source.config
    if to_hf:
        layout = ModelLayout(config)
        summary = export_hf(global_tensors(source, layout), layout, dst, dtype, max_shard_bytes, progress,
                            side_files(src), replace=replace)
    else:
        layout = check_mesh(config, tp, pp, ep)  # one meta model per stage, at the target degrees
        summary = write_colozoo(global_tensors(source, layout), layout, dst, tp, pp, ep, dtype, progress,
                                side_files(src))
    summary.update(seconds=time.perf_counter() - start, peak_rss_mb=peak_rss_mb())
    return summary
