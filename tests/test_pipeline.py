"""Stage placement (partitioner, virtual stages, global names) and the eval forward through the pipeline,
against transformers' logits and loss on every rank."""
import pytest
import torch
from transformers import GPT2Config

from distributed import run_distributed
from parity import LOGITS_ATOL, batch, close, hf_causal_lm

from colozoo.checkpoint.load import load_hf_weights
from colozoo.checkpoint.readers import StateDictReader
from colozoo.api import build_model
from colozoo.core.mesh import init_parallel
from colozoo.core.partition import PartitionError, rank_layers, stage_layers, virtual_stage_layers
from colozoo.models.partition import layer_cost, model_stage_layers
from colozoo.runtime.pipeline import PipelineError, schedule_name, stages_of
from colozoo.runtime.stage import layer_runs
from colozoo.runtime.training import parallelize

CONFIG = dict(vocab_size=101, n_positions=32, n_embd=64, n_layer=4, n_head=4,
              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
TIMEOUT = 150


def test_explicit_layers_per_stage():
    assert stage_layers(6, 3, layers_per_stage=[1, 3, 2]) == [[0], [1, 2, 3], [4, 5]]
    for bad in ([1, 3], [2, 2, 1], [0, 3, 3]):
        with pytest.raises(PartitionError, match="layers_per_stage"):
            stage_layers(6, 3, layers_per_stage=bad)
    with pytest.raises(PartitionError, match="at least one layer"):
        stage_layers(2, 3)


def test_balance_moves_layers_off_the_embedding_and_head_stages():
    config = GPT2Config(n_layer=12, n_embd=768, vocab_size=50257)
    by_params = [run for (run,) in model_stage_layers(config, 4, balance="params")]
    by_flops = [run for (run,) in model_stage_layers(config, 4, balance="flops", seq_len=1024)]
    assert sum(map(len, by_params)) == 12 and len(by_params[0]) < 3 and len(by_params[-1]) < 3
    assert len(by_flops[0]) > len(by_flops[-1])  # a lookup is free, the head is a matmul
    first, last = layer_cost(config, "params")[1:]
    assert 5 < first < 6 and 5 < last < 6  # 50257 x 768 embedding vs 7.1M per layer
    with pytest.raises(PartitionError, match="balance"):
        layer_cost(config, "bytes")


def test_models_are_balanced_by_default_and_take_layers_per_stage():
    from colozoo.core.mesh import ParallelContext

    config = GPT2Config(n_layer=12, n_embd=64, n_head=4, vocab_size=5000, n_positions=32)  # embedding ~ 6.5 layers

    def layers(pp, **partition):
        return [build_model(config, parallel=ParallelContext.virtual(pp=pp, pp_rank=r), device="meta",
                            **partition).layer_ids
                for r in range(pp)]

    balanced = [run for (run,) in model_stage_layers(config, 3)]
    assert layers(3) == balanced and len(balanced[0]) < 4 and len(balanced[2]) < 4  # tied: a copy on the last
    assert layers(3, balance="layers") == [list(range(4)), list(range(4, 8)), list(range(8, 12))]
    assert layers(3, balance="flops") == [run for (run,) in model_stage_layers(config, 3, balance="flops")]
    assert layers(3, layers_per_stage=[2, 6, 4]) == [[0, 1], list(range(2, 8)), list(range(8, 12))]
    assert layers(1) == [list(range(12))]
    with pytest.raises(PartitionError, match="balance"):
        layers(2, balance="bytes")
    with pytest.raises(ValueError, match="either layer_ids or layers_per_stage"):
        build_model(config, parallel=ParallelContext.virtual(pp=2), layer_ids=[0], layers_per_stage=[6, 6],
                    device="meta")


def test_virtual_stages_are_looped_over_ranks():
    assert virtual_stage_layers(8, 2, 2) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert rank_layers(8, 2, 1, virtual_stages=2) == [2, 3, 6, 7]
    assert layer_runs([2, 3, 6, 7]) == [[2, 3], [6, 7]]
    config = GPT2Config(n_layer=8)
    assert model_stage_layers(config, 2, 2, layers_per_stage=[1, 3, 3, 1]) == [[[0], [4, 5, 6]], [[1, 2, 3], [7]]]


def test_schedule_names():
    assert [schedule_name(n) for n in ("GPipe", "1F1B", "Interleaved1F1B", "interleaved-1f1b", "ZB1P")] == [
        "gpipe", "1f1b", "interleaved_1f1b", "interleaved_1f1b", "zero_bubble"]
    with pytest.raises(PipelineError, match="unknown pipeline schedule"):
        schedule_name("looped_bfs")


def load(parallel, config, hf, virtual_stages=1):
    layer_ids = rank_layers(config.num_hidden_layers, parallel.config.pp, parallel.rank("pp"), virtual_stages)
    model = build_model(config, parallel=parallel, layer_ids=layer_ids, device="meta")
    return load_hf_weights(model, StateDictReader(hf.state_dict()), device="cpu").eval()


def eval_parity(pp, tp, sp=False, virtual_stages=1, dp=1, parallel=None):
    """model(...) through the pipeline: full logits and loss on every rank equal transformers'."""
    parallel_context = init_parallel(pp=pp, tp=tp, dp=dp, sequence_parallel=sp)
    config, hf = hf_causal_lm("gpt2", CONFIG)
    model = load(parallel_context, config, hf, virtual_stages)
    if parallel is not None:
        parallelize(model, **parallel)
    ids, mask, labels = batch(config.vocab_size, 12)
    with torch.no_grad():  # with labels under gradients a pipeline refuses: that step is forward_backward
        out = model(ids, attention_mask=mask, labels=labels)
    with pytest.raises(RuntimeError, match="forward_backward"):
        model(ids, attention_mask=mask, labels=labels)
    ref = hf(ids, attention_mask=mask, labels=labels)
    keep = mask.bool()
    assert out.logits.shape == ref.logits.shape
    close(out.logits[keep], ref.logits[keep], LOGITS_ATOL, "logits")
    close(out.loss, ref.loss, LOGITS_ATOL, "loss")
    plain = model(ids)
    assert plain.loss is None and plain.logits.shape == ref.logits.shape  # logits whenever no labels are given
    stage_names = [{n for n, _ in stage.named_parameters()} for stage in stages_of(model)]
    owned = {id(p) for stage in stages_of(model) for p in stage.parameters()}
    assert owned == {id(p) for p in model.parameters()}, "stages must own exactly the model's parameters"
    return dict(names=sorted(n for n, _ in model.named_parameters()), stages=len(stage_names))


@pytest.mark.parametrize("pp,tp,sp,virtual", [(2, 1, False, 1), (2, 2, True, 1), (4, 1, False, 1), (2, 1, False, 2)])
def test_eval_forward_through_the_pipeline(pp, tp, sp, virtual):
    results = run_distributed(eval_parity, pp * tp, pp=pp, tp=tp, sp=sp, virtual_stages=virtual, timeout=TIMEOUT)
    assert {r["stages"] for r in results} == {virtual}
    first, last = results[0]["names"], results[-1]["names"]
    assert "wpe.weight" in first and "ln_f.weight" not in first
    assert "ln_f.weight" in last and "wte.weight" in last  # the last stage's copy of the tied embedding
    layers = {n.split(".")[1] for r in results for n in r["names"] if n.startswith("layers.")}
    assert layers == {"0", "1", "2", "3"}  # global layer names across the stages


def test_eval_forward_after_fsdp_wrapping():
    run_distributed(eval_parity, 4, pp=2, tp=1, sp=False, virtual_stages=1, dp=2, parallel=dict(data_parallel="fsdp"),
                    timeout=TIMEOUT)


def bad_schedules():
    parallel = init_parallel(pp=2)
    config, hf = hf_causal_lm("gpt2", CONFIG)
    ids, mask, labels = batch(config.vocab_size, 12, batch_size=4)
    model = load(parallel, config, hf, virtual_stages=2)
    with pytest.raises(PipelineError, match="unknown pipeline schedule .dualpipe."):
        model.forward_backward(ids, labels, num_microbatches=2, schedule="dualpipe")
    with pytest.raises(PipelineError, match="virtual stages per rank"):
        model.forward_backward(ids, labels, num_microbatches=2, schedule="1f1b")
    single = load(parallel, config, hf)
    with pytest.raises(PipelineError, match="at least as many micro-batches"):
        single.forward_backward(ids, labels, num_microbatches=1, schedule="1f1b")
    return True


def test_bad_schedules_are_clear_errors():
    assert all(run_distributed(bad_schedules, 2, timeout=TIMEOUT))


def uneven_virtual_stages():
    parallel = init_parallel(pp=2)
    config, _ = hf_causal_lm("gpt2", CONFIG)
    layer_ids = [0, 2, 3] if parallel.rank("pp") == 0 else [1]  # two contiguous runs on one rank, one on the other
    with pytest.raises(PipelineError, match="same number of virtual stages"):  # the run builds the stages
        build_model(config, parallel=parallel, layer_ids=layer_ids, device="meta")
    with pytest.raises(PipelineError, match="not in stage order"):
        build_model(config, parallel=parallel, layer_ids=[2, 3] if parallel.rank("pp") == 0 else [0, 1], device="meta")
    return True


def test_misplaced_layers_are_a_clear_error():
    assert all(run_distributed(uneven_virtual_stages, 2, timeout=TIMEOUT))


@pytest.mark.parametrize("name", ["gemma-3-4b-text", "gemma-2-27b", "Qwen3-8B", "Qwen3-30B-A3B", "Llama-3.1-8B",
                                  "pythia-1b", "DeepSeek-V3"])
def test_layer_cost_equals_the_built_model(name):
    """The balance's costs against the model: by parameters, a layer against the first stage's embedding and the
    last stage's head (Gemma and Qwen3: heads x head_dim != hidden; grouped kv heads; Qwen3-MoE's router; DeepSeek-V3's
    latent attention, shared expert and first dense layers, as the mean layer); by FLOPs, the profiler's traced layers
    (their mean forward) against its head's three matmuls over three (the fused head takes them all in the forward)."""
    from colozoo.core.mesh import ParallelContext
    from colozoo.cost.profiler import profile_for
    from colozoo.models import build_shard
    from colozoo.registry import get_config

    config = get_config(name)
    stages = [build_shard(config, parallel=ParallelContext.virtual(pp=2, pp_rank=r), device="meta") for r in range(2)]

    def count(model, in_layers: bool):
        return sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.") == in_layers)

    layer = sum(count(stage, True) for stage in stages) / config.num_hidden_layers
    _, first, last = layer_cost(config, "params")
    assert first == pytest.approx(count(stages[0], False) / layer, rel=1e-3)
    assert last == pytest.approx(count(stages[1], False) / layer, rel=1e-3)  # the head (a tied copy) and the norm
    report = profile_for(name, batch_size=1, seq_len=256, optimizer="none")  # bf16: MoE experts run torch._grouped_mm
    layers = [u for u in report.units if u["name"].startswith("layer")]
    mean = sum(u["count"] * u["fwd_flops"] for u in layers) / sum(u["count"] for u in layers)
    head = next(u for u in report.units if u["name"] == "head")
    measured = (head["fwd_flops"] + head["bwd_flops"]) / 3 / mean
    assert layer_cost(config, "flops", seq_len=256)[2] == pytest.approx(measured, rel=1e-3)
