"""The batch context: what every layer may need to know about the batch besides its hidden states, built once per
forward by the model (`model.batch_context`) from the full, unsharded batch and handed to every layer.

The model fills in what the batch is (padding, positions, rotary frequencies, token types, whether MoE router losses
are wanted); the run fills in how it runs (`shard_sequence` for context parallelism, the KV cache of generation, the
group router statistics are summed over, token rows known already). Derived tensors (dense masks, packed document
ids, rotary angles) are built on first use and kept in dicts the context shares with its copies: FSDP rebuilds the
dataclasses among a layer's inputs, and every copy must see what one layer built.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import dense_attention_mask
from .context_parallel import ContextParallel
from .documents import packed_documents
from .rope import rotary_angles


class RouterLogits:
    """One (tokens, experts) tensor per MoE layer, in order. Deliberately not a list: FSDP rebuilds the lists among a
    layer's inputs (to hook their tensors); every layer must append to the one the head reads."""

    def __init__(self):
        self.items: list = []

    def append(self, logits):
        self.items.append(logits)

    def __iter__(self):
        return iter(self.items)

    def __getitem__(self, index):
        return self.items[index]

    def __len__(self):
        return len(self.items)


@dataclass
class BatchContext:
    attention_mask: torch.Tensor | None      # (batch, seq) 1 = token, 0 = padding
    position_ids: torch.Tensor               # (batch, seq) global positions (after shard_sequence: this rank's)
    seq_len: int                             # the positions this rank holds
    causal: bool = True
    window: int | None = None                # the sliding window of most layers (layers with another build their own)
    dense_mask: torch.Tensor | None = None   # given instead of built (ViT's padded sequence)
    token_type_ids: torch.Tensor | None = None     # BERT's segments
    rope_inv_freq: torch.Tensor | None = None      # rotary families: the batch's frequencies
    rope_scale: float = 1.0                        # YaRN / LongRoPE attention factor
    local_rope_inv_freq: torch.Tensor | None = None  # Gemma 3's sliding-window layers rotate with their own base
    output_router_logits: bool = False             # MoE: compute the router losses
    router_logits: RouterLogits = field(default_factory=lambda: RouterLogits())  # a class as the factory breaks
    # torch.compile's graph (dynamo traces a call of the class, not the class as a factory): decode steps compile whole
    router_stats_in: torch.Tensor | None = None    # MoE under pp: the router statistics of earlier stages' layers
    # set by the run
    cp: ContextParallel | None = None        # context parallelism: tokens are this rank's zigzag share
    data_group: object | None = None         # where MoE router statistics are summed (None: the cp group)
    cache: object | None = None              # layers.kv_cache.KVCache while generating: attention reads and extends it
    token_rows: torch.Tensor | None = None   # greedy decoding under tp: the token embedding's rows of input_ids
    hidden_states: list | None = None        # with output_hidden_states: every layer's input, then the last output
    _built: dict = field(default_factory=dict, repr=False)  # masks, documents and angles built on first use

    @property
    def documents(self) -> torch.Tensor | None:
        """(batch, seq) ids of the packed documents (colozoo.layers.documents) of a causal batch, computed on first use
        from the full batch's positions, or None: transformers' convention packs only with position_ids, no
        attention_mask and no KV cache. Context parallelism reads them before it shards the positions."""
        if not self.causal or self.cache is not None or self.attention_mask is not None:
            return None
        if "documents" not in self._built:
            self._built["documents"] = packed_documents(self.position_ids)
        return self._built["documents"]

    def mask_for(self, window: int | None = None) -> torch.Tensor | None:
        """The boolean dense mask (batch|1, 1, q, k) of a layer with this sliding window, True = attend (None: plain
        causal or no masking), built once per window. None under context parallelism: cp attention masks per block."""
        if self.cp is not None:
            return None
        if self.dense_mask is not None:
            return self.dense_mask
        key = ("mask", window)
        if key not in self._built:
            self._built[key] = dense_attention_mask(self.attention_mask, self.seq_len, self.causal, window,
                                                    self.position_ids.device)
        return self._built[key]

    @property
    def unpadded(self) -> bool:
        """Whether the masks are only causal and sliding windows (no attention_mask or dense mask was given): every
        query then sees at least its own position, in the cache too."""
        return self.attention_mask is None and self.dense_mask is None

    @property
    def mask(self) -> torch.Tensor | None:
        return self.mask_for(self.window)

    def rope(self, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (batch, seq, rotary_dim) of the positions, computed once per batch on first use (after any
        context-parallel sharding of the positions). `local`: the sliding-window layers' own frequencies."""
        local = local and self.local_rope_inv_freq is not None
        if ("rope", local) not in self._built:
            inv_freq, scale = (self.local_rope_inv_freq, 1.0) if local else (self.rope_inv_freq, self.rope_scale)
            self._built[("rope", local)] = rotary_angles(self.position_ids, inv_freq, scale)
        return self._built[("rope", local)]

    def prepare(self):
        """Build now what layers would build on first use (compiled layers then all see the same context)."""
        self.documents  # noqa: B018 (the property computes the packed documents' ids)
        self.mask  # noqa: B018
        if self.rope_inv_freq is not None:
            self.rope()
        if self.local_rope_inv_freq is not None:
            self.rope(local=True)

    def shard_sequence(self, group, mode: str, sequence_parallel_tp: int = 1) -> "BatchContext":
        """This context turned into this rank's context-parallel share of the sequence (in place; returned).

        Positions come from the full batch (they may depend on the padding, as in OPT) and are then sharded; packed
        document ids are read from the full batch first; no dense (S, S) mask is kept: cp attention builds its masks
        per block from the padding mask, positions and document ids."""
        cp = ContextParallel(group, mode, self.seq_len, self.attention_mask, documents=self.documents)
        local = self.seq_len // cp.size
        if local % sequence_parallel_tp:
            raise ValueError(f"sequence parallel needs the per-rank sequence ({local} = {self.seq_len}/cp) divisible by "
                             f"tp={sequence_parallel_tp}")
        self.cp, self.seq_len, self.dense_mask = cp, local, None
        self.position_ids = cp.shard(self.position_ids)
        for key in [k for k in self._built if k != "documents"]:  # the documents stay the full sequence's
            del self._built[key]
        return self
