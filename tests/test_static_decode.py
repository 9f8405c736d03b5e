"""The static decode step (colozoo.runtime.static_decode), what CUDA graphs replay on a GPU, checked on the CPU: dynamo
compiles it whole (fullgraph=True, dynamic=False: no graph break, no host sync) and never again over 64 steps, at tp 1
and tp 2 (gloo: the collectives captured as functional ones), its tokens the eager loop's and transformers'; through
generate(cache_implementation="static") every option equals transformers' (scores, logits, eos lists, lengths,
repetition penalty, stop strings in test_generate_surface) and sampling, streaming and early ends the eager loop's;
MLA decodes over its latent cache; which calls take which path."""
import dataclasses

import pytest
import torch
import transformers

from distributed import run_distributed
from test_deepseek_v3 import DENSE as DEEPSEEK
from test_generate import FAMILIES, ours_and_hf, prompts
from test_generate_surface import greedy_options_match_transformers

from colozoo.core.mesh import init_parallel, single_process

TIMEOUT = 180
STEPS = 64
LLAMA = dict(FAMILIES["llama"], max_position_embeddings=128)
GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
STATIC_FAMILIES = {**FAMILIES, "deepseek_v3": dict(DEEPSEEK, first_k_dense_replace=2)}


def compiled_steps(tp: int = 1, family: str = "llama", config=LLAMA, steps: int = STEPS):
    """Greedy steps of the step compiled by dynamo (backend "eager": the capture is what is tested, and the cheapest
    backend that proves it) with a recompilation an error; (the tokens, and generate's on the static step, equal
    transformers', the tokens equal the eager loop's, dynamo's graph count, its graph breaks)."""
    from torch._dynamo.utils import counters

    from colozoo.layers.vocab import LogitsRequest
    from colozoo.runtime.static_decode import StaticStep, decode_step

    parallel = init_parallel(tp=tp) if tp > 1 else single_process()
    config, hf, model = ours_and_hf(family, parallel, config, "eager" if family == "gemma2" else "sdpa")
    ids, mask = prompts(config.vocab_size)
    options = dict(GREEDY, max_new_tokens=steps + 1)
    expected = hf.generate(ids, attention_mask=mask, **options)
    eager = model.generate(ids, attention_mask=mask, **options)
    step = StaticStep(model, mask, ids.shape[1] + steps + 1, LogitsRequest("full", 1))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(decode_step, fullgraph=True, dynamic=False, backend="eager")
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True, recompile_limit=1):
        logits, tokens = step.prefill(ids, mask), []
        for _ in range(steps):
            tokens.append(logits.argmax(dim=-1))
            step.tokens.copy_(tokens[-1][:, None])
            logits = compiled(model, step.cache, step.tokens, step.positions, step.logits)
        tokens.append(logits.argmax(dim=-1))
    got = torch.cat([ids, torch.stack(tokens, dim=1)], dim=1)
    static = model.generate(ids, attention_mask=mask, cache_implementation="static", **options)  # tp: sharded argmax
    return (torch.equal(got, expected) and torch.equal(static, expected), torch.equal(got, eager),
            counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))


def test_the_step_compiles_whole_once_and_gives_transformers_tokens():
    assert compiled_steps() == (True, True, 1, 0)


def test_the_step_compiles_whole_at_tp2():
    assert run_distributed(compiled_steps, 2, tp=2, timeout=TIMEOUT) == [(True, True, 1, 0)] * 2


@pytest.mark.parametrize("family", ["gpt2", "mistral", "gemma2", "qwen3", "deepseek_v3"])
def test_every_family_of_the_static_step_compiles_whole(family):
    """What a CUDA graph needs of each (no host sync, no value-dependent branch), a few steps each: learned positions,
    a window's ring, capped scores with windows, q/k norms, MLA's absorbed decoding."""
    assert compiled_steps(family=family, config=STATIC_FAMILIES[family], steps=3) == (True, True, 1, 0)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_static_step_options_equal_transformers(family):
    """A sliding window's ring (mistral), capped scores and windows on every other layer (gemma2): tokens, every
    step's scores and logits, eos lists, lengths, repetition penalty."""
    assert greedy_options_match_transformers(family, cache_implementation="static")


class Recorder:
    """transformers' streamer calls, kept."""

    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(value.tolist())

    def end(self):
        self.calls.append("end")


def test_sampling_streaming_and_early_ends_equal_the_eager_loop():
    """Seeded sampling through every processor, rows that end early (padded after, the call cut where all ended,
    between two of the host's looks), and a streamer's calls: the static step's are the eager loop's."""
    config, hf, model = ours_and_hf("llama", single_process(), LLAMA)
    ids, mask = prompts(config.vocab_size)
    sampled = dict(do_sample=True, temperature=0.7, top_k=30, top_p=0.95, min_p=0.05, repetition_penalty=1.2, seed=3,
                   max_new_tokens=20, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    free = model.generate(ids, attention_mask=mask, eos_token_id=None, **sampled).sequences[:, ids.shape[1]:]
    eos = [int(free[0, 2]), int(free[1, 4]), int(free[2, 3])]  # every row ends (or stops at another row's token)
    runs = {}
    for cache in ("dynamic", "static"):
        streamer = Recorder()
        out = model.generate(ids, attention_mask=mask, eos_token_id=eos, streamer=streamer, cache_implementation=cache,
                             **sampled)
        quiet = model.generate(ids, attention_mask=mask, eos_token_id=eos, cache_implementation=cache, **sampled)
        runs[cache] = out, quiet, streamer.calls
    (eager, eager_quiet, eager_calls), (static, static_quiet, static_calls) = runs["dynamic"], runs["static"]
    assert eager.decode_path == "eager" and static.decode_path == "static"
    assert eager.sequences.shape[1] < ids.shape[1] + 8, "the rows should all have ended within 8 steps"
    for got in (static.sequences, static_quiet.sequences, eager_quiet.sequences):
        assert torch.equal(got, eager.sequences), f"\nstatic {got}\neager  {eager.sequences}"
    assert static_calls == eager_calls
    assert len(static.scores) == len(eager.scores) == eager.sequences.shape[1] - ids.shape[1]
    for ours, theirs in zip(static.scores, eager.scores):  # attention over more (masked) keys rounds elsewhere
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_unwritten_cache_slots_cannot_poison_a_step(monkeypatch):
    """A step attends over every slot: slots not written yet hold zeros, never what the memory held (NaN here)."""
    config, hf, model = ours_and_hf("llama", single_process(), LLAMA)
    ids, mask = prompts(config.vocab_size)
    expected = hf.generate(ids, attention_mask=mask, max_new_tokens=4, **GREEDY)
    empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda t, *shape, **kw: empty(t, *shape, **kw).fill_(float("nan")))
    got = model.generate(ids, attention_mask=mask, max_new_tokens=4, cache_implementation="static", **GREEDY)
    assert torch.equal(got, expected)


def test_mla_decodes_over_its_latent_cache():
    """DeepSeek-V3's attention (dense layers): the static step reads the latent cache with the up-projections
    absorbed (kv_b_proj runs in the prefill only), tokens and logits as transformers'."""
    from parity import close

    config, hf, model = ours_and_hf("deepseek_v3", single_process(), dict(DEEPSEEK, num_hidden_layers=3,
                                                                             first_k_dense_replace=3))
    ids, mask = prompts(config.vocab_size)
    options = dict(GREEDY, max_new_tokens=6, return_dict_in_generate=True, output_logits=True)
    expansions = []
    for layer in model.layers.values():
        layer.self_attn.kv_b_proj.register_forward_pre_hook(lambda m, args: expansions.append(args[0].shape[1]))
    out = model.generate(ids, attention_mask=mask, cache_implementation="static", **options)
    ref = hf.generate(ids, attention_mask=mask, **options)
    assert out.decode_path == "static" and torch.equal(out.sequences, ref.sequences)
    for step, (ours, theirs) in enumerate(zip(out.logits, ref.logits, strict=True)):
        close(ours, theirs, 1e-5, f"logits of step {step}")
    assert expansions == [ids.shape[1]] * config.num_hidden_layers


def test_which_calls_take_which_path():
    from colozoo.runtime.generation_config import resolve
    from colozoo.runtime.static_decode import decode_path

    config, hf, model = ours_and_hf("llama", single_process(), LLAMA)
    decoding = resolve(model, 9, max_new_tokens=4)
    assert decode_path(model, decoding) == ("eager", "not on CUDA")
    static = dataclasses.replace(decoding, cache_implementation="static")
    assert decode_path(model, static) == ("static", None)
    assert decode_path(model, dataclasses.replace(static, disable_compile=True)) == ("static", None)
    assert decode_path(model, dataclasses.replace(decoding, cache_implementation="dynamic"))[0] == "eager"
    ids, mask = prompts(config.vocab_size)
    with pytest.raises(ValueError, match="beam search reorders its cache"):
        model.generate(ids, attention_mask=mask, num_beams=2, max_new_tokens=2, cache_implementation="static")
    with pytest.raises(ValueError, match="cache_implementation='offloaded' is not implemented"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, cache_implementation="offloaded")
    compile_config = transformers.CompileConfig(backend="eager", fullgraph=True, dynamic=False)
    compiled = model.generate(ids, attention_mask=mask, max_new_tokens=3, cache_implementation="static",
                              compile_config=compile_config, return_dict_in_generate=True, **GREEDY)
    assert compiled.decode_path == "compiled"
    assert torch.equal(compiled.sequences, model.generate(ids, attention_mask=mask, max_new_tokens=3, **GREEDY))
    assert "micro-batches" in decode_path(model, decoding, num_microbatches=2)[1]
    model.train()
    assert "training mode" in decode_path(model, decoding)[1]
    model.eval()
    head = model.lm_head.weight
    model.lm_head.weight = torch.nn.Parameter(head.to("meta"))  # a weight elsewhere (offloaded)
    assert "offloaded" in decode_path(model, decoding)[1]
    model.lm_head.weight = head
    mixtral = ours_and_hf("mixtral", single_process())[2]
    with pytest.raises(ValueError, match="mixture-of-experts layers read"):
        decode_path(mixtral, dataclasses.replace(decoding, cache_implementation="static"))


class HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that read a tensor's value back to the host (on CUDA, a wait for the device each): torch's
    multinomial too, which checks the probabilities' range on the host before it draws (sampling.draw does not)."""

    READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.multinomial.default)

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


def test_the_static_loop_reads_nothing_back_per_token():
    """16 more tokens read no value back to the host without an eos id (sampled through every processor), and one per
    8 steps with one; the eager loop reads at every step (what tests/test_gpu.py counts, on a GPU, as waits for the
    device with torch's sync debug mode)."""
    config, hf, model = ours_and_hf("llama", single_process(), LLAMA)
    ids, mask = prompts(config.vocab_size)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=20, **GREEDY)
    never = dict(GREEDY, eos_token_id=next(i for i in range(config.vocab_size) if i not in free))
    sampled = dict(GREEDY, do_sample=True, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
                   seed=1)

    def more_reads(**options):
        counts = []
        for new in (4, 20):
            with HostReads() as mode:
                model.generate(ids, attention_mask=mask, max_new_tokens=new, **options)
            counts.append(mode.count)
        return counts[1] - counts[0]

    assert more_reads(cache_implementation="static", **sampled) == 0
    assert more_reads(cache_implementation="static", **never) <= 2
    assert more_reads(**never) >= 16, "the eager loop reads at every step"
