"""A data-parallel gradient reduction is cut into as many collective calls as the software's buckets make, and each
call's steps pay the collective's latency where they are shorter than it: torch DDP's 25 MiB buckets, Megatron-Core's
max(40M, 1M x dp) elements, one call for Megatron-LM's local DDP of 2021."""
import math

import pytest

from colozoo.cost.cost_model import assemble
from colozoo.cost.hardware import get_hardware
from colozoo.cost.model_trace import trace_model
from colozoo.cost.published import published_runs
from colozoo.cost.setup import Workload
from colozoo.cost.software import Software
from colozoo.cost.step_time import estimate
from colozoo.runtime.plan import Plan

WORKLOAD = Workload(seq_len=64)


@pytest.fixture(scope="module")
def traced():
    return trace_model("gpt2", 1, WORKLOAD.seq_len)  # 124M parameters: 248 MB of bf16 gradients


def _stage(traced, dp, zero, rule):
    plan = Plan(dp=dp, zero=zero)
    return plan, assemble(traced, plan, WORKLOAD, Software(grad_buckets=rule))


@pytest.mark.parametrize("dp", [8, 64])
def test_reduction_calls_follow_the_software_buckets(traced, dp):
    calls = {}
    for rule in ("ddp", "megatron_core", "whole"):
        _, report = _stage(traced, dp, 1, rule)
        st = report.stages[0]
        assert st["comm_calls"]["dp_cp.all_gather"] == st["comm_calls"]["dp_cp.reduce_scatter"]  # ZeRO-1's gather
        calls[rule] = st["comm_calls"]["dp_cp.reduce_scatter"]
        grad_bytes = st["comm"]["dp_cp.reduce_scatter"]
    assert calls["ddp"] == math.ceil(grad_bytes / (25 * 2 ** 20)) == 10
    assert calls["megatron_core"] == math.ceil(grad_bytes / 2 / max(40e6, 1e6 * dp)) == (4 if dp == 8 else 2)
    assert calls["whole"] == 1
    _, plain = _stage(traced, dp, 0, "megatron_core")  # no ZeRO: one all-reduce a bucket
    assert plain.stages[0]["comm_calls"]["dp_cp.all_reduce"] == calls["megatron_core"]


def _dp_seconds(traced, hw):
    out = {}
    for rule in ("ddp", "whole"):
        plan, report = _stage(traced, 64, 0, rule)
        out[rule] = estimate(report, plan, WORKLOAD, hw, software=Software(grad_buckets=rule,
                                                                           grad_reduce_overlap=False))[1]["dp"]
    return out


def test_fewer_calls_pay_less_latency(traced):
    # hops of a millisecond: every step of a 25 MiB bucket's all-reduce waits on its hop
    hw = get_hardware("H100-80GB", gpus=64).with_(collective_latency_s=1e-3, inter_node_latency_s=2e-3)
    dp_seconds = _dp_seconds(traced, hw)
    # the same bytes; nine calls fewer of an all-reduce over 8 nodes (tree between them, ring inside each)
    latency = 9 * (2 * 7 * hw.collective_latency_s + 2 * 3 * hw.inter_node_latency_s)
    assert dp_seconds["ddp"] - dp_seconds["whole"] == pytest.approx(latency)


def test_long_steps_hide_their_latency(traced):
    # an H100's hops (microseconds) are shorter than a 25 MiB bucket's steps: the buckets cost what the bytes do
    dp_seconds = _dp_seconds(traced, get_hardware("H100-80GB", gpus=64))
    assert dp_seconds["ddp"] == pytest.approx(dp_seconds["whole"])


def test_published_software_names_its_buckets():
    rules = {run.software.name: run.software.grad_buckets for run in published_runs()}
    assert rules["Megatron-LM (2021)"] == "whole"
    assert rules["Megatron-Core r0.8.0"] == "megatron_core"
    assert Software().grad_buckets == "ddp"  # colozoo's data parallelism is torch's
    with pytest.raises(ValueError, match="'fsdp' not priced"):
        Software(grad_buckets="fsdp")


def test_megatron_core_sizes_buckets_by_data_parallel_ranks_without_context_parallel():
    """get_data_parallel_world_size() (without context parallelism) sets Megatron-Core's bucket: at dp 32 and cp 2
    the reduction over 64 ranks goes in buckets of 40M elements (4 for GPT-2's 124M), not 64M (2)."""
    traced = trace_model("gpt2", 1, WORKLOAD.seq_len // 2, "cp=2")
    plan = Plan(dp=32, cp=2, zero=1)
    st = assemble(traced, plan, WORKLOAD, Software(grad_buckets="megatron_core")).stages[0]
    grad_elements = st["comm"]["dp_cp.reduce_scatter"] / 2
    assert st["comm_calls"]["dp_cp.reduce_scatter"] == math.ceil(grad_elements / 40e6) == 4
