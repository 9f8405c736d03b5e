"""On a CUDA GPU, where the Triton kernels compile (skipped without one; CI has none): every causal family against
transformers on the same GPU. Logits, loss, hidden states and every gradient in fp32 (the kernels' fp32 dots are IEEE,
not tf32); the loss in bf16; greedy generation token for token through `colozoo.from_pretrained(..., device="cuda")`
and the flash-decoding kernel; a few AdamW steps' losses. Run `pytest tests/test_gpu.py` on a GPU machine."""
import pytest
import torch

import colozoo
from family_cases import attention
from parity import batch, causal_lm_parity, close, hf_causal_lm
from test_generate import FAMILIES as GENERATE_FAMILIES
from test_generate import prompts

from colozoo.kernels import dispatch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# families of the table, their declared configs
DENSE = {f: GENERATE_FAMILIES[f] for f in ("gpt2", "opt", "llama", "mistral", "gemma2", "gemma3_text", "phi3", "qwen2",
                                           "qwen3", "gpt_neox")}
MOE = {f: GENERATE_FAMILIES[f] for f in ("mixtral", "qwen2_moe")}
ATTENTION = {f: attention(f) for f in DENSE}
FP32_ATOL = 1e-4  # IEEE fp32 dots, but another summation order than cuBLAS and SDPA


@pytest.fixture(autouse=True)
def on_triton():
    """'auto' would take them too on CUDA; forcing makes a silent fall-back to torch impossible."""
    with dispatch.use_kernels("triton"):
        yield


@pytest.mark.parametrize("family", sorted(DENSE))
def test_fp32_logits_loss_and_gradients_match_transformers(family):
    # Gemma 2 unpadded: the flash kernel gives a row that sees no key zeros, transformers' eager attention an even
    # spread over all keys ('auto' keeps padded capped attention on torch: the next test)
    report = causal_lm_parity(family, DENSE[family], attn_implementation=ATTENTION.get(family, "sdpa"),
                              logits_atol=FP32_ATOL, grad_atol=FP32_ATOL, device="cuda", padded=family != "gemma2")
    print(family, report)  # the harness asserts; -s shows the worst differences


@pytest.mark.parametrize("family", ["gemma2", "llama"])
def test_auto_kernels_match_transformers_on_a_padded_batch(family):
    with dispatch.use_kernels("auto"):
        causal_lm_parity(family, DENSE[family], attn_implementation=ATTENTION.get(family, "sdpa"),
                         logits_atol=FP32_ATOL, grad_atol=FP32_ATOL, device="cuda")


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_bf16_matches_transformers(family):
    """bf16 against bf16: other kernels round elsewhere, so a few elements differ by a bf16 step of a value near 4;
    a wrong mask or scale moves the logits by whole units."""
    causal_lm_parity(family, DENSE[family], attn_implementation=ATTENTION.get(family, "sdpa"), logits_atol=0.1,
                     grad_atol=0.1, device="cuda", dtype=torch.bfloat16, padded=family != "gemma2")


def saved(tmp_path, family, config_kwargs):
    config, hf = hf_causal_lm(family, config_kwargs, attn_implementation=ATTENTION.get(family, "sdpa"))
    hf = hf.to("cuda")
    hf.save_pretrained(tmp_path)
    return config, hf


# every family on the kernels; 'auto' too, which decodes with torch's norms, rotary and SwiGLU (a decode step's
# inputs are launch-bound) and the Triton decoding kernel, and prefills on the kernels
@pytest.mark.parametrize("family,kernels", [(f, "triton") for f in sorted(DENSE) + sorted(MOE)]
                         + [(f, "auto") for f in ("llama", "gpt2", "qwen3")])
def test_greedy_generate_token_for_token_on_gpu(tmp_path, family, kernels):
    config, hf = saved(tmp_path, family, {**DENSE, **MOE}[family])
    model = colozoo.from_pretrained(tmp_path, device="cuda").eval()
    assert all(p.is_cuda for p in model.parameters())
    ids, mask = (t.cuda() for t in prompts(config.vocab_size))
    options = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    # Phi-3's LongRoPE switches factors past original_max_position_embeddings, where transformers drops its cache;
    # some releases (5.17) then encode only the last token: the peer there is its generation without a cache
    expected = hf.generate(ids, attention_mask=mask, use_cache=family != "phi3", **options)
    with dispatch.use_kernels(kernels):
        got = model.generate(ids, attention_mask=mask, **options)
    assert torch.equal(got, expected), f"{family}:\nours {got.tolist()}\nhf   {expected.tolist()}"


@pytest.mark.parametrize("family", sorted(MOE))
def test_moe_logits_and_loss_match_transformers(tmp_path, family):
    config, hf = saved(tmp_path, family, MOE[family])
    model = colozoo.from_pretrained(tmp_path, device="cuda").eval()
    ids, mask, labels = (t.cuda() for t in batch(config.vocab_size, 12))
    ref = hf(ids, attention_mask=mask, labels=labels)
    out = model(ids, attention_mask=mask, labels=labels, return_logits=True)
    keep = mask.bool()
    close(out.logits[keep], ref.logits[keep], FP32_ATOL, "logits")
    close(out.loss, ref.loss, FP32_ATOL, "loss")


def test_adamw_steps_follow_transformers(tmp_path):
    """Five AdamW steps in bf16 autocast from the same weights: the loss curves agree."""
    config, hf = saved(tmp_path, "llama", DENSE["llama"])
    model = colozoo.from_pretrained(tmp_path, device="cuda").train()
    hf.train()
    ids, mask, labels = (t.cuda() for t in batch(config.vocab_size, 12))
    curves = []
    for net in (hf, model):
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        losses = []
        for _ in range(5):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = net(ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        curves.append(torch.tensor(losses))
    assert curves[1][-1] < curves[1][0]
    torch.testing.assert_close(curves[1], curves[0], rtol=2e-2, atol=2e-2)


def test_auto_takes_the_triton_kernels_on_cuda(monkeypatch):
    """'auto' is the default: on CUDA a training step's norms (each layer's fused into the projection after it),
    rotary, SwiGLU and the head with its loss run the Triton kernels (this fails if the policy never picks them); a
    decode step's small elementwise ops stay on torch, by design."""
    from test_kernels_in_models import count_kernel_calls

    calls = count_kernel_calls(monkeypatch)
    config, hf = hf_causal_lm("llama", DENSE["llama"])
    model = colozoo.build_model(config, device="cuda")
    ids = torch.randint(0, config.vocab_size, (2, 16), device="cuda")
    with dispatch.use_kernels("auto"):
        model.train()(ids, labels=ids).loss.backward()
    assert {"rms_norm_linear_triton", "rms_norm_triton", "rotate_qk_in_place_triton", "swiglu_linear_triton",
            "linear_cross_entropy_triton"} <= set(calls), calls


# --- the decode step replayed from a CUDA graph (colozoo.runtime.static_decode) -----------------------------------

GRAPH_FAMILIES = ("llama", "gpt2", "mistral", "gemma2", "qwen3")  # GQA, learned positions, a ring, caps, q/k norms


@pytest.mark.parametrize("family", GRAPH_FAMILIES)
def test_graph_decode_equals_the_eager_loop(tmp_path, family):
    """Greedy with rows that end early, and seeded sampling through every processor: the CUDA graph's tokens, scores
    and logits are the eager loop's (the growing cache)."""
    config, hf = saved(tmp_path, family, DENSE[family])
    model = colozoo.from_pretrained(tmp_path, device="cuda").eval()
    ids, mask = (t.cuda() for t in prompts(config.vocab_size))
    free = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                          eos_token_id=None)[:, ids.shape[1]:]
    cases = [dict(do_sample=False, eos_token_id=[int(free[0, 2]), int(free[1, 5])]),
             dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2, seed=1,
                  eos_token_id=None)]
    for case in cases:
        options = dict(case, max_new_tokens=12, pad_token_id=0, return_dict_in_generate=True, output_scores=True,
                       output_logits=True)
        graph = model.generate(ids, attention_mask=mask, **options)
        eager = model.generate(ids, attention_mask=mask, cache_implementation="dynamic", **options)
        assert graph.decode_path == "cuda_graph" and eager.decode_path == "eager"
        assert torch.equal(graph.sequences, eager.sequences), f"{family} {case}:\n{graph.sequences}\n{eager.sequences}"
        for ours, theirs in zip(graph.scores + graph.logits, eager.scores + eager.logits, strict=True):
            close(ours, theirs, FP32_ATOL, f"{family} {case}: scores and logits")


def _syncs(model, ids, mask, new: int, **options) -> int:
    """How many times a generate call made the host wait for the GPU (torch's sync debug mode counts them)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model.generate(ids, attention_mask=mask, max_new_tokens=new, pad_token_id=0, **options)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def test_graph_decode_waits_for_the_gpu_only_every_few_steps(tmp_path):
    """32 more tokens cost no wait for the GPU without an end-of-sequence id, greedy or sampled through every
    processor, and one per 8 steps with one (the host looks whether every row ended); the eager loop waits at every
    step."""
    config, hf = saved(tmp_path, "llama", DENSE["llama"])
    model = colozoo.from_pretrained(tmp_path, device="cuda").eval()
    ids, mask = (t.cuda() for t in prompts(config.vocab_size))
    free = model.generate(ids, attention_mask=mask, max_new_tokens=40, pad_token_id=0, eos_token_id=None)
    never = dict(eos_token_id=next(i for i in range(config.vocab_size) if i not in free))  # an id no row writes
    sampled = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2, seed=1,
                   eos_token_id=None)
    for options, extra in ((dict(eos_token_id=None), 0), (sampled, 0), (never, 32 // 8)):
        counts = [_syncs(model, ids, mask, new, **options) for new in (8, 8, 40)]
        assert counts[2] - counts[1] <= extra, f"{options}: {counts} host waits for 8, 8 and 40 new tokens"
    eager = [_syncs(model, ids, mask, new, cache_implementation="dynamic", **never) for new in (8, 40)]
    assert eager[1] - eager[0] >= 32, f"the eager loop should wait at every step: {eager}"


def test_a_draw_is_torch_multinomials_on_cuda():
    from colozoo.runtime.sampling import draw

    probs = torch.randn(8, 1000, device="cuda").mul(3).softmax(-1)
    ours, theirs = (torch.Generator(device="cuda").manual_seed(3) for _ in range(2))
    for _ in range(5):
        assert torch.equal(draw(probs, ours), torch.multinomial(probs, 1, generator=theirs).squeeze(1))
