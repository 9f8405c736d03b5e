"""Saved activations a framework keeps differently from colozoo's own layers, term by term, from the trace's saved
bytes by module, op and width (UnitCost.module_saved, keys "module path|op|(width,)"):

- module recompute (Megatron-Core's --recompute-modules, Software.recompute_modules): "layernorm" drops what the
  norms save, "moe_act" what the experts save besides their GEMM inputs (the gated activation's inputs). Priced
  only: colozoo's runtime checkpoints whole layers (colozoo.runtime.options.CHECKPOINTING); the recomputed norm and
  activation are memory-bound elementwise passes, a few % of a layer's forward, not added to its FLOPs;
- folded experts (Software.expert_tp_folded, with sequence parallelism): Megatron-Core routes each rank's own
  sequence shard to whole experts (expert tp 1), where colozoo's MoE routes the tensor-parallel group's gathered
  tokens to experts split over tp; the ffn-wide expert activations are the same bytes either way (tp x the rows,
  1/tp the width), the hidden-wide ones (router input, dispatched rows, the weighted combine) are 1/tp of
  colozoo's; with the experts split over tp (Software.expert_dispatch_sharded without folding) the router input
  and the weighted combine are, the dispatched rows gathered whole again;
- fused norms (Software.fused_norm): a norm keeps its input (and a statistic per row), not an fp32 copy and its
  normalized output;
- the fused gated activation (Software.fused_swiglu: Megatron-Core's SwiGLUFunction in
  megatron/core/fusions/fused_bias_swiglu.py saves its input, gate and up, and recomputes the activation in
  backward): the dense MLP keeps its two ffn-wide inputs, not also the activated gate;
- the sequence shard kept for backward (Software.sequence_parallel_saves_shard): a column-parallel linear under
  sequence parallelism keeps 1/tp of the gathered input colozoo's keeps.
"""
from __future__ import annotations

GEMMS = ("mm", "addmm", "bmm", "grouped_mm", "_grouped_mm", "matmul", "linear")
LAYERNORM, MOE_ACT = "layernorm", "moe_act"  # Megatron-Core's --recompute-modules names
MODULES = (LAYERNORM, MOE_ACT)  # the --recompute-modules priced
# what the keys' parts are matched against: a norm module's name ends so, the experts' module, the MLP block (dense,
# or the MoE block the experts are in)
NORM_SUFFIX, EXPERTS, MLP_BLOCK = "norm", "experts", "mlp"
COLUMN_PARALLEL = "_ColumnParallel"  # the op a column-parallel linear's saved input is recorded under


def _parts(key: str) -> tuple[str, str, str]:
    module, op, width = key.split("|")
    return module, op, width


def recomputed(module_saved: dict, modules) -> dict:
    """The saved tensors (module_saved entries) that recomputing `modules` (of MODULES) drops from one layer."""
    unknown = set(modules) - set(MODULES)
    if unknown:
        raise ValueError(f"recompute_modules {sorted(unknown)} not priced; the cost model prices {MODULES}")
    out = {}
    for key, nbytes in module_saved.items():
        module, op, _ = _parts(key)
        if (LAYERNORM in modules and module.rsplit(".", 1)[-1].endswith(NORM_SUFFIX)) or \
                (MOE_ACT in modules and module.endswith(EXPERTS) and op not in GEMMS):
            out[key] = nbytes
    return out


def dropped_bytes(module_saved: dict, modules=(), moe_hidden: int = 0, tp: int = 1, experts_whole: bool = True
                  ) -> float:
    """Saved bytes per micro-batch of one layer that the framework does not keep: recomputed modules, then the
    sequence-shard share of what is left of the MoE block (moe_hidden: the model's hidden size; 0: none; see
    moe_shard_bytes for `experts_whole`)."""
    gone = recomputed(module_saved, modules)
    kept = {k: n for k, n in module_saved.items() if k not in gone}
    return sum(gone.values()) + moe_shard_bytes(kept, moe_hidden, tp, experts_whole)


def fused_norm_bytes(module_saved: dict, norm_inputs: dict) -> float:
    """Saved bytes a fused norm kernel does not keep: each norm's saved tensors beyond its input."""
    saved = {}
    for key, nbytes in module_saved.items():
        module = _parts(key)[0]
        if module in norm_inputs:
            saved[module] = saved.get(module, 0) + nbytes
    return sum(max(0.0, n - norm_inputs[m]) for m, n in saved.items())


def fused_swiglu_bytes(module_saved: dict) -> float:
    """Saved bytes of the dense MLP's gated activation beyond its two inputs (gate and up, each as wide as the
    down projection's saved input)."""
    dense = [(_parts(key)[1], n) for key, n in module_saved.items() if _parts(key)[0] == MLP_BLOCK]
    elementwise = sum(n for op, n in dense if op not in GEMMS)
    down = sum(n for op, n in dense if op in GEMMS)
    return max(0.0, elementwise - 2 * down) if down else 0.0


def sequence_shard_bytes(module_saved: dict, tp: int) -> float:
    """Saved bytes of the column-parallel linears' gathered inputs beyond the sequence shard."""
    return sum(n for key, n in module_saved.items() if _parts(key)[1] == COLUMN_PARALLEL) * (1 - 1 / tp)


def moe_shard_bytes(module_saved: dict, hidden: int, tp: int, experts_whole: bool = True) -> float:
    """Saved bytes per micro-batch that Megatron-Core's MoE keeps on the rank's sequence shard where colozoo's keeps
    the tensor-parallel group's gathered tokens: (1 - 1/tp) of the MoE block's hidden-wide saved tensors (router
    input, weighted combine, and with the experts whole (folded, expert tp 1) the dispatched rows too; experts split
    over tp gather each dispatched row whole again: Software.expert_dispatch_sharded)."""
    if tp <= 1 or not hidden or not any(_parts(key)[0].endswith(EXPERTS) for key in module_saved):
        return 0.0  # a dense layer's MLP is not routed
    wide = sum(n for key, n in module_saved.items()
               if _parts(key)[0].split(".")[0] == MLP_BLOCK and _parts(key)[2] == f"({hidden},)"
               and (experts_whole or not _parts(key)[0].endswith(EXPERTS)))
    return wide * (1 - 1 / tp)
