"""Fused attention priced by its measured speed (colozoo.cost.attention_speed: the FlashAttention-2 paper's
forward + backward figures by implementation, head dimension, mask and sequence), split between the passes by the
paper's best forward and backward shares of peak; without a measurement, Hardware.attention_efficiency."""
import warnings

import pytest
import transformers

from colozoo.cost import attention_speed
from colozoo.cost.attention_speed import fwd_bwd_tflops, pass_tflops
from colozoo.cost.compute_time import attention_seconds, unit_seconds
from colozoo.cost.hardware import get_hardware

warnings.filterwarnings("ignore", category=FutureWarning)
A100 = attention_speed.A100


def test_measured_points_and_between_them():
    assert fwd_bwd_tflops(A100, "flash2", 128, True, 16384) == 189
    assert fwd_bwd_tflops(A100, "flash1", 128, True, 16384) == 83
    # halfway between 8k and 16k in log2 of the sequence (about 11.6k): halfway between 182 and 189
    assert fwd_bwd_tflops(A100, "flash2", 128, True, int(8192 * 2 ** 0.5)) == pytest.approx(185.5, abs=0.01)
    # beyond the measured lengths the last measured speed holds; head dims between the measured ones interpolate
    assert fwd_bwd_tflops(A100, "flash2", 128, True, 65536) == 189
    assert fwd_bwd_tflops(A100, "flash2", 96, True, 16384) == pytest.approx((171 + 189) / 2)
    assert fwd_bwd_tflops(A100, "flash3", 128, True, 16384) is None
    # the H100 runs FlashAttention-2 at about a third of its peak, against three fifths on the A100
    assert fwd_bwd_tflops(attention_speed.H100, "flash2", 128, True, 2048) == 265


def test_the_published_tables_are_read_only():
    """A caller changing a table it was given (the module's, a preset's, a dict given to Hardware) is refused, and
    every later answer stays the paper's (Figure 4: 189 TFLOP/s at d128, causal, 16k on the A100)."""
    import pickle

    from colozoo.cost.hardware import Hardware

    given = Hardware("mine", 1e9, 1e12, attention_speed={"flash2/d128/causal": {16384: 100}})
    for table in (A100, get_hardware("A100-80GB").attention_speed, given.attention_speed):
        with pytest.raises(TypeError):
            table["flash2/d128/causal"][16384] = 1
        with pytest.raises(TypeError):
            table["flash3/d128/causal"] = {}
    assert fwd_bwd_tflops(get_hardware("A100-80GB").attention_speed, "flash2", 128, True, 16384) == 189
    assert pickle.loads(pickle.dumps(get_hardware("H100-80GB"))) == get_hardware("H100-80GB")  # a spawned planner


def test_backward_slower_than_forward_and_the_sum_as_measured():
    both = fwd_bwd_tflops(A100, "flash2", 128, False, 16384)
    fwd = pass_tflops(A100, "flash2", 128, False, 16384, "fwd")
    bwd = pass_tflops(A100, "flash2", 128, False, 16384, "bwd")
    assert both == 203  # Figure 4's best point, which the split gives as ~226 forward and ~195 backward
    assert (fwd, bwd) == (pytest.approx(226, abs=0.5), pytest.approx(195, abs=0.5))
    assert fwd / bwd == pytest.approx(73 / 63)  # the paper's best forward and backward shares of peak
    flops = 1e15  # a forward's FLOPs; the backward does 2.5x: the two passes take what the combined rate says
    assert flops / fwd + 2.5 * flops / bwd == pytest.approx(3.5 * flops / both)


def test_attention_kernel_at_its_measured_speed():
    hw = get_hardware("A100-80GB")
    flops, shape = 4 * 32 * 16384 ** 2 * 128, (32, 16384, 16384, 128)
    fwd = attention_seconds(flops, 1e6, True, hw, "fwd", shape)
    # Figure 4: 189 TFLOP/s causal at d128 and 16k; forward 189 x 3.5 / (63 / 73 + 2.5) x 73 / 63 = 210.43
    assert fwd == pytest.approx(flops / 2 / 210.43e12, rel=1e-4)
    bwd = attention_seconds(2.5 * flops, 1e6, True, hw, "bwd", shape)
    assert bwd / fwd == pytest.approx(2.5 * 73 / 63)
    assert attention_seconds(flops, 1e6, True, hw, "fwd", shape, "flash1") > 2 * fwd
    # no shape, or an implementation never measured: the preset's share of peak
    for seconds in (attention_seconds(flops, 1e6, True, hw), attention_seconds(flops, 1e6, True, hw, "fwd", shape,
                                                                                "flash3")):
        assert seconds == pytest.approx(flops / 2 / (312e12 * 0.5))  # the datasheet's peak, the preset's 50%


def test_traced_attention_keeps_its_shape():
    """The trace keys a fused attention kernel by (batch x heads, query length, key length, head dim), which
    unit_seconds prices by the implementation the software runs."""
    from colozoo.cost.model_trace import trace_model

    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=16)
    unit = trace_model(config, 2, 16, None, "bfloat16", "cuda").units["layer:0"]
    keys = [key for key in unit.kernels if "|attention|" in key]
    assert keys and all(key.split("|")[3] == "8x16x16x16" for key in keys)
    hw = get_hardware("H100-80GB", kernel_floor_s=0.0)
    # a million times the FLOPs: a kernel this small would be bound by its bytes
    core = {k: [n, 1e6 * f, b] for k, (n, f, b) in unit.kernels.items() if "|attention|" in k}
    assert unit_seconds(core, hw, "bwd", attention="flash1") > unit_seconds(core, hw, "bwd", attention="flash2")
