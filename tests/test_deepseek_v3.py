"""DeepSeek-V3 beyond the family table (tests/test_family_table.py: the declared config, MLA in every layer, layer 0
dense and 1-2 DeepSeekMoE, on one process, tp2 with sequence parallelism, ep 2, pp2 x tp2 and cp 2 ring; round trips,
generation, LoRA): every layer dense at tp 2 and 4, a variant with an uncompressed query, cp2 x tp2 all-to-all, a
clipped AdamW step under FSDP (dp2 x tp2); DeepSeekMoE (sigmoid routing with a bias that changes the choice,
group-limited top-k, routed scaling, an ungated shared expert) on one process with another routing, at tp 2 without
sequence parallelism, tp2 x ep2, with an idle ep rank, cp2 x tp2 x ep2, pp 2 and pp2 x ep2, FSDP with ep 1 and 2; the
latent cache; the registry's sizes against transformers'.

The declared config keeps every feature of the published model: compressed queries (q_lora_rank) and keys/values
(kv_lora_rank) with their norms, a decoupled rotary key in interleaved pairs (rope_interleave), values narrower than
queries and keys (v_head_dim), YaRN with an mscale_all_dim (the softmax scale times mscale ** 2, transformers'
quirk, and cos/sin times mscale / mscale_all_dim). A variant has an uncompressed query (q_proj), biases on the
compressions and o_proj, and rotary features in halves."""
import pytest

from distributed import run_distributed
from family_cases import tiny_kwargs
from parity import batch, causal_lm_parity

TIMEOUT = 300
MOE = tiny_kwargs("deepseek_v3")  # layer 0 dense, 1 and 2 DeepSeekMoE
DENSE = {**MOE, "num_hidden_layers": 2, "first_k_dense_replace": 2}
VARIANT = dict(q_lora_rank=None, attention_bias=True, rope_interleave=False, tie_word_embeddings=True)
WIDE = dict(num_attention_heads=8, num_key_value_heads=8)


def test_single_process_variant():
    causal_lm_parity("deepseek_v3", {**DENSE, **VARIANT})


@pytest.mark.parametrize("tp,sp,wide", [(2, False, False), (4, True, False), (4, False, True)])
def test_tensor_parallel(tp, sp, wide):
    """tp 4 over 4 heads: one head a rank; the compressions replicated, their gradients whole on every rank."""
    run_distributed(causal_lm_parity, tp, model_type="deepseek_v3", config_kwargs={**DENSE, **(WIDE if wide else {})},
                    tp=tp, sequence_parallel=sp, timeout=TIMEOUT)


def test_tensor_parallel_variant():
    run_distributed(causal_lm_parity, 2, model_type="deepseek_v3", config_kwargs={**DENSE, **VARIANT}, tp=2,
                    sequence_parallel=True, timeout=TIMEOUT)


def test_context_parallel_all_to_all_tp2():
    from test_context_parallel import cp_parity

    run_distributed(cp_parity, 4, tp=2, cp=2, mode="all_to_all", sequence_parallel=True, family="deepseek_v3",
                    overrides=DENSE, timeout=TIMEOUT)


@pytest.mark.parametrize("config,ep", [("dense", 1), ("moe", 1), ("moe", 2)])
def test_fsdp_training_step(config, ep):
    """dp2 x tp2 under FSDP, 2 micro-batches: loss, clipped gradients and parameters after one AdamW step; with MoE
    layers the routing bias stays frozen (no gradient, not in the norm, unchanged by the step)."""
    from test_qwen import training_step

    run_distributed(training_step, 4, family="deepseek_v3", config=DENSE if config == "dense" else MOE, dp=2, tp=2,
                    ep=ep, microbatches=2, options=dict(data_parallel="fsdp"), timeout=TIMEOUT)


def split_after_compressions(sp: bool):
    """At tp 2: the compressions and their norms are whole on every rank (no shard spec) and, under sequence
    parallelism, see only the rank's half of the positions; q_b_proj / kv_b_proj / o_proj hold half the heads; after a
    backward every rank holds the same whole gradient of the replicated weights."""
    import torch
    import torch.distributed as dist

    from colozoo.api import build_model
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.readers import StateDictReader
    from colozoo.core.mesh import init_parallel
    from colozoo.layers.shard import spec_of
    from parity import hf_causal_lm

    parallel = init_parallel(tp=2, sequence_parallel=sp)
    config, hf = hf_causal_lm("deepseek_v3", DENSE)
    model = build_model(config, parallel=parallel, device="meta")
    load_hf_weights(model, StateDictReader(hf.state_dict()), device="cpu")
    attn = model.layers["0"].self_attn
    replicated = (attn.q_a_proj.weight, attn.q_a_layernorm.weight, attn.kv_a_proj_with_mqa.weight,
                  attn.kv_a_layernorm.weight)
    assert all(not spec_of(p) for p in replicated)
    assert attn.q_a_proj.weight.shape == (24, 64) and attn.kv_a_proj_with_mqa.weight.shape == (16 + 8, 64)
    assert attn.q_b_proj.weight.shape == (2 * 20, 24) and attn.kv_b_proj.weight.shape == (2 * (12 + 10), 16)
    assert attn.o_proj.weight.shape == (64, 2 * 10)
    seen = []
    hook = attn.kv_a_proj_with_mqa.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    ids, mask, labels = batch(config.vocab_size, 12)
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    hook.remove()
    assert seen == [6 if sp else 12]
    for p in replicated:
        other = [torch.empty_like(p.grad) for _ in range(2)]
        dist.all_gather(other, p.grad)
        assert p.grad.abs().sum() > 0 and torch.equal(other[0], other[1])
    return seen


@pytest.mark.parametrize("sp", [False, True])
def test_heads_split_after_the_compressions(sp):
    run_distributed(split_after_compressions, 2, sp=sp, timeout=TIMEOUT)


# --- DeepSeekMoE ------------------------------------------------------------------------------------------------

def hf_moe(config_kwargs, bias=None):
    """transformers' tiny model with a routing bias that changes the experts chosen (0.5 apart, on scores in (0, 1)),
    or `bias` (a list, one value per expert) in every MoE layer."""
    import torch

    from parity import hf_causal_lm

    config, hf = hf_causal_lm("deepseek_v3", config_kwargs)
    with torch.no_grad():
        for layer in hf.model.layers[config.first_k_dense_replace:]:
            value = torch.randn(config.n_routed_experts) * 0.5 if bias is None else torch.tensor(bias)
            layer.mlp.gate.e_score_correction_bias.copy_(value)
    return config, hf


def check_gradients(model, hf_grads, config, dp_sum: bool = False):
    """Every gradient gathered (over tp and ep) equals transformers'; the frozen routing bias has none. `dp_sum`:
    every rank ran the whole batch, so non-expert gradients are summed over dp x cp here, and all divided by dp."""
    import torch.distributed as dist

    from colozoo.checkpoint.readers import GlobalTensor
    from colozoo.converters import family_module
    from colozoo.core.mesh import coords_of
    from colozoo.layers.shard import gather_tensor, spec_of
    from parity import close

    parallel, sources, checked = model.parallel, family_module("deepseek_v3").module_sources(config), []
    dp = parallel.size("dp") if dp_sum else 1
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            assert not p.requires_grad and p.grad is None, name
            continue
        spec, grad = spec_of(p), p.grad.clone()
        if dp_sum and not any(s.mesh_dim == "ep" for s in spec) and parallel.group("dp_cp") is not None:
            dist.all_reduce(grad, group=parallel.group("dp_cp"))
        expected = GlobalTensor(hf_grads, sources[name], name).read()
        close(gather_tensor(grad / dp, spec, expected.shape, parallel.groups, coords_of(parallel)), expected, 1e-5,
              f"gradient of {name}")
        checked.append(name)
    return checked


def moe_parity(tp=1, ep=1, cp=1, sp=False, cp_mode="ring", config=None, bias=None):
    """Ours loaded from transformers' save_pretrained (one tensor per expert; each ep rank reads only its experts)
    against transformers: logits, loss, hidden states and every gradient. Every rank runs the whole batch: expert
    owners sum their ep group's tokens, the rest is summed over dp x cp here, then both are divided by dp. The routing
    bias is a frozen parameter: no gradient, like transformers' buffer."""
    from colozoo.checkpoint.readers import StateDictReader
    from colozoo.core.mesh import init_parallel
    from parity import check_hidden_states, close
    from test_mixtral import load_saved

    parallel = init_parallel(tp=tp, cp=cp, ep=ep, sequence_parallel=sp)
    config, hf = hf_moe(config or MOE, bias)
    ids, mask, labels = batch(config.vocab_size, 16)
    ref = hf(ids, attention_mask=mask, labels=labels, output_hidden_states=True)
    ref.loss.backward()
    hf_grads = StateDictReader({n: p.grad for n, p in hf.named_parameters()})

    model, reader = load_saved(hf, config, parallel)
    owned = range(parallel.rank("ep") * model.num_experts // ep, (parallel.rank("ep") + 1) * model.num_experts // ep)
    assert reader.experts_read() == set(owned), f"ep rank {parallel.rank('ep')} read experts {reader.experts_read()}"
    model.eval()
    out = model(ids, attention_mask=mask, labels=labels, return_logits=True, output_hidden_states=cp == 1,
                **({"cp_mode": cp_mode} if cp > 1 else {}))
    out.loss.backward()
    keep = mask.bool()
    close(out.logits[keep], ref.logits[keep], 1e-5, "logits")
    close(out.loss, ref.loss, 1e-5, "loss")
    assert out.aux_loss is None and ref.aux_loss is None
    if cp == 1:
        check_hidden_states(out.hidden_states, ref.hidden_states, keep)
    return len(check_gradients(model, hf_grads, config, dp_sum=True))


def test_moe_single_process():
    assert moe_parity() > 0
    moe_parity(config={**MOE, "norm_topk_prob": False, "n_group": 1, "topk_group": 1, "n_shared_experts": 2})


@pytest.mark.parametrize("tp,ep,sp", [(2, 1, False), (2, 2, True)])
def test_moe_tensor_and_expert_parallel(tp, ep, sp):
    run_distributed(moe_parity, tp * ep, tp=tp, ep=ep, sp=sp, timeout=TIMEOUT)


def test_expert_parallel_with_an_idle_rank():
    """The bias sends every token to experts 4-7 (ep rank 1): ep rank 0's experts get no row, and its backward still
    passes through the all-to-alls its peer waits in (it used to leave them out and hang)."""
    run_distributed(moe_parity, 2, ep=2, bias=[-5.0] * 4 + [0.0] * 4, timeout=TIMEOUT)


def test_moe_context_parallel():
    """cp2 x tp2, ep2 folded over cp; all-to-all attention."""
    run_distributed(moe_parity, 4, tp=2, ep=2, cp=2, cp_mode="all_to_all", timeout=TIMEOUT)


def moe_pipeline(pp, tp, ep):
    """4 layers (0 dense, 1-3 DeepSeekMoE) over pp stages: the eval forward's logits and loss on every rank, then a
    forward_backward over 2 micro-batches (under DDP, each dp rank its rows): loss and every gradient."""
    import torch

    from colozoo.checkpoint.readers import StateDictReader
    from colozoo.core.mesh import init_parallel
    from colozoo.runtime.training import parallelize
    from parity import close
    from test_mixtral import load_saved

    parallel = init_parallel(pp=pp, tp=tp, ep=ep)
    config, hf = hf_moe({**MOE, "num_hidden_layers": 4})
    model = load_saved(hf, config, parallel)[0].eval()
    ids, mask, labels = batch(config.vocab_size, 16, batch_size=4)
    ref = hf(ids, attention_mask=mask, labels=labels)
    ref.loss.backward()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, labels=labels, return_logits=True)
    close(out.logits[mask.bool()], ref.logits[mask.bool()], 1e-5, "logits")
    close(out.loss, ref.loss, 1e-5, f"loss (pp rank {parallel.rank('pp')})")
    parallelize(model.train(), data_parallel="ddp")
    close(model.forward_backward(ids, labels, attention_mask=mask, num_microbatches=2), ref.loss, 1e-5,
          "forward_backward loss")
    return check_gradients(model, StateDictReader({n: p.grad for n, p in hf.named_parameters()}), config)


@pytest.mark.parametrize("pp,tp,ep", [(2, 1, 1), (2, 1, 2)])
def test_moe_pipeline_parallel(pp, tp, ep):
    names = run_distributed(moe_pipeline, pp * tp * ep, pp=pp, tp=tp, ep=ep, timeout=TIMEOUT)
    assert {n.split(".")[1] for ranks in names for n in ranks if n.startswith("layers.")} == {"0", "1", "2", "3"}


# --- the registry ---------------------------------------------------------------------------------------------

PUBLISHED = {"DeepSeek-V3": 671_026_404_352, "DeepSeek-R1": 671_026_404_352, "Kimi-K2-Instruct": 1_026_408_209_408}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_registered_sizes_match_transformers(name):
    """The count transformers gives (its routing bias is a buffer, not counted; ours a frozen parameter, not counted
    either), stored in the registry; transformers 5.24 knows no kimi_k2 model type, so Kimi-K2 is registered as the
    deepseek_v3 it is built as (its checkpoints say DeepseekV3ForCausalLM)."""
    import torch
    import transformers

    from colozoo.registry import count_parameters, get_config, get_entry

    config = get_config(name)
    assert config.model_type == "deepseek_v3"
    with torch.device("meta"):
        hf = getattr(transformers, config.architectures[0])(config)
    expected = sum(p.numel() for p in hf.parameters())
    assert count_parameters(config) == expected == get_entry(name)[1]["params"] == PUBLISHED[name]


# --- generation -------------------------------------------------------------------------------------------------

GENERATE = {"deepseek_v3": {**MOE, "num_hidden_layers": 4}}


def latent_cache_decoding(tp=1):
    """Greedy decoding against transformers' with every step's logits; the cache holds kv_lora_rank +
    qk_rope_head_dim numbers a position and layer on every rank (what transformers' cache holds too), a fraction of
    the 2 x heads/tp x head widths of full keys and values, as the planner counts it (cost.inference.kv_cache_bytes);
    kv_b_proj expands keys and values in the prefill only (decoding steps attend over the latent). Returns the cache's
    share of a full one."""
    from colozoo.core.mesh import init_parallel, single_process
    from colozoo.cost.inference import kv_cache_bytes
    from parity import close
    from test_generate import NEW, ours_and_hf, prompts

    parallel = init_parallel(tp=tp) if tp > 1 else single_process()
    config, hf, model = ours_and_hf("deepseek_v3", parallel, GENERATE["deepseek_v3"])
    ids, mask = prompts(config.vocab_size)
    options = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None,
                   return_dict_in_generate=True, output_logits=True)
    expansions = []
    hooks = [layer.self_attn.kv_b_proj.register_forward_pre_hook(lambda m, args: expansions.append(args[0].shape[1]))
             for layer in model.layers.values()]
    out, ref = model.generate(ids, attention_mask=mask, **options), hf.generate(ids, attention_mask=mask, **options)
    for hook in hooks:
        hook.remove()
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert len({tuple(row) for row in out.sequences[:, ids.shape[1]:].tolist()}) == ids.shape[0]  # rows differ
    for step, (ours, theirs) in enumerate(zip(out.logits, ref.logits, strict=True)):
        close(ours, theirs, 1e-5, f"logits of step {step}")
    layers = config.num_hidden_layers
    assert expansions == [ids.shape[1]] * layers  # the prefill, once per layer; no step expands the cache
    positions = ids.shape[0] * (ids.shape[1] + NEW)
    assert out.cache_elements == layers * positions * (config.kv_lora_rank + config.qk_rope_head_dim)
    assert out.cache_elements == kv_cache_bytes(config, layers, tp, ids.shape[0], ids.shape[1] + NEW, 1)
    full = layers * positions * config.num_attention_heads // tp * (config.qk_nope_head_dim + config.qk_rope_head_dim
                                                                     + config.v_head_dim)
    return out.cache_elements / full


@pytest.mark.parametrize("tp", [1, 2])
def test_latent_cache(tp):
    share = latent_cache_decoding() if tp == 1 else run_distributed(latent_cache_decoding, 2, tp=2, timeout=TIMEOUT)[0]
    assert share == (16 + 8) / (4 // tp * (12 + 8 + 10))


def test_a_kimi_k2_directory_loads_without_its_remote_code(tmp_path):
    """Kimi-K2's config.json says model_type kimi_k2 (which transformers does not know) and points auto_map at remote
    code; its architecture is DeepseekV3ForCausalLM, which colozoo builds, never running that code: from_pretrained and
    convert read the directory, with transformers' logits."""
    import json

    import torch

    import colozoo
    from colozoo.checkpoint.convert import convert

    _, hf = hf_moe(MOE)
    hf.save_pretrained(tmp_path / "kimi")
    config = json.loads((tmp_path / "kimi" / "config.json").read_text())
    config.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                                                  "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    (tmp_path / "kimi" / "config.json").write_text(json.dumps(config))
    ids = batch(hf.config.vocab_size, 12)[0]
    with torch.no_grad():
        expected = hf(ids).logits
        model = colozoo.from_pretrained(str(tmp_path / "kimi"))
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)
    convert(str(tmp_path / "kimi"), str(tmp_path / "kimi-tp1"), tp=1, pp=1)
    assert colozoo.registry.get_config(str(tmp_path / "kimi-tp1")).model_type == "deepseek_v3"
