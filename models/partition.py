"""Which layers of a model live on which pipeline stage: colozoo.core.partition's balanced split, weighted by what
the model's layers, embeddings and head cost (read off the config and the family table)."""
from __future__ import annotations

from colozoo.core.partition import PartitionError, virtual_stage_layers
from colozoo.models.family import family_of

BALANCE = ("params", "flops", "layers")


def _attention(config, h: int, heads: int) -> tuple[int, int]:
    """(projection weights, query x key and probability x value widths summed over heads) of one attention block."""
    if getattr(config, "kv_lora_rank", None):  # multi-head latent attention (DeepSeek-V3): compressions, heads' ups
        qk, v, latent = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim, config.kv_lora_rank
        q = h * heads * qk if config.q_lora_rank is None else config.q_lora_rank * (h + heads * qk)
        kv = h * (latent + config.qk_rope_head_dim) + latent * heads * (config.qk_nope_head_dim + v)
        return q + kv + heads * v * h, heads * (qk + v)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads  # Gemma, Qwen3: heads x head_dim != hidden
    return h * head_dim * (2 * heads + 2 * kv_heads), 2 * heads * head_dim  # q and o, k and v (grouped: fewer kv)


def layer_cost(config, balance: str = "params", seq_len: int = 1024) -> tuple[float, float, float]:
    """(per layer, first-stage extra, last-stage extra) cost of a decoder-only transformer, in units of one layer (the
    mean layer where DeepSeek-V3's first first_k_dense_replace layers have dense MLPs and the others experts).

    "params": embeddings and the LM head count by their weights (a tied head counts on both stages: the last
    stage holds a copy). "flops": per-token forward FLOPs; the embedding lookup is free, the head is a matmul.
    """
    h, vocab = config.hidden_size, getattr(config, "vocab_size", 0)
    heads = config.num_attention_heads
    attention, core = _attention(config, h, heads)
    inner = (getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
             or getattr(config, "ffn_dim", None) or 4 * h)
    family = family_of(config.model_type)
    gated = family.gated_mlp  # gate, up and down projections
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 1
    matrices = 3 if gated else 2
    expert = matrices * h * (getattr(config, "moe_intermediate_size", None) or inner)  # Qwen-MoE experts are narrower
    shared_size = (getattr(config, "shared_expert_intermediate_size", None)
                   or (getattr(config, "n_shared_experts", None) or 0) * (getattr(config, "moe_intermediate_size", 0)))
    shared = matrices * h * shared_size
    router = h * experts if experts > 1 else 0
    dense = min(getattr(config, "first_k_dense_replace", 0) if experts > 1 else 0, config.num_hidden_layers)
    share = dense / config.num_hidden_layers  # of the layers with a dense MLP instead of the experts

    def mean(moe, dense_mlp=matrices * h * inner):
        return share * dense_mlp + (1 - share) * moe

    if balance == "params":
        layer = attention + mean(expert * experts + shared + router)
        positions = getattr(config, "max_position_embeddings", 0) if family.learned_positions else 0
        first = vocab * h + positions * h
        last = vocab * h
    elif balance == "flops":
        active = expert * (getattr(config, "num_experts_per_tok", None) or 1) + shared + router  # routed tokens only
        layer = 2 * (attention + mean(active)) + 2 * seq_len * core  # projections + attention scores/values
        first, last = 0.0, 2 * vocab * h
    else:
        raise PartitionError(f"balance must be 'params' or 'flops', got {balance!r}")
    return 1.0, first / layer, last / layer


def model_stage_layers(config, pp: int, virtual_stages: int = 1, balance: str = "params",
                       layers_per_stage: list[int] | None = None, seq_len: int = 1024) -> list[list[list[int]]]:
    """`virtual_stage_layers` for an HF config, balanced by parameters or FLOPs ("layers": equal layer counts)
    unless `layers_per_stage` is given."""
    n = config.num_hidden_layers
    if layers_per_stage is not None:
        return virtual_stage_layers(n, pp, virtual_stages, layers_per_stage=layers_per_stage)
    if balance not in BALANCE:
        raise PartitionError(f"balance must be one of {BALANCE}, got {balance!r}")
    if balance == "layers":
        return virtual_stage_layers(n, pp, virtual_stages)
    _, first, last = layer_cost(config, balance, seq_len)
    return virtual_stage_layers(n, pp, virtual_stages, first_extra=first, last_extra=last)


def model_rank_layers(config, pp: int, pp_rank: int, balance: str = "params",
                      layers_per_stage: list[int] | None = None) -> list[int]:
    """The layers of one pp rank (one stage per rank) of a model built without explicit `layer_ids`: by
    default balanced by parameters, so the embedding and head stages get fewer layers when those are large."""
    if pp == 1 and layers_per_stage is None:
        return list(range(config.num_hidden_layers))
    return model_stage_layers(config, pp, balance=balance, layers_per_stage=layers_per_stage)[pp_rank][0]
