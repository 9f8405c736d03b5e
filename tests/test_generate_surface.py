"""transformers' generate surface, each option equal to transformers' own generate: beam search (length penalty,
early stopping, several returned sequences), output_scores / output_logits with return_dict_in_generate, a list of
eos ids and the model's generation_config.json, max_length, min_new_tokens, stop_strings, sampling several sequences
per prompt; at tp 2 and pp 2 too. The references are tiny models with spread weights, whose continuations depend on
their context (each row of a reference holds several distinct tokens)."""
import pytest
import torch
import transformers

from distributed import run_distributed
from family_cases import attention
from parity import close, vary_weights
from test_generate import FAMILIES as GENERATE, NEW, ours_and_hf, prompts
from test_real_bert import minilm  # noqa: F401 (the fixture)

from colozoo.core.mesh import init_parallel, single_process

TIMEOUT = 240
COMMON = dict(max_new_tokens=NEW, pad_token_id=0, do_sample=False, return_dict_in_generate=True, output_scores=True,
              output_logits=True)


# causal families of the table (their declared configs), one of each kind of attention, position and MLP
FAMILIES = {name: GENERATE[name] for name in ("gpt2", "opt", "llama", "mistral", "mixtral", "qwen2_moe", "qwen2",
                                              "qwen3", "gemma2", "gemma3_text", "phi3", "gpt_neox")}
SPREAD = {"gpt2": 0.3, "qwen3": 0.3, "gemma2": 0.06, "gemma3_text": 0.06}  # else 0.5: what keeps continuations apart
# a tiny Gemma (scaled embeddings, capped logits) repeats a token whatever the spread: its steps' logits, compared
# below, are what shows a wrong cache or position there
MIN_DISTINCT = {"gemma2": 1, "gemma3_text": 1, "qwen3": 2}


def _varied(family, parallel):
    """transformers' model with spread weights, and ours loaded from it."""
    return ours_and_hf(family, parallel, FAMILIES[family], attention(family),
                       prepare=lambda hf: vary_weights(hf, SPREAD.get(family, 0.5), seed=4 if "gemma" in family else 3))


def _assert_steps_equal(ours, theirs, what):
    assert ours is not None and len(ours) == len(theirs), what
    for step, (a, b) in enumerate(zip(ours, theirs)):
        finite = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), finite), f"{what}: step {step} masks other tokens"
        close(a[finite], b[finite], 1e-3, f"{what}, step {step}")  # spread weights: logits in the tens


BEAMS = [dict(num_beams=3), dict(num_beams=3, num_return_sequences=2, length_penalty=0.5, eos="step1"),
         dict(num_beams=2, early_stopping=True, eos="step1"), dict(num_beams=3, early_stopping="never", eos="step2",
                                                                  length_penalty=1.5)]


def beams_match_transformers(families, tp=1, pp=1):
    parallel = init_parallel(tp=tp, pp=pp) if tp * pp > 1 else single_process()
    for family in families:
        config, hf, model = _varied(family, parallel)
        ids, mask = prompts(config.vocab_size)
        greedy = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
        distinct = [len(set(row[ids.shape[1]:].tolist())) for row in greedy]
        assert min(distinct) >= MIN_DISTINCT.get(family, 3), f"{family}: the reference repeats itself ({distinct})"
        for options in BEAMS:
            options = dict(options)
            eos = options.pop("eos", None)
            options["eos_token_id"] = int(greedy[0, ids.shape[1] + int(eos[-1])]) if eos else None
            ref = hf.generate(ids, attention_mask=mask, **COMMON, **options)
            got = model.generate(ids, attention_mask=mask, **COMMON, **options)
            what = f"{family} tp={tp} pp={pp} {options}"
            assert torch.equal(got.sequences, ref.sequences), f"{what}:\nours {got.sequences}\nhf   {ref.sequences}"
            close(got.sequences_scores, ref.sequences_scores, 1e-3, f"{what}: sequences_scores")
            assert torch.equal(got.beam_indices, ref.beam_indices.long()), what
            _assert_steps_equal(got.scores, ref.scores, f"{what}: scores")
            _assert_steps_equal(got.logits, ref.logits, f"{what}: logits")
    return True


@pytest.mark.parametrize("family", list(FAMILIES))
def test_beam_search_equals_transformers(family):
    assert beams_match_transformers([family])


def test_beam_search_at_tp2_and_pp2():
    assert all(run_distributed(beams_match_transformers, 2, families=["llama", "mixtral"], tp=2, timeout=TIMEOUT))
    assert all(run_distributed(beams_match_transformers, 2, families=["gpt2", "llama"], pp=2, timeout=TIMEOUT))


def greedy_options_match_transformers(family, tp=1, pp=1, **ours):
    """Scores and logits of every step, a list of eos ids, max_length and min_new_tokens, as transformers'. `ours`:
    options for our generate only (test_static_decode: cache_implementation)."""
    parallel = init_parallel(tp=tp, pp=pp) if tp * pp > 1 else single_process()
    config, hf, model = _varied(family, parallel)
    ids, mask = prompts(config.vocab_size)
    plain = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                        eos_token_id=None)
    first, later = (int(plain[row, ids.shape[1] + step]) for row, step in ((0, 1), (1, 3)))
    cases = [dict(eos_token_id=None), dict(eos_token_id=[first, later]), dict(eos_token_id=first, min_new_tokens=3),
             dict(eos_token_id=None, max_length=ids.shape[1] + 3, max_new_tokens=None),
             dict(eos_token_id=None, repetition_penalty=1.3)]
    for options in cases:
        ref = hf.generate(ids, attention_mask=mask, **{**COMMON, **options})
        got = model.generate(ids, attention_mask=mask, **{**COMMON, **options, **ours})
        what = f"{family} tp={tp} pp={pp} {options} {ours}"
        assert torch.equal(got.sequences, ref.sequences), f"{what}:\nours {got.sequences}\nhf   {ref.sequences}"
        _assert_steps_equal(got.scores, ref.scores, f"{what}: scores")
        _assert_steps_equal(got.logits, ref.logits, f"{what}: logits")
    return True


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_scores_logits_eos_lists_and_lengths_equal_transformers(family):
    assert greedy_options_match_transformers(family)


def test_greedy_options_at_tp2_and_pp2():
    assert all(run_distributed(greedy_options_match_transformers, 2, family="llama", tp=2, timeout=TIMEOUT))
    assert all(run_distributed(greedy_options_match_transformers, 2, family="opt", pp=2, timeout=TIMEOUT))


def test_the_returned_dict_is_transformers_own_output_for_the_same_call():
    """return_dict_in_generate returns what transformers returns for the same call: its GenerateDecoderOnlyOutput or
    GenerateBeamDecoderOnlyOutput, with the same keys in the same order (key and index access, iteration, to_tuple,
    `in`); colozoo's timings and cache size are attributes, not keys. transformers also returns its KV cache
    (use_cache): colozoo's holds each rank's heads only and is not returned."""
    config, hf, model = _varied("llama", single_process())
    ids, mask = prompts(config.vocab_size)
    common = dict(max_new_tokens=NEW, pad_token_id=0, do_sample=False, return_dict_in_generate=True)
    for options in (dict(output_scores=True, output_logits=True, use_cache=False), dict(num_beams=2)):
        ref = hf.generate(ids, attention_mask=mask, **common, **options)
        got = model.generate(ids, attention_mask=mask, **common, **options)
        keys = [k for k in ref.keys() if k != "cache"]
        assert type(got) is type(ref) and list(got.keys()) == list(got) == keys, (options, list(got.keys()), keys)
        assert len(got.to_tuple()) == len(keys) and all(k in got for k in keys) and "timings" not in got
        assert torch.equal(got[0], ref[0]) and got["sequences"] is got.sequences is got.to_tuple()[0]
        assert isinstance(got.timings, dict) and got.cache_elements > 0


def test_sampling_several_sequences_per_prompt_is_seeded_and_shaped_like_transformers():
    config, hf, model = _varied("llama", single_process())
    ids, mask = prompts(config.vocab_size)
    options = dict(do_sample=True, num_return_sequences=3, max_new_tokens=NEW, pad_token_id=0, eos_token_id=None)
    got = model.generate(ids, attention_mask=mask, seed=5, **options)
    assert got.shape == hf.generate(ids, attention_mask=mask, **options).shape == (9, ids.shape[1] + NEW)
    assert torch.equal(got, model.generate(ids, attention_mask=mask, seed=5, **options))
    assert torch.equal(got[::3, :ids.shape[1]], ids) and len({tuple(r) for r in got[:3].tolist()}) > 1


def test_the_models_generation_config_and_stop_strings(tmp_path, minilm):
    """generation_config.json's eos ids end generation as in transformers; stop_strings with the tokenizer (a real
    WordPiece vocabulary: transformers' stop-string matcher needs one that spells arbitrary text)."""
    import colozoo

    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm, padding_side="left")
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      pad_token_id=tokenizer.pad_token_id, eos_token_id=None)
    path = tmp_path / "model"
    torch.manual_seed(0)
    vary_weights(transformers.LlamaForCausalLM(config)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    ids = tokenizer(["once upon a time", "the little"], return_tensors="pt", padding=True, add_special_tokens=False,
                    return_token_type_ids=False)
    free = hf.generate(**ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
    turn_end = [int(free[0, -5]), int(free[1, -3])]
    transformers.GenerationConfig(eos_token_id=turn_end, pad_token_id=tokenizer.pad_token_id,
                                  max_new_tokens=8).save_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    model = colozoo.from_pretrained(str(path))
    assert model.generation_config.eos_token_id == turn_end
    assert torch.equal(model.generate(**ids), hf.generate(**ids))  # max_new_tokens and both eos ids from the file
    # a word each row writes (one word: WordPiece's vocabulary has no spaces to match across)
    stops = [tokenizer.decode(free[0, -4:-3]), tokenizer.decode(free[1, -3:-2])]
    ours = model.generate(**ids, stop_strings=stops, tokenizer=tokenizer, eos_token_id=None)
    theirs = hf.generate(**ids, stop_strings=stops, tokenizer=tokenizer, eos_token_id=None)
    assert torch.equal(ours, theirs) and ours.shape[1] == free.shape[1] - 2
    static = model.generate(**ids, stop_strings=stops, tokenizer=tokenizer, eos_token_id=None,
                            cache_implementation="static")
    assert torch.equal(static, theirs)
    with pytest.raises(ValueError, match="stop_strings needs the tokenizer"):
        model.generate(**ids, stop_strings=stops)
