"""Global-norm gradient clipping is priced by its memory traffic: colozoo's clip_grad_norm_ counted byte by byte on a
real model (one read of every gradient for the norm, one read and write to scale it), and the step time's term for
the software that clips so and for the software that scales only when the norm exceeds the threshold."""
import pytest
import torch
from op_traffic import OpTraffic
from parity import hf_causal_lm

from colozoo.api import build_model
from colozoo.checkpoint.load import load_hf_weights
from colozoo.checkpoint.readers import StateDictReader
from colozoo.core.mesh import single_process
from colozoo.cost.hardware import get_hardware
from colozoo.cost.profiler import profile_for
from colozoo.cost.published import published_runs
from colozoo.cost.setup import Workload
from colozoo.cost.software import Software
from colozoo.cost.step_time import estimate
from colozoo.runtime.plan import Plan
from colozoo.runtime.training import clip_grad_norm_, parallelize

CONFIG = dict(vocab_size=101, n_positions=32, n_embd=64, n_layer=2, n_head=4)


def _nbytes(t) -> int:  # the norm's scalars left out
    return t.numel() * t.element_size() if t.numel() > 1 else 0


@pytest.mark.parametrize("max_norm", [1e-3, 1e3])  # clipped, and not: torch's rule scales either way
def test_clipping_reads_each_gradient_once_and_scales_it_in_place(max_norm):
    config, hf = hf_causal_lm("gpt2", CONFIG)
    model = build_model(config, parallel=single_process(), device="meta")
    load_hf_weights(model, StateDictReader(hf.state_dict()), device="cpu")
    parallelize(model.train())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    with OpTraffic(_nbytes) as moved:
        clip_grad_norm_(model, max_norm)
    assert moved.total == Software().grad_clip_passes * grad_bytes  # an fp32 copy or a squared temporary: 5 passes


@pytest.mark.parametrize("zero, share", [(0, 1), (1, 1 / 2)])
def test_step_prices_the_clipping_passes_the_software_makes(zero, share):
    """Over the gradients the optimizer steps from: all of them under DDP, the rank's shard under ZeRO-1 (Megatron-Core's
    distributed optimizer and DeepSpeed take the norm of their shard's main gradients and all-reduce it)."""
    report = profile_for("gpt2", batch_size=1, seq_len=16, mesh="dp=2", zero=zero)
    plan, workload, hw = Plan.from_dict(report.plan), Workload.from_dict(report.workload), get_hardware("H100-80GB")
    grads = share * report.stages[0]["grads"] / (3350e9 * hw.hbm_efficiency)
    seconds = {n: estimate(report, plan, workload, hw, software=Software(grad_clip_passes=n))[1]["optimizer"]
               for n in (0, 1, 3)}
    assert seconds[1] - seconds[0] == pytest.approx(grads)
    assert seconds[3] - seconds[0] == pytest.approx(3 * grads)


def test_published_software_names_how_it_clips():
    passes = {run.software.name: run.software.grad_clip_passes for run in published_runs()}
    assert passes.pop("llm-foundry / Composer FSDP (2023-2024)") == 3  # torch FSDP's clip_grad_norm_ scales always
    assert set(passes.values()) == {1}, passes  # Megatron and DeepSpeed scale only above the threshold
