"""Reading our global tensors out of Hugging Face tensors, slice by slice.

A family map says, for each of our global parameter names, which HF tensors make it up: a `Source` with
the HF names (concatenated along `cat_dim`, e.g. q/k/v into one fused weight) and whether HF stores it
transposed (GPT-2's Conv1D) or laid out per head (GPT-NeoX's fused query_key_value, `regroup`).
`GlobalTensor` turns that into a lazy global tensor that can be sliced; slices are read straight from the files
(colozoo.checkpoint.safetensors_io), so nothing is materialised beyond the slice.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch


from colozoo.converters.source import Source
from colozoo.core.errors import CheckpointError


def index_files(index_path: Path) -> list[str]:
    """The weight files an HF index (model.safetensors.index.json and the like) maps tensors to, sorted."""
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # bad JSON, no weight_map, not a mapping
        raise CheckpointError(f"{index_path} is corrupted: {type(e).__name__}: {e}") from None
    if not all(isinstance(f, str) and f for f in files):
        raise CheckpointError(f"{index_path} is corrupted: its weight_map values are not all file names")
    return files


class TensorReader:
    """Uniform access to named tensors: shape, dtype and slices."""

    def names(self) -> list[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def dtype(self, name: str) -> torch.dtype:
        raise NotImplementedError

    def read(self, name: str, index: tuple | None = None) -> torch.Tensor:
        raise NotImplementedError

    def __contains__(self, name: str) -> bool:
        return name in set(self.names())


class StateDictReader(TensorReader):
    def __init__(self, state_dict: dict[str, torch.Tensor]):
        self.state_dict = state_dict

    def names(self):
        return list(self.state_dict)

    def shape(self, name):
        return tuple(self.state_dict[name].shape)

    def dtype(self, name):
        return self.state_dict[name].dtype

    def read(self, name, index=None):
        t = self.state_dict[name]
        return t if index is None else t[index]


class GlobalTensor:
    """One of our global tensors assembled lazily from HF tensors: `shape` and `read(index)`."""

    def __init__(self, reader: TensorReader, source: Source, name: str = ""):
        self.reader, self.source, self.name = reader, source, name
        if source.stack:  # only metadata is touched here: an item (expert) is read when its slice is asked for
            self.items = [GlobalTensor(reader, group, name) for group in source.groups()]
            shapes = {item.shape for item in self.items}
            if len(shapes) != 1:
                raise CheckpointError(f"stacked tensors for {name!r} differ in shape: {sorted(shapes)}")
            self.shape, self.dtype = (source.stack, *self.items[0].shape), self.items[0].dtype
            return
        shapes = []
        for hf_name in source.names:
            if hf_name not in reader:
                raise CheckpointError(f"missing tensor {hf_name!r} (needed for {name!r})")
            shape = reader.shape(hf_name)
            shapes.append(tuple(reversed(shape)) if source.transpose else shape)
        first = list(shapes[0])
        for s in shapes[1:]:
            if len(s) != len(first) or any(a != b for d, (a, b) in enumerate(zip(s, first)) if d != source.cat_dim):
                raise CheckpointError(f"tensors {source.names} cannot be concatenated along dim {source.cat_dim}: {shapes}")
        first[source.cat_dim] = sum(s[source.cat_dim] for s in shapes)
        self.shape = tuple(first)
        self.part_shapes = shapes
        self.dtype = reader.dtype(source.names[0])

    def read(self, index: tuple | None = None) -> torch.Tensor:
        ndim = len(self.shape)
        index = tuple(index) if index is not None else ()
        index = index + (slice(None),) * (ndim - len(index))
        if self.source.stack:
            picked = range(*index[0].indices(self.shape[0]))
            if not picked:
                return torch.empty((0, *self.shape[1:]), dtype=self.dtype)[(slice(None), *index[1:])]
            return torch.stack([self.items[i].read(index[1:]) for i in picked])
        d = self.source.cat_dim
        start, stop, _ = index[d].indices(self.shape[d])
        if self.source.regroup:
            return self._read_regrouped(index, d, start, stop)
        parts, offset = [], 0
        for hf_name, shape in zip(self.source.names, self.part_shapes):
            lo, hi = max(start, offset), min(stop, offset + shape[d])
            if lo < hi:
                part_index = list(index)
                part_index[d] = slice(lo - offset, hi - offset)
                parts.append(self._read_part(hf_name, tuple(part_index)))
            offset += shape[d]
        if not parts:
            shape = [len(range(*s.indices(n))) for s, n in zip(index, self.shape)]
            return torch.empty(shape, dtype=self.dtype)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=d)

    def _read_regrouped(self, index, d, start, stop):
        """Our rows start..stop of a regrouped tensor: the HF rows they come from, read in contiguous runs."""
        rows = self.source.hf_positions(self.shape[d])[start:stop]
        if not len(rows):
            return torch.empty([len(range(*s.indices(n))) for s, n in zip(index, self.shape)], dtype=self.dtype)
        breaks = ((rows[1:] != rows[:-1] + 1).nonzero().flatten() + 1).tolist()
        parts = []
        for run in torch.tensor_split(rows, breaks):
            part_index = list(index)
            part_index[d] = slice(int(run[0]), int(run[-1]) + 1)
            parts.append(self.reader.read(self.source.names[0], tuple(part_index)))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=d)

    def _read_part(self, hf_name, index):
        if self.source.transpose:
            return self.reader.read(hf_name, tuple(reversed(index))).t()
        return self.reader.read(hf_name, index)
