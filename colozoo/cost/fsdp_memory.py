"""How FSDP (ZeRO-3 gathering a layer at a time: FSDP2, FSDP1) holds a stage's weights and gradients through a
training step, as the memory walk of colozoo.cost.cost_model sees it unit by unit.

Each gathered layer is a buffer of its own beside the shard a rank keeps. The forward gathers a layer into its
collective's output and copies it out into the weights; the output stays until the next gather in the forward has
been copied out (FSDP2's implicit prefetch: torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py,
wait_for_unshard), and the backward issues the next unit's gather before this one computes. A layer's backward makes
its gradients unsharded and reduce-scatters them at its end from an input of the reduction's dtype, which stays until
the next unit's is issued. The embedding and head (the root) stay gathered from the forward's start to the
backward's end."""
from __future__ import annotations

from dataclasses import dataclass

from colozoo.cost.zero3_submodules import held_share


@dataclass(frozen=True)
class FsdpWalk:
    gathered: list          # per unit of the stage, in order: its gathered weights (0 for the root's units)
    regather: bool          # frees a layer's weights after its forward and gathers them again (reshard_after_forward)
    reduce_ratio: float     # bytes the reduce-scatter's input takes a gradient byte (the reduction's dtype)
    deferred: bool          # gradients accumulate unsharded over the micro-batches (in the reduction's dtype) and are
    #                         reduce-scattered in the last one's backward
    kept_after_backward: bool  # a backward keeps the weights it gathered until the step's last (torch's pipelines)

    def weights(self, j: int, phase: str) -> float:
        """Gathered layers when unit j computes ("forward", "backward"), once its forward is done and the next
        layer is gathered ("next"), or as its backward begins ("arrive": its gather copied out). Kept from forward
        to backward without resharding, every layer gathered so far stays, and the backward gathers none."""
        g = self.gathered
        if phase in ("backward", "arrive") and self.kept_after_backward:
            return float(sum(g))
        nxt = next((i for i in range(j + 1, len(g)) if g[i]), None)
        so_far = g[j] if self.regather else sum(g[:j + 1])
        if phase == "forward":
            return so_far + g[j]  # its own gather's output, until the next one is copied out
        if phase == "next":
            return 0.0 if nxt is None else so_far + 2 * g[nxt] + (0.0 if self.regather else g[j])
        if phase == "arrive":
            return so_far + (g[j] if self.regather else 0.0)
        prv = next((i for i in range(j - 1, -1, -1) if g[i]), None)
        return so_far + (g[prv] if self.regather and prv is not None else 0.0)

    def most_gathered(self) -> float:
        return max((self.weights(j, phase) for j in range(len(self.gathered))
                    for phase in ("forward", "next", "arrive", "backward")), default=0.0)


def fsdp_walk(plan, software, in_order: list, layers: list, itemsize: int) -> tuple[float, FsdpWalk | None]:
    """(bytes of gathered weights held throughout the step, and the FsdpWalk of what varies, or None where nothing
    does): the root's units under FSDP, the submodules DeepSpeed gathers (`software.zero3_gather_unit`, one and the
    next: colozoo.cost.zero3_submodules.held_share), the working copies under parameter offload."""
    if plan.offload == "params":
        return 2.0 * max([u.param_bytes for u in layers] or [0]), None
    shard = plan.dp * plan.cp
    if plan.zero < 3 or shard <= 1:
        return 0.0, None
    edp = max(1, shard // plan.ep)

    def whole(u):  # experts are gathered only where ZeRO shards them (over edp)
        return (u.param_bytes - u.expert_param_bytes) + u.expert_param_bytes * (edp > 1)

    if software.zero3_gather_unit == "submodule":
        if plan.reshard_after_forward:
            return max([whole(u) * held_share(u.kernels) for u in layers] or [0.0]), None
        return float(sum(whole(u) for u in layers)), None
    is_layer = {id(u) for u in layers}
    deferred = not software.zero3_reduces_each_microbatch(plan) and plan.num_microbatches > 1
    walk = FsdpWalk([float(whole(u)) if id(u) in is_layer else 0.0 for u in in_order], plan.reshard_after_forward,
                    (software.grad_reduce_bytes or itemsize) / itemsize, deferred,
                    kept_after_backward=plan.pp > 1 and software.pipeline_defers_reduction)
    return float(sum(whole(u) for u in in_order if id(u) not in is_layer)), walk
