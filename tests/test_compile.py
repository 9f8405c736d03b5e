"""compile=True: every transformer layer runs torch.compile'd and gives the logits, loss and gradients of the same
model run eagerly, at tp 1 and tp 2 with sequence parallelism, with activation checkpointing, with FSDP2 over dp 2 and
pp 2; `colozoo finetune --compile` trains. Compiling is slow on two cores: the configs are tiny, inductor's cache lives
in the temp dir (a second run reuses the compiled kernels) and inductor runs only where it is what is tested."""
import os
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402
from parity import GRAD_ATOL, LOGITS_ATOL, batch, close, hf_causal_lm  # noqa: E402

CACHE = os.path.join(tempfile.gettempdir(), "colozoo-inductor")
TIMEOUT = 600
LLAMA = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0)
MIXTRAL = dict(vocab_size=101, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
               pad_token_id=0, output_router_logits=True, router_aux_loss_coef=0.05)
GPT2 = dict(vocab_size=101, n_positions=32, n_embd=64, n_layer=2, n_head=4)


def _build(config, reader, parallel, compile, data_parallel, checkpointing, backend="inductor"):
    from colozoo.api import build_model
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.runtime.compile import compile_layers
    from colozoo.runtime.parallelize import parallelize

    model = build_model(config, parallel=parallel, device="meta")
    load_hf_weights(model, reader, device="cpu")
    parallelize(model, data_parallel=data_parallel, activation_checkpointing=checkpointing,
                compile=compile and backend == "inductor")
    if compile and backend != "inductor":
        compile_layers(model, backend=backend)
    return model.eval()  # no dropout: inductor draws its own random numbers


def _saved(hf, directory):
    """What transformers' save_pretrained writes (MoE experts are stored per expert, not as they sit in memory)."""
    from colozoo.checkpoint.safetensors_io import SafetensorsReader

    hf.save_pretrained(directory)
    return SafetensorsReader(directory)


def _step(model, ids, mask, labels, microbatches):
    """(loss, gradients, sequence length of every layer input) of one training step."""
    calls = []
    hooks = [layer.register_forward_pre_hook(lambda m, args: calls.append(args[0].shape[1]))
             for layer in model.layers.values()]
    loss = model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=microbatches)
    for hook in hooks:
        hook.remove()
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in model.named_parameters()}
    return loss, grads, calls


def compiled_parity(model_type: str, config_kwargs: dict, tp: int = 1, sequence_parallel: bool = False, dp: int = 1,
                    pp: int = 1, checkpointing: str | None = None, seq_len: int = 12, one_graph: bool = True,
                    backend: str = "inductor"):
    """The compiled model's logits, loss and gradients equal the eager model's; the layers really ran compiled
    (dynamo captured one graph, with no break at the collectives, and it served every layer)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", CACHE)
    from torch._dynamo.utils import counters

    from colozoo.checkpoint.readers import StateDictReader
    from colozoo.core.mesh import init_parallel
    from colozoo.runtime.compile import is_compiled

    parallel = init_parallel(tp=tp, dp=dp, pp=pp, sequence_parallel=sequence_parallel)
    config, hf = hf_causal_lm(model_type, config_kwargs)
    ids, mask, labels = batch(config.vocab_size, seq_len)
    data_parallel = "fsdp"
    with tempfile.TemporaryDirectory() as directory:  # MoE experts: read as saved (one rank here), not as in memory
        reader = _saved(hf, directory) if "num_local_experts" in config_kwargs else StateDictReader(hf.state_dict())
        eager = _build(config, reader, parallel, False, data_parallel, checkpointing)
        compiled = _build(config, reader, parallel, True, data_parallel, checkpointing, backend)
    assert all(is_compiled(layer) for layer in compiled.layers.values())
    assert not any(is_compiled(layer) for layer in eager.layers.values())
    expected, expected_grads, eager_calls = _step(eager, ids, mask, labels, pp)
    torch._dynamo.reset()  # the graphs of this test only, whatever compiled before in this process
    counters.clear()
    loss, grads, calls = _step(compiled, ids, mask, labels, pp)
    graphs = counters["stats"]["unique_graphs"]
    # one graph for every layer, tp / sp collectives inside it (dynamo traces them as functional collectives); MoE
    # routing (tokens per expert) is data-dependent: the graph breaks there
    assert graphs == 1 if one_graph else graphs > 1, f"{graphs} graphs for {len(compiled.layers)} layers"
    # checkpointed layers run forward again in backward (through the compiled body); sequence parallel: seq / tp
    assert calls == eager_calls, (calls, eager_calls)
    assert len(calls) == len(compiled.layers) * pp * (2 if checkpointing else 1)  # pp: as many micro-batches
    assert set(calls) == {seq_len // tp if sequence_parallel else seq_len}
    close(loss, expected, LOGITS_ATOL, "loss")
    for name, grad in grads.items():
        close(grad, expected_grads[name], GRAD_ATOL, f"gradient of {name}")
    keep = mask.bool()
    with torch.no_grad():
        logits = compiled(ids, attention_mask=mask, return_logits=True).logits
        close(logits[keep], eager(ids, attention_mask=mask, return_logits=True).logits[keep], LOGITS_ATOL, "logits")
    return graphs


# Inductor (and the C++ compiler behind it on CPU) runs where it is the part under test: one layer at tp 1 with
# activation checkpointing, one at tp 2 with sequence parallelism (its collectives lowered), and `finetune --compile`
# below, about two minutes on two cores with a cold cache. The other meshes check what they add, that dynamo captures
# the layer whole around their collectives and AOT autograd gives eager's numbers, without inductor (aot_eager).
def test_compile_llama_tp1_activation_checkpointing():
    compiled_parity("llama", LLAMA, checkpointing="full")


@pytest.mark.parametrize("model_type,config,backend", [("llama", LLAMA, "aot_eager"), ("gpt2", GPT2, "inductor")])
def test_compile_tp2_sequence_parallel(model_type, config, backend):
    run_distributed(compiled_parity, 2, model_type=model_type, config_kwargs=config, tp=2, sequence_parallel=True,
                    backend=backend, timeout=TIMEOUT)


def test_compile_gpt2_fsdp_dp2():
    run_distributed(compiled_parity, 2, model_type="gpt2", config_kwargs=GPT2, dp=2, backend="aot_eager",
                    timeout=TIMEOUT)


def test_compile_llama_pipeline_pp2():
    run_distributed(compiled_parity, 2, model_type="llama", config_kwargs=LLAMA, pp=2, backend="aot_eager",
                    timeout=TIMEOUT)


def test_compile_mixtral_moe():
    """MoE routing breaks the graph (bincount, per-expert token counts): ~15 graphs, minutes of inductor on two cores,
    so dynamo's graphs run through AOT autograd without inductor here; same numbers as eager."""
    compiled_parity("mixtral", MIXTRAL, one_graph=False, backend="aot_eager")


def test_compile_refuses_interpreted_triton_kernels(tmp_path):
    from colozoo.kernels import interpreting, use_kernels
    from colozoo.runtime.compile import compile_layers
    from colozoo.runtime.errors import TrainingError

    if not interpreting():
        pytest.skip("triton does not run on its CPU interpreter here")
    config, hf = hf_causal_lm("llama", LLAMA)
    model = _build(config, _saved(hf, tmp_path), None, False, "fsdp", None)
    with use_kernels("triton"), pytest.raises(TrainingError, match="TRITON_INTERPRET"):
        compile_layers(model)
    assert not model.run.compiled


def test_compile_generation_decodes_eagerly():
    """generate() on a compiled model: the KV-cache steps run the layers eagerly (nothing compiles), same tokens."""
    from torch._dynamo.utils import counters

    from colozoo.api import build_model
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.readers import StateDictReader

    config, hf = hf_causal_lm("gpt2", GPT2)
    models = []
    for compile in (False, True):
        model = build_model(config, device="meta", compile=compile)
        load_hf_weights(model, StateDictReader(hf.state_dict()), device="cpu")
        models.append(model.eval())
    ids = batch(config.vocab_size, 6, padded=False)[0]
    counters.clear()
    tokens = [model.generate(ids, max_new_tokens=4) for model in models]
    assert torch.equal(tokens[0], tokens[1]) and not counters["stats"]["unique_graphs"]
    assert models[1].run.compiled


def test_finetune_compile_trains_like_eager(tmp_path, monkeypatch):
    """`colozoo finetune --compile` trains a few steps with compiled layers (evaluation and the greedy samples
    included, which decode eagerly) and its loss curve is the eager run's."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", CACHE)
    from torch._dynamo.utils import counters

    from colozoo.demo_finetune import make_tiny_gpt2
    from colozoo.finetune import main, runtime
    from colozoo.finetune.metrics import read_metrics
    from colozoo.runtime.compile import is_compiled

    model = make_tiny_gpt2(tmp_path / "gpt2", n_layer=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                           attn_pdrop=0.0)
    data = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "stories.jsonl")
    seen = []
    prepare = runtime.prepare_training

    def watched(model, cfg):
        step = prepare(model, cfg)
        seen.append(all(is_compiled(layer) for layer in model.layers.values()))
        return step

    monkeypatch.setattr(runtime, "prepare_training", watched)
    curves, graphs = {}, {}
    for flag in ("--compile", "--no-compile"):
        counters.clear()
        out = tmp_path / flag
        assert main(["--model", str(model), "--data", data, "--output", str(out), "--seq-len", "16", "--steps", "4",
                     "--micro-batch-size", "2", "--lr", "1e-2", "--warmup-steps", "1", "--eval-batches", "1",
                     "--samples", "1", "--sample-tokens", "4", "--no-progress", "--no-plot", "--no-export-hf",
                     flag], task="lm") == 0
        curves[flag] = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
        graphs[flag] = counters["stats"]["unique_graphs"]
    assert seen == [True, False] and graphs["--compile"] >= 1 and graphs["--no-compile"] == 0, graphs
    assert len(curves["--compile"]) == 4 and curves["--compile"][-1] < curves["--compile"][0]
    close(torch.tensor(curves["--compile"]), torch.tensor(curves["--no-compile"]), 1e-4, "loss curves")
