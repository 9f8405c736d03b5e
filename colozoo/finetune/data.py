"""Fine-tuning data: read, tokenize, pack, and hand each data-parallel rank its slice of every global batch.

Records stream in one at a time (colozoo.finetune.records: JSON lines, text, Parquet, Arrow, datasets directories)
and are tokenized a chunk at a time into rows; the fine-tuning loop keeps a causal LM's rows on disk
(colozoo.finetune.token_cache), classification data stays in memory. The position in the data is just the
optimizer step: `BatchSampler.step_indices(step)` is a pure function of (seed, step), which is what
makes a resumed run see exactly the batches an uninterrupted one would.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from colozoo.finetune.records import DataError, existing, iter_records

IGNORE_INDEX = -100
CHUNK_RECORDS = 1024  # records tokenized together (one call of a fast tokenizer)
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp"}


@dataclass
class TensorData:
    """Equal-length tensors indexed together; `tokens` counts the trained-on tokens of each sample (0 for images);
    `label_names`: class id -> name where the data names its classes (string labels, class folders); `stats`: what
    fitting the samples into the sequence length did (--chat)."""
    tensors: dict[str, torch.Tensor]
    tokens: torch.Tensor
    label_names: dict[int, str] | None = None
    stats: dict | None = None

    def __len__(self):
        return len(self.tokens)

    def take(self, indices) -> dict[str, torch.Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        return {k: v[index] for k, v in self.tensors.items()}

    def split(self, fraction: float) -> tuple["TensorData", "TensorData"]:
        """(head, tail) with the tail holding `fraction` of the samples (at least one when fraction > 0)."""
        cut = holdout_cut(len(self), fraction)
        head, tail = ({k: v[:cut] for k, v in self.tensors.items()}, {k: v[cut:] for k, v in self.tensors.items()})
        return (TensorData(head, self.tokens[:cut], self.label_names, self.stats),
                TensorData(tail, self.tokens[cut:], self.label_names, self.stats))


def holdout_cut(samples: int, fraction: float) -> int:
    """Where a split holding out `fraction` of the samples for evaluation (at least one when fraction > 0) cuts."""
    cut = samples - (max(1, round(samples * fraction)) if fraction > 0 else 0)
    if cut < 1:
        raise DataError(f"cannot hold out {fraction:.0%} of {samples} samples for evaluation and keep any for training")
    return cut


def pad_id(tokenizer) -> int:
    """The token padded rows are filled with: the tokenizer's pad token, else its EOS, else 0 (masked either way)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)


# ----------------------------------------------------------------------------------------------- reading


def read_records(path, fields: tuple[str, ...]) -> Iterator[dict]:
    """The records of a .jsonl / .parquet / .arrow file or a datasets directory with the given fields, or (for a .txt
    file and fields == ("text",)) documents separated by blank lines; one at a time."""
    if Path(path).suffix == ".txt" and fields != ("text",):
        raise DataError(f"{path}: plain text has no {fields[1:]} field; use a .jsonl file")
    return iter_records(path, lambda record, where: check_record(record, fields, where))


def check_record(record, fields: tuple[str, ...], where: str):
    """A JSON object with a string text (fields[0]) and, for classification, an integer or string label."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a JSON {type(record).__name__}, not an object with a {fields[0]!r} field")
    missing = [f for f in fields if f not in record]
    if missing:
        chat = " or pass --chat for them" if {"messages", "prompt"} & set(record) else ""
        raise DataError(f"{where}: no field {missing[0]!r}; the record's fields are {list(record)} "
                        f"(pick others with --text-field / --label-field{chat})")
    if not isinstance(record[fields[0]], str):
        raise DataError(f"{where}: field {fields[0]!r} is {record[fields[0]]!r}, not a string")
    for name in fields[1:]:
        if isinstance(record[name], bool) or not isinstance(record[name], (int, str)):
            raise DataError(f"{where}: field {name!r} is {record[name]!r}, not an integer or a string label")


# only padding is checked: published configs and tokenizers legitimately disagree on eos (e.g. chat models)
SPECIAL_TOKENS = ("pad_token_id",)
WARNING_ROWS = 4096


def load_tokenizer(model_dir, vocab_size: int, special_ids: dict | None = None):
    """The tokenizer saved in the model directory (local files only), checked against the model's vocabulary
    and against `special_ids` ({"pad_token_id": id, ...} from the model config; an id may be a list of ids)."""
    from transformers import AutoTokenizer

    if model_dir is None or not Path(model_dir, "tokenizer_config.json").exists() and \
            not Path(model_dir, "tokenizer.json").exists():
        raise DataError(f"no tokenizer in the model directory {model_dir} (expected tokenizer.json / tokenizer_config.json)")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    if len(tokenizer) > vocab_size:
        raise DataError(f"the tokenizer in {model_dir} has {len(tokenizer)} tokens but the model's vocabulary has "
                        f"{vocab_size}: token ids would run past the embedding (wrong tokenizer for this model?)")
    for name, expected in (special_ids or {}).items():
        actual = getattr(tokenizer, name, None)
        allowed = expected if isinstance(expected, (list, tuple)) else [expected]
        if expected is not None and actual is not None and actual not in allowed:
            raise DataError(f"the tokenizer in {model_dir} has {name} {actual} but the model config says {expected} "
                            f"(wrong tokenizer for this model?)")
    return tokenizer


def tokenizer_warnings(tokenizer, config, data) -> list[str]:
    """What is legal but most likely a mistake (judged on the first WARNING_ROWS rows): text the tokenizer mostly
    does not know, an EOS other than the model's (generation would not stop where training taught it to)."""
    out = []
    rows = data.take(range(min(len(data), WARNING_ROWS)))
    unk, ids = tokenizer.unk_token_id, rows["input_ids"]
    mask = rows.get("attention_mask")  # packed chat rows have none: every token is real or padding
    real = ids[mask.bool()] if mask is not None else ids.flatten()
    if unk is not None and real.numel() and (real == unk).float().mean() > 0.5:
        out.append(f"{(real == unk).float().mean():.0%} of the tokens are the tokenizer's unknown token "
                   f"{tokenizer.unk_token!r}: wrong tokenizer for this text?")
    eos = getattr(config, "eos_token_id", None)
    allowed = eos if isinstance(eos, (list, tuple)) else [eos]
    if eos is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in allowed:
        out.append(f"the tokenizer's EOS is {tokenizer.eos_token_id} ({tokenizer.eos_token!r}) but the model "
                   f"config's eos_token_id is {eos}")
    return out


def special_token_ids(config) -> dict:
    """The special token ids of SPECIAL_TOKENS a model config declares (None where it declares none)."""
    return {name: getattr(config, name, None) for name in SPECIAL_TOKENS}


def check_seq_len(seq_len: int, config, flag: str = "--seq-len"):
    from colozoo.registry import check_positions

    check_positions(config, seq_len, f"{flag} {seq_len}")


# ----------------------------------------------------------------------------------------------- language


def lm_dataset(path, tokenizer, seq_len: int, pack: bool = True, text_field: str = "text") -> TensorData:
    """Causal-LM samples of `seq_len` tokens. Packed: documents joined by EOS and cut into full sequences.
    Unpacked: each document cut into pieces of at most `seq_len`, right-padded and masked."""
    return collect(lm_blocks(path, tokenizer, seq_len, pack, text_field))


def lm_blocks(path, tokenizer, seq_len: int, pack: bool = True, text_field: str = "text", stats: dict | None = None
              ) -> Iterator[dict[str, torch.Tensor]]:
    """lm_dataset's rows, a few thousand records at a time (memory stays bounded by the chunk, not the dataset);
    `stats["samples"]` counts the records read so far."""
    stats = stats if stats is not None else {}
    stats["samples"] = 0
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    pad = pad_id(tokenizer)
    carry, rows = np.zeros(0, dtype=np.int64), 0
    for texts in chunks((r[text_field] for r in read_records(path, (text_field,))), CHUNK_RECORDS):
        docs = tokenizer(texts, add_special_tokens=False)["input_ids"]
        stats["samples"] += len(texts)
        if pack:
            stream = np.concatenate([carry] + [np.asarray(doc + eos, dtype=np.int64) for doc in docs])
            n = len(stream) // seq_len
            carry = stream[n * seq_len:].copy()
            input_ids = torch.from_numpy(stream[: n * seq_len]).view(n, seq_len)
            block = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                     "labels": input_ids.clone()}
        else:
            pieces = [np.asarray(doc[i: i + seq_len], dtype=np.int64) for doc in docs
                      for i in range(0, len(doc), seq_len)]
            block = pad_rows([(p, p) for p in pieces if len(p) > 1], seq_len, pad)  # one token predicts nothing
        if len(block["input_ids"]):
            rows += len(block["input_ids"])
            yield block
    if rows == 0 and pack:
        raise DataError(f"dataset {path} has {len(carry)} tokens, fewer than one sequence of --seq-len {seq_len}")
    if rows == 0:
        raise DataError(f"dataset {path} has no document of two or more tokens")


def pad_rows(samples: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad: int) -> dict[str, torch.Tensor]:
    """Samples (ids, labels), one per row, right-padded, with an attention mask."""
    input_ids = torch.full((len(samples), seq_len), pad, dtype=torch.long)
    labels = torch.full((len(samples), seq_len), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(samples), seq_len), dtype=torch.long)
    for r, (ids, lab) in enumerate(samples):
        input_ids[r, : len(ids)], labels[r, : len(ids)], mask[r, : len(ids)] = (
            torch.from_numpy(ids), torch.from_numpy(lab), 1)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


PAD_MULTIPLE = 8  # unpacked batches are cut to a multiple of this: few shapes to compile, tensor-core friendly


def padding_multiple(parallel) -> int:
    """What an unpacked batch's width must be a multiple of on the mesh `parallel`: PAD_MULTIPLE and what the mesh
    needs to split a sequence (core.sequence.sequence_multiple)."""
    return math.lcm(PAD_MULTIPLE, parallel.config.sequence_multiple)


def trim_padding(batch: dict[str, torch.Tensor], multiple: int = PAD_MULTIPLE) -> dict[str, torch.Tensor]:
    """An unpacked batch (rows right-padded to --seq-len, with an attention mask) cut to its longest row rounded up
    to `multiple` (at most its width): the positions cut are padding, attended by no one and without a label, so
    the loss and the tokens trained on stay, the tokens computed shrink. Every rank cuts the same global batch alike,
    so dp ranks, pipeline micro-batches and cp chunks agree on the width."""
    mask = batch.get("attention_mask")
    if mask is None:
        return batch
    width = mask.shape[1]
    columns = mask.any(0).nonzero()
    longest = int(columns.max()) + 1 if len(columns) else 1
    keep = min(width, -(-longest // multiple) * multiple)
    return {k: v[:, :keep] if v.dim() == 2 and v.shape[1] == width else v for k, v in batch.items()}


def chunks(items, size: int) -> Iterator[list]:
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def trained_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Per row, the tokens trained on: the model predicts token t+1 from position t."""
    return (labels[:, 1:] != IGNORE_INDEX).sum(1)


def collect(blocks) -> TensorData:
    """Blocks of rows (dicts of equal-width tensors) as one in-memory TensorData."""
    parts = list(blocks)
    tensors = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    return TensorData(tensors, trained_tokens(tensors["labels"]))


# ----------------------------------------------------------------------------------------------- classification


def label_mapping(labels: list, config) -> dict[str, int] | None:
    """Class name -> id for string labels: config.label2id where it names them all, else sorted order; None for
    integer labels."""
    if all(isinstance(v, int) and not isinstance(v, bool) for v in labels):
        return None
    mapping = {k: int(v) for k, v in (getattr(config, "label2id", None) or {}).items()}
    names = sorted({str(v) for v in labels})
    return mapping if set(names) <= set(mapping) else {name: i for i, name in enumerate(names)}


def label_ids(labels: list, config) -> list[int]:
    """Integers as they are; strings through label_mapping."""
    num_labels = getattr(config, "num_labels", None)
    mapping = label_mapping(labels, config)
    out = labels if mapping is None else [mapping[str(v)] for v in labels]
    bad = [v for v in out if not 0 <= v < (num_labels or 0)]
    if bad:
        raise DataError(f"label {bad[0]} is outside the model's {num_labels} classes (pass --num-labels)")
    return out


def label_names(mapping: dict[str, int] | None, num_labels: int) -> dict[int, str] | None:
    """id -> name for every class of the head (LABEL_i, transformers' default, where the data names none)."""
    if mapping is None:
        return None
    names = {i: name for name, i in mapping.items()}
    return {i: names.get(i, f"LABEL_{i}") for i in range(num_labels)}


def classification_dataset(path, tokenizer, seq_len: int, config, text_field="text", label_field="label") -> TensorData:
    records = list(read_records(path, (text_field, label_field)))
    enc = tokenizer([r[text_field] for r in records], max_length=seq_len, truncation=True, padding="max_length",
                    return_tensors="pt")
    raw = [r[label_field] for r in records]
    labels = torch.tensor(label_ids(raw, config))
    # one text per sample: every token is segment 0, the model's default, so token_type_ids are left out
    tensors = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}
    return TensorData(tensors, enc["attention_mask"].sum(1), label_names(label_mapping(raw, config), config.num_labels))


# ----------------------------------------------------------------------------------------------- images


def image_input(config) -> tuple[int, int]:
    """(channels, image size) of the images the model reads, as its family declares them."""
    from colozoo.models import family_of

    return family_of(config.model_type).model.image_input(config)


def _image_norm(model_dir, config):
    mean, std = [0.5] * 3, [0.5] * 3
    proc = Path(model_dir, "preprocessor_config.json") if model_dir else None
    if proc is not None and proc.exists():
        spec = json.loads(proc.read_text())
        mean, std = spec.get("image_mean", mean), spec.get("image_std", std)
    channels = image_input(config)[0]
    return (torch.tensor(mean[:channels]).view(-1, 1, 1), torch.tensor(std[:channels]).view(-1, 1, 1))


def _read_image_folder(path: Path, size: int, channels: int):
    from PIL import Image

    classes = sorted(p.name for p in path.iterdir() if p.is_dir())
    images, labels = [], []
    for label, name in enumerate(classes):
        for file in sorted((path / name).iterdir()):
            if file.suffix.lower() in IMAGE_SUFFIXES:
                img = Image.open(file).convert("RGB" if channels == 3 else "L").resize((size, size))
                images.append(np.asarray(img).reshape(size, size, channels))
                labels.append(label)
    if not images:
        raise DataError(f"image folder {path} has no images (expected one sub-folder of images per class)")
    return np.stack(images), np.array(labels), classes


def image_dataset(path, config, model_dir=None) -> TensorData:
    """An .npz with `images` (N, H, W, C) or (N, C, H, W) uint8/float and integer `labels`, or a folder of class folders."""
    path = existing(path)
    channels, size = image_input(config)
    classes = None
    if path.is_dir():
        images, labels, classes = _read_image_folder(path, size, channels)
    else:
        with np.load(path) as npz:
            missing = [k for k in ("images", "labels") if k not in npz]
            if missing:
                raise DataError(f"{path} has no array {missing[0]!r} (expected 'images' and 'labels')")
            images, labels = npz["images"], npz["labels"]
    if len(images) == 0:
        raise DataError(f"dataset {path} is empty")
    if images.ndim != 4 or len(labels) != len(images):
        raise DataError(f"{path}: expected images (N, H, W, C) and N labels, got {images.shape} and {labels.shape}")
    x = torch.as_tensor(images)
    if x.shape[-1] == channels and x.shape[1] != channels:
        x = x.permute(0, 3, 1, 2)
    if tuple(x.shape[1:]) != (channels, size, size):
        raise DataError(f"{path}: images have shape {tuple(x.shape[1:])}, the model expects ({channels}, {size}, {size})")
    x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
    mean, std = _image_norm(model_dir, config)
    targets = torch.tensor(label_ids([int(v) for v in labels], config))
    names = label_names({c: i for i, c in enumerate(classes)} if classes else None, config.num_labels)
    return TensorData({"pixel_values": (x - mean) / std, "labels": targets}, torch.zeros(len(targets), dtype=torch.long),
                      names)


# ----------------------------------------------------------------------------------------------- sampling


class BatchSampler:
    """Which samples each data-parallel rank trains on at each optimizer step.

    Epoch e is a permutation seeded by (seed, e); step s takes the next `global_batch` samples of it (the tail
    that does not fill a global batch is dropped) and dp rank r takes its contiguous `global_batch / dp` of them.
    """

    def __init__(self, num_samples: int, global_batch: int, dp_rank: int, dp_size: int, seed: int, shuffle=True):
        if num_samples < global_batch:
            raise DataError(f"the dataset has {num_samples} samples, fewer than one global batch of {global_batch}")
        self.num_samples, self.global_batch, self.seed, self.shuffle = num_samples, global_batch, seed, shuffle
        self.dp_rank, self.per_rank = dp_rank, global_batch // dp_size
        self.steps_per_epoch = num_samples // global_batch
        self._epoch, self._order = None, None

    def order(self, epoch: int) -> torch.Tensor:
        if self._epoch != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._order = torch.randperm(self.num_samples, generator=g)
            else:
                self._order = torch.arange(self.num_samples)
            self._epoch = epoch
        return self._order

    def global_indices(self, step: int) -> torch.Tensor:
        """The whole global batch of `step`; dp rank r's rows are the r-th contiguous `global_batch / dp` of it."""
        epoch, offset = divmod(step, self.steps_per_epoch)
        return self.order(epoch)[offset * self.global_batch: (offset + 1) * self.global_batch]

    def step_indices(self, step: int) -> torch.Tensor:
        return self.global_indices(step)[self.dp_rank * self.per_rank: (self.dp_rank + 1) * self.per_rank]

    def total_steps(self, epochs: float) -> int:
        return max(1, math.floor(epochs * self.steps_per_epoch))


def microbatches(batch: dict[str, torch.Tensor], num_microbatches: int) -> list[dict[str, torch.Tensor]]:
    chunks = {k: v.chunk(num_microbatches) for k, v in batch.items()}
    return [{k: c[i] for k, c in chunks.items()} for i in range(num_microbatches)]
