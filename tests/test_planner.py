"""Planner search, hardware presets and the heterogeneous-memory (offload) decisions, all without a GPU."""
import math
import warnings

import pytest
import torch

from colozoo.cost.hardware import GB, GiB, HardwareError, get_hardware, parse_bytes
from colozoo.cost.offload import MemoryNeed, decide_offload, pipelined, split
from colozoo.runtime.offload import CHUNK_BYTES, OffloadedAdamW, fsdp2_offload_policy
from colozoo.cost.planner import SearchSpace, best_plan_for_world, plan_for
from colozoo.cost.profiler import profile, profile_for
from colozoo.cost.setup import Workload, get_config

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
    # the CPU step is the pipeline's slowest stage: the transfers add only their first and last chunk to it
    cpu_step, chunks = 5e9 / small.cpu_adam_params_per_s, math.ceil(20 * GB / CHUNK_BYTES)
    assert fast.exposed_seconds == pytest.approx(cpu_step + 2 * 10 * GB / small.pcie_bw / chunks)
    assert fast.exposed_seconds < 1.001 * cpu_step
    assert pipelined((1.0, 4.0, 1.0), chunks=4) == 4.5 and pipelined((1.0, 4.0, 1.0), chunks=1) == 6.0
    assert split(need(), "params")[1] == 80 * GB


@pytest.mark.parametrize("chunk_bytes", [2 ** 26, 64])  # one chunk; a chunk per tensor, pipelined
def test_offloaded_adamw_matches_adamw(chunk_bytes):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 4))
    ours = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 4))
    ours.load_state_dict(ref.state_dict())
    ours[1].bias.requires_grad_(False)
    ref[1].bias.requires_grad_(False)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = OffloadedAdamW(ours.parameters(), chunk_bytes=chunk_bytes, lr=1e-2, weight_decay=0.1)
    assert len(opt.chunks) == (1 if chunk_bytes > 1000 else 3)
    for step in range(3):
        x = torch.randn(5, 8)
        for model, o in ((ref, opt_ref), (ours, opt)):
            o.zero_grad()
            model(x).square().sum().backward()
            o.step()
    for a, b in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_plan_ranks_fitting_plans_and_decides_checkpointing_with_layout():
    result = plan_for("opt-125m", gpus=8, gpu_memory="80GB", seq_len=1024, global_batch=64,
                      micro_batch_sizes=(1, 2))
    best = result.best
    assert best.tp * best.pp * best.dp * best.cp == 8 and best.dp * best.micro_batch_size * best.num_microbatches == 64
    # the predicted memory is the profiler's for the same plan
    again = profile("opt-125m", best.choices(), Workload(seq_len=1024))
    assert again.peak_memory == pytest.approx(best.memory)
    assert "why" in result.table() and result.to_json().startswith("{")
    # ranked fastest first, among plans that differ: the best is the fastest of all those searched
    times = [p.step_seconds for p in result.plans]
    assert len(result.plans) > 1 and times == sorted(times) and times[0] < times[-1]
    assert all(p.memory <= get_hardware("H100-80GB", gpus=8, gpu_memory="80GB").memory_limit for p in result.plans)


def test_partial_checkpointing_beats_recomputing_every_layer():
    # opt-125m, 4 x 1024 tokens per micro-batch on one 3.35 GB GPU: without recompute the peak is over the limit
    # (3.4 GB fit since the fused LM head keeps one chunk of logits), recomputing part of the 12 layers fits and
    # costs less than recomputing all 12
    kw = dict(gpus=1, gpu_memory="3.35GB", seq_len=1024, global_batch=8, micro_batch_sizes=(4,), allow_offload=False)
    limit = get_hardware("H100-80GB", gpu_memory="3.35GB").memory_limit
    partial, whole = plan_for("opt-125m", **kw).best, plan_for("opt-125m", partial_checkpointing=False, **kw).best
    assert partial.checkpointing == whole.checkpointing == "full"
    assert 0 < partial.checkpoint_layers < 12 and whole.checkpoint_layers is None
    assert partial.step_seconds < whole.step_seconds and partial.memory <= limit
    setup = dict(batch_size=4, seq_len=1024, num_microbatches=2)
    assert profile_for("opt-125m", **setup).peak_memory > limit  # so some recompute is needed...
    fewer = profile_for("opt-125m", checkpointing="full", checkpoint_layers=partial.checkpoint_layers - 1, **setup)
    assert fewer.peak_memory > limit  # ...and the planner took the fewest layers that fit


def test_long_sequences_choose_context_parallel():
    # 32k tokens of a 1B LLaMA on two 30 GB GPUs: splitting the sequence (cp=2) fits without recompute, plain data
    # parallelism has to recompute layers (each keeps 1.7 GB a layer on colozoo's fused CUDA path); the planner sees
    # cp only when it may use it
    kw = dict(gpus=2, gpu_memory="30GB", seq_len=32768, global_batch=2, micro_batch_sizes=(1,), zero_levels=(3,),
              schedules=("1f1b",))
    with_cp = plan_for("Llama-3.2-1B", **kw)
    assert (with_cp.best.cp, with_cp.best.checkpointing) == (2, "none"), with_cp.best.mesh()
    dp_only = next(p for p in with_cp.plans if (p.dp, p.cp, p.tp, p.pp) == (2, 1, 1, 1))
    assert dp_only.checkpointing == "full" and dp_only.step_seconds > with_cp.best.step_seconds
    without = plan_for("Llama-3.2-1B", context_parallel=False, **kw)
    assert all(p.cp == 1 for p in without.plans) and without.best.step_seconds > with_cp.best.step_seconds


def test_context_parallel_ranks_do_the_whole_sequences_attention():
    # ring attention: a cp rank's queries meet every chunk's keys, so two half sequences on a cp=2 rank cost
    # what one whole sequence costs on a cp=1 rank (the same tokens, the same (query, key) pairs)
    config = get_config("Llama-3.2-1B")
    whole = profile_for(config, batch_size=1, seq_len=8192)
    halves = profile_for(config, batch_size=2, seq_len=8192, mesh="cp=2")
    for key in ("fwd_flops", "bwd_flops"):
        assert halves.stages[0][key] == pytest.approx(whole.stages[0][key], rel=1e-3), key
    assert halves.stages[0]["activations"] == pytest.approx(whole.stages[0]["activations"], rel=0.01)


def test_mixture_of_experts_chooses_expert_parallelism():
    # Mixtral 8x7B on 16 GPUs without tensor parallelism: FSDP over plain data parallelism gathers all eight
    # experts of every layer on every rank; splitting the experts over ep ranks gathers only their own and sends
    # tokens instead. (With tp, whose shards of the experts are already small, tp4 x pp2 x dp2 wins.)
    result = plan_for("Mixtral-8x7B-v0.1", gpus=16, gpu_memory="80GB", seq_len=4096, global_batch=16,
                      micro_batch_sizes=(1,), zero_levels=(3,), schedules=("1f1b",))
    data_parallel = [p for p in result.plans if p.tp == 1]
    best = min(data_parallel, key=lambda p: p.step_seconds)
    assert best.ep > 1, best.mesh()
    no_ep = min((p for p in data_parallel if p.ep == 1), key=lambda p: p.step_seconds)
    assert no_ep.step_seconds > best.step_seconds
    # experts split over ep are sharded by FSDP only over the dp*cp/ep ranks holding the same experts: with
    # ep=8 over dp=8 each rank keeps its one expert per layer whole, so its AdamW states (8 bytes a parameter)
    # are still 1/8 of the model's, as under plain FSDP, not 1/64 of the experts'
    kw = dict(batch_size=1, seq_len=1024, zero=3, checkpointing="full")
    flat, split = (profile_for("Mixtral-8x7B-v0.1", mesh=m, **kw) for m in ("dp=8", "dp=8,ep=8"))
    assert flat.stages[0]["optimizer"] == pytest.approx(8 * flat.total_params / 8, rel=1e-3)
    assert split.stages[0]["optimizer"] == pytest.approx(flat.stages[0]["optimizer"], rel=1e-3)
    assert split.stages[0]["comm"]["ep.all_to_all"] > 0 and "ep.all_to_all" not in flat.stages[0]["comm"]


def test_one_f_one_b_fits_where_gpipe_does_not():
    setup = dict(batch_size=4, seq_len=1024, mesh="pp=4", num_microbatches=8)
    one_f, gpipe = (profile_for("opt-125m", schedule=s, **setup) for s in ("1f1b", "gpipe"))
    # the first stage holds pp=4 micro-batches' activations under 1F1B, all 8 under GPipe
    assert one_f.stages[0]["inflight"] == 4 and gpipe.stages[0]["inflight"] == 8
    assert gpipe.peak_memory > 2 * one_f.peak_memory
    result = plan_for("opt-125m", gpus=4, gpu_memory="3GB", seq_len=1024, global_batch=128, micro_batch_sizes=(4,),
                      zero_levels=(0,))
    pp4 = [p for p in result.plans if p.pp == 4]
    assert pp4 and all(p.schedule == "1f1b" for p in pp4)
    assert any(p.checkpointing == "none" and p.offload == "none" for p in pp4)
    assert any("gpipe holds 32 micro-batches" in reason for reason in result.rejected)


def test_plan_offloads_when_gpu_memory_runs_short():
    # 1.3B parameters x 16 bytes of model state do not fit one 20 GB GPU: the optimizer moves to the CPU
    result = plan_for("opt-1.3b", gpus=1, gpu_memory="20GB", seq_len=1024, global_batch=8, micro_batch_sizes=(1,))
    best = result.best
    assert best.offload == "optimizer" and any("optimizer states" in w for w in best.why)
    assert best.breakdown["offload"] > 0
    assert not plan_for("opt-1.3b", gpus=1, gpu_memory="20GB", seq_len=1024, global_batch=8, micro_batch_sizes=(1,),
                        allow_offload=False).plans


def test_collective_latency_and_overlap_are_priced():
    from colozoo.core.mesh import ParallelConfig
    from colozoo.cost.planner import estimate
    from colozoo.cost.setup import plan_of

    workload = Workload(seq_len=256, dtype="bfloat16")
    kw = dict(batch_size=2, seq_len=256, zero=3, num_microbatches=2)
    tp, dp = ParallelConfig(tp=2, sequence_parallel=True), ParallelConfig(dp=2)
    tp_plan, dp_plan = (plan_of(mesh, micro_batch_size=2, zero=3, num_microbatches=2) for mesh in (tp, dp))
    tp_report, dp_report = profile_for("opt-125m", mesh=tp, **kw), profile_for("opt-125m", mesh=dp, **kw)
    # 12 layers x (2 forward + 2 backward) sequence-parallel gathers and reduce-scatters, 2 micro-batches
    assert sum(tp_report.comm_calls.values()) >= 12 * 4 * 2
    # FSDP: every layer and the stage gathered for each micro-batch's forward and (but the stage) backward,
    # reduced once
    assert dp_report.comm_calls == {"dp_cp.all_gather": (2 * 13 - 1) * 2, "dp_cp.reduce_scatter": 13}
    hw = get_hardware("H100-80GB", gpus=2)
    slow = hw.with_(collective_latency_s=hw.collective_latency_s + 1e-3)
    base, _, _ = estimate(tp_report, tp_plan, workload, hw)
    slower, breakdown, _ = estimate(tp_report, tp_plan, workload, slow)
    # tp collectives sit on the critical path: every call costs one more ms per ring step (2 for an all-reduce)
    steps = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}
    ring_steps = sum(n * steps[key.split(".")[1]] for key, n in tp_report.comm_calls.items())
    assert slower - base == pytest.approx(1e-3 * ring_steps, rel=1e-6)
    # FSDP traffic hides behind compute on GPUs (but the last reduce-scatter, which the optimizer step waits for,
    # what the embedding's gather outlasts of the compute before it, and the SMs NCCL takes from the compute it
    # overlaps), and is all exposed where the collectives share busy cores
    hidden, hidden_parts, _ = estimate(dp_report, dp_plan, workload, hw)
    exposed, exposed_parts, _ = estimate(dp_report, dp_plan, workload, hw.with_(comm_overlap=0.0))
    assert 0 < hidden_parts["dp"] < 0.25 * exposed_parts["dp"]
    assert exposed - exposed_parts["dp"] == pytest.approx(hidden - hidden_parts["dp"])
    # a collective that reaches half the link's bandwidth takes twice as long
    half = hw.with_(comm_overlap=0.0, collective_latency_s=0.0, collective_efficiency={"all_gather": 0.5,
                                                                                         "reduce_scatter": 0.5})
    full = hw.with_(comm_overlap=0.0, collective_latency_s=0.0)
    assert (estimate(dp_report, dp_plan, workload, half)[1]["dp"]
            == pytest.approx(2 * estimate(dp_report, dp_plan, workload, full)[1]["dp"]))


def test_best_plan_for_world_and_cli(capsys):
    degrees = best_plan_for_world("opt-125m", 4, Workload(seq_len=512), SearchSpace(micro_batch_sizes=(2,)),
                                  global_batch=16, gpu_memory="16GB").to_dict()
    assert degrees["tp"] * degrees["pp"] * degrees["dp"] * degrees["cp"] == 4
    from colozoo.cli import main

    assert main(["plan", "opt-125m", "--gpus", "2", "--gpu-memory", "16GB", "--seq-len", "512",
                 "--global-batch", "8", "--json", "--top", "2"]) == 0
    assert '"plans"' in capsys.readouterr().out
    assert main(["plan", "opt-125m", "--hardware", "TPU"]) == 1
    args = ["plan", "opt-125m", "--gpus", "2", "--seq-len", "512", "--global-batch", "8", "--json", "--top", "1"]
    assert main(args + ["--set", "collective_latency_s=0.5", "--set", "comm_overlap=0"]) == 0
    import json

    chosen = json.loads(capsys.readouterr().out)
    assert chosen["hardware"]["collective_latency_s"] == 0.5 and chosen["hardware"]["comm_overlap"] == 0
    assert chosen["plans"][0]["tp"] == 1  # half a second a collective step: tp's many collectives lose
    assert main(args + ["--set", "nvlink=1"]) == 1 and "no field 'nvlink'" in capsys.readouterr().err


def test_meshes_the_sequence_cannot_split_are_rejected_with_the_users_length():
    """The planner runs sequence parallelism wherever tp > 1: a sequence that is no multiple of the layers' split
    (core.sequence.sequence_multiple) is no mesh to trace, and the reason names the user's length."""
    from colozoo.cost.planner import _meshes

    reasons = []
    meshes = list(_meshes(8, get_hardware("H100-80GB"), 8, None, 1028, True, SearchSpace(), reasons.append))
    assert (2, 2, 1) in meshes and (4, 1, 1) in meshes
    assert (4, 2, 1) not in meshes and (8, 1, 1) not in meshes  # 1028 = 4 x 257: not 8 at tp 4 x cp 2, nor tp 8
    assert "seq_len=1028 is not a multiple of 8 (tp=4, cp=2)" in reasons
