"""What every colozoo model shares: the output type, the batch context, config checks, and the three-part
forward (embed on the first stage, blocks on every stage, head on the last) that pipeline stages reuse.

A model knows only its layers. How it runs on its mesh (pipeline stages and schedules, context-parallel
sharding of the batch, data-parallel wrapping, the training step, saving) is the business of the layers
above: `colozoo.runtime.run.Run` attaches itself as `model.run`, and the methods users call on a model
(`model(...)` on a pipeline or cp mesh, `forward_backward`, `save_pretrained`) are handed to it."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from colozoo.core.mesh import ParallelContext, single_process
from colozoo.core.partition import model_rank_layers
from colozoo.layers.dropout import dropout  # noqa: F401 (the families import it from here)


@dataclass
class ModelOutput:
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    router_loss: torch.Tensor | None = None  # the part of `loss` that is a batch statistic (MoE), not a token mean
    pooler_output: torch.Tensor | None = None  # encoders (BERT, ViT): the pooled first token


@dataclass
class BatchContext:
    """Per-batch tensors every layer may need, built once from the full (unsharded) batch."""
    attention_mask: torch.Tensor | None  # (batch, seq) 1 = token, 0 = padding
    # the dense boolean (batch, 1, q, k) mask (None: plain causal), or a function building it on first use: under
    # context parallelism it is dropped unbuilt, since an (S, S) mask would grow with the full sequence squared
    dense_mask: torch.Tensor | Callable[[], torch.Tensor | None] | None
    position_ids: torch.Tensor           # (batch, seq) global positions
    seq_len: int
    cp: object | None = None             # layers.context_parallel.ContextParallel when cp > 1 (tokens are sharded)
    data_group: object | None = None     # where batch statistics (MoE router losses) are summed; None: the cp group
    cache: object | None = None          # layers.kv_cache.KVCache while generating: attention reads and extends it

    @property
    def mask(self) -> torch.Tensor | None:
        if callable(self.dense_mask):
            self.dense_mask = self.dense_mask()
        return self.dense_mask

    @mask.setter
    def mask(self, value):
        self.dense_mask = value

    def prepare(self):
        """Build now what layers would build on first use (compiled layers then all see the same context). The
        dense mask is left unbuilt under context parallelism."""
        if self.cp is None:
            self.mask  # noqa: B018 (the property builds it)

    def mask_for(self, window: int | None) -> torch.Tensor | None:
        """The dense mask of a layer with this sliding window: one mask serves every layer, unless the family mixes
        windowed and full layers (Gemma)."""
        return self.mask


class UnsupportedConfig(ValueError):
    """A transformers option this family does not implement."""


def require(condition: bool, message: str):
    if not condition:
        raise UnsupportedConfig(message)


def default_positions(input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """`position_ids`, or 0..seq-1 for every sequence of the batch."""
    if position_ids is not None:
        return position_ids
    b, s = input_ids.shape
    return torch.arange(s, device=input_ids.device).expand(b, s)


def check_divisible(what: str, value: int, tp: int):
    if value % tp:
        raise UnsupportedConfig(f"tp={tp} must divide {what} ({value})")


class ParallelModel(nn.Module):
    """Base of every family. Subclasses build `self.layers` as a ModuleDict keyed by *global* layer index."""

    family: str = ""
    tied_embedding: str | None = None  # parameter a tied LM head shares; the last pp stage holds a copy of it

    def __init__(self, config, pc: ParallelContext | None = None, layer_ids=None):
        super().__init__()
        self.config = config
        self.pc = pc or single_process()
        if layer_ids is None:  # one stage per pp rank, balanced by parameters
            layer_ids = model_rank_layers(config, self.pc.config.pp, self.pc.rank("pp"))
        self.layer_ids = list(layer_ids)
        self.is_first = self.pc.is_first_stage
        self.is_last = self.pc.is_last_stage

    @staticmethod
    def num_layers(config) -> int:
        return config.num_hidden_layers

    @property
    def tp_group(self):
        return self.pc.tp_group

    @property
    def sequence_parallel(self) -> bool:
        return self.pc.sequence_parallel

    def check_sequence(self, seq_len: int, max_positions: int | None = None):
        """The sequence fits a learned position table of `max_positions` rows (if any) and sequence parallelism."""
        if max_positions is not None and seq_len > max_positions:
            raise ValueError(f"sequence length {seq_len} exceeds max_position_embeddings={max_positions}")
        if self.sequence_parallel and seq_len % self.pc.tp_size:
            raise ValueError(f"sequence parallel needs the sequence length ({seq_len}) divisible by tp={self.pc.tp_size}")

    def run_layers(self, hidden: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        for layer in self.layers.values():
            hidden = layer(hidden, ctx)
        return hidden

    run = None  # the colozoo.runtime.run.Run that runs this model on its mesh; attached by the runtime

    def forward(self, input_ids, attention_mask=None, labels=None, return_logits=False, **kwargs) -> ModelOutput:
        if self.run is not None:
            return self.run.forward(input_ids, attention_mask=attention_mask, labels=labels,
                                    return_logits=return_logits, **kwargs)
        if self.pc.config.pp > 1 or self.pc.config.cp > 1:
            raise RuntimeError(f"on a mesh with pp={self.pc.config.pp}, cp={self.pc.config.cp} a model runs through "
                               f"its Run: build it with colozoo.build_model or colozoo.from_pretrained (or attach "
                               f"colozoo.runtime.run.Run(model))")
        return self.local_forward(input_ids, attention_mask=attention_mask, labels=labels,
                                  return_logits=return_logits, **kwargs)

    def local_forward(self, input_ids, attention_mask=None, labels=None, return_logits=False, **kwargs):
        """embed -> layers -> head on this rank's whole model, the batch unsharded (pp == cp == 1)."""
        ctx = self.batch_context(input_ids, attention_mask, **kwargs)
        hidden = self.embed(input_ids, ctx)
        hidden = self.run_layers(hidden, ctx)
        return self.head(hidden, ctx, labels=labels, return_logits=return_logits)

    def loss_token_count(self, labels) -> torch.Tensor:
        """How many label positions the mean loss averages over (causal LM: labels shift by one)."""
        return (labels[..., 1:] != -100).sum()

    def _run(self):
        if self.run is None:
            raise RuntimeError(f"{type(self).__name__} has no Run: build it with colozoo.build_model or "
                               f"colozoo.from_pretrained (a model on its own knows only its layers)")
        return self.run

    def forward_backward(self, input_ids, labels, attention_mask=None, num_microbatches: int = 1, **kwargs):
        """One training step's forward and backward over the whole mesh; returns the mean loss on every rank."""
        return self._run().forward_backward(input_ids, labels, attention_mask=attention_mask,
                                            num_microbatches=num_microbatches, **kwargs)

    def generate(self, input_ids, attention_mask=None, **options):
        """Token ids (batch, prompt + new) on every rank, as transformers' generate returns them: greedy or sampled
        (max_new_tokens, do_sample, temperature, top_k, top_p, repetition_penalty, eos_token_id, pad_token_id,
        seed, streamer)."""
        return self._run().generate(input_ids, attention_mask=attention_mask, **options)

    def save_pretrained(self, path, format: str = "colozoo", **kwargs):
        """Write a colozoo sharded checkpoint (collectively, each rank its shard), with format="hf" an HF directory
        (merge_lora=True folds LoRA adapters in), with format="peft" the LoRA adapters as PEFT writes them."""
        return self._run().save_pretrained(path, format=format, **kwargs)
