"""Token choice against transformers' own logits processors: the same scores for the same options, greedy =
argmax, seeded sampling reproducible, pad after eos; the options resolved as transformers resolves them (the call's,
the model's generation config, transformers' defaults), one clear error per bad or unimplemented option."""
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.generation.logits_process import (MinLengthLogitsProcessor, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from colozoo.runtime.generation_config import resolve
from colozoo.runtime.sampling import choose, draw, finish, process

VOCAB = 40
PROMPT = 7


def options(generation_config=None, model_config=None, **given):
    """The Decoding of a generate call on prompts of PROMPT tokens."""
    config = model_config or transformers.LlamaConfig(vocab_size=VOCAB, max_position_embeddings=64)
    model = SimpleNamespace(config=config, generation_config=generation_config)
    return resolve(model, PROMPT, **given)


def next_tokens(scores, ids, decoding, generator=None):
    return choose(process(scores, ids, decoding), decoding, generator)


def scores_and_ids(seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(3, VOCAB, generator=g) * 3
    scores[:, 5] = scores[:, 6]  # ties
    ids = torch.randint(0, VOCAB, (3, 7), generator=g)
    return scores, ids


def transformers_scores(scores, ids, penalty=None, temperature=1.0, top_k=None, top_p=None, min_p=None):
    processors = []
    if penalty is not None:
        processors.append(RepetitionPenaltyLogitsProcessor(penalty))
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k is not None:
        processors.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        processors.append(TopPLogitsWarper(top_p))
    if min_p is not None:
        processors.append(MinPLogitsWarper(min_p))
    for p in processors:
        scores = p(ids, scores)
    return scores


@pytest.mark.parametrize("penalty,temperature,top_k,top_p,min_p", [
    (None, 1.0, None, None, None), (1.3, 1.0, None, None, None), (0.7, 1.0, None, None, None),
    (None, 0.7, None, None, None), (None, 1.0, 5, None, None), (None, 1.0, VOCAB + 10, None, None),
    (None, 1.0, None, 0.8, None), (None, 1.0, None, 1.0, None), (1.2, 0.8, 10, 0.9, None), (None, 1.5, 1, 0.5, None),
    (None, 1.0, None, None, 0.1), (None, 1.0, None, None, 1.0), (None, 1.0, None, None, 0.0), (1.2, 0.8, 10, 0.9, 0.2)])
def test_processed_scores_equal_transformers(penalty, temperature, top_k, top_p, min_p):
    scores, ids = scores_and_ids()
    decoding = options(do_sample=True, temperature=temperature, top_k=top_k or 0, top_p=top_p,
                       repetition_penalty=penalty, min_p=min_p)
    expected = transformers_scores(scores.clone(), ids, penalty, temperature, top_k, top_p, min_p)
    torch.testing.assert_close(process(scores, ids, decoding), expected, rtol=0, atol=0)


def test_sampling_keeps_transformers_default_top_k_of_50():
    scores = torch.randn(2, 80)
    ids = torch.zeros(2, PROMPT, dtype=torch.long)
    kept = (process(scores, ids, options(do_sample=True)) > -float("inf")).sum(-1)
    assert kept.tolist() == [50, 50]


def test_min_length_suppresses_the_end_of_sequence_tokens_until_reached():
    scores, ids = scores_and_ids(3)
    for given in (dict(min_new_tokens=2), dict(min_length=PROMPT + 2)):
        decoding = options(eos_token_id=[5, 9], **given)
        assert decoding.min_length == PROMPT + 2
        expected = MinLengthLogitsProcessor(PROMPT + 2, [5, 9])(ids, scores.clone())
        torch.testing.assert_close(process(scores, ids, decoding), expected, rtol=0, atol=0)
        longer = torch.cat([ids, ids[:, :2]], dim=1)  # reached: nothing suppressed
        torch.testing.assert_close(process(scores, longer, decoding), scores, rtol=0, atol=0)


def test_greedy_is_argmax_after_the_penalty_and_ignores_the_warpers():
    scores, ids = scores_and_ids(1)
    greedy = options(temperature=0.3, top_k=2, repetition_penalty=1.5)
    expected = transformers_scores(scores.clone(), ids, penalty=1.5).argmax(-1)
    assert torch.equal(next_tokens(scores, ids, greedy), expected)


def test_seeded_sampling_is_reproducible_and_samples_the_processed_distribution():
    scores, ids = scores_and_ids(2)
    sampled = options(do_sample=True, temperature=0.9, top_k=8, top_p=0.9)
    draws = [next_tokens(scores, ids, sampled, torch.Generator().manual_seed(5)) for _ in range(2)]
    assert torch.equal(draws[0], draws[1])
    expected = torch.multinomial(process(scores, ids, sampled).softmax(-1), 1,
                                 generator=torch.Generator().manual_seed(5)).squeeze(1)
    assert torch.equal(draws[0], expected)
    kept = process(scores, ids, sampled) > -float("inf")
    many = torch.stack([next_tokens(scores, ids, sampled, torch.Generator().manual_seed(s)) for s in range(50)])
    assert all(kept[row, many[:, row]].all() for row in range(3)), "a filtered token was sampled"


def test_a_draw_is_torch_multinomials_bit_for_bit():
    """Its own algorithm for one sample, without the check that reads the probabilities back to the host."""
    for seed in range(20):
        probs = (torch.randn(4, 33, generator=torch.Generator().manual_seed(seed)) * 3).softmax(-1)
        probs[:, 5] = 0  # a token never drawn
        ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        assert torch.equal(draw(probs, ours), torch.multinomial(probs, 1, generator=theirs).squeeze(1))
        assert torch.equal(ours.get_state(), theirs.get_state()), "the generator must advance alike"


def test_pad_after_eos_as_transformers():
    decoding = options(eos_token_id=[3, 4], pad_token_id=0)
    tokens, unfinished = finish(torch.tensor([3, 9, 4]), torch.tensor([True, True, False]), decoding)
    assert tokens.tolist() == [3, 9, 0] and unfinished.tolist() == [False, True, False]
    none = options(eos_token_id=None, model_config=transformers.LlamaConfig(eos_token_id=None))
    assert finish(torch.tensor([3]), torch.tensor([True]), none)[1].tolist() == [True]
    assert options(eos_token_id=7, model_config=transformers.LlamaConfig(pad_token_id=None)).pad_token_id == 7


def test_options_resolve_as_transformers_resolves_them():
    assert options().max_length == PROMPT + 20  # 20 new tokens by default
    assert options(max_new_tokens=5).max_length == PROMPT + 5 and options(max_length=12).max_length == 12
    saved = transformers.GenerationConfig(eos_token_id=[2, 30], max_new_tokens=9, do_sample=True, temperature=0.6)
    model_config = transformers.LlamaConfig(vocab_size=VOCAB, eos_token_id=2)
    from_file = options(saved, model_config)  # the model's generation_config.json, as transformers reads it
    assert from_file.eos_token_id == (2, 30) and from_file.max_length == PROMPT + 9 and from_file.do_sample
    assert from_file.temperature == 0.6 and from_file.top_k == 50
    overridden = options(saved, model_config, do_sample=False, max_new_tokens=2)
    assert not overridden.do_sample and overridden.max_length == PROMPT + 2 and overridden.eos_token_id == (2, 30)
    assert options(stop_strings="stop").stop_strings == ("stop",)
    # the call's cache choice, a generation config's passed to it; never the one a model's file names for transformers
    hybrid = transformers.GenerationConfig(cache_implementation="hybrid")
    assert options(hybrid).cache_implementation is None
    model = SimpleNamespace(config=transformers.LlamaConfig(vocab_size=VOCAB), generation_config=None)
    assert resolve(model, PROMPT, generation_config=hybrid).cache_implementation == "static"
    assert options(cache_implementation="dynamic", disable_compile=True).disable_compile


@pytest.mark.parametrize("bad,match", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=1.5), "max_new_tokens"),
    (dict(max_length=PROMPT), "max_length"), (dict(do_sample=True, temperature=0), "temperature"),
    (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
    (dict(cache_implementation="offloaded"), "cache_implementation='offloaded' is not implemented"),
    (dict(num_return_sequences=2), "greedy decoding"),
    (dict(num_beams=2, num_return_sequences=3), "num_return_sequences"), (dict(num_beams=2, do_sample=True), "beam")])
def test_bad_options_get_one_clear_error(bad, match):
    with pytest.raises(ValueError, match=match):
        options(**bad)


def test_unknown_and_unimplemented_options_are_refused_not_ignored():
    with pytest.raises(ValueError, match="unknown generate options .'num_beems'."):
        options(num_beems=4)
    with pytest.raises(ValueError, match="does not implement.*no_repeat_ngram_size"):
        options(no_repeat_ngram_size=3)
    assert options(no_repeat_ngram_size=0, cache_implementation="static").max_length == PROMPT + 20  # neutral
