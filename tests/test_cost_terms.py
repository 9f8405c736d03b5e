"""Each term of the step-time model on a case counted by hand: GEMM tile and wave quantization and the roofline,
causal attention, the kernels of a traced layer, collectives per link (ring or tree, NVLink or the network), overlap
with the SMs collectives take, ZeRO-3 gathers per micro-batch, pipelines with virtual stages and uneven ranks,
interleaved in-flight activations, FSDP's reshard_after_forward, and measured hardware fields from a file."""
import json
import warnings

import pytest
import transformers

from colozoo.cost.compute_time import attention_seconds, gemm_seconds, unit_seconds, wave_efficiency
from colozoo.cost.hardware import GB, Hardware, HardwareError, get_hardware
from colozoo.cost.network import collective_seconds, latency_steps
from colozoo.cost.software import Software
from colozoo.cost.step_time import _layer_chain, chain_exposure, overlapped, pipeline_seconds
from colozoo.cost.zero3_submodules import held_share, submodule_ops, submodules
from colozoo.runtime.plan import Plan

warnings.filterwarnings("ignore", category=FutureWarning)

GPU = Hardware("test", 80 * GB, 300e12, vector_flops=20e12, sm_count=100, gemm_tile=(256, 128), small_tile=None,
               matmul_efficiency=0.8,
               attention_efficiency=0.5, hbm_bw=2000 * GB, hbm_efficiency=0.8, kernel_floor_s=0.0,
               intra_node_bw=300 * GB, inter_node_bw=25 * GB, collective_latency_s=1e-5, inter_node_latency_s=2e-5)


def test_gemm_tiles_fill_waves_of_sms():
    # 2560 x 2560 outputs: 10 x 20 tiles of 256 x 128 = 200 tiles fill 2 waves of 100 SMs exactly
    assert wave_efficiency(1, 2560, 2560, GPU) == 1.0
    # one row more: 11 x 20 = 220 tiles, 3 waves, 2561 * 2560 useful of 3 * 100 * 256 * 128
    assert wave_efficiency(1, 2561, 2560, GPU) == pytest.approx(2561 * 2560 / (300 * 256 * 128))
    # a narrow tensor-parallel slice (n = 640) makes 10 x 5 = 50 tiles: half a wave
    assert wave_efficiency(1, 2560, 640, GPU) == pytest.approx(0.5)
    # batched: 4 x 50 tiles fill 2 waves
    assert wave_efficiency(4, 2560, 640, GPU) == 1.0
    # cuBLAS's smaller tile where it fills the SMs better: the slice's 20 x 10 tiles of 128 x 64 fill 2 waves, at that
    # tile's rate; whole waves of large tiles keep them
    small = GPU.with_(small_tile=(128, 64), small_tile_efficiency=0.9)
    assert wave_efficiency(1, 2560, 640, small) == pytest.approx(0.9)
    assert wave_efficiency(1, 2560, 2560, small) == 1.0
    flops = 2 * 2560 * 640 * 4096
    nbytes = 2 * (2560 * 4096 + 4096 * 640 + 2560 * 640)
    assert gemm_seconds(flops, nbytes, (1, 2560, 640, 4096), GPU) == pytest.approx(flops / (300e12 * 0.8 * 0.5))
    # one row (decode-like) would waste 255 of 256 rows of a tensor-core tile: a GEMV kernel on the vector units,
    # bound by reading the weight
    flops, nbytes = 2 * 1 * 4096 * 4096, 2 * (4096 + 4096 * 4096 + 4096)
    assert gemm_seconds(flops, nbytes, (1, 1, 4096, 4096), GPU) == pytest.approx(nbytes / (2000e9 * 0.8))


def test_causal_attention_computes_half_the_pairs():
    full = attention_seconds(1e12, 1e6, False, GPU)
    assert full == pytest.approx(1e12 / (300e12 * 0.5))
    assert attention_seconds(1e12, 1e6, True, GPU) == pytest.approx(1e12 / 2 / (300e12 * 0.5))


def test_unit_seconds_adds_its_kernels():
    kernels = {"fwd|gemm||1x2560x2560x4096|": [2, 2 * 2 * 2560 * 2560 * 4096, 2 * 50e6],
               "fwd|memory|||": [3, 0, 3 * 160e6],
               "fwd|attention|core||causal": [1, 4e11, 1e6],
               "bwd|memory|||": [1, 0, 320e6]}
    gemm = 2 * (2 * 2560 * 2560 * 4096) / (300e12 * 0.8)
    memory = 3 * 160e6 / 1600e9
    core = 2e11 / 150e12
    assert unit_seconds(kernels, GPU, "fwd") == pytest.approx(gemm + memory + core)
    assert unit_seconds(kernels, GPU, "fwd", core_only=True) == pytest.approx(core)
    assert unit_seconds(kernels, GPU, "fwd", core_scale=4) == pytest.approx(gemm + memory + 4 * core)
    assert unit_seconds(kernels, GPU, "bwd") == pytest.approx(320e6 / 1600e9)
    # a host issuing 1 ms per kernel cannot keep up: six kernels take 6 ms
    assert unit_seconds(kernels, GPU.with_(launch_s=1e-3), "fwd") == pytest.approx(6e-3)


def test_traced_layer_records_its_gemm_shapes():
    """A GPT-2 layer at 2 x 16 tokens and hidden 64: q/k/v (64 -> 192), the projection (64 -> 64), the MLP
    (64 -> 256 -> 64) forward, with the kernels' FLOPs adding up to the layer's hand count: 2 x 32 tokens x 64 x
    (192 + 64 + 256) + 2 x 32 x 256 x 64 in the GEMMs, 2 products of 4 x 8 heads x 16 x 16 x 16 in attention
    (131072: flop_counter counts the full square); backward twice the GEMMs and 2.5 x attention's forward."""
    from colozoo.cost.model_trace import trace_model

    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=16,
                                     activation_function="gelu_pytorch_tanh")
    unit = trace_model(config, 2, 16, None, "bfloat16", "cuda").units["layer:0"]
    shapes = {key.split("|")[3] for key, (n, _, _) in unit.kernels.items() if key.startswith("fwd|gemm")}
    assert {"1x32x192x64", "1x32x64x64", "1x32x256x64", "1x32x64x256"} <= shapes
    gemms, attention = 2 * 32 * 64 * (192 + 64 + 256) + 2 * 32 * 256 * 64, 4 * 8 * 16 * 16 * 16
    for phase, flops in (("fwd", gemms + attention), ("bwd", 2 * gemms + 2.5 * attention)):
        assert sum(f for key, (_, f, _) in unit.kernels.items() if key.startswith(phase)) == flops
    assert (unit.fwd_flops, unit.bwd_flops) == (gemms + attention, 2 * gemms + 2.5 * attention)
    assert any(key.startswith("fwd|attention|core") and key.endswith("causal") for key in unit.kernels)


def test_collectives_per_link_and_algorithm():
    # inside a node: a ring all-gather of 8 ranks moves 7/8 of the payload over NVLink in 7 steps a call; a
    # gigabyte's steps (1.7 ms each) hide the hop's 10 us latency, a kilobyte's (0.4 ns) wait on it
    assert collective_seconds(GPU, "all_gather", 8e9, 8, 8, calls=2) == pytest.approx(7e9 / 300e9)
    assert collective_seconds(GPU, "all_gather", 8e3, 8, 8, calls=2) == pytest.approx(2 * 7 * 1e-5)
    # across nodes (8 ranks one per node, 64 consecutive ranks): each GPU's own adapter, network latency
    assert collective_seconds(GPU, "all_gather", 8e9, 8, 64, calls=1) == pytest.approx(7e9 / 25e9)
    assert collective_seconds(GPU, "all_gather", 8e3, 8, 64, calls=1) == pytest.approx(7 * 2e-5)
    # an all-reduce over 512 ranks on 64 nodes takes NCCL's tree: 2 log2(64) steps between nodes and 2 (8 - 1)
    # inside them, not 2 x 511
    assert latency_steps("all_reduce", 512, 8) == (2 * 7, 2 * 6)
    assert latency_steps("all_reduce", 8, 8) == (14, 0)
    # a ring over 64 nodes of 8 leaves a node on 64 of its 512 hops: that share of its 511 steps waits on the network
    assert latency_steps("reduce_scatter", 512, 8) == pytest.approx((511 * 7 / 8, 511 / 8))
    assert collective_seconds(GPU, "all_reduce", 1e3, 512, 512, calls=1) == pytest.approx(14 * 1e-5 + 12 * 2e-5)
    assert collective_seconds(GPU, "all_gather", 1e3, 512, 512, calls=1) == pytest.approx(
        511 * 7 / 8 * 1e-5 + 511 / 8 * 2e-5)
    # 16 us a step of a 200 MB ring over 512 ranks: past the NVLink hop's 10 us, short of the network's 20 us
    step = 511 / 512 * 2e8 / 25e9 / 511
    assert collective_seconds(GPU, "all_gather", 2e8, 512, 512, calls=1) == pytest.approx(
        511 * 7 / 8 * step + 511 / 8 * 2e-5)
    assert collective_seconds(GPU, "all_reduce", 1e9, 1, 1) == 0.0


def test_overlap_hides_traffic_but_takes_sms():
    assert overlapped(10.0, 4.0, 1.0) == 10.0 and overlapped(10.0, 4.0, 0.0) == 14.0
    assert overlapped(3.0, 4.0, 1.0) == 4.0
    assert overlapped(10.0, 4.0, 1.0, contention=0.25) == 11.0  # 4 s of it ran on 3/4 of the SMs
    # behind longer traffic the compute loses its share and still ends first: the traffic alone sets the time
    assert overlapped(2.0, 4.0, 1.0, contention=0.25) == 4.0
    assert overlapped(3.5, 4.0, 1.0, contention=0.25) == 4.5  # 3.5 s of work on 3/4 of the SMs for 4 s: 0.5 late
    # a cyclic chain: each step's traffic runs during the step before it
    ops = [(1.0, 0.5), (2.0, 3.0), (1.0, 0.5)]
    assert chain_exposure(ops, 1.0) == pytest.approx(0 + (3.0 - 1.0) + 0)
    assert chain_exposure(ops, 0.0) == pytest.approx(4.0)


def test_zero3_gathers_that_prefetching_cannot_hide():
    """Two units, each 1 s forward and 2 s backward, gathered in 1.5 s, reduce-scattered in 1 s. Forward: each
    gather behind the other unit's forward (0.5 s each exposed); backward: the second unit gathers again behind
    the first's forward... in cycle order: unit 2's backward gather (1.5) behind unit 2's forward (1 s): 0.5,
    unit 1's gather (1.5) + unit 2's reduce-scatter (1) behind unit 2's backward (2 s): 0.5; the last
    reduce-scatter rides with the next forward's first gather: 2.5 behind unit 1's backward (2 s): 0.5."""
    units = [(1.0, 2.0, 1.5, 1.0, 1), (1.0, 2.0, 1.5, 1.0, 1)]
    assert _layer_chain(units, True, 1.0, 0.0) == pytest.approx(0.5 + 0.5 + 0.5 + 0.5)
    # gathered once more for a recomputed layer's backward (DeepSpeed under Megatron's checkpointing)
    again = [(1.0, 2.0, 1.5, 1.0, 2), (1.0, 2.0, 1.5, 1.0, 2)]
    assert _layer_chain(again, True, 1.0, 0.0) == pytest.approx(0.5 + 0.5 + 2.0 + 2.0)
    # nothing overlaps: every byte waits
    assert _layer_chain(units, True, 0.0, 0.0) == pytest.approx(2 * 1.5 + 2 * 1.5 + 2 * 1.0)


def _flat(pairs):
    return [x for pair in pairs for x in pair]


def test_zero3_gathered_by_submodule(monkeypatch):
    """DeepSpeed's stage 3 gathers each linear's weight one submodule ahead: a layer of a 3-unit query/key/value
    weight, the attention core, a 1-unit output projection and a 4-unit MLP weight."""
    kernels = {"fwd|memory|||": [2, 0, 0], "fwd|gemm||1x10x30x10|": [1, 1, 0], "fwd|gemm|core|4x10x10x5|": [1, 1, 0],
               "fwd|gemm||1x10x10x10|": [1, 1, 0], "fwd|gemm||1x10x40x10|": [1, 1, 0], "bwd|gemm||1x10x10x40|": [1, 1, 0]}
    seconds = {"fwd|memory|||": 0.5, "fwd|gemm||1x10x30x10|": 3.0, "fwd|gemm|core|4x10x10x5|": 1.0,
               "fwd|gemm||1x10x10x10|": 1.0, "fwd|gemm||1x10x40x10|": 4.0}
    monkeypatch.setattr("colozoo.cost.zero3_submodules.kernel_seconds", lambda key, *args: seconds[key])
    subs = submodules(kernels, GPU)
    # the norms' 0.5 s spread over the linears by their time (8 s); the core carries no weights
    assert _flat(subs) == pytest.approx([3 * 17 / 16, 3 / 8, 1.0, 0.0, 17 / 16, 1 / 8, 4 * 17 / 16, 4 / 8])
    assert held_share(kernels) == pytest.approx(5 / 8)  # the output projection and the MLP weight after it
    # one unit, forward 2 s, backward 4 s, gathers of 1 s per unit share, no recomputation, gathered again once
    unit = ([(1.0, 0.5), (1.0, 0.5)], 2.0, 4.0, lambda w: 1.0 * w, lambda w: 0.0, lambda w: 0.0, False, 1)
    ops, fills = submodule_ops([unit], reduce=False)
    assert ops == [(1.0, 0.5), (1.0, 0.5), (2.0, 0.5), (2.0, 0.5)] and fills == 0.0
    # recomputed and gathered again for it (DeepSpeed under Megatron's checkpointing), buffers zeroed at 0.1 s a
    # unit share, each submodule's gradients reduce-scattered (2 s a unit) behind the next backward
    unit = ([(1.0, 0.5), (1.0, 0.5)], 2.0, 4.0, lambda w: w, lambda w: 2 * w, lambda w: 0.1 * w, True, 2)
    ops, fills = submodule_ops([unit], reduce=True)
    assert _flat(ops) == pytest.approx([1.05, 0.5 + 1.0, 1.05, 0.5, 1.05, 0.5, 1.05, 0.5, 2.05, 0.5, 2.05, 0.5 + 1.0])
    assert fills == pytest.approx(6 * 0.05)
    # every gather shorter than the compute before it (the first behind the last backward): all hidden
    assert chain_exposure(ops, 1.0) == 0.0 and chain_exposure(ops, 0.0) == pytest.approx(5.0)


def test_pipelines_with_virtual_stages_and_uneven_ranks():
    assert pipeline_seconds([1.0] * 4, m=8) == pytest.approx(8 + 3)  # (m + p - 1) t
    assert pipeline_seconds([1.0] * 4, m=8, v=2) == pytest.approx(8 + 3 / 2)  # the bubble over v
    assert pipeline_seconds([1.0, 1.0, 1.0, 2.0], m=8) == pytest.approx(8 * 2 + 3)  # the head's rank sets the pace


def test_interleaved_schedule_holds_more_micro_batches():
    from colozoo.cost.cost_model import in_flight

    one_f = Plan(pp=4, num_microbatches=16)
    inter = Plan(pp=4, num_microbatches=16, schedule="interleaved_1f1b", virtual_stages=2)
    assert [in_flight(one_f, s) for s in range(4)] == [4, 3, 2, 1]
    # 2(p - s - 1) + (v - 1)p + 1 chunks of half the rank's layers: p (1 + (p - 1)/(p v)) on the first rank
    assert [in_flight(inter, s) for s in range(4)] == [5.5, 4.5, 3.5, 2.5]
    assert in_flight(Plan(pp=4, num_microbatches=16, schedule="gpipe"), 0) == 16


def test_plan_refuses_virtual_stages_it_cannot_run():
    with pytest.raises(ValueError, match="runs one stage per rank"):
        Plan(pp=2, virtual_stages=2)
    with pytest.raises(ValueError, match="layers_per_stage"):
        Plan(pp=2, layers_per_stage=(3, 3, 3))
    assert Plan(pp=2, layers_per_stage=[2, 3]).layers_per_stage == (2, 3)


def test_plan_holds_its_mesh_as_a_parallel_config():
    from dataclasses import replace

    from colozoo.core.mesh import ParallelConfig, ParallelConfigError

    plan = Plan(tp=2, dp=2, ep=2, sequence_parallel=True, micro_batch_size=2)
    assert plan.degrees == ParallelConfig(tp=2, dp=2, ep=2, sequence_parallel=True)
    assert (plan.tp, plan.dp, plan.world_size) == (2, 2, 4) and plan == Plan(plan.degrees, micro_batch_size=2)
    assert replace(plan, tp=4).degrees.tp == 4 and replace(plan, degrees=ParallelConfig()).tp == 1
    from colozoo.cost.planner import RankedPlan

    ranked = RankedPlan(tp=2, step_seconds=1.0)  # the planner's subclass takes the degrees as keywords too
    assert replace(ranked, tp=4).tp == 4 and replace(ranked, tp=4).step_seconds == 1.0 and ranked.why == []
    with pytest.raises(ParallelConfigError, match="ep=2 must divide dp\\*cp=1"):  # ParallelConfig's own check
        Plan(ep=2)
    with pytest.raises(AttributeError):
        plan.tp = 8  # read-only: the mesh is plan.degrees
    flat = json.loads(json.dumps(plan.to_dict()))  # the JSON a run's config.json and `colozoo plan --json` hold
    assert flat["tp"] == 2 and "degrees" not in flat and Plan.from_dict(flat) == plan == Plan(**flat)
    assert Plan.from_dict({**flat, "memory": 1.0}) == plan  # a prediction beside it is left out


def test_reshard_after_forward_trades_gathers_for_memory():
    from colozoo.cost.profiler import profile_for

    config = transformers.GPT2Config(n_embd=64, n_layer=4, n_head=4, vocab_size=128, n_positions=32)
    kw = dict(batch_size=2, seq_len=32, mesh="dp=4", zero=3, num_microbatches=2)
    resharded, kept = (profile_for(config, reshard_after_forward=r, **kw) for r in (True, False))
    units = {u["name"]: u["param_bytes"] for u in resharded.units}
    layer, root = units["layer 0"], units["embed"] + units["head"]  # gathered whole, beside the shard
    # the most at once, as the next layer is gathered: the one before's collective output (kept until this copy-out),
    # the next one's output and the weights it is copied into; the embedding and head (the root) throughout
    assert resharded.stages[0]["fsdp_buffers"] == pytest.approx(root + 3 * layer)
    assert kept.stages[0]["fsdp_buffers"] == pytest.approx(root + (4 + 2) * layer)  # and every layer gathered before
    assert kept.comm["dp_cp.all_gather"] == pytest.approx(resharded.comm["dp_cp.all_gather"] / 2)


def test_measured_hardware_fields_from_a_file(tmp_path, capsys):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"preset": "A100-80GB", "matmul_efficiency": 0.7, "hbm_efficiency": 0.9,
                                "sources": {"matmul_efficiency": "bench/gpu.py, 8192^3 bf16"}}))
    hw = get_hardware(measured=path, gpus=16)
    assert (hw.name, hw.nodes, hw.matmul_efficiency, hw.hbm_efficiency) == ("A100-80GB", 2, 0.7, 0.9)
    assert hw.sources["matmul_efficiency"] == "bench/gpu.py, 8192^3 bf16"
    assert hw.sources["hbm_efficiency"] == f"measured: {path}" and "datasheet" in hw.sources["peak_flops"]
    assert get_hardware("H100-80GB", measured=path).peak_flops == 989e12  # over the preset named
    path.write_text(json.dumps({"matmul_eff": 0.7}))
    with pytest.raises(HardwareError, match="unknown hardware fields"):
        get_hardware(measured=path)
    from colozoo.cli import main

    path.write_text(json.dumps({"preset": "A100-80GB", "matmul_efficiency": 0.123}))
    args = ["plan", "opt-125m", "--gpus", "1", "--seq-len", "128", "--global-batch", "1", "--json", "--top", "1"]
    assert main(args + ["--hardware-file", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["hardware"]["matmul_efficiency"] == 0.123


def test_lora_counts_follow_the_config_not_the_object():
    """A config changed between two calls (hidden 32, then 64) is counted as it is at each call."""
    from colozoo.cost.lora import adapter_params_per_layer
    from colozoo.runtime.lora import LoraSettings

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=64)
    lora = LoraSettings(r=4, targets=("q_proj",))
    assert adapter_params_per_layer(config, 1, lora)["0"] == 4 * (32 + 32)
    config.hidden_size = 64  # the heads keep their head_dim of 8: q_proj maps 64 to 32
    assert adapter_params_per_layer(config, 1, lora)["0"] == 4 * (64 + 32)


def test_apply_plan_refuses_stages_the_model_was_not_built_with():
    """A plan's virtual stages and layer counts are how the model must be built: apply_plan says so, in one line,
    before wrapping anything."""
    from colozoo.api import build_model
    from colozoo.runtime.errors import TrainingError
    from colozoo.runtime.training import apply_plan

    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=16)
    model = build_model(config, device="meta")
    with pytest.raises(TrainingError, match="2 virtual stage"):
        apply_plan(model, Plan(schedule="interleaved_1f1b", virtual_stages=2))
    with pytest.raises(TrainingError, match="layers_per_stage"):
        apply_plan(model, Plan(layers_per_stage=(1,)))


def _gpt2_report(software, dp=2):
    """(report, plan, workload): a tiny bf16 GPT-2, one micro-batch of one sequence, ZeRO-1 over `dp` ranks,
    assembled under `software`."""
    from colozoo.core.mesh import ParallelConfig
    from colozoo.cost.cost_model import assemble
    from colozoo.cost.model_trace import trace_model
    from colozoo.cost.setup import Workload

    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32)
    traced = trace_model(config, 1, 32, ParallelConfig(dp=dp), "bfloat16", "cuda")
    plan, workload = Plan(dp=dp, zero=1, micro_batch_size=1), Workload(seq_len=32)
    return assemble(traced, plan, workload, software), plan, workload


def test_optimizer_states_kept_in_the_softwares_dtype():
    """NeMo's distributed_fused_adam with `dtype: bf16` keeps its master weights and both moments in bf16
    (Software.optimizer_state_bytes = 2): half the fp32 bytes on every rank, the weights and gradients unchanged, and
    the optimizer step reads and writes less. Other widths are refused."""
    from colozoo.cost.step_time import estimate

    (fp32, plan, workload), (bf16, _, _) = (_gpt2_report(Software(optimizer_state_bytes=b)) for b in (4, 2))
    h100 = get_hardware("H100-80GB")
    full, half = fp32.stages[0], bf16.stages[0]
    assert half["master"] == full["master"] / 2 and half["optimizer"] == full["optimizer"] / 2 > 0
    assert (half["weights"], half["grads"]) == (full["weights"], full["grads"]) and half["peak"] < full["peak"]
    steps = [estimate(report, plan, workload, h100, software=Software(optimizer_state_bytes=b))[1]["optimizer"]
             for report, b in ((fp32, 4), (bf16, 2))]
    assert 0 < steps[1] < steps[0]
    with pytest.raises(ValueError, match="optimizer_state_bytes"):
        Software(optimizer_state_bytes=1)


def _gpt2_stage(software, dp=2):
    """Stage 0 of `_gpt2_report`: its states, activations and peak."""
    return _gpt2_report(software, dp)[0].stages[0]


def test_gradients_kept_in_the_buffer_the_software_reduces_them_in():
    """Megatron-Core accumulates a bf16 model's gradients in an fp32 buffer allocated once, whole on every rank
    under its distributed optimizer (Software.grads_in_reduce_dtype): 6 + 12/d bytes a parameter with the fp32 master
    weights and moments sharded over d ranks, as Megatron-LM's docs count them; the buffer is there from the start,
    so one micro-batch's forward already holds it. Without the flag the gradients are the parameters' dtype, and a
    buffer of a half-width reduction is half-width."""
    megatron = Software(grad_reduce_bytes=4, grads_in_reduce_dtype=True)
    buffered, plain = _gpt2_stage(megatron), _gpt2_stage(Software(grad_reduce_bytes=4))
    assert buffered["grads"] == 2 * plain["grads"] > 0 and buffered["weights"] == plain["weights"]
    for d in (2, 4):
        stage = _gpt2_stage(megatron, dp=d)
        states = stage["weights"] + stage["grads"] + stage["master"] + stage["optimizer"]
        assert states / stage["params"] == pytest.approx(6 + 12 / d)
    assert _gpt2_stage(Software(grad_reduce_bytes=2, grads_in_reduce_dtype=True))["grads"] == plain["grads"]
    fused = _gpt2_stage(Software(grad_reduce_bytes=4, grads_in_reduce_dtype=True, wgrad_accumulation_fused=True))
    assert fused["peak"] < buffered["peak"] and fused["grads"] == buffered["grads"]  # no fresh gradient beside it
    # one micro-batch: colozoo's gradients grow through the backward, the buffer is whole before the first forward
    grown = _gpt2_stage(Software(grad_reduce_bytes=4))["peak"] - plain["grads"]
    whole = _gpt2_stage(Software(grad_reduce_bytes=2, grads_in_reduce_dtype=True))["peak"] - plain["grads"]
    assert whole > grown


def test_master_weights_kept_as_the_software_keeps_them():
    """NeMo's distributed_fused_adam keeps no master weights when its states share the model's dtype and only the
    16-bit remainders of fp32 ones beside bf16 parameters (Software.master_weight_bytes 0 and 2); by default they
    take the optimizer states' width. The moments are unchanged; other widths are refused."""
    fp32, remainders, none = (_gpt2_stage(Software(master_weight_bytes=b)) for b in (None, 2, 0))
    assert remainders["master"] == fp32["master"] / 2 > 0 and none["master"] == 0
    assert fp32["optimizer"] == remainders["optimizer"] == none["optimizer"] > 0
    assert _gpt2_stage(Software(optimizer_state_bytes=2))["master"] == remainders["master"]
    with pytest.raises(ValueError, match="master_weight_bytes"):
        Software(master_weight_bytes=1)


def test_an_out_tensor_is_written_not_read():
    """An op writing into out= moves its inputs and its output once each; in place, its operand is read and written;
    a bare allocation launches nothing (what fills it, a kernel or a collective, is priced itself)."""
    import torch

    from colozoo.cost.trace import kernel_of

    a, b, c = (torch.empty(4, 8, device="meta") for _ in range(3))
    nbytes = a.numel() * a.element_size()
    assert kernel_of(torch.ops.aten.sub.out, (a, b), {"out": c}, c, 0).nbytes == 3 * nbytes
    assert kernel_of(torch.ops.aten.sub_.Tensor, (a, b), {}, a, 0).nbytes == 3 * nbytes
    assert kernel_of(torch.ops.aten.empty.memory_format, ((4, 8),), {"device": "meta"}, c, 0) is None
    assert kernel_of(torch.ops.aten.empty_like.default, (a,), {}, c, 0) is None
    assert kernel_of(torch.ops.aten.zeros_like.default, (a,), {}, c, 0) is not None  # a fill kernel runs
