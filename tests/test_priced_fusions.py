"""The profiler prices colozoo's layers on a GPU as its Triton fusions run them (colozoo.kernels.priced): each
stand-in keeps what its Triton function keeps, the traced layer keeps what the Triton path's layer keeps, and the
planner's memory follows. Published runs keep their frameworks' composition.

The Triton functions run on triton's CPU interpreter here (fp32 / fp16), as in test_activation_memory."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from family_cases import NAMES, tiny_config  # noqa: E402
from test_activation_memory import TINY, kept_bytes  # noqa: E402
from test_kernels import DEVICE, kernel_module, randn  # noqa: E402

from colozoo.kernels import activations, dispatch, norms, priced  # noqa: E402

def saved_storages(fn, *tensors) -> list[int]:
    """Bytes of each distinct storage `fn(*tensors)` saves for backward (parameters given as tensors count too)."""
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*tensors)
    del out
    return sorted(kept.values())


def leaves(*tensors):
    return [t.to(DEVICE).requires_grad_() for t in tensors]


CASES = {  # name: (stand-in, Triton function's module and name, inputs)
    "rms_norm": (lambda x, w: priced.rms_norm(x, w, 1e-6), ("norms_triton", "rms_norm_triton"),
                 lambda: [randn(3, 5, 24, seed=1), 1 + randn(24, seed=2, scale=0.2)]),
    "rms_norm_residual": (lambda x, w, r: priced.rms_norm(x, w, 1e-6, r),
                          ("norms_triton", "rms_norm_triton"),
                          lambda: [randn(3, 5, 24, seed=1), 1 + randn(24, seed=2, scale=0.2), randn(3, 5, 24, seed=3)]),
    "layer_norm": (lambda x, w, b: priced.layer_norm(x, w, b), ("norms_triton", "layer_norm_triton"),
                   lambda: [randn(3, 5, 24, seed=1), 1 + randn(24, seed=2, scale=0.2), randn(24, seed=3)]),
    "rms_norm_linear": (lambda x, nw, w, b, r: priced.rms_norm_linear(x, nw, 1e-6, w, b, r),
                        ("norms_triton", "rms_norm_linear_triton"),
                        lambda: [randn(3, 5, 24, seed=1), 1 + randn(24, seed=2, scale=0.2),
                                 randn(10, 24, seed=3, scale=0.3), randn(10, seed=4), randn(3, 5, 24, seed=5)]),
    "swiglu_linear": (lambda gu, w, b: priced.swiglu_linear(gu, w, b), ("activations_triton", "swiglu_linear_triton"),
                      lambda: [randn(3, 5, 2 * 23, seed=1, scale=3), randn(7, 23, seed=2, scale=0.3),
                               randn(7, seed=3)]),
}


def _triton(case):
    module, name = CASES[case][1]
    fn = getattr(kernel_module(module), name)
    if case == "rms_norm":
        return lambda x, w: fn(x, w, 1e-6)
    if case == "rms_norm_residual":
        return lambda x, w, r: fn(x, w, 1e-6, r)
    if case == "rms_norm_linear":
        return lambda x, nw, w, b, r: fn(x, nw, 1e-6, w, b, r)
    return fn


def shapes(fn, tensors):
    """The saved storages' bytes, the outputs' and the inputs' gradients' shapes and dtypes of fn on fresh leaves."""
    low = leaves(*tensors)
    saved = saved_storages(fn, *low)
    out = fn(*low)
    out = out if isinstance(out, tuple) else (out,)
    grads = torch.autograd.grad(out, low, [torch.ones_like(o) for o in out], allow_unused=True)
    return saved, [(o.shape, o.dtype) for o in out], [None if g is None else (g.shape, g.dtype) for g in grads]


@pytest.mark.parametrize("case", sorted(CASES))
def test_stand_in_keeps_what_its_triton_function_keeps(case):
    """The same saved storages, and outputs and gradients of the same shapes and dtypes, as the Triton function (the
    stand-ins price the kernels' traffic, not their values: meta tensors have none)."""
    stand_in, _, inputs = CASES[case]
    assert shapes(stand_in, inputs()) == shapes(_triton(case), inputs())


@pytest.mark.parametrize("rotary_dim", [16, 10], ids=["full", "partial"])
def test_rotary_stand_in_rotates_in_place(rotary_dim):
    """q and k rotated inside the projection: the Triton function's saved angles, output and gradient."""
    rope_triton = kernel_module("rope_triton")
    heads, kv_heads, head_dim = 4, 2, 16
    angles = randn(2, 5, rotary_dim // 2, seed=7)
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    qkv = randn(2, 5, (heads + 2 * kv_heads) * head_dim, seed=8)

    def run(fn):
        return lambda t: fn(t * 1, cos, sin, heads, kv_heads)  # * 1: not a leaf, as a projection's output

    assert shapes(run(priced.rotate_qk_in_place), [qkv]) == shapes(run(rope_triton.rotate_qk_in_place_triton), [qkv])


def _function_of(out):
    """The autograd function that made `out` (None for a built-in op)."""
    return getattr(out.grad_fn, "_forward_cls", None)


def test_stand_ins_only_on_meta_while_pricing():
    """The ops take the stand-ins for meta tensors inside pricing_fusions, nowhere else: a CPU tensor under
    pricing, or a meta tensor outside it, takes the op's usual path (here the torch reference)."""
    x, w = torch.randn(2, 3, 8, requires_grad=True), torch.ones(8, requires_grad=True)
    meta, meta_w = x.detach().to("meta").requires_grad_(), w.detach().to("meta")
    gate_up, down = torch.empty(2, 3, 16, device="meta", requires_grad=True), torch.empty(4, 8, device="meta")
    with dispatch.use_kernels("torch"):
        with priced.pricing_fusions():
            assert not priced.priced(x) and _function_of(norms.rms_norm(x, w)) is None
            assert priced.priced(meta) and _function_of(norms.rms_norm(meta, meta_w)) is priced._Norm
            assert _function_of(activations.swiglu_linear(gate_up, down)) is priced._SwiGLULinear
        assert not priced.priced(meta) and _function_of(norms.rms_norm(meta, meta_w)) is None
        assert _function_of(activations.swiglu_linear(gate_up, down)) is None


def tiny_llama():
    import transformers

    return transformers.LlamaConfig(vocab_size=101, hidden_size=TINY["hidden"], intermediate_size=TINY["inner"],
                                    num_hidden_layers=1, num_attention_heads=TINY["heads"],
                                    num_key_value_heads=TINY["kv_heads"], head_dim=TINY["head_dim"],
                                    max_position_embeddings=64)


def traced_layer_bytes(fusions: bool, batch: int = 2, seq: int = 8) -> int:
    from colozoo.cost.model_trace import trace_model

    traced = trace_model(tiny_llama(), batch, seq, dtype="float32", target="cuda", fusions=fusions)
    layer = next(u for key, u in traced.units.items() if key.startswith("layer"))
    return layer.saved_bytes


def test_the_traced_layer_keeps_what_the_triton_layer_keeps():
    """The profiler's layer on "cuda" keeps, byte for byte, what the same layer keeps on the Triton kernels (measured
    with saved-tensor hooks on the interpreter), besides two things the measurement leaves out: the batch's rotary
    angles (cos and sin, (batch, seq, head_dim) fp32), which every layer shares and the trace leaves with the first
    that saves them; and in fp32 the repeated keys and values, since CUDA's attention then runs SDPA on k and v
    repeated for every query head (grouped-query SDPA only in fp16 / bf16: colozoo.kernels.attention), where the
    Triton flash kernel measured here reads them as they are. Without the fusions the trace keeps the torch
    composition's more."""
    batch, seq = 2, 8
    tokens, fp32 = batch * seq, 4
    angles = 2 * tokens * TINY["head_dim"] * fp32
    repeated_kv = 2 * tokens * TINY["heads"] * TINY["head_dim"] * fp32
    assert traced_layer_bytes(True, batch, seq) == kept_bytes("triton", batch=batch, seq=seq) + angles + repeated_kv
    assert traced_layer_bytes(False, batch, seq) > 1.3 * traced_layer_bytes(True, batch, seq)


def test_the_planner_prices_the_fusions_and_published_runs_do_not():
    """colozoo's software prices its fusions (the layer's activations fall by the torch composition's surplus); every
    published framework's preset keeps its own composition (their differences are colozoo.cost.saved_layout's)."""
    from dataclasses import replace

    from colozoo.cost.hardware import get_hardware
    from colozoo.cost.planner import SearchSpace, Workload, plan
    from colozoo.cost.published import published_runs
    from colozoo.cost.software import COLOZOO

    assert COLOZOO.triton_fusions
    assert not any(run.software.triton_fusions for run in published_runs())
    search = SearchSpace(micro_batch_sizes=(1,), zero_levels=(0,), allow_offload=False)
    hardware, work = get_hardware("H100-80GB", gpus=1), Workload(seq_len=8192, dtype="bfloat16")
    peaks = [plan(tiny_llama(), hardware, work, search, software=software).best.memory
             for software in (COLOZOO, replace(COLOZOO, triton_fusions=False))]
    assert peaks[0] < peaks[1]


@pytest.mark.parametrize("mesh", ["tp=1", "tp=2,sp"])
@pytest.mark.parametrize("family", NAMES)
def test_every_family_traces_on_the_fused_gpu_path(family, mesh):
    """Every declared family's training step runs on "cuda" with the fusions priced, on one rank and on two
    tensor-parallel ranks: the GPU path's autograd structure (fused functions whose outputs the rotary turns in place)
    runs here on meta tensors, where the CPU's torch path never takes it (a biased qkv projection's view output
    failed so, at tp 1 and tp 2)."""
    from colozoo.cost.profiler import profile_for

    report = profile_for(tiny_config(family), batch_size=1, seq_len=32, dtype="bfloat16", target="cuda", mesh=mesh)
    assert report.peak_memory > 0


def test_the_dispatch_compiles_into_one_graph():
    """Choosing between a stand-in and a Triton function adds no graph break under torch.compile (the layers compile
    whole on a GPU): the Triton modules are imported by statements, which dynamo traces, not by importlib."""
    def pick(x):
        chosen = [priced.fused(x, module, name) for module, name in (("norms_triton", "rms_norm_linear"),
                                                                      ("rope_triton", "rotate_qk_in_place"),
                                                                      ("activations_triton", "swiglu_linear"))]
        return x + 1, [fn.__name__ for fn in chosen]

    _, names = torch.compile(pick, fullgraph=True)(torch.ones(2))
    assert names == ["rms_norm_linear_triton", "rotate_qk_in_place_triton", "swiglu_linear_triton"]
