"""Tests for what the switch-off audit found no test saw (tests/helpers/mutations.py names them): a decoding step
feeds each sequence one new token, left padding moves the positions, an adapter's alpha scales its logits as in
peft, and a chat template survives HF -> colozoo -> HF."""
import json

import pytest
import torch
import transformers

import colozoo
from distributed import run_distributed
from parity import close, vary_weights
from test_generate import FAMILIES, ours_and_hf, prompts

from colozoo.core.mesh import init_parallel, single_process

TIMEOUT = 240
NEW = 4


def fed_shapes(family="llama", tp=1, pp=1, **options):
    """The shapes of the ids the first stage's token embedding sees while generate runs."""
    parallel = init_parallel(tp=tp, pp=pp) if tp * pp > 1 else single_process()
    config, _, model = ours_and_hf(family, parallel)
    ids, mask = prompts(config.vocab_size)
    shapes = []
    embedding = model.get_input_embeddings()
    handle = embedding.register_forward_pre_hook(lambda m, args: shapes.append(tuple(args[0].shape))) \
        if embedding is not None else None
    model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, eos_token_id=None, **options)
    if handle is not None:
        handle.remove()
    return shapes, tuple(ids.shape)


@pytest.mark.parametrize("options", [{}, {"do_sample": True, "seed": 0}, {"num_beams": 2}], ids=["greedy", "sampled",
                                                                                                 "beams"])
def test_each_decoding_step_feeds_one_new_token_per_sequence(options):
    shapes, (batch, prompt) = fed_shapes(**options)
    rows = batch * options.get("num_beams", 1)
    assert shapes == [(rows, prompt)] + [(rows, 1)] * (NEW - 1), shapes


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_each_decoding_step_feeds_one_new_token_on_a_mesh(tp, pp):
    for rank, (shapes, (batch, prompt)) in enumerate(run_distributed(fed_shapes, tp * pp, tp=tp, pp=pp,
                                                                     timeout=TIMEOUT)):
        if pp > 1 and rank >= tp:  # the last stage holds no token embedding
            assert shapes == []
            continue
        micro = [rows for rows, _ in shapes[:len(shapes) // NEW]]  # pipeline micro-batches
        assert sum(micro) == batch and all(s[1] == 1 for s in shapes[len(micro):]), shapes
        assert all(s[1] == prompt for s in shapes[:len(micro)]), shapes


def test_left_padding_moves_the_positions_as_in_transformers():
    """Prompts padded by different amounts continue as transformers continues them, and as the same prompt without
    padding continues. GPT-2's learned positions see a wrong offset; rotary positions are blind to a shift of the
    whole row, so LLaMA only checks that padding changes nothing."""
    for family in ("gpt2", "llama"):
        config, hf, model = ours_and_hf(family, single_process(), prepare=vary_weights)
        ids, mask = prompts(config.vocab_size)
        options = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
        ours, theirs = model.generate(ids, attention_mask=mask, **options), hf.generate(ids, attention_mask=mask,
                                                                                      **options)
        assert torch.equal(ours, theirs), family
        alone = model.generate(ids[2:, -3:], **options)  # row 2 is 3 real tokens, left-padded by 6
        assert torch.equal(alone[0, 3:], ours[2, ids.shape[1]:]), family


def test_an_adapters_alpha_scales_its_logits_as_in_peft(tmp_path):
    import peft

    config, hf, _ = ours_and_hf("llama", single_process())
    hf.save_pretrained(tmp_path / "base")
    adapted = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=24, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # peft starts B at zero, which would hide any scaling
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    adapted.save_pretrained(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["lora_alpha"] == 24
    ids, mask = prompts(config.vocab_size)
    model = colozoo.from_pretrained(str(tmp_path / "base"), adapter=str(tmp_path / "adapter"))
    with torch.no_grad():
        expected = adapted(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    close(model(ids, attention_mask=mask).logits[keep], expected[keep], 1e-5, "logits with the adapter")


def test_a_chat_template_survives_hf_to_colozoo_to_hf(tmp_path):
    from chat_model import TEMPLATE, make_chat_llama

    hf = make_chat_llama(tmp_path / "hf")
    colozoo.convert(str(hf), str(tmp_path / "ckpt"), tp=2)
    colozoo.convert(str(tmp_path / "ckpt"), str(tmp_path / "back"), to_hf=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "back")
    assert tokenizer.chat_template == TEMPLATE
    messages = [{"role": "user", "content": "hello"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == \
        transformers.AutoTokenizer.from_pretrained(hf).apply_chat_template(messages, tokenize=False)
    model = colozoo.from_pretrained(str(tmp_path / "ckpt"))
    model.save_pretrained(tmp_path / "saved")  # and through a live model's save
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "saved").chat_template == TEMPLATE
