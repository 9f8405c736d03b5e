"""Safetensors files read and written a slice at a time, with plain file I/O.

The `safetensors` library writes a file from a dict of tensors held in memory and reads through a memory map
(whose touched pages count toward the reader's resident memory until it is closed). Conversions here stream
tensor by tensor, so this module reads slices with `pread` into fresh buffers and writes a file whose header is
known ahead: the header first, then each tensor's bytes in header order, hashing as it goes. The files are
ordinary safetensors files (the `safetensors` library reads them).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path

import torch

from colozoo.checkpoint.readers import TensorReader, index_files
from colozoo.core.dtypes import SAFETENSORS as DTYPES, SAFETENSORS_CODES as DTYPE_CODES
from colozoo.core.errors import CheckpointError

BLOCK_BYTES = 16 << 20  # a strided slice is read in blocks of whole rows of about this size
MAX_HEADER = 100 << 20


def as_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


class SafetensorsFile:
    """One safetensors file: header parsed and checked against the file size, slices read with pread."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.fd = -1
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"cannot open {self.path}: {e.strerror}") from None
        size = os.fstat(self.fd).st_size
        try:
            (header_len,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
            if header_len > min(MAX_HEADER, size - 8):
                raise ValueError(f"header length {header_len} does not fit a file of {size} bytes")
            header = json.loads(os.pread(self.fd, header_len, 8))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            self.close()
            raise CheckpointError(f"{self.path} is not a valid safetensors file (truncated or corrupted?): {e}") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + header_len
        self.entries = {}
        for key, info in header.items():
            try:
                begin, end = info["data_offsets"]
                dtype, shape = DTYPES[info["dtype"]], tuple(info["shape"])
                if not all(type(n) is int and n >= 0 for n in (begin, end, *shape)):
                    raise ValueError
            except (KeyError, TypeError, ValueError):
                self.close()
                raise CheckpointError(f"{self.path}: malformed header entry for tensor {key!r} (corrupted "
                                      f"safetensors file)") from None
            if end - begin != math.prod(shape) * dtype.itemsize or self.data_start + end > size:
                self.close()
                raise CheckpointError(f"{self.path}: tensor {key!r} extends past the end of the file "
                                      f"(truncated or corrupted safetensors file)")
            self.entries[key] = (dtype, shape, self.data_start + begin)

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        self.close()

    def keys(self):
        return list(self.entries)

    def _read_into(self, out: torch.Tensor, offset: int):
        view, done = as_bytes(out), 0
        while done < len(view):  # one read returns at most ~2 GiB
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if not got:
                raise CheckpointError(f"{self.path}: short read at byte {offset + done} (file truncated?)")
            done += got

    def read(self, key: str, index: tuple | None = None) -> torch.Tensor:
        """The tensor `key`, or the slice `index` (a tuple of slices, one per leading dim) of it."""
        try:
            dtype, shape, offset = self.entries[key]
        except KeyError:
            raise CheckpointError(f"tensor {key!r} not found in {self.path}") from None
        ranges = [range(*s.indices(n)) if isinstance(s, slice) else range(s, s + 1)
                  for s, n in zip(index or (), shape)]
        ranges += [range(n) for n in shape[len(ranges):]]
        if any(r.step != 1 for r in ranges):
            raise ValueError("only contiguous slices can be read")
        out = torch.empty([len(r) for r in ranges], dtype=dtype)
        if out.numel() == 0:
            return out
        row_shape = shape[1:]
        row_bytes = math.prod(row_shape) * dtype.itemsize
        rows, rest = ranges[0], ranges[1:]
        if all(len(r) == n for r, n in zip(rest, row_shape)):  # whole rows: one contiguous read
            self._read_into(out, offset + rows.start * row_bytes)
            return out
        block = max(1, BLOCK_BYTES // max(row_bytes, 1))
        inner = tuple(slice(r.start, r.stop) for r in rest)
        for start in range(rows.start, rows.stop, block):
            stop = min(start + block, rows.stop)
            buf = torch.empty((stop - start, *row_shape), dtype=dtype)
            self._read_into(buf, offset + start * row_bytes)
            out[start - rows.start: stop - rows.start] = buf[(slice(None), *inner)]
        return out

    def sha256(self) -> str:
        digest = hashlib.sha256()
        buf = bytearray(BLOCK_BYTES)
        offset = 0
        while True:
            got = os.preadv(self.fd, [buf], offset)
            if not got:
                return digest.hexdigest()
            digest.update(memoryview(buf)[:got])
            offset += got


class SafetensorsReader(TensorReader):
    """An HF checkpoint (one safetensors file, model.safetensors, or shards with an index) read with pread."""

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        if path.is_file():
            files = [path]
        elif (path / "model.safetensors.index.json").exists():
            files = [path / f for f in index_files(path / "model.safetensors.index.json")]
        elif (path / "model.safetensors").exists():
            files = [path / "model.safetensors"]
        else:
            raise CheckpointError(f"no safetensors weights in {path} (looked for model.safetensors and "
                                  f"model.safetensors.index.json)")
        self.files: dict[str, SafetensorsFile] = {}
        for file in files:
            if not file.exists():
                raise CheckpointError(f"{file} is listed in {path / 'model.safetensors.index.json'} but missing")
            handle = SafetensorsFile(file)
            for key in handle.keys():
                self.files[key] = handle

    def _file(self, name):
        try:
            return self.files[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} not found in the checkpoint") from None

    def names(self):
        return list(self.files)

    def __contains__(self, name):
        return name in self.files

    def shape(self, name):
        return self._file(name).entries[name][1]

    def dtype(self, name):
        return self._file(name).entries[name][0]

    def read(self, name, index=None):
        return self._file(name).read(name, index)


class SafetensorsWriter:
    """Writes one safetensors file whose tensors (key, dtype, shape) are declared up front, in that order."""

    def __init__(self, path: str | os.PathLike, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header, offset = {}, 0
        if metadata:
            header["__metadata__"] = metadata
        self.order = []
        for key, dtype, shape in entries:
            nbytes = math.prod(shape) * dtype.itemsize
            header[key] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self.order.append((key, dtype, tuple(shape)))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.size = 8 + len(raw) + offset
        self.file = open(self.path, "wb")
        self.digest = hashlib.sha256()
        self._write(struct.pack("<Q", len(raw)) + raw)
        self.next = 0

    def _write(self, data):
        self.file.write(data)
        self.digest.update(data)

    def write(self, key: str, tensor: torch.Tensor):
        expected_key, dtype, shape = self.order[self.next]
        if key != expected_key or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise RuntimeError(f"{self.path}: expected {expected_key} {dtype} {shape} next, got {key} "
                               f"{tensor.dtype} {tuple(tensor.shape)}")
        self._write(as_bytes(tensor))
        self.next += 1

    def close(self) -> dict:
        """Flush to disk; returns {"sha256", "size"}."""
        if self.next != len(self.order):
            raise RuntimeError(f"{self.path}: closed after {self.next} of {len(self.order)} tensors")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return {"sha256": self.digest.hexdigest(), "size": self.size}

    def abort(self):
        self.file.close()
