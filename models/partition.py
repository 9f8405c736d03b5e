"""Which layers of a model live on which pipeline stage: colozoo.core.partition's balanced split, weighted by what
the model's layers, embeddings and head cost (read off the config and the family table)."""
from __future__ import annotations

from colozoo.core.partition import PartitionError, virtual_stage_layers
from colozoo.models.family import family_of

BALANCE = ("params", "flops", "layers")


def layer_cost(config, balance: str = "params", seq_len: int = 1024) -> tuple[float, float, float]:
    """(per layer, first-stage extra, last-stage extra) cost of a decoder-only transformer, in units of one layer (the
    mean layer where some layers have dense MLPs and the others experts), from the sizes the family's model class
    reads off its config (colozoo.models.base.ParallelModel.attention_size, mlp_width, experts, ...).

    "params": embeddings and the LM head count by their weights (a tied head counts on both stages: the last
    stage holds a copy). "flops": per-token forward FLOPs; the embedding lookup is free, the head is a matmul.
    """
    h, vocab = config.hidden_size, getattr(config, "vocab_size", 0)
    family = family_of(config.model_type)
    model = family.model
    attention, core = model.attention_size(config)
    matrices = 3 if family.gated_mlp else 2  # gate, up and down projections, or in and out
    dense_mlp = matrices * h * model.mlp_width(config)
    experts = model.experts(config)
    expert = matrices * h * model.expert_width(config)
    shared = matrices * h * model.shared_expert_width(config)
    router = h * experts
    share = model.sparse_layers(config) / config.num_hidden_layers if experts else 0.0  # of the layers with experts

    def mean(moe):
        return share * moe + (1 - share) * dense_mlp

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
