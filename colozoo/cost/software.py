"""How the training software runs a plan, where frameworks differ and the step time depends on it. The defaults
describe colozoo's runtime (FSDP2, DDP, torch.distributed.pipelining); a published run names its framework's."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

DDP_BUCKET_BYTES = 25 * 2 ** 20  # torch DistributedDataParallel's default bucket_cap_mb


# An AdamW step's memory traffic in passes of the fused kernel, which touches an element of each state 7 times (reads
# the parameter, the gradient and both moments, writes the parameter and the moments). torch's foreach and
# single-tensor steps touch them 21 times in eight kernels: the weight decay (2), the first moment's lerp (3), the
# second's mul and addcmul (2 + 4), its sqrt, bias correction and eps (2 + 2 + 2) and the addcdiv into the parameter
# (4) (torch/optim/adamw.py); Composer's DecoupledAdamW (v0.16, composer/optim/decoupled_weight_decay.py) as many,
# with no decay pass at weight decay 0 and the first moment as mul_ + add_ (2 + 3).
OPTIMIZER_PASSES = {"fused": 1.0, "foreach": 3.0, "single_tensor": 3.0}

GRAD_BUCKETS = {  # (gradient bytes, bytes an element, data-parallel ranks) -> calls
    "ddp": lambda nbytes, itemsize, dp: nbytes / DDP_BUCKET_BYTES,
    "megatron_core": lambda nbytes, itemsize, dp: nbytes / itemsize / max(40_000_000, 1_000_000 * dp),
    "whole": lambda nbytes, itemsize, dp: 1,
}


@dataclass(frozen=True)
class Software:
    name: str = "colozoo"
    # ZeRO-3 frees a recomputed layer's gathered weights after the recomputation and gathers them again for its
    # backward (DeepSpeed's ZeRO-3 under Megatron's activation checkpointing); FSDP2 keeps them for the backward
    regather_for_recompute: bool = False
    # ZeRO-3 reduce-scatters every micro-batch's gradients (DeepSpeed, FSDP1, colozoo's FSDP2 at pp = 1), or
    # accumulates them whole to reduce-scatter only the last's
    reduce_every_microbatch: bool = True
    # under a pipeline, ZeRO-3 keeps a stage's weights gathered and its gradients whole from the first backward to
    # the last, then reshards and reduce-scatters once (torch.distributed.pipelining, colozoo's pipelines:
    # torch/distributed/pipelining/stage.py, backward_maybe_with_nosync)
    pipeline_defers_reduction: bool = True
    # what a ZeRO-3 gather fetches: a layer (FSDP's wrapped units) or each submodule as it runs, one ahead
    # (DeepSpeed's stage 3 with its default prefetch bucket; colozoo.cost.zero3_submodules)
    zero3_gather_unit: str = "layer"
    # each gathered weight's buffer is allocated zeroed on the compute stream before the gather (torch.zeros in the
    # DeepSpeed of 2021), a memory-bound write of the whole weight per gather
    gather_buffer_zeroed: bool = False
    # data-parallel gradient reduction overlaps the backward (DDP buckets); Megatron's "local" DDP of 2021 reduced
    # after the backward
    grad_reduce_overlap: bool = True
    # ZeRO-1/2's all-gather of the updated weights overlaps the next forward (Megatron-Core's --overlap-param-gather)
    param_gather_overlap: bool = False
    # bytes a gradient element takes on the wire in data-parallel reductions (None: the parameters' dtype)
    grad_reduce_bytes: int | None = None
    # the backward accumulates gradients into a buffer of the reduction's dtype, allocated for the whole run
    # (Megatron's main_grad: its DistributedDataParallel's grad buffer is fp32 when gradients are reduced in fp32,
    # which Megatron-LM forces for bf16, megatron/training/arguments.py "bfloat16 requires gradient accumulation and
    # all-reduce to be done in fp32"; DeepSpeed's BF16_Optimizer likewise), where colozoo's are the parameters' dtype
    # and grow as the first backward runs
    grads_in_reduce_dtype: bool = False
    # at ZeRO-0 without such a buffer, torch DDP keeps the gradients in its buckets, allocated once when it wraps the
    # model (colozoo's DDP sets gradient_as_bucket_view: the gradients are views of them); the micro-batches before
    # the last run under no_sync and accumulate gradients of their own beside the buckets until the last one's
    # backward copies them in
    torch_ddp_buckets: bool = True
    # a linear's GEMM adds its weight gradient straight into that buffer (Megatron's gradient accumulation fusion,
    # on unless --no-gradient-accumulation-fusion; Transformer Engine's fuse_wgrad_accumulation), where autograd
    # computes each gradient into a tensor of its own before adding it
    wgrad_accumulation_fused: bool = False
    # bytes a weight element takes in ZeRO-3 gathers (None: the parameters' dtype; FSDP1 with fp32 parameters: 4)
    gather_bytes: int | None = None
    # pipeline stages exchange 1/tp of a boundary activation over the network and all-gather it over NVLink
    # (Megatron's scatter/gather); with sequence parallelism the activation is already split
    pipeline_scatter_gather: bool = False
    # share of tensor-parallel collectives hidden behind the GEMMs (Megatron-Core's --tp-comm-overlap)
    tp_comm_overlap: float = 0.0
    # a column-parallel linear's backward all-reduces its input gradient (reduce-scatters it under sequence
    # parallelism) while it computes its weight gradient: Megatron-LM's async tensor-parallel all-reduce, on by
    # default since 2022 (megatron/mpu/layers.py, LinearWithGradAccumulationAndAsyncAllreduce)
    tp_wgrad_overlap: bool = False
    # the fused attention kernels' implementation (colozoo.cost.attention_speed): PyTorch's SDPA runs
    # FlashAttention-2 on A100 and H100; one without a measurement there runs at Hardware.attention_efficiency
    attention_kernel: str = "flash2"
    # expert-parallel ranks laid out across the tensor-parallel ones (Megatron-Core's MoE parallel folding with an
    # expert tensor-parallel size of 1): an ep group spans ep consecutive ranks, not tp x ep (colozoo.cost.experts)
    expert_tp_folded: bool = False
    # the expert all-to-all moves each rank's own part of a token under sequence parallelism (Megatron-Core's
    # MoEAlltoAllTokenDispatcher), where colozoo's MoE gathers the sequence first and every tensor-parallel rank
    # dispatches whole tokens: 1/tp of the bytes (colozoo.cost.experts.dispatched_share)
    expert_dispatch_sharded: bool = False
    # modules recomputed inside each layer when the plan checkpoints none (Megatron-Core's --recompute-modules, e.g.
    # saved_layout.MODULES): priced only, their saved activations dropped (colozoo.cost.saved_layout)
    recompute_modules: tuple = ()
    # norm kernels keep only their input and a statistic per row (Apex / Transformer Engine fused RMSNorm and
    # LayerNorm), where colozoo's norm keeps an fp32 copy of its input and its normalized output
    fused_norm: bool = False
    # with sequence parallelism a column-parallel linear keeps its input as the sequence shard and all-gathers it
    # again in backward (Korthikanti et al. 2022, section 4.2.2), where colozoo's keeps the gathered input
    sequence_parallel_saves_shard: bool = False
    # the gated MLP activation saves only its inputs and recomputes itself in backward (Megatron-Core's fused
    # SwiGLU, on unless --no-bias-swiglu-fusion), where colozoo's keeps the activated gate too
    fused_swiglu: bool = False
    # the attention kernel keeps q, k and v as tensors of their own: Transformer Engine's DotProductAttention copies
    # inputs whose memory layout it cannot take (get_qkv_layout: k rotated into a tensor of its own and v, a slice
    # of the fused qkv projection's output, of unequal strides), where torch's SDPA saves v as the slice it is and
    # with it the projection's whole output (UnitCost.attention_unviewed_bytes)
    attention_copies_views: bool = False
    # the optimizer's kernels, priced by the memory traffic of one AdamW step (OPTIMIZER_PASSES):
    # "fused" reads and writes each state once (torch's fused=True, what colozoo's build_optimizer runs; Apex and
    # DeepSpeed FusedAdam); "foreach" (torch's default for CUDA tensors) and "single_tensor" (its default on CPU,
    # Composer's DecoupledAdamW) pass over the states in eight elementwise kernels
    optimizer_kernels: str = "fused"
    # bytes an element of the master weights and of each optimizer state takes: 4 (fp32); NeMo's
    # distributed_fused_adam with `dtype: bf16` keeps both in bf16 (Apex DistributedFusedAdam's `dtype` is the
    # optimizer state's, and its store_params, on by default, keeps the rank's shard of the parameters in it)
    optimizer_state_bytes: int = 4
    # bytes an element of the master weights takes (None: optimizer_state_bytes); NeMo's distributed_fused_adam
    # (nemo/collections/nlp/models/language_modeling/megatron_base_model.py, setup_optimization) keeps none when
    # the optimizer's dtype is the model's (0: the bf16 parameters are the master) and, with fp32 states beside bf16
    # parameters, only the 16 bits the parameters lack (Apex's store_param_remainders: 2)
    master_weight_bytes: int | None = None
    # passes over the gradients the global-norm clipping before the optimizer step makes: colozoo's clip_grad_norm_
    # (colozoo.runtime.clipping) and torch's read them once for the norm and scale them in place always (3);
    # Megatron-LM and DeepSpeed scale only when the norm exceeds the threshold (megatron/optimizer/clip_grads.py,
    # "if clip_coeff < 1.0"; DeepSpeed v0.5 runtime/utils.py), in a long run rarely: the norm's read (1)
    grad_clip_passes: float = 3.0
    # how a data-parallel gradient reduction is cut into calls, whose short steps pay the latency (GRAD_BUCKETS):
    # "ddp", torch DDP's buckets of 25 MiB; "megatron_core", Megatron-Core's of max(40M, 1M x dp) elements
    # (core_r0.8.0 megatron/core/distributed/distributed_data_parallel.py: "large enough to remain bandwidth-bound
    # rather than latency-bound"); "whole", one call for all of them (Megatron-LM's local DDP of 2021 all-reduces
    # its flattened gradients once per dtype: megatron/model/distributed.py, allreduce_gradients)
    grad_buckets: str = "ddp"
    # the LM head and its loss run as one kernel, chunk by chunk, that never keeps the logits (colozoo's
    # kernels.linear_cross_entropy, as Liger-Kernel's fused linear cross-entropy); where the software projects the
    # logits and then takes the loss (Megatron's output_layer and vocab_parallel_cross_entropy, which upcasts them to
    # fp32 and keeps their softmax for the backward), the trace runs the head that way (colozoo.cost.model_trace)
    fused_head: bool = True
    # colozoo's Triton fusions on CUDA (colozoo.kernels.priced): each norm keeps the rows it normalised and fp32
    # statistics, a norm fused with the projection after it not the normed rows, q and k rotate in place inside the
    # qkv projection, SwiGLU fused with the down projection keeps gate | up and not their product; without, the
    # trace keeps what the torch composition of those ops does (the base the other fields here adjust)
    triton_fusions: bool = True

    def __post_init__(self):
        if self.optimizer_kernels not in OPTIMIZER_PASSES:
            raise ValueError(f"optimizer_kernels {self.optimizer_kernels!r} not priced; one of {sorted(OPTIMIZER_PASSES)}")
        if self.optimizer_state_bytes not in (2, 4):
            raise ValueError(f"optimizer_state_bytes {self.optimizer_state_bytes!r} not priced; 2 (bf16) or 4 (fp32)")
        if self.master_weight_bytes not in (None, 0, 2, 4):
            raise ValueError(f"master_weight_bytes {self.master_weight_bytes!r} not priced; 0, 2 or 4")
        if self.grad_buckets not in GRAD_BUCKETS:
            raise ValueError(f"grad_buckets {self.grad_buckets!r} not priced; one of {sorted(GRAD_BUCKETS)}")

    def grad_reduce_calls(self, grad_bytes: float, itemsize: int, dp: int) -> int:
        """Collective calls that carry `grad_bytes` of gradients (`itemsize` bytes an element) when data parallelism
        has dp ranks (context parallelism's not counted: Megatron-Core sizes its buckets by
        get_data_parallel_world_size(), without them)."""
        return max(1, math.ceil(GRAD_BUCKETS[self.grad_buckets](grad_bytes, itemsize, dp)))

    def zero3_reduces_each_microbatch(self, plan) -> bool:
        """Whether ZeRO-3 reduce-scatters each micro-batch's gradients under `plan` (else the last's, once)."""
        return self.reduce_every_microbatch and not (plan.pp > 1 and self.pipeline_defers_reduction)

    def grad_bytes(self, itemsize: int) -> int:
        """Bytes a gradient element takes where a rank keeps it (parameters of `itemsize` bytes)."""
        return (self.grad_reduce_bytes or itemsize) if self.grads_in_reduce_dtype else itemsize

    def to_dict(self) -> dict:
        return asdict(self)


COLOZOO = Software()
