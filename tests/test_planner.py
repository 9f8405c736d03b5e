"""Planner search, hardware presets and the heterogeneous-memory (offload) decisions, all without a GPU."""
import warnings

import pytest
import torch

from colozoo.hardware import GB, GiB, HardwareError, get_hardware, parse_bytes
from colozoo.offload import MemoryNeed, OffloadedAdamW, decide_offload, fsdp2_offload_policy, split
from colozoo.planner import best_plan_for_world, plan
from colozoo.profiler import profile

warnings.filterwarnings("ignore", category=FutureWarning)


def test_hardware_presets_and_sizes():
    assert parse_bytes("80GB") == 80e9 and parse_bytes("40GiB") == 40 * GiB and parse_bytes(1024) == 1024
    hw = get_hardware("a100-40gb", gpus=16)
    assert (hw.nodes, hw.gpus_per_node, hw.gpu_memory) == (2, 8, 40 * GiB)
    assert get_hardware("H100-80GB", gpu_memory="94GB").gpu_memory == 94e9
    with pytest.raises(HardwareError, match="unknown hardware"):
        get_hardware("TPU")
    with pytest.raises(HardwareError, match="whole nodes"):
        get_hardware("H100-80GB", gpus=12)


def need(**kw):
    base = dict(weights=10 * GB, grads=10 * GB, master=20 * GB, optimizer=40 * GB, activations=5 * GB,
                transient=1 * GB, fsdp_buffers=1 * GB, params=5 * 10 ** 9, compute_seconds=10.0, num_microbatches=8)
    return MemoryNeed(**{**base, **kw})


def test_offload_picks_the_least_that_fits():
    hw = get_hardware("H100-80GB", gpu_memory="100GB", cpu_memory=2048 * GiB)
    assert decide_offload(need(), hw).level == "none"  # 87 GB fits in 92 GB
    small = get_hardware("H100-80GB", gpu_memory="40GB", cpu_memory=2048 * GiB)
    d = decide_offload(need(), small)  # 87 GB needed: states (60 GB) go first, leaving 27 GB
    assert d.level == "optimizer" and d.fits and d.cpu_bytes == 60 * GB and d.gpu_bytes == 27 * GB
    assert "optimizer states" in d.reason and d.transfer_bytes == 20 * GB  # grads down, weights up
    tiny = get_hardware("H100-80GB", gpu_memory="12GB", cpu_memory=2048 * GiB)
    d = decide_offload(need(), tiny)
    assert d.level == "params" and d.fits and d.gpu_bytes == 7 * GB
    assert d.transfer_bytes == 8 * (2 * 10 + 10) * GB  # every micro-batch: weights up twice, gradients down
    assert fsdp2_offload_policy(d).__class__.__name__ == "CPUOffloadPolicy"
    assert fsdp2_offload_policy(decide_offload(need(), hw)).__class__.__name__ == "OffloadPolicy"
    no_host = get_hardware("H100-80GB", gpu_memory="12GB", cpu_memory=64 * GiB)
    d = decide_offload(need(), no_host)
    assert not d.fits and "CPU needs" in d.reason


def test_offload_cost_grows_when_transfers_cannot_hide():
    small = get_hardware("H100-80GB", gpu_memory="40GB", cpu_memory=2048 * GiB)
    fast = decide_offload(need(compute_seconds=100.0), small)
    slow = decide_offload(need(compute_seconds=100.0), small.with_(pcie_bw=1 * GB))
    assert slow.exposed_seconds > fast.exposed_seconds
    assert fast.exposed_seconds == pytest.approx(5e9 / small.cpu_adam_params_per_s)  # only the CPU step shows
    assert split(need(), "params")[1] == 80 * GB


def test_offloaded_adamw_matches_adamw():
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 4)
    ours = torch.nn.Linear(8, 4)
    ours.load_state_dict(ref.state_dict())
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = OffloadedAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        x = torch.randn(5, 8)
        for model, o in ((ref, opt_ref), (ours, opt)):
            o.zero_grad()
            model(x).square().sum().backward()
            o.step()
    for a, b in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_plan_ranks_fitting_plans_and_decides_checkpointing_with_layout():
    result = plan("opt-125m", gpus=8, gpu_memory="80GB", seq_len=1024, global_batch=64,
                  micro_batch_sizes=(1, 2))
    assert result.plans and result.best.step_seconds == min(p.step_seconds for p in result.plans)
    limit = get_hardware("H100-80GB", gpu_memory="80GB").memory_limit
    assert all(p.memory <= limit for p in result.plans)
    best = result.best
    assert best.tp * best.pp * best.dp * best.cp == 8 and best.dp * best.micro_batch_size * best.num_microbatches == 64
    # the predicted memory is the profiler's for the same degrees
    again = profile("opt-125m", batch_size=best.micro_batch_size, seq_len=1024, mesh=best.mesh(), zero=best.zero,
                    num_microbatches=best.num_microbatches, checkpointing=best.checkpointing,
                    checkpoint_layers=best.checkpoint_layers, schedule=best.schedule, offload=best.offload)
    assert again.peak_memory == pytest.approx(best.memory)
    assert "why" in result.table() and result.to_json().startswith("{")
    # squeeze memory: the same search now needs recompute, sharding or offload to fit
    tight = plan("opt-125m", gpus=8, gpu_memory="3GB", seq_len=1024, global_batch=64,
                 micro_batch_sizes=(1, 2))
    for p in tight.plans:
        assert p.memory <= get_hardware("H100-80GB", gpu_memory="3GB").memory_limit
    assert any(p.checkpointing != "none" or p.zero or p.offload != "none" for p in tight.plans)
    assert tight.best.step_seconds >= result.best.step_seconds


def test_plan_offloads_when_gpu_memory_runs_short():
    # 1.3B parameters x 16 bytes of model state do not fit one 20 GB GPU: the optimizer moves to the CPU
    result = plan("opt-1.3b", gpus=1, gpu_memory="20GB", seq_len=1024, global_batch=8, micro_batch_sizes=(1,))
    best = result.best
    assert best.offload == "optimizer" and any("optimizer states" in w for w in best.why)
    assert best.breakdown["offload"] > 0
    assert not plan("opt-1.3b", gpus=1, gpu_memory="20GB", seq_len=1024, global_batch=8, micro_batch_sizes=(1,),
                    allow_offload=False).plans


def test_best_plan_for_world_and_cli(capsys):
    degrees = best_plan_for_world("opt-125m", 4, gpu_memory="16GB", seq_len=512, global_batch=16,
                                  micro_batch_sizes=(2,))
    assert degrees["tp"] * degrees["pp"] * degrees["dp"] * degrees["cp"] == 4
    from colozoo.cli import main

    assert main(["plan", "opt-125m", "--gpus", "2", "--gpu-memory", "16GB", "--seq-len", "512",
                 "--global-batch", "8", "--json", "--top", "2"]) == 0
    assert '"plans"' in capsys.readouterr().out
    assert main(["plan", "opt-125m", "--hardware", "TPU"]) == 1
