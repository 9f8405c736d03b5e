"""Which layers live on which pipeline stage.

Layers are split into contiguous runs, one per (virtual) stage, minimising the heaviest stage. A layer's
weight is its parameter count by default; the first stage also carries the embeddings and the last the
head, so they get fewer layers when those are large. `layers_per_stage` overrides the balance. Models built
without explicit `layer_ids` use `model_rank_layers` (balanced by parameters unless told otherwise).
"""
from __future__ import annotations

from functools import lru_cache


class PartitionError(ValueError):
    pass


def balanced_partition(weights: list[float], parts: int, first_extra: float = 0.0, last_extra: float = 0.0) -> list[int]:
    """Sizes of `parts` contiguous runs (each >= 1) of `weights` minimising the maximum run weight, and among
    those the sum of squared run weights (so stages below the maximum are balanced too)."""
    n = len(weights)
    if parts > n:
        raise PartitionError(f"cannot split {n} layers over {parts} stages: every stage needs at least one layer")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    @lru_cache(maxsize=None)
    def best(start: int, k: int) -> tuple[float, float, tuple[int, ...]]:
        # split weights[start:] into k runs; stage index is parts - k
        stage = parts - k
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == parts - 1 else 0.0)
        if k == 1:
            cost = prefix[n] - prefix[start] + extra
            return cost, cost * cost, (n - start,)
        result = (float("inf"), float("inf"), ())
        for end in range(start + 1, n - k + 2):
            head = prefix[end] - prefix[start] + extra
            if head > result[0]:
                break
            tail_max, tail_squares, tail = best(end, k - 1)
            candidate = (max(head, tail_max), head * head + tail_squares, (end - start, *tail))
            if candidate[:2] < result[:2]:
                result = candidate
        return result

    return list(best(0, parts)[2])


def stage_layers(num_layers: int, num_stages: int, layers_per_stage: list[int] | None = None,
                 layer_weights: list[float] | None = None, first_extra: float = 0.0, last_extra: float = 0.0) -> list[list[int]]:
    """Global layer indices of every stage."""
    if layers_per_stage is not None:
        if len(layers_per_stage) != num_stages or sum(layers_per_stage) != num_layers or min(layers_per_stage) < 1:
            raise PartitionError(f"layers_per_stage={layers_per_stage} must have {num_stages} entries >= 1 "
                                 f"adding up to {num_layers} layers")
        sizes = list(layers_per_stage)
    else:
        sizes = balanced_partition(layer_weights or [1.0] * num_layers, num_stages, first_extra, last_extra)
    out, start = [], 0
    for size in sizes:
        out.append(list(range(start, start + size)))
        start += size
    return out


def virtual_stage_layers(num_layers: int, pp: int, virtual_stages: int = 1, **balance) -> list[list[list[int]]]:
    """For every pp rank, the layer runs of its virtual stages. Virtual stage k of rank r is stage r + k*pp
    (the looped placement torch's interleaved schedules expect)."""
    if virtual_stages < 1:
        raise PartitionError(f"virtual_stages must be >= 1, got {virtual_stages}")
    stages = stage_layers(num_layers, pp * virtual_stages, **balance)
    return [[stages[rank + k * pp] for k in range(virtual_stages)] for rank in range(pp)]


def rank_layers(num_layers: int, pp: int, pp_rank: int, virtual_stages: int = 1, **balance) -> list[int]:
    """Global layer indices one pp rank holds (all its virtual stages), for `build_model(layer_ids=...)`."""
    return [i for run in virtual_stage_layers(num_layers, pp, virtual_stages, **balance)[pp_rank] for i in run]


GATED_MLP_FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma2",
                      "gemma3_text", "phi3")
LEARNED_POSITIONS = ("gpt2", "opt", "bert")  # a position table on the first stage (rotary models have none)


def layer_cost(config, balance: str = "params", seq_len: int = 1024) -> tuple[float, float, float]:
    """(per layer, first-stage extra, last-stage extra) cost of a decoder-only transformer, in units of one layer.

    "params": embeddings and the LM head count by their weights (a tied head counts on both stages: the last
    stage holds a copy). "flops": per-token forward FLOPs; the embedding lookup is free, the head is a matmul.
    """
    h, vocab = config.hidden_size, getattr(config, "vocab_size", 0)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads  # Gemma, Qwen3: heads x head_dim != hidden
    attention = h * head_dim * (2 * heads + 2 * kv_heads)  # q and o, k and v (grouped-query: fewer kv heads)
    inner = (getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
             or getattr(config, "ffn_dim", None) or 4 * h)
    gated = config.model_type in GATED_MLP_FAMILIES  # gate, up and down projections
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 1
    matrices = 3 if gated else 2
    expert = matrices * h * (getattr(config, "moe_intermediate_size", None) or inner)  # Qwen-MoE experts are narrower
    shared = matrices * h * (getattr(config, "shared_expert_intermediate_size", None) or 0)
    router = h * experts if experts > 1 else 0
    mlp = expert * experts + shared + router
    if balance == "params":
        layer = attention + mlp
        positions = getattr(config, "max_position_embeddings", 0) if config.model_type in LEARNED_POSITIONS else 0
        first = vocab * h + positions * h
        last = vocab * h
    elif balance == "flops":
        active = expert * (getattr(config, "num_experts_per_tok", None) or 1) + shared + router  # routed tokens only
        layer = 2 * (attention + active) + 4 * seq_len * heads * head_dim  # projections + attention scores/values
        first, last = 0.0, 2 * vocab * h
    else:
        raise PartitionError(f"balance must be 'params' or 'flops', got {balance!r}")
    return 1.0, first / layer, last / layer


BALANCE = ("params", "flops", "layers")


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
