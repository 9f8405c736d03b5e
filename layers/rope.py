"""Rotary position embeddings: the frequencies of every RoPE variant transformers knows (default, linear, dynamic NTK,
llama3, YaRN, LongRoPE), written from the formulas of transformers' modeling_rope_utils (not imported), the module
that gives a batch its frequencies, the cos/sin of its positions, and their application to queries and keys.

With a partial_rotary_factor only the first int(head_dim * factor) features of each head rotate (Phi-3.5 /
Phi-4-mini, GPT-NeoX). A config may keep RoPE parameters per layer type (Gemma 3's sliding-window layers rotate with
their own base): `rope_config(config, layer_type)` is the config as one type's RotaryEmbedding sees it.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from colozoo.core.errors import UnsupportedConfig, require
from colozoo.kernels.rope import apply_rotary

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotary_dim(config) -> int:
    """How many leading features of each head rotate."""
    return int(head_dim_of(config) * rope_parameters(config).get("partial_rotary_factor", 1.0))


def rope_parameters(config) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def check_rope(config):
    params = rope_parameters(config)
    if params["rope_type"] not in ROPE_TYPES:
        raise UnsupportedConfig(f"RoPE type {params['rope_type']!r} is not supported; supported: {ROPE_TYPES}")
    require(rotary_dim(config) % 2 == 0, f"the rotary dimension ({rotary_dim(config)}) must be even")


def rope_inv_freq(config, seq_len: int | None = None, device=None) -> torch.Tensor:
    """Inverse frequencies (rotary_dim / 2,) in fp32; `seq_len` matters only for dynamic NTK scaling and LongRoPE."""
    params = rope_parameters(config)
    rope_type, base, dim = params["rope_type"], params["rope_theta"], rotary_dim(config)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    if rope_type == "dynamic":
        max_pos = config.max_position_embeddings
        # computed on tensors, as transformers does once the sequence grows, so the fp32 rounding agrees
        seq = torch.tensor(max(seq_len or max_pos, max_pos), device=device)
        base = base * ((params["factor"] * seq / max_pos) - (params["factor"] - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_scaling(inv_freq, params)
    elif rope_type == "yarn":
        inv_freq = _yarn_inv_freq(base ** exponents, params, dim, base, _yarn_factor(config, params))
    elif rope_type == "longrope":  # per-frequency factors: the long set once the sequence outgrows the original length
        long = seq_len is not None and seq_len > _original_max_positions(config, params)
        factors = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32, device=device)
        inv_freq = 1.0 / (factors * base ** exponents)
    return inv_freq


def _original_max_positions(config, params) -> int:
    return params.get("original_max_position_embeddings") or config.original_max_position_embeddings


def _yarn_factor(config, params) -> float:
    return params.get("factor") or config.max_position_embeddings / params["original_max_position_embeddings"]


def rope_attention_factor(config) -> float:
    """The scale of cos/sin: 1 except for YaRN and LongRoPE, whose attention temperature grows with log(factor)."""
    params = rope_parameters(config)
    if params["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if params.get("attention_factor") is not None:
        return params["attention_factor"]
    if params["rope_type"] == "longrope":
        original = _original_max_positions(config, params)
        factor = params.get("factor") or config.max_position_embeddings / original
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factor = _yarn_factor(config, params)

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        return float(mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"]))
    return mscale(factor)


def _yarn_inv_freq(wavelengths: torch.Tensor, params: dict, dim: int, base: float, factor: float) -> torch.Tensor:
    """Interpolate (divide by factor) the low frequencies, keep the high ones, ramp linearly in between."""
    original = params["original_max_position_embeddings"]

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(params.get("beta_fast") or 32), correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(wavelengths.device)
    keep = 1 - ramp
    return 1.0 / (factor * wavelengths) * (1 - keep) + 1.0 / wavelengths * keep


def _llama3_scaling(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Keep high frequencies, divide low ones by `factor`, interpolate smoothly in between (Llama 3.1)."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, config, device=None):
        super().__init__()
        check_rope(config)
        self.config = config
        params = rope_parameters(config)
        self.dynamic = params["rope_type"] == "dynamic"
        self.long_after = _original_max_positions(config, params) if params["rope_type"] == "longrope" else None
        self.attention_factor = rope_attention_factor(config)
        self.register_buffer("inv_freq", torch.empty(rotary_dim(config) // 2, device=device), persistent=False)
        if self.inv_freq.device.type != "meta":
            self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self):
        self.inv_freq.copy_(rope_inv_freq(self.config, device=self.inv_freq.device))

    def forward(self, position_ids: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """The inverse frequencies for a batch with these (global) positions; `seq_len`: the whole batch's length
        when these rows are a micro-batch of it (dynamic and LongRoPE scaling choose by the batch, as transformers)."""
        if position_ids.is_meta:  # a symbolic run (profiler): shapes are all that matter
            return self.inv_freq.to("meta")
        if self.inv_freq.is_meta:
            raise RuntimeError("RoPE frequencies are still on the meta device: call model.reset_buffers() after "
                               "materialising the model")
        if not self.dynamic and self.long_after is None:  # fixed frequencies: no max() that waits for the device
            return self.inv_freq
        seq_len = max(int(position_ids.max()) + 1, seq_len or 0)
        if self.dynamic and seq_len > self.config.max_position_embeddings:
            return rope_inv_freq(self.config, seq_len, device=self.inv_freq.device)
        if self.long_after is not None and seq_len > self.long_after:
            return rope_inv_freq(self.config, seq_len, device=self.inv_freq.device)
        return self.inv_freq


def rotary_angles(position_ids: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0):
    """cos/sin (batch, seq, rotary_dim) of these positions, both halves equal, in fp32 and times `scale` (the
    attention factor of YaRN and LongRoPE), as transformers computes them."""
    freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos() * scale, angles.sin() * scale


def apply_rope(x, cos, sin):
    """x: (batch, heads, seq, head_dim) rotated by cos/sin (batch, seq, rotary_dim), their two halves equal; features
    past rotary_dim (partial rotary) pass through. The rotary op (colozoo.kernels.rope) picks its kernel."""
    return apply_rotary(x, cos, sin)


class _RopeView:
    """The config as RotaryEmbedding sees it for one layer type (Gemma 3 keeps RoPE parameters per type)."""

    def __init__(self, config, params: dict):
        self._config, self.rope_parameters = config, params

    def __getattr__(self, name):
        return getattr(self._config, name)


def rope_config(config, layer_type: str):
    """The config with the RoPE parameters of `layer_type` when the config keeps them per layer type, else itself."""
    params = getattr(config, "rope_parameters", None) or {}
    return _RopeView(config, params[layer_type]) if isinstance(params.get(layer_type), dict) else config
