"""Mixture-of-experts: top-k router, stacked experts, expert parallelism by all-to-all token dispatch.

    x -> router (softmax, top-k, optional renormalisation; or DeepSeek-V3's sigmoid scores, bias-corrected choice
      within the best groups, routed scaling) -> sort the (token, expert) assignments by expert
      -> [ep > 1: all-to-all to the experts' owners] -> grouped SwiGLU experts -> [all-to-all back]
      -> weighted sum over each token's k experts (+ a shared expert, gated or not)

Expert weights are stacked with a *global* expert dimension: `gate_up_proj` (experts, 2 * inner, hidden) and
`down_proj` (experts, hidden, inner), split over the ep group along dim 0 (rank r owns a contiguous range of
experts) and optionally over tp inside each expert (gate/up columns, down rows). Dropless by default: every
assignment is computed, however unbalanced; `capacity_factor` caps each expert at
ceil(factor * tokens * k / experts) assignments per rank and drops the rest (first come, first served).

Gradients: an expert's owner accumulates the gradient from every token routed to it over its ep group. With
a data-parallel batch per rank, sum expert gradients over the ranks that own the same experts (the other ep
groups of the dp*cp group) and non-expert ones over dp*cp, then divide both by dp (the loss is a dp mean).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from colozoo.kernels.moe import permute, unpermute

from .activations import get_gated_activation
from .comm import (copy_to_parallel, gather_from_parallel, group_rank, group_size, reduce_from_parallel,
                   split_to_parallel)
from .mlp import GatedMLP
from .shard import Split, shard


class TopKRouter(nn.Module):
    """Mixtral / Qwen-MoE routing: softmax over experts (fp32), top-k, optionally renormalised to sum to 1 (which is
    gpt-oss's softmax over the top-k logits); `bias`: the router's logits have one (gpt-oss)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, normalize: bool = True, bias: bool = False,
                 device=None, dtype=None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({num_experts})")
        self.num_experts, self.top_k, self.normalize = num_experts, top_k, normalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(num_experts, device=device, dtype=dtype)) if bias else None
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor):
        """x (tokens, hidden) -> router logits (tokens, experts), weights (tokens, k) fp32, experts (tokens, k)."""
        logits = F.linear(x, self.weight, self.bias)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights, experts


class GroupLimitedRouter(nn.Module):
    """DeepSeek-V3's routing: sigmoid scores in fp32; experts are chosen by their scores plus a bias correction
    (`e_score_correction_bias`, which DeepSeek's training moves outside gradient descent to balance the load: a
    frozen parameter here, loaded and saved like any other), top-k among the experts of the `topk_group` groups (of
    `groups` equal groups) whose two best corrected scores sum highest. The weights are the chosen experts' scores
    without the correction, normalised to sum to 1 (`normalize`), times `scaling` (routed_scaling_factor)."""

    hf_buffers = ("e_score_correction_bias",)  # a buffer in transformers: not counted as a parameter

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, groups: int = 1, topk_group: int = 1,
                 normalize: bool = True, scaling: float = 1.0, device=None, dtype=None):
        super().__init__()
        if num_experts % groups or not 1 <= topk_group <= groups:
            raise ValueError(f"{num_experts} experts in {groups} groups with {topk_group} chosen: the groups must "
                             f"divide the experts and topk_group lie in [1, groups]")
        if not 1 <= top_k <= num_experts // groups * topk_group:
            raise ValueError(f"top_k={top_k} must be between 1 and the experts of the {topk_group} chosen groups")
        self.num_experts, self.top_k, self.groups, self.topk_group = num_experts, top_k, groups, topk_group
        self.normalize, self.scaling = normalize, scaling
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device, dtype=dtype))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, device=device, dtype=dtype),
                                                    requires_grad=False)
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor):
        """x (tokens, hidden) -> router logits (tokens, experts), weights (tokens, k) fp32, experts (tokens, k)."""
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if self.topk_group < self.groups:
            per_group = choice.view(-1, self.groups, self.num_experts // self.groups)
            best = per_group.topk(2, dim=-1).values.sum(dim=-1).topk(self.topk_group, dim=-1, sorted=False).indices
            kept = torch.zeros_like(per_group[..., 0], dtype=torch.bool).scatter(1, best, True)
            choice = choice.masked_fill(~kept.repeat_interleave(self.num_experts // self.groups, dim=1), float("-inf"))
        experts = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, weights * self.scaling, experts


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (torch._grouped_mm rejects expanded ones)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _grouped_mm_fits(x, weight) -> bool:
    # torch's grouped GEMM takes bf16 only, with rows 16-byte aligned
    return (hasattr(torch, "_grouped_mm") and x.dtype == weight.dtype == torch.bfloat16 and x.shape[0] > 0
            and weight.shape[-1] % 8 == 0 and weight.shape[-2] % 8 == 0)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows of x grouped by expert (`counts` rows each) times that expert's weight (experts, out, in)^T:
    one grouped GEMM where torch offers it (bf16), a loop over experts otherwise."""
    if _grouped_mm_fits(x, weight):
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x.contiguous(), weight.transpose(-1, -2), offs=offsets))
    outs = [F.linear(rows, w) for rows, w in zip(x.split(counts), weight) if rows.shape[0]]
    # no rows at all (an ep rank whose experts were routed nothing): an empty product that keeps x in the graph, so
    # that backward reaches the all-to-all x came from on this rank as on its peers
    return torch.cat(outs) if outs else F.linear(x, weight[0])


class GroupedExperts(nn.Module):
    """This rank's experts (global range [first, first + local)); SwiGLU-style act(gate) * up -> down.

    `activation`: a config name, or a (gate, up) -> hidden function. The weights are stored (experts, out, in), gate
    and up stacked in gate_up_proj's rows. A family whose checkpoints lay experts out otherwise subclasses this and
    overrides `build_weights`, `weights`, `gate_and_up` and `output` (gpt-oss: colozoo.models.gpt_oss)."""

    def __init__(self, num_experts: int, hidden_size: int, inner_size: int, activation="silu", *, ep_group=None,
                 tp_group=None, device=None, dtype=None):
        super().__init__()
        ep, tp = group_size(ep_group), group_size(tp_group)
        if num_experts % ep:
            raise ValueError(f"ep={ep} must divide the number of experts ({num_experts})")
        if inner_size % tp:
            raise ValueError(f"tp={tp} must divide the expert width (intermediate size {inner_size})")
        self.num_experts, self.num_local = num_experts, num_experts // ep
        self.inner_size, self.activation = inner_size, activation
        self.first = group_rank(ep_group) * self.num_local
        self.tp_group = tp_group
        self.gated_act = get_gated_activation(activation) if isinstance(activation, str) else activation
        self.build_weights(hidden_size, inner_size, tp, device=device, dtype=dtype)
        if self.gate_up_proj.device.type != "meta":
            for p in self.parameters():
                nn.init.normal_(p, std=0.02)

    def expert_parameter(self, *shape, splits, device=None, dtype=None) -> nn.Parameter:
        """A (local experts, *shape) parameter split over ep by expert, and over tp by `splits`."""
        return shard(nn.Parameter(torch.empty(self.num_local, *shape, device=device, dtype=dtype)), Split("ep", 0),
                     *splits)

    def build_weights(self, hidden_size: int, inner_size: int, tp: int, **kw):
        local_inner = inner_size // tp
        self.gate_up_proj = self.expert_parameter(2 * local_inner, hidden_size,
                                                  splits=(Split("tp", 1, chunks=(inner_size,) * 2),), **kw)
        self.down_proj = self.expert_parameter(hidden_size, local_inner, splits=(Split("tp", 2),), **kw)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) as (experts, out, in)."""
        return self.gate_up_proj, self.down_proj

    def gate_and_up(self, gate_up: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate and up halves of the rows' gate_up projection."""
        return gate_up.chunk(2, dim=-1)

    def output(self, out: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The rows' output once the tp partial sums are reduced."""
        return out

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x (rows, hidden) grouped by local expert, counts[e] rows for local expert e."""
        x = copy_to_parallel(x, self.tp_group)
        gate_up_weight, down_weight = self.weights()
        gate, up = self.gate_and_up(grouped_linear(x, gate_up_weight, counts), counts)
        out = reduce_from_parallel(grouped_linear(self.gated_act(gate, up), down_weight, counts), self.tp_group)
        return self.output(out, counts)

    def extra_repr(self):
        return f"experts {self.first}..{self.first + self.num_local - 1} of {self.num_experts}"


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return _AllToAllV.apply(grad, recv_splits, send_splits, ctx.group), None, None, None


def all_to_all_rows(x, send_splits: list[int], recv_splits: list[int], group):
    """Send send_splits[r] rows of x to rank r, receive recv_splits[r] rows from rank r (autograd-aware)."""
    return _AllToAllV.apply(x, send_splits, recv_splits, group)


@dataclass(frozen=True)
class MoESpec:
    """What a family declares of its mixture-of-experts layer (MoE adds where it sits: the ep and tp groups).

    `inner_size`: one routed expert's width; `activation`: a config name, or a (gate, up) -> hidden function;
    `normalize_top_k`: the top-k weights renormalised to sum to 1; `capacity_factor`: None for dropless routing;
    `shared_expert_size` adds Qwen-MoE's shared expert (a GatedMLP every token goes through, tensor parallel like the
    experts), scaled per token by sigmoid(shared_expert_gate(x)); without `shared_expert_gate` it is added as it is
    (DeepSeek-V3's shared_experts); `router_bias`: the router's logits have one (gpt-oss)."""
    hidden_size: int
    inner_size: int
    num_experts: int
    top_k: int
    activation: object = "silu"
    normalize_top_k: bool = True
    capacity_factor: float | None = None
    shared_expert_size: int | None = None
    shared_expert_gate: bool = True
    router_bias: bool = False


_UNSAID = object()  # a module that does not say (no such attribute): nothing to compare


def _check_agrees(role: str, spec: MoESpec, **said):
    """The router or experts module given to MoE says what the spec says, where it says anything."""
    for field, value in said.items():
        if value is not _UNSAID and value != getattr(spec, field):
            raise ValueError(f"MoE: the {role} given has {field}={value!r}, the MoESpec {field}="
                             f"{getattr(spec, field)!r}: give a module and a spec that agree")


class MoE(nn.Module):
    """Router + experts for input (batch, seq, hidden); returns (output, router logits (tokens, experts)).

    The family's `spec` (MoESpec) says what kind; `router`: a router module to use instead of the softmax top-k one
    (DeepSeek-V3's GroupLimitedRouter), called as TopKRouter is; `experts`: an experts module to use instead of
    GroupedExperts, called as it is (gpt-oss's layout). The spec describes the layer whole: a module given must agree
    with it where it says (num_experts, top_k, normalize and bias of a router; num_experts, inner_size and activation
    of experts), else ValueError. The `ep_group`, `tp_group` and `sequence_parallel` say where it sits."""

    def __init__(self, spec: MoESpec, *, router: nn.Module | None = None, experts: nn.Module | None = None,
                 ep_group=None, tp_group=None, sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        if spec.capacity_factor is not None and spec.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive or None (dropless), got {spec.capacity_factor}")
        if router is not None:
            _check_agrees("router", spec, num_experts=getattr(router, "num_experts", _UNSAID),
                          top_k=getattr(router, "top_k", _UNSAID), normalize_top_k=getattr(router, "normalize", _UNSAID),
                          router_bias=getattr(router, "bias", None) is not None)
        if experts is not None:
            _check_agrees("experts", spec, num_experts=getattr(experts, "num_experts", _UNSAID),
                          inner_size=getattr(experts, "inner_size", _UNSAID),
                          activation=getattr(experts, "activation", _UNSAID))
        h, activation, kw = spec.hidden_size, spec.activation, dict(device=device, dtype=dtype)
        self.num_experts, self.top_k, self.capacity_factor = spec.num_experts, spec.top_k, spec.capacity_factor
        self.ep_group, self.tp_group, self.sequence_parallel = ep_group, tp_group, sequence_parallel
        self.gate = router if router is not None else TopKRouter(h, spec.num_experts, spec.top_k, spec.normalize_top_k,
                                                                 spec.router_bias, **kw)
        self.experts = experts if experts is not None else GroupedExperts(
            spec.num_experts, h, spec.inner_size, activation, ep_group=ep_group, tp_group=tp_group, **kw)
        self.shared_expert = self.shared_expert_gate = None
        if spec.shared_expert_size:
            self.shared_expert = GatedMLP(h, spec.shared_expert_size, activation, group=tp_group, **kw)
            if spec.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(h, 1, bias=False, **kw)

    def forward(self, x: torch.Tensor):
        if self.sequence_parallel:  # route every token the tp group holds; each rank keeps its share at the end
            x = gather_from_parallel(x, self.tp_group, dim=1)
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits, weights, experts = self.gate(tokens)
        if self.capacity_factor is None:  # dropless
            rows, row_map, counts = permute(tokens, experts, self.num_experts)
            combined = unpermute(self._run_experts(rows, counts), row_map, weights, x.dtype)
            return self._finish(combined, tokens, shape), logits
        assignment = torch.arange(experts.numel(), device=x.device)
        assignment = assignment[self._within_capacity(experts.reshape(-1))]
        expert_of = experts.reshape(-1)[assignment]
        order = torch.argsort(expert_of, stable=True)
        assignment = assignment[order]
        token_of = assignment // self.top_k
        counts = torch.bincount(expert_of[order], minlength=self.num_experts)
        out = self._run_experts(tokens[token_of], counts)
        out = (out * weights.reshape(-1)[assignment, None]).to(x.dtype)
        combined = torch.zeros_like(tokens).index_add(0, token_of, out)
        return self._finish(combined, tokens, shape), logits

    def _finish(self, combined, tokens, shape):
        """Add the shared expert, restore (batch, seq, hidden) and, under sequence parallelism, the rank's share."""
        if self.shared_expert is not None:
            shared = self.shared_expert(tokens)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(tokens)) * shared
            combined = combined + shared
        combined = combined.view(shape)
        if self.sequence_parallel:
            combined = split_to_parallel(combined, self.tp_group, dim=1)
        return combined

    def _within_capacity(self, expert_of: torch.Tensor) -> torch.Tensor:
        capacity = math.ceil(self.capacity_factor * expert_of.numel() / self.num_experts)
        seen = F.one_hot(expert_of, self.num_experts).cumsum(0)  # how many earlier assignments share the expert
        return seen.gather(1, expert_of[:, None]).squeeze(1) <= capacity

    routing = "learned"  # or "balanced": see _run_balanced

    def _run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows sorted by global expert, counts (experts,) -> expert outputs in the same order."""
        ep, local = group_size(self.ep_group), self.experts.num_local
        if self.routing == "balanced":
            return self._run_balanced(rows)
        if ep == 1:
            return self.experts(rows, counts.tolist())
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.ep_group)  # (source rank, my local expert)
        recv_counts = recv_counts.view(ep, local)
        send_splits = counts.view(ep, local).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        received = all_to_all_rows(rows, send_splits, recv_splits, self.ep_group)
        # arrived grouped by (source, expert); the experts want (expert, source): a stable sort on that key
        segment = torch.arange(ep * local, device=rows.device).repeat_interleave(recv_counts.flatten())
        regroup = torch.argsort((segment % local) * ep + segment // local, stable=True)
        out = self.experts(received[regroup], recv_counts.sum(0).tolist())
        restored = torch.empty_like(out).index_copy(0, regroup, out)
        return all_to_all_rows(restored, recv_splits, send_splits, self.ep_group)

    def _run_balanced(self, rows: torch.Tensor) -> torch.Tensor:
        """Every expert receives an equal share of the rows (what the load-balancing loss aims for), whatever the
        router chose: for symbolic runs on meta tensors (the profiler), where routing counts do not exist. The
        all-to-alls of expert parallelism and the expert matmuls keep their real sizes."""
        ep, local = group_size(self.ep_group), self.experts.num_local
        if ep == 1:
            return self.experts(rows, equal_split(rows.shape[0], local))
        splits = equal_split(rows.shape[0], ep)  # rows to each rank; as many arrive from each
        out = self.experts(all_to_all_rows(rows, splits, splits, self.ep_group), equal_split(sum(splits), local))
        return all_to_all_rows(out, splits, splits, self.ep_group)


def equal_split(n: int, parts: int) -> list[int]:
    return [n // parts + (i < n % parts) for i in range(parts)]


def router_statistics(router_logits: list[torch.Tensor], num_experts: int, top_k: int,
                      token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """What the router losses need from some MoE layers, as one fp32 vector that adds up over layers (and so
    over pipeline stages and data ranks): [assignments per expert (E), router probability sums per expert (E),
    tokens, logsumexp^2 sum]; padding excluded. Only the probability sums carry gradients."""
    device = router_logits[0].device
    mask = token_mask.reshape(-1).float().to(device) if token_mask is not None else None
    assigned = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = z_sum = torch.zeros((), dtype=torch.float32, device=device)
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        w = mask if mask is not None else torch.ones(probs.shape[0], device=device)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        assigned = assigned.scatter_add(0, chosen.reshape(-1), w.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * w[:, None]).sum(0)
        rows = rows + w.sum()
        z_sum = z_sum + (torch.logsumexp(logits.float(), dim=-1) ** 2 * w).sum()
    return torch.cat([assigned, prob_sum, torch.stack([rows, z_sum])])


def router_losses(stats: torch.Tensor, num_experts: int, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(load-balancing loss, z-loss) from `router_statistics` summed over every MoE layer; with `group` the
    statistics are summed over its ranks first (the tokens of the whole batch)."""
    stats = reduce_from_parallel(stats, group)
    assigned, prob_sum = stats[:num_experts], stats[num_experts:2 * num_experts]
    rows, z_sum = stats[2 * num_experts:]
    balance = num_experts * torch.sum((assigned / rows) * (prob_sum / rows))
    return balance, z_sum / rows.clamp(min=1)
