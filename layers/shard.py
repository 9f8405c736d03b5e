"""Shard specs: every parameter declares, once and on itself, how it is split over the mesh; converters,
checkpoint I/O, gradient clipping and the profiler read that declaration instead of slicing by name.

A spec is a tuple of `Split`s stored on the parameter as `param.shard_spec`. Each split names a mesh
dimension ("tp" or "ep"), the tensor dimension it cuts, optionally the fused parts inside that dimension
(q/k/v, gate/up: each part is cut separately so every rank gets whole heads of each), optionally how many
whole parts (heads) each fused chunk has, and optionally the logical (unpadded) length of a padded dimension (the
vocabulary). A fused chunk cut over more ranks than it has parts is replicated (grouped-query attention at tp larger
than the kv heads, as Megatron-Core does it): with `size = replicas * parts`, rank r holds part r // replicas, and
only the first rank of each replica group stores it, so a checkpoint holds every element once. Checkpoints hold the *global* logical
tensor; `local_pieces` maps between a global tensor and a rank's local one, and everything that moves
weights (loading, saving, resharding, gathering for export or tests) goes through it.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.distributed as dist

Coords = Mapping[str, tuple[int, int]]  # mesh dim -> (rank, size)


@dataclass(frozen=True)
class Split:
    mesh_dim: str
    dim: int
    chunks: tuple[int, ...] | None = None
    logical_size: int | None = None
    parts: tuple[int, ...] | None = None  # whole parts (heads) per fused chunk; more ranks than parts replicate it

    def __post_init__(self):
        if self.chunks is not None and self.logical_size is not None:
            raise ValueError("a split has either fused chunks or a padded logical size, not both")
        if self.parts is not None and (self.chunks is None or len(self.parts) != len(self.chunks)
                                       or any(c % p for c, p in zip(self.chunks, self.parts))):
            raise ValueError(f"parts {self.parts} must give a whole number of parts for each fused chunk "
                             f"{self.chunks}")

    def to_json(self) -> dict:
        out = {"mesh_dim": self.mesh_dim, "dim": self.dim}
        if self.chunks is not None:
            out["chunks"] = list(self.chunks)
        if self.logical_size is not None:
            out["logical_size"] = self.logical_size
        if self.parts is not None:
            out["parts"] = list(self.parts)
        return out

    @classmethod
    def from_json(cls, d: dict) -> "Split":
        chunks, parts = d.get("chunks"), d.get("parts")
        return cls(d["mesh_dim"], d["dim"], tuple(chunks) if chunks is not None else None, d.get("logical_size"),
                   tuple(parts) if parts is not None else None)


ShardSpec = tuple  # tuple[Split, ...]; empty = replicated


def shard(param: torch.Tensor, *splits: Split) -> torch.Tensor:
    param.shard_spec = tuple(splits)
    return param


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (an FSDP2 or DTensor-parallel shard); a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def spec_of(param: torch.Tensor) -> tuple[Split, ...]:
    return getattr(param, "shard_spec", ())


class ShardError(ValueError):
    pass


def _chunk_pieces(split: Split, global_len: int, rank: int, size: int):
    """Pieces (global_start, global_stop, local_start, local_stop, replicas, primary) of a fused split: `replicas`
    ranks hold the piece, `primary` on the first of them. Returns them and the local length."""
    if sum(split.chunks) != global_len:
        raise ShardError(f"fused chunks {split.chunks} do not add up to the dimension length {global_len}")
    pieces, offset, local = [], 0, 0
    for i, chunk in enumerate(split.chunks):
        parts = split.parts[i] if split.parts is not None else None
        if parts is not None and size > parts:
            if size % parts:
                raise ShardError(f"a fused part of {parts} heads is neither divisible by {split.mesh_dim}={size} "
                                 f"nor a divisor of it")
            replicas, per = size // parts, chunk // parts
            start = offset + (rank // replicas) * per
            pieces.append((start, start + per, local, local + per, replicas, rank % replicas == 0))
        else:
            if chunk % size or (parts is not None and parts % size):
                raise ShardError(f"fused part of length {chunk} is not divisible by {split.mesh_dim}={size}")
            per = chunk // size
            pieces.append((offset + rank * per, offset + (rank + 1) * per, local, local + per, 1, True))
        offset, local = offset + chunk, local + per
    return pieces, local


def _split_pieces(split: Split, global_len: int, rank: int, size: int):
    """Like `_chunk_pieces` for any split: (g0, g1, l0, l1, replicas, primary) and the local length."""
    if split.chunks is not None:
        return _chunk_pieces(split, global_len, rank, size)
    if split.logical_size is not None:
        if global_len != split.logical_size:
            raise ShardError(f"padded dimension expects logical length {split.logical_size}, got {global_len}")
        per = math.ceil(global_len / size)
        start, stop = rank * per, min((rank + 1) * per, global_len)
        return ([(start, stop, 0, stop - start, 1, True)] if stop > start else []), per
    if global_len % size:
        raise ShardError(f"dimension of length {global_len} is not divisible by {split.mesh_dim}={size}")
    per = global_len // size
    return [(rank * per, (rank + 1) * per, 0, per, 1, True)], per


def local_pieces(split: Split, global_len: int, rank: int, size: int) -> tuple[list[tuple[int, int, int, int]], int]:
    """Pieces (global_start, global_stop, local_start, local_stop) of `rank` along the split dim, and the local length."""
    pieces, local = _split_pieces(split, global_len, rank, size)
    return [p[:4] for p in pieces], local


def replicated_pieces(spec, coords: Coords) -> list[tuple[int, int, int, int, bool]]:
    """(dim, local_start, local_stop, replicas, primary) of every piece this rank holds that other ranks hold too
    (a fused part with fewer parts than ranks): its gradient is a sum over the replicas, counted once in norms."""
    out = []
    for split in spec:
        rank, size = coords.get(split.mesh_dim, (0, 1))
        if split.parts is None or size == 1:
            continue
        pieces, _ = _chunk_pieces(split, sum(split.chunks), rank, size)
        out += [(split.dim, l0, l1, replicas, primary) for _, _, l0, l1, replicas, primary in pieces if replicas > 1]
    return out


def local_shape(global_shape, spec, coords: Coords) -> tuple[int, ...]:
    shape = list(global_shape)
    for split in spec:
        rank, size = coords.get(split.mesh_dim, (0, 1))
        shape[split.dim] = local_pieces(split, global_shape[split.dim], rank, size)[1]
    return tuple(shape)


def _piece_product(global_shape, spec, coords):
    """All (global index, local index, primary) of the slices that make up the local shard; `primary`: this rank is
    the first of the ranks holding a replicated slice (always, for a slice held once)."""
    per_dim = []
    for split in spec:
        rank, size = coords.get(split.mesh_dim, (0, 1))
        pieces, _ = _split_pieces(split, global_shape[split.dim], rank, size)
        per_dim.append((split.dim, pieces))
    for combo in itertools.product(*(p for _, p in per_dim)):
        g_index = [slice(None)] * len(global_shape)
        l_index = [slice(None)] * len(global_shape)
        for (dim, _), (g0, g1, l0, l1, _, _) in zip(per_dim, combo):
            g_index[dim], l_index[dim] = slice(g0, g1), slice(l0, l1)
        yield tuple(g_index), tuple(l_index), all(piece[5] for piece in combo)


def load_shard(read: Callable[[tuple], torch.Tensor], global_shape, spec, coords: Coords,
               dtype=None, device=None) -> torch.Tensor:
    """Build the local shard from `read(index)`, which returns a slice of the global tensor (e.g. safetensors get_slice)."""
    out = None
    for g_index, l_index, _ in _piece_product(global_shape, spec, coords):
        piece = read(g_index)
        if out is None:
            out = torch.zeros(local_shape(global_shape, spec, coords), dtype=dtype or piece.dtype, device=device)
        out[l_index] = piece.to(out.dtype)
    if out is None:  # a rank that holds only padding
        out = torch.zeros(local_shape(global_shape, spec, coords), dtype=dtype, device=device)
    return out


def shard_tensor(full: torch.Tensor, spec, coords: Coords) -> torch.Tensor:
    return load_shard(lambda index: full[index], tuple(full.shape), spec, coords)


def held_pieces(global_shape, spec, coords: Coords):
    """(global offsets, global slice, local slice) of all the data a rank holds, padding excluded: what it loads."""
    for g_index, l_index, _ in _piece_product(global_shape, spec, coords):
        yield [s.start or 0 for s in g_index], g_index, l_index


def stored_pieces(global_shape, spec, coords: Coords):
    """The held pieces a rank stores in a checkpoint: a replicated one only on the first rank holding it."""
    for g_index, l_index, primary in _piece_product(global_shape, spec, coords):
        if primary:
            yield [s.start or 0 for s in g_index], g_index, l_index


def gather_tensor(local: torch.Tensor, spec, global_shape, groups: Mapping[str, object], coords: Coords) -> torch.Tensor:
    """All-gather a sharded tensor into its global (unpadded) form on every rank of the groups involved."""
    current = local.detach()
    for split in reversed(spec):
        _, size = coords.get(split.mesh_dim, (0, 1))
        if size == 1:
            gathered = [current]
        else:
            gathered = [torch.empty_like(current) for _ in range(size)]
            dist.all_gather(gathered, current.contiguous(), group=groups[split.mesh_dim])
        shape = list(current.shape)
        shape[split.dim] = global_shape[split.dim]
        out = current.new_empty(shape)
        for r, part in enumerate(gathered):  # a replicated piece from the first rank holding it
            for g0, g1, l0, l1, _, primary in _split_pieces(split, global_shape[split.dim], r, size)[0]:
                if primary:
                    out.narrow(split.dim, g0, g1 - g0).copy_(part.narrow(split.dim, l0, l1 - l0))
        current = out
    return current


def pad_to_multiple(n: int, multiple: int) -> int:
    return math.ceil(n / multiple) * multiple


def materialize(module: torch.nn.Module, device) -> torch.nn.Module:
    """`to_empty` that keeps the shard specs (it replaces the Parameter objects that carry them)."""
    specs = {name: spec_of(p) for name, p in module.named_parameters()}
    module.to_empty(device=device)
    for name, p in module.named_parameters():
        if specs.get(name):
            p.shard_spec = specs[name]
    return module
