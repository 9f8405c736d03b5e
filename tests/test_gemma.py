"""Gemma 2 and Gemma 3 text beyond the family table (tests/test_family_table.py: the declared configs on one process,
tp2 with sequence parallelism and pp2 x tp2, sequences longer than the window, soft-capping that bites): tp 2 and 4
with sequence parallelism on and off, each feature shown to matter, context parallel (ring and all-to-all) against
transformers and against one process, a tied head over pp2 x tp2, the multimodal checkpoints' text model, the
registry's sizes."""
import pytest
import torch

from distributed import run_distributed
from family_cases import attention, tiny_kwargs
from family_parity import family_parity
from parity import LOGITS_ATOL, batch, hf_causal_lm

# the declared configs: windows of 4 over sequences of 12-16; weights large enough (std 0.2) that caps of 2.0 bite on
# scores and logits alike; Gemma 3's two sliding layers (a local RoPE base) around a full one with linear scaling
CONFIGS = {family: tiny_kwargs(family) for family in ("gemma2", "gemma3_text")}
GEMMA2, GEMMA3 = CONFIGS["gemma2"], CONFIGS["gemma3_text"]
# transformers' Gemma 2 refuses SDPA (it cannot cap); Gemma 3 takes it, which treats the fully masked rows of left
# padding as ours do (the loss reads one of them: the last pad predicts the first token)
ATTENTION = {family: attention(family) for family in CONFIGS}
WIDE = dict(num_attention_heads=8, num_key_value_heads=4)  # tp=4 shards whole kv heads


def parity(family, tp=1, sp=False, **extra):
    return family_parity(family, tp=tp, sequence_parallel=sp, overrides=extra)


@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("tp,sp", [(2, False), (4, False), (4, True)])
def test_gemma_tensor_parallel(family, tp, sp):
    run_distributed(parity, tp, family=family, tp=tp, sp=sp, **(WIDE if tp == 4 else {}))


def _logits_without(family, switch_off: str):
    from colozoo.api import build_model
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.readers import StateDictReader

    config, hf = hf_causal_lm(family, CONFIGS[family], attn_implementation=ATTENTION[family])
    ids, mask, _ = batch(config.vocab_size, 12)
    model = build_model(config, device="meta")
    load_hf_weights(model, StateDictReader(hf.state_dict()), device="cpu")
    model.eval()
    for layer in model.layers.values():
        if switch_off == "attention_softcap":
            layer.self_attn.softcap = None
        elif switch_off == "sliding_window":
            layer.self_attn.window = None
        elif switch_off == "local_rope":
            layer.self_attn.rotary = "global"
    if switch_off == "final_softcap":
        model.lm_head.softcap = None
    keep = mask.bool()
    return model(ids, attention_mask=mask, return_logits=True).logits[keep], hf(ids, attention_mask=mask).logits[keep]


@pytest.mark.parametrize("family,switch_off", [("gemma2", "attention_softcap"), ("gemma2", "final_softcap"),
                                               ("gemma2", "sliding_window"), ("gemma3_text", "local_rope"),
                                               ("gemma3_text", "sliding_window")])
def test_each_feature_matters(family, switch_off):
    """The test configs are sensitive: without the feature the parity check would fail."""
    ours, theirs = _logits_without(family, switch_off)
    assert (ours - theirs).abs().max() > 100 * LOGITS_ATOL, switch_off


# --- Gemma 3 4b/12b/27b as published: Gemma3ForConditionalGeneration -----------------------------------------------

VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
              patch_size=8)


def test_gemma3_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """A Gemma3ForConditionalGeneration saved by transformers (text model under language_model.model., a vision
    tower): from_pretrained and convert load the text model with one note, and its logits equal transformers'
    Gemma3ForCausalLM on the same text weights, and the conditional model's on text input."""
    import transformers
    from safetensors.torch import load_file

    from colozoo.api import from_pretrained
    from colozoo.checkpoint.convert import convert
    from colozoo.registry import get_config
    from parity import close, hf_model

    # without a final logit cap, as published: transformers' conditional model does not apply text_config's cap
    text = {**GEMMA3, "final_logit_softcapping": None}
    config = transformers.Gemma3Config(text_config=text, vision_config=VISION, mm_tokens_per_image=4)
    multimodal = hf_model("Gemma3ForConditionalGeneration", config)
    multimodal.save_pretrained(tmp_path / "hf")
    text_only = transformers.Gemma3ForCausalLM(config.text_config).eval()
    text_only.model.load_state_dict(multimodal.model.language_model.state_dict())
    text_only.tie_weights()
    ids, mask, _ = batch(config.text_config.vocab_size, 12)
    keep = mask.bool()
    with torch.no_grad():
        expected = text_only(ids, attention_mask=mask).logits
        close(multimodal(input_ids=ids, attention_mask=mask).logits[keep], expected[keep], LOGITS_ATOL,
              "transformers' conditional and text-only logits")
        assert get_config(str(tmp_path / "hf")).model_type == "gemma3_text"
        with pytest.warns(UserWarning, match="text model, the vision tower and multimodal projector ignored"):
            model = from_pretrained(tmp_path / "hf")
        close(model(ids, attention_mask=mask, return_logits=True).logits[keep], expected[keep], LOGITS_ATOL, "logits")
        with pytest.warns(UserWarning, match="vision tower"):
            convert(tmp_path / "hf", tmp_path / "tp2", tp=2)
        resharded = from_pretrained(tmp_path / "tp2")
        close(resharded(ids, attention_mask=mask, return_logits=True).logits[keep], expected[keep], LOGITS_ATOL,
              "logits after convert at tp=2")
    convert(tmp_path / "tp2", tmp_path / "text", to_hf=True)  # exported as the text model transformers would save
    text_only.save_pretrained(tmp_path / "reference")
    exported, reference = (load_file(tmp_path / d / "model.safetensors") for d in ("text", "reference"))
    assert sorted(exported) == sorted(reference)
    assert all(torch.equal(exported[name], reference[name]) for name in reference)


# text_config of google/gemma-3-{4b,12b,27b}-pt's config.json (Gemma3ForConditionalGeneration, transformers 4.50); the
# rest of the text model comes from Gemma3TextConfig's defaults
PUBLISHED_TEXT = {
    "gemma-3-4b-text": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34),
    "gemma-3-12b-text": dict(hidden_size=3840, intermediate_size=15360, num_attention_heads=16, num_hidden_layers=48,
                             num_key_value_heads=8),
    "gemma-3-27b-text": dict(head_dim=128, hidden_size=5376, intermediate_size=21504, num_attention_heads=32,
                             num_hidden_layers=62, num_key_value_heads=16, query_pre_attn_scalar=168),
}
ARCHITECTURE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "query_pre_attn_scalar", "sliding_window", "layer_types",
                       "rope_parameters", "rms_norm_eps", "hidden_activation", "attn_logit_softcapping",
                       "final_logit_softcapping", "tie_word_embeddings", "max_position_embeddings")


@pytest.mark.parametrize("name", sorted(PUBLISHED_TEXT))
def test_registered_gemma3_text_configs_equal_the_published_multimodal_text_config(tmp_path, name):
    """The registry's gemma-3-*-text entry is the text model of the published checkpoint's config, as a local
    directory holding that config.json reads it."""
    import json

    from colozoo.registry import get_config, get_entry

    text = {"model_type": "gemma3_text", "sliding_window": 1024,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, **PUBLISHED_TEXT[name]}
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 256,
        "text_config": text, "vision_config": {"model_type": "siglip_vision_model", **VISION}}))
    published, registered = get_config(str(tmp_path)), get_config(name)
    assert published.architectures == ["Gemma3ForCausalLM"]
    for field in ARCHITECTURE_FIELDS:
        assert getattr(registered, field) == getattr(published, field), field
    published_name = f"{name.removesuffix('-text')}-pt"  # the checkpoint's own name resolves to the entry
    assert get_entry(f"google/{published_name}")[0] == get_entry(published_name)[0] == name


# as transformers counts them on the same configs (tied embedding once)
REGISTERED = {"gemma-2-2b": 2_614_341_888, "gemma-2-9b": 9_241_705_984, "google/gemma-2-27b": 27_227_128_320,
              "gemma-3-1b-pt": 999_885_952, "gemma-3-4b-text": 3_880_263_168, "gemma-3-12b-text": 11_766_034_176,
              "gemma-3-27b-text": 27_009_346_304}


@pytest.mark.parametrize("name", sorted(REGISTERED))
def test_registered_gemma_configs_build_offline_with_the_published_sizes(name):
    from colozoo.registry import count_parameters, get_config

    assert count_parameters(get_config(name)) == REGISTERED[name]


def gemma_cp_parity(family, cp, mode, tp=1, sp=False):
    """test_context_parallel's cp parity on a Gemma config; the first sequence's right padding (3) is shorter than
    the window, so that no query sees only padding (such rows are noise, computed differently by transformers'
    eager attention and the ring)."""
    from test_context_parallel import cp_parity

    cp_parity(tp, cp, mode, sequence_parallel=sp, family=family, overrides=CONFIGS[family], right_padding=3,
              attn_implementation=ATTENTION[family])


@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
def test_gemma2_cp2_matches_transformers(mode):
    # soft-capped scores and windows across the ring's blocks (chunks of 4, window 4)
    run_distributed(gemma_cp_parity, 2, family="gemma2", cp=2, mode=mode)


def test_gemma3_cp2_tp2_ring_matches_transformers():
    run_distributed(gemma_cp_parity, 4, family="gemma3_text", cp=2, mode="ring", tp=2, sp=True)


def cp_softcap_attention_matches():
    """Ring and all-to-all attention with capped scores equal the one-process torch path: output and q/k/v gradients,
    with and without a window."""
    from test_context_parallel import _inputs

    from parity import close

    from colozoo.core.mesh import init_parallel
    from colozoo.layers.attention import attention
    from colozoo.layers.context_parallel import ContextParallel, full_mask, gather_sequence, shard_sequence

    group = init_parallel(cp=2).group("cp")
    q, k, v, dout, padding = _inputs()
    padding[0] = 1  # right padding only, shorter than the window: every query sees a key
    seq = q.shape[2]
    for window in (None, 6):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        mask = full_mask(padding, seq, True, window)
        ref = attention(*leaves, mask, causal=True, softcap=1.0)
        ref.backward(dout)
        uncapped = attention(q, k, v, mask, causal=True)
        assert (ref - uncapped).abs().max() > 1e-2  # the cap bites
        for mode in ("ring", "all_to_all"):
            cp = ContextParallel(group, mode, seq, padding)
            local = [shard_sequence(t, group, dim=2).requires_grad_() for t in (q, k, v)]
            out = attention(*local, causal=True, cp=cp, window=window, softcap=1.0)
            out.backward(shard_sequence(dout, group, dim=2))
            got = [gather_sequence(out.detach(), group, dim=2)] + [gather_sequence(t.grad, group, dim=2)
                                                                    for t in local]
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, [ref] + [t.grad for t in leaves]):
                close(a, b, 1e-5, f"{mode} window={window} {name}")


def test_soft_capped_cp_attention_equals_one_process():
    run_distributed(cp_softcap_attention_matches, 2)


def test_gemma3_pipeline_parallel_pp2_tp2():
    from parity import pipeline_parity

    ids, mask, labels = batch(GEMMA3["vocab_size"], 12)
    run_distributed(pipeline_parity, 4, "Gemma3ForCausalLM", {**GEMMA3, "tie_word_embeddings": True}, ids, mask,
                    labels, 2, 2, True)


def test_embedding_normaliser_is_rounded_to_the_activation_dtype():
    """sqrt(72) = 8.485 is 8.5 in bf16: transformers scales bf16 embeddings by 8.5, and so do we, bit for bit."""
    from colozoo.api import build_model
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.readers import StateDictReader

    config, hf = hf_causal_lm("gemma2", {**GEMMA2, "hidden_size": 72}, attn_implementation="eager")
    hf = hf.to(torch.bfloat16)
    model = build_model(config, device="meta", dtype=torch.bfloat16)
    load_hf_weights(model, StateDictReader(hf.state_dict()), device="cpu")
    ids = batch(config.vocab_size, 12)[0]
    from colozoo.layers.batch import BatchContext

    batch_context = BatchContext(attention_mask=None, position_ids=None, seq_len=ids.shape[1])
    ours, theirs = model.embed(ids, batch_context), hf.model.embed_tokens(ids)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs)
    assert not torch.equal(ours, (model.embed_tokens(ids).float() * 72 ** 0.5).to(torch.bfloat16))
