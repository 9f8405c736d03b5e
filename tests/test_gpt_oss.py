"""gpt-oss beyond the family table (tests/test_family_table.py: the declared config on one process, tp2 with sequence
parallelism, ep 2, pp2 x tp2 and cp 2 all-to-all; round trips, generation, LoRA; eager attention: transformers has no
SDPA path for sinks): a tied head with a SwiGLU limit that clamps, tp 2 and 4, tp2 x ep2, cp2 x tp2 x ep2, pp 2 with
ep 2, the ring refusing sinks, a clipped AdamW step under FSDP, loading the published MXFP4 layout (dequantised on
read, against transformers' own dequantisation) and the generation plan of the 120b. Sinks, YaRN, biases on
attention, router and experts, the clamped SwiGLU and the alternation of sliding and full layers are in every case;
the tiny config's YaRN scales 16 original positions by 4."""
import json

import pytest
import torch

from distributed import run_distributed
from family_cases import tiny_kwargs
from family_parity import family_parity, family_pipeline_parity
from parity import batch

TIMEOUT = 300
GPT_OSS = tiny_kwargs("gpt_oss")
WIDE = dict(num_attention_heads=8, num_key_value_heads=4)


def test_single_process():
    family_parity("gpt_oss", overrides={"tie_word_embeddings": True, "swiglu_limit": 0.05,
                                        "output_router_logits": False})  # a limit that clamps


@pytest.mark.parametrize("tp,sp,wide", [(2, False, False), (4, True, False), (4, False, True)])
def test_tensor_parallel(tp, sp, wide):
    run_distributed(family_parity, tp, family="gpt_oss", overrides=WIDE if wide else None, tp=tp,
                    sequence_parallel=sp, timeout=TIMEOUT)


def test_expert_and_tensor_parallel():
    run_distributed(family_parity, 4, family="gpt_oss", tp=2, ep=2, sequence_parallel=True, timeout=TIMEOUT)


def test_context_parallel_all_to_all():
    """cp2 x tp2 (Ulysses; ep2 folded over cp): each cp rank attends over half of its tp rank's heads, with their
    sinks."""
    run_distributed(family_parity, 4, family="gpt_oss", tp=2, ep=2, cp=2, cp_mode="all_to_all", timeout=TIMEOUT)


def test_ring_context_parallel_refuses_sinks():
    from colozoo.layers.context_parallel import context_parallel_attention

    class Ring:
        mode, size = "ring", 2

    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="sinks are not supported with cp_mode='ring'"):
        context_parallel_attention(q, q, q, Ring(), causal=True, sinks=torch.zeros(2))


def test_pipeline_parallel_ep2():
    names = run_distributed(family_pipeline_parity, 4, family="gpt_oss", pp=2, ep=2, timeout=TIMEOUT,
                            overrides={"num_hidden_layers": 4})
    assert {n.split(".")[1] for ranks in names for n in ranks if n.startswith("layers.")} == {"0", "1", "2", "3"}


def test_fsdp_training_step():
    from test_qwen import training_step

    run_distributed(training_step, 4, family="gpt_oss", config=GPT_OSS, dp=2, tp=2, microbatches=2,
                    options=dict(data_parallel="fsdp"), timeout=TIMEOUT)


def published_layout(directory, hf, config, seed: int = 3) -> dict:
    """transformers' checkpoint of `hf` rewritten as gpt-oss is published: every expert weight replaced by random MXFP4
    codes and exponents (`_blocks` (experts, out, in / 32, 16), `_scales` (experts, out, in / 32)) and the config
    marked quant_method mxfp4. Returns the weights transformers' own dequantisation makes of them."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf.save_pretrained(directory)
    tensors, g, expected = load_file(directory / "model.safetensors"), torch.Generator().manual_seed(seed), {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = tensors.pop(name).shape
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(118, 128, (experts, outputs, inputs // 32), dtype=torch.uint8, generator=g)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        expected[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    saved = json.loads((directory / "config.json").read_text())
    saved["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(saved))
    return expected


def test_mxfp4_checkpoint_loads_dequantised(tmp_path):
    """The published layout reads as transformers dequantises it, bit for bit (whole tensors and an ep x tp slice);
    the model loaded from it gives the logits of transformers' model holding those weights; converted to HF it is a
    bf16 checkpoint without quantization_config that transformers loads."""
    import transformers

    import colozoo
    from colozoo.checkpoint.convert import HFCheckpoint, convert
    from parity import close, hf_causal_lm

    config, hf = hf_causal_lm("gpt_oss", GPT_OSS)
    expected = published_layout(tmp_path / "mxfp4", hf, config)
    assert len(expected) == 2 * config.num_hidden_layers
    checkpoint = HFCheckpoint(tmp_path / "mxfp4")
    assert not hasattr(checkpoint.config, "quantization_config")
    for name, weight in expected.items():
        ours = checkpoint.tensor(name.removeprefix("model."))
        assert ours.dtype == torch.bfloat16 and torch.equal(ours.read(), weight), name
        index = (slice(1, 3), slice(None), slice(weight.shape[2] // 2, None))  # experts 1-2, the second tp half
        assert torch.equal(ours.read(index), weight[index]), name

    with torch.no_grad():
        for name, weight in expected.items():
            hf.get_parameter(name).copy_(weight.float())
    model = colozoo.from_pretrained(tmp_path / "mxfp4", dtype=torch.float32).eval()
    ids, mask, labels = batch(config.vocab_size, 12)
    with torch.no_grad():
        ours, ref = model(ids, attention_mask=mask, labels=labels), hf(ids, attention_mask=mask, labels=labels)
    close(ours.logits[mask.bool()], ref.logits[mask.bool()], 1e-5, "logits from the MXFP4 checkpoint")
    close(ours.loss, ref.loss, 1e-5, "loss from the MXFP4 checkpoint")

    convert(tmp_path / "mxfp4", tmp_path / "hf", to_hf=True)
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    for name, weight in expected.items():
        assert torch.equal(exported.get_parameter(name), weight), name


def test_generation_plan_120b_on_8_gpus():
    """`colozoo plan gpt-oss-120b --gpus 8 --generate` (bf16 weights, batch 1 x 2048 tokens on H100-80GB): 2 GPUs
    hold no 116.8B parameters in bf16, 3 pipeline stages of 12 layers do (the fewest GPUs win); the fullest rank's
    weights and cache, counted by hand: the last stage, its 12 layers whole (tp 1), the final norm and the untied LM
    head; all 8 kv heads, a full cache in its 6 full layers and 128 positions in its 6 sliding ones."""
    from colozoo.cost.inference import plan_generation

    found = plan_generation("gpt-oss-120b", gpus=8)
    assert found.mesh == "tp=1,pp=3" and found.fits
    h, heads, kv, hd, experts, inner, vocab = 2880, 64, 8, 64, 128, 2880, 201088
    attention = (heads * hd * h + heads * hd) + 2 * (kv * hd * h + kv * hd) + heads * hd * h + heads  # + sinks
    expert_weights = experts * (h * 2 * inner + 2 * inner + inner * h)  # gate_up (+ bias), down
    replicated = h + experts * h + experts * h + experts + 2 * h  # o bias, down biases, router, two norms
    assert found.weights_bytes == 2 * (12 * (attention + expert_weights + replicated) + vocab * h + h)
    per_position = 2 * kv * hd * 2  # k and v of every kv head, bf16
    assert found.kv_cache_bytes == per_position * (6 * 2048 + 6 * 128)
    assert found.weights_bytes + found.kv_cache_bytes < 80e9
