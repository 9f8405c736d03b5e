"""The colozoo sharded checkpoint format: a directory with `colozoo_index.json` and safetensors files.

The index holds the format version, the family, the HF config, the mesh it was saved on, and for every
*global* tensor (our names, global layer/expert indices, vocabulary padding never stored, fused q/k/v stored
fused, tied embeddings stored once) its shape, dtype, shard spec and the pieces that hold it:
{file, key, offsets (global start per dim), shape}. Every file carries its sha256 and size. Any mesh reads
any other mesh's checkpoint by slices: a piece is read only where it meets the requested slice.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from colozoo.core.dtypes import dtype_name
from colozoo.core.errors import CheckpointError
from colozoo.layers.shard import Split, stored_pieces
from colozoo.checkpoint.checksums import verify_checksums
from colozoo.checkpoint.layout import ModelLayout, TensorInfo
from colozoo.checkpoint.safetensors_io import SafetensorsFile
from colozoo.registry import COLOZOO_INDEX as INDEX_NAME

FORMAT_VERSION = 1


def is_colozoo_checkpoint(path) -> bool:
    return (Path(path) / INDEX_NAME).is_file()


# --- the index: which pieces of which global tensors each file holds ------------------------------

def file_name(pp_rank: int, tp_rank: int, ep_rank: int) -> str:
    return f"model-pp{pp_rank:02d}-tp{tp_rank:02d}-ep{ep_rank:02d}.safetensors"


def saves(spec, coords) -> bool:
    """A replicated dimension is saved by its rank 0 only."""
    split_dims = {s.mesh_dim for s in spec}
    return all(coords.get(d, (0, 1))[0] == 0 for d in ("tp", "ep") if d not in split_dims)


@dataclass
class Piece:
    name: str
    file: str
    key: str
    offsets: list[int]
    index: tuple  # global slice
    local: tuple = ()  # the same data's slice of the rank's local tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.index)

    def to_json(self) -> dict:
        return {"file": self.file, "key": self.key, "offsets": self.offsets, "shape": list(self.shape)}


def rank_pieces(name: str, info: TensorInfo, coords, file: str) -> list[Piece]:
    """The pieces of a global tensor that the rank at `coords` stores (none if another rank owns them)."""
    if not saves(info.spec, coords):
        return []
    found = [(offsets, tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, info.shape)), local)
             for offsets, index, local in stored_pieces(info.shape, info.spec, coords)]
    return [Piece(name, file, name if len(found) == 1 else f"{name}:{i}", offsets, index, local)
            for i, (offsets, index, local) in enumerate(found)]


def plan_mesh(layout: ModelLayout, tp: int, pp: int, ep: int) -> dict[str, list[Piece]]:
    """Every global tensor's pieces for a checkpoint saved at (tp, pp, ep), in model order."""
    if pp != layout.pp:
        raise ValueError(f"layout built for pp={layout.pp}, asked for pp={pp}")
    out = {}
    for name, info in layout.tensors.items():
        out[name] = [piece for t in range(tp) for e in range(ep)
                     for piece in rank_pieces(name, info, {"tp": (t, tp), "ep": (e, ep)},
                                              file_name(info.stage, t, e))]
    return out


def make_index(layout: ModelLayout, mesh: dict, tensors: dict[str, dict], files: dict[str, dict]) -> dict:
    config = layout.config
    index = {"format": "colozoo", "format_version": FORMAT_VERSION, "family": config.model_type,
             "architecture": (getattr(config, "architectures", None) or [None])[0],
             "mesh": mesh, "config": config.to_dict(), "tied": layout.aliases, "tensors": tensors, "files": files}
    if layout.lora is not None:
        index["lora"] = layout.lora.to_json()
    return index


def tensor_entry(info: TensorInfo, dtype: torch.dtype, pieces) -> dict:
    return {"shape": list(info.shape), "dtype": dtype_name(dtype), "spec": [s.to_json() for s in info.spec],
            "pieces": [p.to_json() if isinstance(p, Piece) else p for p in pieces]}


def write_index(directory: Path, index: dict, name: str = INDEX_NAME):
    path = directory / name
    with open(path, "w") as f:
        json.dump(index, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


# --- reading -----------------------------------------------------------------------------------------------

def _is_shape(value) -> bool:
    return isinstance(value, list) and all(type(n) is int and n >= 0 for n in value)


def _valid_piece(piece, shape: list) -> bool:
    return (isinstance(piece, dict) and isinstance(piece.get("file"), str) and isinstance(piece.get("key"), str)
            and _is_shape(piece.get("shape")) and _is_shape(piece.get("offsets"))
            and len(piece["shape"]) == len(piece["offsets"]) == len(shape)
            and all(o + n <= s for o, n, s in zip(piece["offsets"], piece["shape"], shape)))


def index_problem(index) -> str | None:
    """What is structurally wrong with a parsed colozoo index (a hand edit, a bad copy), or None."""
    if not isinstance(index, dict):
        return "it is not a JSON object"
    for key in ("config", "mesh", "files", "tensors"):
        if not isinstance(index.get(key), dict):
            return f"{key!r} is missing or not an object"
    for name, info in index["files"].items():
        if not (isinstance(info, dict) and type(info.get("size")) is int and isinstance(info.get("sha256"), str)):
            return f"the entry of file {name!r} is malformed"
    for name, entry in index["tensors"].items():
        if not (isinstance(entry, dict) and _is_shape(entry.get("shape")) and isinstance(entry.get("dtype"), str)
                and isinstance(entry.get("pieces"), list) and isinstance(entry.get("spec", []), list)):
            return f"the entry of tensor {name!r} is malformed"
        try:
            for split in entry.get("spec", []):
                Split.from_json(split)
        except (AttributeError, KeyError, TypeError, ValueError):
            return f"the shard spec of tensor {name!r} is malformed"
        if not all(_valid_piece(p, entry["shape"]) for p in entry["pieces"]):
            return f"a piece of tensor {name!r} is malformed or lies outside its shape {entry['shape']}"
    return None


class ColozooTensor:
    """One global tensor of a colozoo checkpoint: `shape`, `dtype`, and `read(index)` over its pieces."""

    def __init__(self, checkpoint: "ColozooCheckpoint", name: str, entry: dict):
        self.checkpoint, self.name = checkpoint, name
        self.shape = tuple(entry["shape"])
        self.dtype = getattr(torch, entry["dtype"], None)
        if not isinstance(self.dtype, torch.dtype):
            raise CheckpointError(f"{checkpoint.path / INDEX_NAME}: {name!r} has an unknown dtype {entry['dtype']!r}")
        self.spec = tuple(Split.from_json(s) for s in entry.get("spec", ()))
        self.pieces = entry["pieces"]

    def read(self, index: tuple | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The slice `index` of the global tensor; with `out`, copied (and cast) into it instead."""
        index = tuple(index or ())
        box = [range(*s.indices(n)) for s, n in zip(index, self.shape)]
        box += [range(n) for n in self.shape[len(box):]]
        if any(len(r) == 0 for r in box):
            return out if out is not None else torch.empty([len(r) for r in box], dtype=self.dtype)
        found = False
        for piece in self.pieces:
            start = piece["offsets"]
            meet = [range(max(b.start, o), min(b.stop, o + n)) for b, o, n in zip(box, start, piece["shape"])]
            if any(len(r) == 0 for r in meet):
                continue
            local = tuple(slice(r.start - o, r.stop - o) for r, o in zip(meet, start))
            data = self.checkpoint.read_piece(self.name, piece, local)
            if meet == box and out is None:
                return data
            if out is None:
                out = torch.empty([len(r) for r in box], dtype=self.dtype)
            out[tuple(slice(r.start - b.start, r.stop - b.start) for r, b in zip(meet, box))] = data
            found = True
        if not found:
            raise CheckpointError(f"{self.checkpoint.path}: no piece of {self.name!r} covers the slice {index}")
        return out


class ColozooCheckpoint:
    """A colozoo checkpoint directory opened for slice reads: with `verify`, its index and side files are checked
    against checksums.json when opened, its tensor files (size, sha256) when first used."""

    def __init__(self, path, verify: bool = True, index_name: str = INDEX_NAME):
        """`index_name`: another index of the same schema (a training state's optimizer tensors)."""
        self.path = Path(path)
        index_path = self.path / index_name
        if not index_path.is_file():
            raise CheckpointError(f"{self.path} is not a colozoo checkpoint (no {index_name})")
        try:
            self.index = json.loads(index_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index_path} is corrupted: {e}") from None
        if not isinstance(self.index, dict):
            raise CheckpointError(f"{index_path} is corrupted: it is not a JSON object")
        if self.index.get("format") != "colozoo" or self.index.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"{index_path}: unsupported format {self.index.get('format')!r} version "
                                  f"{self.index.get('format_version')!r} (this colozoo reads version {FORMAT_VERSION})")
        problem = index_problem(self.index)
        if problem:
            raise CheckpointError(f"{index_path} is corrupted: {problem}")
        self.verify = verify
        self._files: dict[str, SafetensorsFile] = {}
        for name, info in self.index["files"].items():
            file = self.path / name
            if not file.is_file():
                raise CheckpointError(f"{file} is listed in {INDEX_NAME} but missing")
            if file.stat().st_size != info["size"]:
                raise CheckpointError(f"{file} has {file.stat().st_size} bytes, the index says {info['size']} "
                                      f"(truncated or corrupted)")
        for name, entry in self.index["tensors"].items():
            covered = sum(math.prod(p["shape"]) for p in entry["pieces"])
            if covered != math.prod(entry["shape"]):
                raise CheckpointError(f"{index_path}: the pieces of {name!r} cover {covered} of "
                                      f"{math.prod(entry['shape'])} elements")
            for piece in entry["pieces"]:
                if piece["file"] not in self.index["files"]:
                    raise CheckpointError(f"{index_path}: a piece of {name!r} is in {piece['file']!r}, which the "
                                          f"index does not list")
        if verify:  # the index, and every other file beside the tensors, as saved (checksums.json)
            note = verify_checksums(self.path)
            if note:
                warnings.warn(note, stacklevel=2)

    @cached_property
    def config(self):
        from colozoo.registry import config_from_dict

        return config_from_dict(self.index["config"], self.index.get("architecture"))

    @property
    def mesh(self) -> dict:
        return self.index["mesh"]

    @property
    def lora(self):
        """The LoraSettings of the adapters the checkpoint holds, or None."""
        if "lora" not in self.index:
            return None
        from colozoo.runtime.lora import LoraSettings

        try:
            return LoraSettings.from_json(self.index["lora"])
        except (KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{self.path / INDEX_NAME}: its 'lora' entry is malformed: {e!r}") from None

    def names(self) -> list[str]:
        return list(self.index["tensors"])

    def tensor(self, name: str) -> ColozooTensor:
        if name not in self.index["tensors"]:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint {self.path}")
        return ColozooTensor(self, name, self.index["tensors"][name])

    def file(self, name: str) -> SafetensorsFile:
        handle = self._files.get(name)
        if handle is None:
            if name not in self.index["files"]:
                raise CheckpointError(f"{self.path / INDEX_NAME} refers to {name}, which it does not list")
            handle = SafetensorsFile(self.path / name)
            if self.verify:
                expected, actual = self.index["files"][name]["sha256"], handle.sha256()
                if actual != expected:
                    raise CheckpointError(f"checksum mismatch in {self.path / name}: sha256 {actual}, the index "
                                          f"says {expected} (corrupted file)")
            self._files[name] = handle
        return handle

    def read_piece(self, name: str, piece: dict, local: tuple) -> torch.Tensor:
        handle = self.file(piece["file"])
        entry = handle.entries.get(piece["key"])
        if entry is None or list(entry[1]) != list(piece["shape"]):
            raise CheckpointError(f"{handle.path}: piece {piece['key']!r} of {name!r} is missing or has the wrong "
                                  f"shape (index says {piece['shape']})")
        return handle.read(piece["key"], local)

    def check_against(self, layout: ModelLayout):
        """Every global tensor of the model present with the right shape, and nothing else."""
        names = set(self.names())
        missing = [n for n in layout.tensors if n not in names]
        unexpected = sorted(names - set(layout.tensors))
        if missing:
            raise CheckpointError(f"tensors missing from the checkpoint {self.path}: {missing[:8]}"
                                  f"{' ...' if len(missing) > 8 else ''}")
        if unexpected and all(".lora." in n for n in unexpected):
            raise CheckpointError(f"the checkpoint {self.path} holds LoRA adapters, which this model (or HF export) "
                                  f"lacks: load it with colozoo.from_pretrained, or export merged weights with "
                                  f"model.save_pretrained(path, format='hf', merge_lora=True)")
        if unexpected:
            raise CheckpointError(f"unexpected tensors in the checkpoint {self.path}: {unexpected[:8]}"
                                  f"{' ...' if len(unexpected) > 8 else ''}")
        for name, info in layout.tensors.items():
            shape = tuple(self.index["tensors"][name]["shape"])
            if shape != info.shape:
                raise CheckpointError(f"tensor {name!r} has shape {shape} in {self.path}, but the config gives "
                                      f"{info.shape}")
