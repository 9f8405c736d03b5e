"""What a run started from, as short digests its checkpoints keep, so that a resume can tell it is continuing the same
run: the base weights, the LoRA settings, and the training rows.

The base weights' digest is taken from their values, not their files: a few rows of every global tensor (the first,
the last and two between; the first few rows and the last dimension of a tensor with more than two dimensions),
as float32, so the same weights give the same digest as an HF directory or a colozoo checkpoint of any mesh, and
another checkpoint of the same config (another fine-tune, another seed) gives another.
"""
from __future__ import annotations

import hashlib

import torch

from colozoo.core.errors import CheckpointError

ROWS = 4  # rows read per tensor


def sampled_index(shape: tuple[int, ...]) -> list[tuple]:
    """The slices of a tensor of `shape` that its digest reads."""
    if len(shape) <= 1:
        return [tuple(slice(None) for _ in shape)]
    rows = sorted({round(i * (shape[0] - 1) / (ROWS - 1)) for i in range(ROWS)})
    middle = tuple(slice(0, 2) for _ in shape[1:-1])
    return [(slice(r, r + 1), *middle, slice(None)) for r in rows]


def weights_fingerprint(name_or_path) -> str:
    """The digest of the weights a model name or directory holds (without verifying checksums: loading does)."""
    from colozoo.api import resolve
    from colozoo.checkpoint.layout import ModelLayout

    source = resolve(name_or_path, verify=False)
    digest = hashlib.sha256()
    for name, info in ModelLayout(source.config).tensors.items():
        digest.update(f"{name}{tuple(info.shape)}".encode())
        try:
            tensor = source.tensor(name)
        except CheckpointError:  # a task head the checkpoint lacks, initialised fresh
            digest.update(b"absent")
            continue
        for index in sampled_index(tuple(tensor.shape)):
            digest.update(tensor.read(index).to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def data_fingerprint(data) -> str:
    """The digest of the rows a dataset holds: a token cache's, computed as it was written, or the tensors' of
    in-memory data."""
    stored = getattr(data, "sha256", None)
    if stored:
        return stored[:16]
    digest = hashlib.sha256()
    for name in sorted(data.tensors):
        digest.update(name.encode())
        digest.update(data.tensors[name].contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]
