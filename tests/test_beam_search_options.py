"""Beam search options that change the result only in some cases, each in a case where it does, against
transformers' generate: early_stopping="never" (which runs on while a running beam could still beat a finished one,
where True stops at num_beams finished ones) on a LLaMA, and stop_strings ending beams (with a real WordPiece
vocabulary: transformers' stop-string matcher needs one that spells arbitrary text)."""
import torch
import transformers

from parity import close, vary_weights
from test_generate import NEW, prompts
from test_generate_surface import COMMON, _varied
from test_real_bert import minilm  # noqa: F401 (the fixture)

from colozoo.core.mesh import single_process


def _same(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


def _assert_beams_equal(got, ref, what):
    assert _same(got.sequences, ref.sequences), f"{what}:\nours {got.sequences}\nhf   {ref.sequences}"
    close(got.sequences_scores, ref.sequences_scores, 1e-3, f"{what}: sequences_scores")
    assert torch.equal(got.beam_indices, ref.beam_indices.long()), what


def test_early_stopping_never_equals_transformers_where_it_differs_from_true():
    config, hf, model = _varied("llama", single_process())
    ids, mask = prompts(config.vocab_size)
    greedy = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                         eos_token_id=None)
    options = dict(COMMON, num_beams=2, length_penalty=2.0, eos_token_id=int(greedy[2, ids.shape[1]]))
    ref = hf.generate(ids, attention_mask=mask, **options, early_stopping="never")
    _assert_beams_equal(model.generate(ids, attention_mask=mask, **options, early_stopping="never"), ref,
                        "early_stopping='never'")
    stopped = hf.generate(ids, attention_mask=mask, **options, early_stopping=True)
    assert not _same(stopped.sequences, ref.sequences)  # the case tells "never" from True


def test_stop_strings_end_beams_as_in_transformers(tmp_path, minilm):  # noqa: F811 (the fixture)
    import colozoo

    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm, padding_side="left")
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      pad_token_id=tokenizer.pad_token_id, eos_token_id=None)
    torch.manual_seed(0)
    vary_weights(transformers.LlamaForCausalLM(config)).save_pretrained(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    model = colozoo.from_pretrained(str(tmp_path))
    ids = tokenizer(["once upon a time", "the little"], return_tensors="pt", padding=True, add_special_tokens=False,
                    return_token_type_ids=False)
    options = dict(max_new_tokens=8, do_sample=False, num_beams=3, eos_token_id=None, return_dict_in_generate=True,
                   output_scores=True)
    free = hf.generate(**ids, **options).sequences
    prompt = ids["input_ids"].shape[1]
    stops = [tokenizer.decode(free[0, prompt + 1:prompt + 2]), tokenizer.decode(free[1, prompt:prompt + 1])]
    ref = hf.generate(**ids, **options, stop_strings=stops, tokenizer=tokenizer)
    _assert_beams_equal(model.generate(**ids, **options, stop_strings=stops, tokenizer=tokenizer), ref,
                        f"stop_strings={stops}")
    assert not _same(ref.sequences, free)  # the stop strings end beams here
