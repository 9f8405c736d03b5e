"""What expert parallelism costs, term by term:

- where an expert-parallel group lies (`expert_span`): colozoo groups ep consecutive ranks of the dp x cp ranks of
  one tensor-parallel coordinate, so a group spans tp x ep consecutive ranks; Megatron-Core's MoE parallel folding
  with an expert tensor-parallel size of 1 (Software.expert_tp_folded) lays the expert ranks out across the tp
  ranks too, so a group spans ep consecutive ranks (Liu et al. 2025, "MoE Parallel Folding", arXiv 2504.14960);
- the token dispatch and combine (`dispatch_combine_seconds`): an all-to-all in which each rank keeps 1/ep of its
  tokens, sends to the ep - 1 others; of those, the ranks of its own node are reached over NVLink and the others
  over its network adapter, both at once, so the slower share sets the time (not all of it at the slower link),
  each step taking the longer of its hop's latency and its share of that (colozoo.cost.network.pipelined_seconds);
- the experts' GEMMs run grouped: one kernel over each local expert's tokens (torch._grouped_mm, Megatron's
  grouped GEMM), whose output tiles fill the GPU per expert (colozoo.cost.trace records a grouped product as
  (experts, tokens per expert, n, k), and colozoo.cost.compute_time.wave_efficiency prices its tiles); the
  router (a GEMM to the expert logits, softmax / sigmoid, top-k) is traced as the model runs it.
"""
from __future__ import annotations

from colozoo.cost.hardware import Hardware
from colozoo.cost.network import collective_seconds, pipelined_seconds


def expert_span(tp: int, ep: int, folded: bool = False) -> int:
    """Consecutive ranks one expert-parallel group lies within."""
    return ep if folded else tp * ep


def dispatch_combine_seconds(hw: Hardware, nbytes: float, ep: int, span: int, calls: float) -> float:
    """Seconds of all-to-alls moving `nbytes` of payload in all (each rank's tokens, before the split) over an ep
    group lying within `span` consecutive ranks: the shares kept, sent inside the node and sent across nodes, the
    slower link setting the pace."""
    if ep <= 1:
        return 0.0
    if span <= hw.gpus_per_node:
        return collective_seconds(hw, "all_to_all", nbytes, ep, span, calls)
    per_node = max(1, hw.gpus_per_node * ep // span)  # the group's ranks in one node
    inside = nbytes * (per_node - 1) / ep / hw.bandwidth("all_to_all", hw.gpus_per_node)
    across = nbytes * (ep - per_node) / ep / hw.bandwidth("all_to_all", span)
    return pipelined_seconds(hw, "all_to_all", max(inside, across), ep, per_node, calls)


def dispatched_share(plan, sharded: bool) -> float:
    """The share of colozoo's dispatched bytes a rank sends when the dispatcher moves only the rank's own part of
    each token (Software.expert_dispatch_sharded): under sequence parallelism colozoo's MoE gathers the sequence and
    every tensor-parallel rank dispatches whole tokens; Megatron-Core's all-to-all dispatcher sends a rank's own
    sequence shard (folded experts) or each token's 1/tp slice of the hidden state, gathered again in the tensor-
    parallel group after the all-to-all (core_r0.8.0 megatron/core/transformer/moe/token_dispatcher.py,
    MoEAlltoAllTokenDispatcher: all_to_all_sp2hp, the expert all-to-all, all_gather_last_dim): 1/tp either way."""
    return 1 / plan.tp if sharded and plan.sequence_parallel and plan.tp > 1 else 1.0


def expert_exchange_seconds(comm: dict, calls: dict, plan, hw: Hardware, folded: bool = False,
                            scale: float = 1.0, share: float = 1.0) -> float:
    """Seconds of one unit's expert-parallel collectives per micro-batch ("ep.<collective>" bytes and calls of a
    traced unit, times `scale` for a recomputed forward, the all-to-alls' bytes times `share`: dispatched_share),
    over the group's links."""
    span = expert_span(plan.tp, plan.ep, folded)
    out = 0.0
    for key, nbytes in comm.items():
        group, _, collective = key.partition(".")
        if group != "ep":
            continue
        n = scale * calls.get(key, 0)
        out += dispatch_combine_seconds(hw, share * scale * nbytes, plan.ep, span, n) if collective == "all_to_all" \
            else collective_seconds(hw, collective, scale * nbytes, plan.ep, span, n)
    return out
