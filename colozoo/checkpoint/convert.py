"""Convert and reshard checkpoints, offline and streaming; save a live sharded model collectively.

    convert("hf_dir", "ckpt", tp=2, pp=2)        # HF -> colozoo at a mesh
    convert("ckpt", "ckpt4", tp=4)               # colozoo -> colozoo at another mesh, no HF original needed
    convert("ckpt4", "hf_out", to_hf=True)       # colozoo (or HF) -> HF directory
    model.save_pretrained(path[, format="hf"])   # every rank of a job writes its own shard

One process converts tensor by tensor: each global tensor is read once (plain reads, no memory map), cut into
the pieces of every target rank and appended to their files, so memory stays near the largest tensor.
Everything is written into a temp dir beside the destination and renamed at the end.
"""
from __future__ import annotations

import resource
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
import transformers
from tqdm import tqdm

from colozoo.checkpoint.atomic import atomic_directory, check_destination, publish
from colozoo.checkpoint.format import (INDEX_NAME, ColozooCheckpoint, file_name, is_colozoo_checkpoint, make_index,
                                       plan_mesh, rank_pieces, tensor_entry, write_index)
from colozoo.checkpoint.layout import ModelLayout, check_mesh
from colozoo.core.dtypes import dtype_name, parse_dtype
from colozoo.checkpoint.sources import GlobalTensor, StateDictReader
from colozoo.checkpoint.load import HFTensors
from colozoo.checkpoint.sources import index_files
from colozoo.core.errors import CheckpointError
from colozoo.checkpoint.hf_export import DEFAULT_MAX_SHARD_BYTES, export_hf
from colozoo.checkpoint.safetensors_io import SafetensorsReader, SafetensorsWriter

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
    """PyTorch pickles, loaded only on request and only with `weights_only=True` (memory-mapped)."""

    def __init__(self, path: Path):
        if (path / "pytorch_model.bin.index.json").exists():
            files = index_files(path / "pytorch_model.bin.index.json")
        else:
            files = ["pytorch_model.bin"]
        state = {}
        for file in files:
            try:
                state.update(torch.load(path / file, map_location="cpu", weights_only=True, mmap=True))
            except Exception as e:
                raise CheckpointError(f"cannot read {path / file}: {e}") from None
        super().__init__(state)


class HFCheckpoint(HFTensors):
    """An HF directory: its config and its safetensors (or, allowed, .bin) weights under our global names."""

    def __init__(self, path, config=None, allow_bin: bool = False):
        self.path = Path(path)
        config = config or transformers.AutoConfig.from_pretrained(self.path)
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
    largest = 0
    with atomic_directory(dst) as tmp, tqdm(total=total, unit="B", unit_scale=True, disable=not progress,
                                            desc="convert") as bar:
        writers, files = {}, {}  # a file is open from its first piece to its last (stages are written in order)
        try:
            for name, pieces in plan.items():
                full = tensors[name].read()  # the one global tensor held at a time
                largest = max(largest, full.numel() * full.element_size())
                for p in pieces:
                    piece = full[p.index].to(dtypes[name])
                    if p.file not in writers:
                        writers[p.file] = SafetensorsWriter(tmp / p.file, entries[p.file])
                    writers[p.file].write(p.key, piece)
                    if writers[p.file].next == len(entries[p.file]):
                        files[p.file] = writers.pop(p.file).close()
                    bar.update(piece.numel() * piece.element_size())
                del full
            files = {f: files[f] for f in entries}
        except BaseException:
            for w in writers.values():
                w.abort()
            raise
        mesh = {"tp": tp, "pp": pp, "ep": ep, "dp": 1, "cp": 1}
        index = make_index(layout, mesh, {n: tensor_entry(layout.tensors[n], dtypes[n], plan[n]) for n in plan},
                           files)
        write_index(tmp, index)
        for file in extra_files:
            shutil.copy2(file, tmp / file.name)
    return {"tensors": len(plan), "bytes": total, "files": len(entries), "largest_tensor_bytes": largest}


def convert(src, dst, tp: int = 1, pp: int = 1, ep: int = 1, dtype=None, to_hf: bool = False,
            allow_bin: bool = False, verify: bool = True, progress: bool = False,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict:
    """Convert an HF or colozoo checkpoint into a colozoo checkpoint at (tp, pp, ep), or with to_hf=True into an
    HF directory. One process, streaming; tokenizer and generation files come along. Returns a summary (tensors, bytes, seconds, peak RSS)."""
    start = time.perf_counter()
    dst = Path(dst)
    check_destination(dst)
    dtype = parse_dtype(dtype)
    source = open_checkpoint(src, allow_bin=allow_bin, verify=verify)
    config = source.config
    if to_hf:
        layout = ModelLayout(config)
        summary = export_hf(global_tensors(source, layout), layout, dst, dtype, max_shard_bytes, progress,
                            side_files(src))
    else:
        check_mesh(config, tp, pp, ep)
        layout = ModelLayout(config, pp)
        summary = write_colozoo(global_tensors(source, layout), layout, dst, tp, pp, ep, dtype, progress,
                                side_files(src))
    summary.update(seconds=time.perf_counter() - start, peak_rss_mb=peak_rss_mb())
    return summary


# --- collective save of a live model -----------------------------------------------------------------------

def _world():
    initialized = dist.is_available() and dist.is_initialized()
    return (dist.get_rank(), dist.get_world_size()) if initialized else (0, 1)


def _collective(what: str, fn) -> list:
    """Run `fn` on every rank; if it fails anywhere, every rank raises (no rank is left waiting). Returns all results."""
    try:
        mine, error = (None, fn()), None
    except Exception as e:  # noqa: BLE001 - reported to every rank
        mine, error = (f"{type(e).__name__}: {e}", None), e
    _, world = _world()
    gathered = [mine]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
    if error is not None:
        raise error
    failed = [(rank, message) for rank, (message, _) in enumerate(gathered) if message]
    if failed:
        raise CheckpointError(f"{what} failed on rank {failed[0][0]}: {failed[0][1]}")
    return [result for _, result in gathered]


def _prepare(dst: Path, tmp: Path, rank: int):
    check_destination(dst)
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)


@torch.no_grad()
def _write_own_shard(model, layout: ModelLayout, tmp: Path):
    """This rank's file: the pieces it owns (one owner per replicated tensor). Returns (file, info, pieces)."""
    pc = model.pc
    ep, dp_cp_rank = pc.size("ep"), pc.rank("dp_cp")
    coords = {"tp": (pc.rank("tp"), pc.size("tp")), "ep": (dp_cp_rank % ep, ep)}  # experts fold over dp x cp
    file = file_name(pc.rank("pp"), coords["tp"][0], coords["ep"][0])
    owned = []
    for name, param in model.named_parameters():
        if name in layout.aliases:  # a tied copy: the owner of the weight saves it
            continue
        info = layout.tensors[name]
        if info.stage != pc.rank("pp"):  # a tied copy on a later stage
            continue
        if isinstance(param, DTensor):  # FSDP's shards over the data ranks: all of them gather, the owner writes
            param = param.full_tensor()
        expert = any(s.mesh_dim == "ep" for s in info.spec)
        if (dp_cp_rank // ep if expert else dp_cp_rank) != 0:
            continue
        owned += [(piece, param) for piece in rank_pieces(name, info, coords, file)]
    if not owned:
        return None
    writer = SafetensorsWriter(tmp / file, [(p.key, t.dtype, p.shape) for p, t in owned])
    try:
        for piece, param in owned:
            writer.write(piece.key, param.detach()[piece.local].cpu())
    except BaseException:
        writer.abort()
        raise
    return file, writer.close(), [(p.name, p.to_json(), dtype_name(t.dtype)) for p, t in owned]


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
    pc = model.pc
    mesh = {d: pc.size(d) for d in ("tp", "pp", "dp", "cp", "ep")}
    tensors = {n: tensor_entry(info, dtypes[n], pieces[n]) for n, info in layout.tensors.items()}
    write_index(tmp, make_index(layout, mesh, tensors, files))


def _stage_layers(model) -> list[list[int]] | None:
    """Every pp rank's global layer indices (collective over pp): the model may be split other than by default."""
    pp = model.pc.config.pp
    if pp == 1:
        return None
    every_rank = [None] * pp
    dist.all_gather_object(every_rank, list(model.layer_ids), group=model.pc.group("pp"))
    return every_rank


def _save_colozoo(model, dst: Path):
    rank, _ = _world()
    tmp = dst.parent / f".{dst.name}.tmp-colozoo"
    layout = ModelLayout(model.config, model.pc.config.pp, _stage_layers(model))
    _collective(f"preparing {dst}", lambda: _prepare(dst, tmp, rank))
    def write_index_and_publish(shards):
        if rank == 0:
            _write_index(model, layout, tmp, shards)
            publish(tmp, dst)

    try:
        shards = _collective(f"saving shards of {dst}", lambda: _write_own_shard(model, layout, tmp))
        _collective(f"publishing {dst}", lambda: write_index_and_publish(shards))
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_pretrained(model, path, format: str = "colozoo", max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
    """Save a live sharded model: every rank writes its own shard of a colozoo checkpoint (atomic as a whole);
    with format="hf", rank 0 then exports that into an HF directory."""
    dst = Path(path)
    if format not in ("colozoo", "hf"):
        raise ValueError(f"format must be 'colozoo' or 'hf', got {format!r}")
    if format == "colozoo":
        return _save_colozoo(model, dst)
    rank, _ = _world()
    staging = dst.parent / f".{dst.name}.staging-colozoo"

    def prepare():
        check_destination(dst)
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)

    def export():
        if rank == 0:
            convert(staging, dst, to_hf=True, max_shard_bytes=max_shard_bytes)

    _collective(f"preparing {dst}", prepare)
    try:
        _save_colozoo(model, staging)
        _collective(f"exporting {dst}", export)
    finally:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)


# --- CLI ---------------------------------------------------------------------------------------------------

def _run_convert(args) -> int:
    summary = convert(args.src, args.dst, tp=args.tp, pp=args.pp, ep=args.ep, dtype=args.dtype, to_hf=args.to_hf,
                      allow_bin=args.allow_bin, progress=not args.quiet)
    from rich.console import Console

    Console().print(f"[bold]converted[/bold] {args.src} -> {args.dst}: {summary['tensors']} tensors, "
                    f"{summary['bytes'] / 1e6:.1f} MB in {summary['files']} files, {summary['seconds']:.2f} s, "
                    f"peak RSS {summary['peak_rss_mb']:.0f} MB (largest tensor "
                    f"{summary['largest_tensor_bytes'] / 1e6:.1f} MB)")
    return 0


def add_parser(subparsers):
    p = subparsers.add_parser("convert", help="convert / reshard a checkpoint (HF or colozoo) to colozoo or HF")
    p.add_argument("src", help="HF directory or colozoo checkpoint")
    p.add_argument("dst", help="destination directory (must not exist or be empty)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the output")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree of the output")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree of the output")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default=None, help="convert floating tensors")
    p.add_argument("--to-hf", action="store_true", help="write a Hugging Face directory instead")
    p.add_argument("--allow-bin", action="store_true", help="read PyTorch .bin weights (torch.load weights_only)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_convert)
