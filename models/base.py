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
from colozoo.layers.comm import gather_from_parallel
from colozoo.layers.context_parallel import gather_sequence
from colozoo.layers.documents import packed_documents
from colozoo.layers.dropout import dropout  # noqa: F401 (the families import it from here)
from colozoo.models.outputs import ModelOutput  # noqa: F401 (the families import it from here)


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
    token_rows: torch.Tensor | None = None  # greedy decoding under tp: the token embedding's rows of input_ids
    hidden_states: list | None = None    # with output_hidden_states: every layer's input, then the last output
    _documents: torch.Tensor | bool | None = None  # packed document ids once computed; False: one per row

    @property
    def documents(self) -> torch.Tensor | None:
        """(batch, seq) ids of the packed documents (colozoo.layers.documents), computed on first use from the full
        batch's positions, or None: transformers' convention packs only with position_ids, no attention_mask and
        no KV cache. Context parallelism reads them before it shards the positions."""
        if self.cache is not None or self.attention_mask is not None:
            return None
        if self._documents is None:
            found = packed_documents(self.position_ids)
            self._documents = False if found is None else found
        return None if self._documents is False else self._documents

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
        self.documents  # noqa: B018 (the property computes the packed documents' ids)
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

    def run_layers(self, hidden: torch.Tensor, ctx: BatchContext, layers=None) -> torch.Tensor:
        """`layers` (default: all of this rank's) in order; with output_hidden_states each input and the last output
        are kept in ctx.hidden_states."""
        for layer in (self.layers if layers is None else layers).values():
            if ctx.hidden_states is not None:
                ctx.hidden_states.append(hidden)
            hidden = layer(hidden, ctx)
        if ctx.hidden_states is not None:
            ctx.hidden_states.append(hidden)
        return hidden

    def context(self, input_ids, attention_mask=None, output_hidden_states=None, **kwargs) -> BatchContext:
        """The family's batch context, set to keep every layer's hidden states when `output_hidden_states` (or
        the config's, as in transformers) asks for them."""
        ctx = self.batch_context(input_ids, attention_mask, **kwargs)
        if self.wants_hidden_states(output_hidden_states):
            ctx.hidden_states = []
        return ctx

    def wants_hidden_states(self, output_hidden_states=None) -> bool:
        """The forward's `output_hidden_states`, else the config's; refused under pipeline parallelism."""
        if output_hidden_states is None:
            output_hidden_states = getattr(self.config, "output_hidden_states", False)
        if not isinstance(output_hidden_states, bool):
            raise ValueError(f"output_hidden_states must be True or False; got {output_hidden_states!r}")
        if output_hidden_states and self.pc.config.pp > 1:
            raise ValueError(f"output_hidden_states=True is not supported with pipeline parallelism "
                             f"(pp={self.pc.config.pp}): each stage holds only its own layers' states; run the "
                             f"model at pp=1 to get them")
        return output_hidden_states

    def whole_sequence(self, hidden: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        """A (batch, seq, hidden) activation whole on every rank: all-gathered over tp under sequence parallelism
        and over cp under context parallelism (backward keeps this rank's share)."""
        if self.sequence_parallel:
            hidden = gather_from_parallel(hidden, self.tp_group, dim=1)
        if ctx.cp is not None:
            hidden = gather_sequence(hidden, ctx.cp.group)
        return hidden

    def output_hidden_states(self, ctx: BatchContext, last: torch.Tensor | None = None) -> tuple | None:
        """transformers' `hidden_states`: the embedding output, then every layer's output, whole on every rank;
        `last` (a decoder's final norm output, as transformers' decoders give it) replaces the last layer's.
        None unless the forward asked for them."""
        if ctx.hidden_states is None:
            return None
        states = ctx.hidden_states if last is None else ctx.hidden_states[:-1] + [last]
        return tuple(self.whole_sequence(state, ctx) for state in states)

    run = None  # the colozoo.runtime.run.Run that runs this model on its mesh; attached by the runtime

    def forward(self, input_ids, attention_mask=None, labels=None, return_logits=False, return_dict=None,
                **kwargs) -> ModelOutput | tuple:
        """A ModelOutput (`return_dict=False`: its tuple, as in transformers). `output_hidden_states=True` adds
        `hidden_states` (pp == 1)."""
        if self.run is not None:
            out = self.run.forward(input_ids, attention_mask=attention_mask, labels=labels,
                                   return_logits=return_logits, **kwargs)
        elif self.pc.config.pp > 1 or self.pc.config.cp > 1:
            raise RuntimeError(f"on a mesh with pp={self.pc.config.pp}, cp={self.pc.config.cp} a model runs through "
                               f"its Run: build it with colozoo.build_model or colozoo.from_pretrained (or attach "
                               f"colozoo.runtime.run.Run(model))")
        else:
            out = self.local_forward(input_ids, attention_mask=attention_mask, labels=labels,
                                     return_logits=return_logits, **kwargs)
        return out.to_tuple() if return_dict is False else out

    def local_forward(self, input_ids, attention_mask=None, labels=None, return_logits=False, **kwargs):
        """embed -> layers -> head on this rank's whole model, the batch unsharded (pp == cp == 1)."""
        ctx = self.context(input_ids, attention_mask, **kwargs)
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
