"""The KV cache of incremental decoding, sharded like the attention weights: each rank keeps the keys and values
of its own (kv) heads, (batch, local kv heads, max_len, head_dim) per layer (keyed by the global layer index; a
sliding-window layer keeps only its window), allocated once at the first write (the prefill) for the whole
generation. Batches are left-padded: every row has the same length, and `key_keep` says which cached positions are
real tokens.

An attention module with `batch.cache` set writes its new keys/values and attends over everything cached:

    k, v, mask = batch.cache.update(layer_idx, k, v, window=self.window)   # mask: (batch, 1, new, cached + new)

Keys and values may differ in heads and width: multi-head latent attention (layers.mla) stores its compressed latent
as the "keys" and its rotary key as the "values", one head each, instead of every head's keys and values.

After a forward in which every layer wrote, the caller (colozoo.runtime.generate) calls `cache.advance(new)`; to encode
the whole sequence again, `cache.restart()`.

StaticKVCache is the same cache with decode steps of static shapes (what CUDA graphs and torch.compile capture, see
colozoo.runtime.static_decode): after the prefill (`start_decoding`) the write position is a device tensor; a step
writes its one position there and attends over every slot under a mask built on the device from that position.
"""
from __future__ import annotations

import torch


class KVCache:
    zeroed = False  # buffers start as zeros (a step that reads slots nobody wrote multiplies them by 0: no NaN)

    def __init__(self, key_keep: torch.Tensor, max_len: int):
        """`key_keep`: (batch, prompt) the prompt's attention mask (1 = token, 0 = left padding)."""
        batch, prompt = key_keep.shape
        if prompt > max_len:
            raise ValueError(f"the prompt ({prompt} tokens) is longer than the cache ({max_len})")
        self.max_len, self.length = max_len, 0
        self.key_keep = torch.ones(batch, max_len, dtype=torch.bool, device=key_keep.device)
        self.key_keep[:, :prompt] = key_keep.bool()
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # global layer index -> (keys, values)
        self.rows = slice(None)
        self.masks: dict = {}  # the masks of the current step, built once for every layer

    def micro_batch(self, rows: slice) -> "KVCache":
        """A view of some rows sharing this cache's buffers (pipeline stages decode micro-batches in turn)."""
        view = object.__new__(KVCache)
        view.__dict__.update(self.__dict__)
        view.rows = rows
        return view

    def advance(self, new: int):
        """The `new` positions every layer just wrote are cached: the next forward writes after them."""
        if self.length + new > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} positions; {self.length + new} were asked for")
        self.length += new

    def reorder(self, rows: torch.Tensor):
        """Row i of every buffer becomes what row rows[i] held (beam search continues its best sequences)."""
        rows = rows.to(self.key_keep.device)
        self.key_keep = self.key_keep.index_select(0, rows)
        self.buffers = {layer: (k.index_select(0, rows.to(k.device)), v.index_select(0, rows.to(v.device)))
                        for layer, (k, v) in self.buffers.items()}
        self.masks = {}

    def restart(self):
        """Forget every cached position (the buffers stay): the next forward writes from position 0."""
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, window: int | None = None):
        """Store k/v (batch, kv heads, new, width) at positions length.. and return the keys and values the new
        queries attend over with their boolean mask (batch, 1, new, keys). A sliding-window layer keeps only its
        last `window` positions, in a ring of `window` slots."""
        new = k.shape[2]
        end = self.length + new
        if end > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} positions; {end} were asked for")
        ring = window is not None and window < self.max_len
        if layer not in self.buffers:
            batch, length = self.key_keep.shape[0], window if ring else self.max_len
            allocate = torch.Tensor.new_zeros if self.zeroed else torch.Tensor.new_empty
            self.buffers[layer] = tuple(allocate(t, batch, t.shape[1], length, t.shape[3]) for t in (k, v))
        keys, values = (b[self.rows] for b in self.buffers[layer])
        if not ring:
            keys[:, :, self.length:end] = k
            values[:, :, self.length:end] = v
            return keys[:, :, :end], values[:, :, :end], self.mask(new, window)
        if self.length and new > 1:
            raise ValueError("a sliding-window cache takes one prefill, then one token at a time")
        kept = torch.arange(max(self.length, end - window), end, device=k.device)  # new positions the ring keeps
        keys[:, :, kept % window] = k[:, :, kept - self.length]
        values[:, :, kept % window] = v[:, :, kept - self.length]
        if self.length == 0:  # the prefill attends over its own keys, causal within the window
            return k, v, self.mask(new, window)
        return keys, values, self.ring_mask(window)

    def ring_mask(self, window: int) -> torch.Tensor:
        """(batch, 1, 1, window): which slots hold a real token for the query at position `length`."""
        slot = torch.arange(window, device=self.key_keep.device)
        position = self.length - (self.length - slot) % window  # the newest position each slot holds
        filled = position >= 0
        keep = self.key_keep[self.rows][:, position.clamp(min=0)] & filled
        return keep[:, None, None, :]

    def mask(self, new: int, window: int | None = None) -> torch.Tensor:
        key = (self.length, new, window, self.rows.start, self.rows.stop)
        if key not in self.masks:
            self.masks = {k: v for k, v in self.masks.items() if k[0] == self.length}
            self.masks[key] = self._mask(new, window)
        return self.masks[key]

    def _mask(self, new: int, window: int | None) -> torch.Tensor:
        end = self.length + new
        q_pos = torch.arange(self.length, end, device=self.key_keep.device)[:, None]
        k_pos = torch.arange(end, device=self.key_keep.device)[None, :]
        keep = k_pos <= q_pos
        if window is not None:
            keep = keep & (k_pos > q_pos - window)
        return keep[None, None] & self.key_keep[self.rows, None, None, :end]

    def buffers_flat(self) -> list[torch.Tensor]:
        """Every layer's keys and values buffers."""
        return [t for pair in self.buffers.values() for t in pair]

    def numel(self) -> int:
        """Elements held for keys and values on this rank."""
        return sum(k.numel() + v.numel() for k, v in self.buffers.values())


def keys_values_mask(batch, layer: int, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                     window: int | None = None):
    """What an attention module attends over: its new k/v with the batch's mask, or, while generating
    (`batch.cache`), every cached k/v with the cache's mask (causal order and window already in it).
    Returns (k, v, mask, causal) for `colozoo.layers.attention.attention`."""
    if batch.cache is None:
        return k, v, batch.mask_for(window), causal
    k, v, mask = batch.cache.update(layer, k, v, window)
    return k, v, mask, False


class StaticKVCache(KVCache):
    """A KVCache whose decode steps have static shapes and read nothing back to the host: after `start_decoding`
    every step writes one position at `position` (a 0-d device tensor; a sliding-window layer's ring at position
    % window) and returns the whole buffers with the mask (batch, 1, 1, slots) of the slots that hold a real token
    the query may see. The step moves `position` on itself (colozoo.runtime.static_decode)."""

    position: torch.Tensor | None = None
    zeroed = True  # a step attends over every slot: an unwritten one must hold no NaN, which a masked 0 keeps

    def start_decoding(self):
        """The prefill is cached (`advance` counted it): from now on one token a step, at a device position."""
        device = self.key_keep.device
        self.position = torch.full((), self.length, dtype=torch.long, device=device)
        self.slots = torch.arange(self.max_len, device=device)
        self.masks = {}

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, window: int | None = None):
        if self.position is None:  # the prefill: the growing cache's update
            return super().update(layer, k, v, window)
        if k.shape[2] != 1:
            raise ValueError(f"a static cache's decode step takes one token per sequence, got {k.shape[2]}")
        ring = window is not None and window < self.max_len
        slot = (self.position % window if ring else self.position).view(1)
        keys, values = (b[self.rows] for b in self.buffers[layer])
        keys.index_copy_(2, slot, k)
        values.index_copy_(2, slot, v)
        return keys, values, self.step_mask(window if ring else None)

    def step_mask(self, window: int | None) -> torch.Tensor:
        """(batch, 1, 1, slots): the full cache's positions up to `position`, or the ring slots of a window layer
        that hold a real token (what KVCache.ring_mask keeps), built once per step and window."""
        key = ("step", window, self.rows.start, self.rows.stop)
        if key not in self.masks:
            keep_rows = self.key_keep[self.rows]
            if window is None:
                keep = keep_rows & (self.slots <= self.position)
            else:
                slot = self.slots[:window]
                newest = self.position - (self.position - slot) % window  # the newest position each slot holds
                keep = keep_rows.gather(1, newest.clamp(min=0).expand(keep_rows.shape[0], -1)) & (newest >= 0)
            self.masks[key] = keep[:, None, None, :]
        return self.masks[key]
