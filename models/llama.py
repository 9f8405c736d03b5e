"""LLaMA-style decoders (also Mistral): RoPE, RMSNorm, SwiGLU, grouped-query attention, optional sliding window.

    embed_tokens (vocab-parallel) -> [input_layernorm -> attn(qkv column, fused q/k/v of different sizes; RoPE;
                                      o_proj row) -> + post_attention_layernorm -> mlp(gate_up column, silu(gate) * up,
                                      down_proj row) -> +] x n -> norm -> lm_head (tied or not)

One DecoderLayer serves every family on this decoder (Mixtral, Qwen2-MoE): a family picks each layer's attention
options (`build_attention`: biases, sliding window) and its MLP (`build_mlp`: dense, experts, experts + shared).

RoPE frequencies follow the formulas of transformers' modeling_rope_utils (default, linear, dynamic NTK, llama3, YaRN,
LongRoPE), written here from the formulas, not imported. With a partial_rotary_factor only the first
int(head_dim * factor) features of each head rotate (Phi-3.5 / Phi-4-mini, GPT-NeoX).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn

from colozoo.kernels import apply_rotary, use_triton
from colozoo.layers import (ColumnParallelLinear, GatedMLP, RMSNorm, RowParallelLinear, VocabParallelEmbedding,
                            VocabParallelLMHead, attention, merge_heads, split_heads)
from colozoo.layers.kv_cache import keys_values_mask
from colozoo.layers.moe import MoE
from colozoo.models.base import (BatchContext, ModelOutput, ParallelModel, UnsupportedConfig, check_divisible,
                                 default_positions, dropout, require)

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


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    """x: (batch, heads, seq, head_dim); cos/sin: (batch, seq, rotary_dim), their two halves equal. Features past
    rotary_dim (partial rotary) pass through."""
    if use_triton(x, elementwise=True):  # the kernel takes one angle per rotated pair, passes the rest
        half = cos.shape[-1] // 2
        return apply_rotary(x, cos[..., :half], sin[..., :half])
    rot = cos.shape[-1]
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    if rot < x.shape[-1]:
        x, rest = x[..., :rot], x[..., rot:]
        return torch.cat((x * cos + rotate_half(x) * sin, rest), dim=-1)
    return x * cos + rotate_half(x) * sin


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


@dataclass
class RopeBatchContext(BatchContext):
    inv_freq: torch.Tensor | None = None
    rope_scale: float = 1.0
    window: int | None = None  # the sliding window in `mask` (the model's)
    local_inv_freq: torch.Tensor | None = None  # Gemma 3's sliding-window layers rotate with their own base
    _rope: tuple | None = None
    _local_rope: tuple | None = None
    _window_masks: dict | None = None

    def mask_for(self, window: int | None):
        """The dense mask of a layer with this sliding window: `mask`, or, for a layer whose window is not the
        model's (Qwen2's and Gemma's mix of full and sliding layers), a mask built on first use. Without context parallelism
        only: with it, attention takes the window itself."""
        if window == self.window or self.cp is not None:
            return self.mask
        if self._window_masks is None:
            self._window_masks = {}
        if window not in self._window_masks:
            self._window_masks[window] = attention_mask_for(self.attention_mask, self.seq_len, window,
                                                            self.position_ids.device)
        return self._window_masks[window]

    def prepare(self):
        super().prepare()
        if self.inv_freq is not None:
            self.rope()
        if self.local_inv_freq is not None:
            self.rope(local=True)

    def rope(self, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (batch, seq, head_dim) of `position_ids`, computed once per batch on first use: context
        parallelism replaces position_ids by the rank's share after the context is built."""
        if local and self.local_inv_freq is not None:
            if self._local_rope is None:
                self._local_rope = self._angles(self.local_inv_freq, 1.0)
            return self._local_rope
        if self._rope is None:
            self._rope = self._angles(self.inv_freq, self.rope_scale)
        return self._rope

    def _angles(self, inv_freq, scale):
        freqs = self.position_ids[..., None].float() * inv_freq.to(self.position_ids.device)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos() * scale, angles.sin() * scale


class LlamaAttention(nn.Module):
    """Grouped-query attention with RoPE. Families on this decoder set its options here: `qkv_bias` / `out_bias`
    (default: config.attention_bias), the sliding `window` (None: full causal attention), the score `scale`
    (default head_dim ** -0.5) and `softcap`, `qk_norm` (a per-head RMSNorm of q and k before RoPE; a dict gives
    its RMSNorm options) and `local_rope` (ctx's sliding-window RoPE)."""

    def __init__(self, config, pc, device=None, dtype=None, *, qkv_bias: bool | None = None,
                 out_bias: bool | None = None, window: int | None = None, scale: float | None = None,
                 softcap: float | None = None, qk_norm: bool | dict = False, local_rope: bool = False):
        super().__init__()
        h, tp, hd = config.hidden_size, pc.tp_size, head_dim_of(config)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        # tp > kv heads: each rank holds one kv head, replicated over the tp // kv_heads ranks whose queries use it
        self.head_dim, self.local_heads, self.local_kv_heads = hd, heads // tp, max(kv_heads // tp, 1)
        self.dropout_p = config.attention_dropout
        self.window = window  # in ctx.mask without context parallelism
        self.scale, self.softcap, self.local_rope = scale or hd ** -0.5, softcap, local_rope
        bias = getattr(config, "attention_bias", False)
        kw = dict(group=pc.tp_group, sequence_parallel=pc.sequence_parallel, device=device, dtype=dtype)
        self.qkv = ColumnParallelLinear(h, (heads + 2 * kv_heads) * hd, bias=bias if qkv_bias is None else qkv_bias,
                                        chunks=(heads * hd, kv_heads * hd, kv_heads * hd),
                                        parts=(heads, kv_heads, kv_heads),
                                        replica_group=pc.tp_subgroup(max(tp // kv_heads, 1)), **kw)
        self.o_proj = RowParallelLinear(heads * hd, h, bias=bias if out_bias is None else out_bias, **kw)
        self.qk_norm = bool(qk_norm)
        if qk_norm:  # replicated, but each tp rank sees only its heads: the gradient is summed over tp
            norm = dict(eps=config.rms_norm_eps, group=pc.tp_group, sequence_parallel=tp > 1, device=device,
                        dtype=dtype, **(qk_norm if isinstance(qk_norm, dict) else {}))
            self.q_norm, self.k_norm = RMSNorm(hd, **norm), RMSNorm(hd, **norm)

    def forward(self, x, ctx: RopeBatchContext):
        q, k, v = split_heads(self.qkv(x), self.local_heads, self.local_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = ctx.rope(self.local_rope)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v, mask, causal = keys_values_mask(ctx, self, k, v, window=self.window)
        out = attention(q, k, v, mask, causal=causal, scale=self.scale, cp=ctx.cp, window=self.window,
                        dropout_p=self.dropout_p if self.training else 0.0, softcap=self.softcap,
                        documents=ctx.documents)
        return self.o_proj(merge_heads(out))


def dense_mlp(config, pc, device=None, dtype=None) -> GatedMLP:
    """The dense SwiGLU MLP (gate_up column, silu(gate) * up, down_proj row)."""
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                    bias=getattr(config, "mlp_bias", False), group=pc.tp_group,
                    sequence_parallel=pc.sequence_parallel, device=device, dtype=dtype)


class DecoderLayer(nn.Module):
    """input_layernorm -> self_attn -> + post_attention_layernorm -> mlp -> +, for every family on this decoder.

    The MLP is the family's: dense SwiGLU (LLaMA, Mistral, Qwen2-MoE's dense layers), a mixture of experts
    (Mixtral), or experts plus a shared expert (Qwen2-MoE). A MoE returns (output, router logits); the logits
    are appended to ctx.router_logits for the load-balancing loss. `resid_dropout` drops out both block outputs
    before their residual adds (Phi-3's resid_pdrop)."""

    attention_block = "self_attn"  # what selective activation checkpointing recomputes

    def __init__(self, config, pc, self_attn: nn.Module, mlp: nn.Module, device=None, dtype=None,
                 resid_dropout: float = 0.0):
        super().__init__()
        self.resid_dropout, self.sharded_resid = resid_dropout, pc.sequence_parallel
        norm = dict(eps=config.rms_norm_eps, group=pc.tp_group, sequence_parallel=pc.sequence_parallel,
                    device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, **norm)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, **norm)
        self.mlp = mlp
        self.routed = isinstance(mlp, MoE)

    def _dropout(self, x):
        return dropout(x, self.resid_dropout, self.training, sharded=self.sharded_resid) if self.resid_dropout else x

    def forward(self, x, ctx):
        attn_out = self._dropout(self.self_attn(self.input_layernorm(x), ctx))
        mlp_in, x = self.post_attention_layernorm(attn_out, residual=x)  # x + attn_out, and that normalised
        if not self.routed:
            return x + self._dropout(self.mlp(mlp_in))
        out, router_logits = self.mlp(mlp_in)
        ctx.router_logits.append(router_logits)
        return x + self._dropout(out)


def attention_mask_for(attention_mask, seq_len: int, sliding_window: int | None, device):
    """Boolean (batch or 1, 1, q, k) mask, True = attend; None when plain causal attention suffices."""
    windowed = sliding_window is not None and sliding_window < seq_len
    if attention_mask is None and not windowed:
        return None
    q = torch.arange(seq_len, device=device)[:, None]
    k = torch.arange(seq_len, device=device)[None, :]
    keep = k <= q
    if windowed:
        keep = keep & (k > q - sliding_window)
    keep = keep[None, None]
    if attention_mask is not None:
        keep = keep & attention_mask.to(torch.bool)[:, None, None, :]
    return keep


class RotaryModel(ParallelModel):
    """A model with rotary positions (`self.rotary`) and an optional sliding window shared by its layers' mask."""

    sliding_window: int | None = None

    def reset_buffers(self):
        """Recompute the non-persistent RoPE frequencies (after materialising a meta-initialised model)."""
        self.rotary.reset_buffers()

    def batch_context(self, input_ids, attention_mask=None, position_ids=None,
                      rope_length: int | None = None) -> RopeBatchContext:
        """`rope_length`: the length of the whole batch these rows belong to (generate's pipeline micro-batches)."""
        s = input_ids.shape[1]
        self.check_sequence(s)
        position_ids = default_positions(input_ids, position_ids)
        dense_mask = functools.partial(attention_mask_for, attention_mask, s, self.sliding_window, input_ids.device)
        return RopeBatchContext(attention_mask, dense_mask, position_ids, s,
                                inv_freq=self.rotary(position_ids, rope_length),
                                rope_scale=self.rotary.attention_factor, window=self.sliding_window)


class LlamaForCausalLM(RotaryModel):
    family = "llama"
    tied_embedding = "embed_tokens.weight"
    norm_options: dict = {}  # of every RMSNorm (Gemma: offset=True)

    def __init__(self, config, pc=None, layer_ids=None, device=None, dtype=None):
        super().__init__(config, pc, layer_ids)
        pc = self.pc
        if type(self) is LlamaForCausalLM and config.model_type == "mistral":
            self.family = "mistral"  # one class serves both; subclasses keep their class attribute
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if heads % kv_heads:
            raise UnsupportedConfig(f"num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads})")
        check_divisible("the attention heads (num_attention_heads)", heads, pc.tp_size)
        if kv_heads % pc.tp_size and pc.tp_size % kv_heads:
            raise UnsupportedConfig(f"tp={pc.tp_size} must divide the key/value heads (num_key_value_heads="
                                    f"{kv_heads}) or be a multiple of them (each kv head then replicated over "
                                    f"tp / num_key_value_heads ranks)")
        pc.tp_subgroup(max(pc.tp_size // kv_heads, 1))  # collective: here, where every rank of every stage passes
        check_divisible("the MLP width (intermediate_size)", config.intermediate_size, pc.tp_size)
        self.sliding_window = self.attention_window(config)
        h = config.hidden_size
        kw = dict(device=device, dtype=dtype)
        sp = dict(group=pc.tp_group, sequence_parallel=pc.sequence_parallel)
        if self.is_first or (self.is_last and config.tie_word_embeddings):  # the last stage holds a tied copy
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h, padding_idx=config.pad_token_id, **sp, **kw)
        self.layers = nn.ModuleDict({str(i): self.build_layer(i, config, pc, **kw) for i in self.layer_ids})
        if self.is_last:
            self.norm = RMSNorm(h, eps=config.rms_norm_eps, **self.norm_options, **sp, **kw)
            tied = self.embed_tokens if config.tie_word_embeddings else None
            self.lm_head = VocabParallelLMHead(h, config.vocab_size, **sp, tied_embedding=tied,
                                               softcap=getattr(config, "final_logit_softcapping", None), **kw)
        self.rotary = RotaryEmbedding(config, device=device)

    def build_layer(self, layer_idx: int, config, pc, **kw) -> DecoderLayer:
        return DecoderLayer(config, pc, self.build_attention(layer_idx, config, pc, **kw),
                            self.build_mlp(layer_idx, config, pc, **kw), **kw)

    def attention_window(self, config) -> int | None:
        """The sliding attention window (None: full causal attention), in the mask and in every layer."""
        return getattr(config, "sliding_window", None)

    def build_attention(self, layer_idx: int, config, pc, **kw) -> nn.Module:
        """Layer `layer_idx`'s attention; families on this decoder pass their options to LlamaAttention here."""
        return LlamaAttention(config, pc, window=self.sliding_window, **kw)

    def build_mlp(self, layer_idx: int, config, pc, **kw) -> nn.Module:
        """Layer `layer_idx`'s MLP: dense here, a mixture of experts in Mixtral and Qwen2-MoE."""
        return dense_mlp(config, pc, **kw)


    def embed(self, input_ids, ctx):
        return self.embed_tokens(input_ids, ctx.token_rows)

    def head(self, hidden, ctx, labels=None, return_logits=False) -> ModelOutput:
        hidden = self.norm(hidden)
        loss, logits = self.lm_head.loss_and_logits(hidden, labels, return_logits, cp=ctx.cp)
        return ModelOutput(loss=loss, logits=logits, hidden_states=self.output_hidden_states(ctx, last=hidden))
