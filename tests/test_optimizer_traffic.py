"""The optimizer step is priced by the memory traffic of the kernels the software runs: torch's AdamW counted element
access by element access on a real step, and the step time's optimizer term for fused and unfused kernels."""
import pytest
import torch
from op_traffic import OpTraffic

from colozoo.cost.hardware import get_hardware
from colozoo.cost.profiler import profile_for
from colozoo.cost.published import published_runs
from colozoo.cost.setup import Workload
from colozoo.cost.software import OPTIMIZER_PASSES, Software
from colozoo.cost.step_time import estimate
from colozoo.runtime.plan import Plan

N = 1000  # elements of the one parameter


def _state(t) -> int:
    return int(t.numel() == N)  # the states are the only tensors this large


@pytest.mark.parametrize("kernels, options", [("single_tensor", dict(foreach=False)), ("foreach", dict(foreach=True)),
                                              ("fused", dict(fused=True))])
def test_adamw_touches_each_state_as_often_as_priced(kernels, options):
    param = torch.nn.Parameter(torch.randn(N))
    param.grad = torch.randn(N)
    optimizer = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, **options)
    optimizer.step()  # the first step creates the moments
    # the fused kernel's schema marks the gradients writable (it unscales them under a grad scaler): read here
    with OpTraffic(_state, read_only=("grads",)) as accesses:
        optimizer.step()
    # the fused kernel: read the parameter, gradient and both moments, write the parameter and both moments
    assert accesses.total == 7 * OPTIMIZER_PASSES[kernels]


def test_step_prices_the_optimizer_kernels_the_software_runs():
    report = profile_for("gpt2", batch_size=1, seq_len=16, mesh="dp=2", zero=1)
    plan, workload, hw = Plan.from_dict(report.plan), Workload.from_dict(report.workload), get_hardware("H100-80GB")
    st = report.stages[0]
    # ZeRO-1 over 2 ranks: each updates half the weights from half the gradients, and all of its own states
    one_pass = ((st["weights"] + st["grads"]) / 2 + 2 * (st["master"] + st["optimizer"])) / (3350e9 * hw.hbm_efficiency)
    seconds = {kernels: estimate(report, plan, workload, hw, software=Software(optimizer_kernels=kernels,
                                                                               grad_clip_passes=0))[1]
               for kernels in OPTIMIZER_PASSES}  # the clipping's passes: tests/test_clipping_traffic.py
    assert seconds["fused"]["optimizer"] == pytest.approx(one_pass)
    assert seconds["foreach"]["optimizer"] == pytest.approx(3 * one_pass)  # torch's default AdamW on CUDA
    assert Software().optimizer_kernels == "fused"  # colozoo's build_optimizer (tests/test_training.py)
    with pytest.raises(ValueError, match="'lamb' not priced"):
        Software(optimizer_kernels="lamb")


def test_published_software_names_its_optimizer():
    kernels = {run.software.name: run.software.optimizer_kernels for run in published_runs()}
    assert kernels.pop("llm-foundry / Composer FSDP (2023-2024)") == "single_tensor"  # Composer's DecoupledAdamW
    assert set(kernels.values()) == {"fused"}  # Apex, DeepSpeed and Transformer Engine FusedAdam
