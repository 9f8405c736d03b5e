"""Saving a live model, collectively: every rank of a job writes its own shard of a colozoo checkpoint, or the model
is exported as a directory transformers loads (with the tokenizer, chat template and generation config it came
with), or its LoRA adapters as PEFT writes them.

    model.save_pretrained("out/")                     # an HF directory: transformers' from_pretrained loads it
    model.save_pretrained("ckpt/", format="colozoo")  # sharded, reshardable onto any mesh
    model.save_pretrained("adapter/", format="peft")

A save replaces an existing model directory as transformers' does (its other files stay), atomically: the new
directory is complete before it takes the old one's name.
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from colozoo.checkpoint.atomic import check_destination, publish
from colozoo.checkpoint.collective import collective as _collective, world as _world
from colozoo.checkpoint.convert import convert, side_files
from colozoo.checkpoint.checksums import write_checksums
from colozoo.checkpoint.format import file_name, is_colozoo_checkpoint, make_index, rank_pieces, tensor_entry, write_index
from colozoo.checkpoint.hf_export import DEFAULT_MAX_SHARD_BYTES, export_hf
from colozoo.checkpoint.layout import ModelLayout
from colozoo.checkpoint.peft import save_peft
from colozoo.checkpoint.safetensors_io import SafetensorsWriter
from colozoo.core.dtypes import dtype_name
from colozoo.core.errors import CheckpointError
from colozoo.runtime.lora import lora_modules, lora_settings, merged_lora

FORMATS = ("hf", "colozoo", "peft")


def _prepare(dst: Path, tmp: Path, rank: int, replace: bool = False):
    if not replace:
        check_destination(dst)
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)


@torch.no_grad()
def _write_own_shard(model, layout: ModelLayout, tmp: Path):
    """This rank's file: the pieces it owns (one owner per replicated tensor). Returns (file, info, pieces).

    Under FSDP every data rank gathers each parameter in turn (a collective) and the owner writes it before the next
    is gathered, so no rank ever holds more than one whole parameter. A failed write stops the writing, not the
    gathering: the other ranks would wait in the next all-gather otherwise."""
    from torch.distributed.tensor import DTensor  # a second of imports that an offline conversion does not need

    parallel = model.parallel
    ep, dp_cp_rank = parallel.size("ep"), parallel.rank("dp_cp")
    # experts fold over dp x cp
    coords = {"tp": (parallel.rank("tp"), parallel.size("tp")), "ep": (dp_cp_rank % ep, ep)}
    file = file_name(parallel.rank("pp"), coords["tp"][0], coords["ep"][0])
    params = []  # (parameter, the pieces this rank writes of it), in the order every data rank gathers them
    for name, param in model.named_parameters():
        if name in layout.aliases:  # a tied copy: the owner of the weight saves it
            continue
        info = layout.tensors[name]
        if info.stage != parallel.rank("pp"):  # a tied copy on a later stage
            continue
        expert = any(s.mesh_dim == "ep" for s in info.spec)
        owner = (dp_cp_rank // ep if expert else dp_cp_rank) == 0
        params.append((param, rank_pieces(name, info, coords, file) if owner else []))
    owned = [(piece, param.dtype) for param, pieces in params for piece in pieces]
    writer = SafetensorsWriter(tmp / file, [(p.key, dtype, p.shape) for p, dtype in owned]) if owned else None
    failure = None
    for param, pieces in params:
        if isinstance(param, DTensor):  # FSDP's shards over the data ranks: all of them gather
            param = param.full_tensor()
        if pieces and failure is None:
            try:
                for piece in pieces:
                    writer.write(piece.key, param.detach()[piece.local].cpu())
            except Exception as e:  # re-raised below, once the gathers are done
                failure = e
            except BaseException:
                writer.abort()
                raise
    if failure is not None:
        writer.abort()
        raise failure
    if writer is None:
        return None
    return file, writer.close(), [(p.name, p.to_json(), dtype_name(dtype)) for p, dtype in owned]


def _write_index(model, layout: ModelLayout, tmp: Path, shards: list):
    files, pieces, dtypes = {}, {}, {}
    for shard in filter(None, shards):
        file, info, owned = shard
        files[file] = info
        for name, piece, dtype in owned:
            pieces.setdefault(name, []).append(piece)
            dtypes[name] = getattr(torch, dtype)
    missing = [n for n in layout.tensors if n not in pieces]
    if missing:
        raise CheckpointError(f"no rank saved {missing[:8]}")
    parallel = model.parallel
    mesh = {d: parallel.size(d) for d in ("tp", "pp", "dp", "cp", "ep")}
    tensors = {n: tensor_entry(info, dtypes[n], pieces[n]) for n, info in layout.tensors.items()}
    write_index(tmp, make_index(layout, mesh, tensors, files))


def _stage_layers(model) -> list[list[int]] | None:
    """Every pp rank's global layer indices (collective over pp): the model may be split other than by default."""
    pp = model.parallel.config.pp
    if pp == 1:
        return None
    every_rank = [None] * pp
    dist.all_gather_object(every_rank, list(model.layer_ids), group=model.parallel.group("pp"))
    return every_rank


def lora_of_every_stage(model):
    """The LoRA settings of the whole model (collective over pp): each stage knows only its own adapted modules."""
    settings = lora_settings(model)
    if model.parallel.config.pp == 1:
        return settings
    every_stage = [None] * model.parallel.config.pp
    dist.all_gather_object(every_stage, settings, group=model.parallel.group("pp"))
    found = [s for s in every_stage if s is not None]
    if not found:
        return None
    return dataclasses.replace(found[0], targets=tuple(sorted({t for s in found for t in s.targets})),
                               modules_to_save=tuple(sorted({m for s in found for m in s.modules_to_save})))


def _save_colozoo(model, dst: Path, extra_files=(), replace: bool = True):
    """Every rank writes its own shard, rank 0 the index; an existing colozoo checkpoint at `dst` is replaced."""
    rank, _ = _world()
    tmp = dst.parent / f".{dst.name}.tmp-colozoo"
    layout = ModelLayout(model.config, model.parallel.config.pp, _stage_layers(model), lora=lora_of_every_stage(model))
    replace = replace and is_colozoo_checkpoint(dst)  # another kind of directory: refused, as before
    _collective(f"preparing {dst}", lambda: _prepare(dst, tmp, rank, replace))

    def write_index_and_publish(shards):
        if rank == 0:
            _write_index(model, layout, tmp, shards)
            for file in extra_files:
                shutil.copy2(file, tmp / Path(file).name)
            if model.can_generate() and model.generation_config is not None:
                model.generation_config.save_pretrained(tmp)
            write_checksums(tmp)
            publish(tmp, dst, replace=replace)

    try:
        shards = _collective(f"saving shards of {dst}", lambda: _write_own_shard(model, layout, tmp))
        _collective(f"publishing {dst}", lambda: write_index_and_publish(shards))
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_pretrained(model, path, format: str = "hf", max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                    merge_lora: bool = False):
    """Save a live model (collective: every rank of the job calls it). format="hf": a directory transformers loads,
    with the tokenizer files, chat template and generation config the model came with (a LoRA model only with
    merge_lora=True: the adapters folded into the weights); "colozoo": every rank writes its own shard of a
    reshardable checkpoint; "peft": the LoRA adapters as PEFT writes them."""
    dst = Path(path)
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if format == "peft":
        return save_peft(model, dst)
    if merge_lora:
        if format != "hf":
            raise ValueError("merge_lora=True goes with format='hf' (the merged model as transformers loads it)")
        with merged_lora(model):
            return save_pretrained(model, dst, format="hf", max_shard_bytes=max_shard_bytes)
    if lora_modules(model) and format == "hf":
        raise ValueError("this model has LoRA adapters: save them with format='peft', or export merged weights "
                         "with format='hf', merge_lora=True")
    extra = _extra_files(model)
    if format == "colozoo":
        return _save_colozoo(model, dst, extra)
    rank, size = _world()
    if size == 1:  # every tensor is here, whole: straight to transformers' layout, no staging
        layout = ModelLayout(model.config, lora=None)
        tensors = {name: _Live(param) for name, param in model.named_parameters() if name in layout.tensors}
        with _generation_config(model) as generation:
            return export_hf(tensors, layout, dst, max_shard_bytes=max_shard_bytes, extra_files=extra + generation,
                             replace=True)
    staging = dst.parent / f".{dst.name}.staging-colozoo"

    def prepare():
        if dst.exists() and not dst.is_dir():
            raise FileExistsError(f"destination {dst} exists and is not a directory")
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)

    def export():
        if rank == 0:
            convert(staging, dst, to_hf=True, max_shard_bytes=max_shard_bytes, replace=True)

    _collective(f"preparing {dst}", prepare)
    try:
        _save_colozoo(model, staging, extra, replace=False)
        _collective(f"exporting {dst}", export)
    finally:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)


class _Live:
    """A parameter of a single-process model, as the exporter reads global tensors."""

    def __init__(self, param: torch.Tensor):
        self.param, self.shape, self.dtype = param, tuple(param.shape), param.dtype

    def read(self) -> torch.Tensor:
        return self.param.detach().cpu()


def _extra_files(model) -> list[Path]:
    """The tokenizer and processor files of the directory the model came from (its generation config is written
    from model.generation_config, which the user may have changed since)."""
    source = getattr(model, "name_or_path", None)
    if not source or not Path(source).is_dir():
        return []
    return [f for f in side_files(source) if f.name != "generation_config.json"]


class _generation_config:
    """model.generation_config as a generation_config.json in a temp file, for the export to copy (none for models
    that do not generate)."""

    def __init__(self, model):
        self.config = model.generation_config if model.can_generate() else None

    def __enter__(self) -> list[Path]:
        if self.config is None:
            return []
        import tempfile

        self.directory = Path(tempfile.mkdtemp(prefix="colozoo-generation-"))
        self.config.save_pretrained(self.directory)
        return [self.directory / "generation_config.json"]

    def __exit__(self, *exc):
        if self.config is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
