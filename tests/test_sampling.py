"""Token choice against transformers' own logits processors: the same scores for the same options, greedy =
argmax, seeded sampling reproducible, pad after eos, one clear error per bad option."""
import pytest
import torch
from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from colozoo.runtime.sampling import GenerationOptions, finish, next_tokens, process

VOCAB = 40


def scores_and_ids(seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(3, VOCAB, generator=g) * 3
    scores[:, 5] = scores[:, 6]  # ties
    ids = torch.randint(0, VOCAB, (3, 7), generator=g)
    return scores, ids


def transformers_scores(scores, ids, penalty=None, temperature=1.0, top_k=None, top_p=None):
    processors = []
    if penalty is not None:
        processors.append(RepetitionPenaltyLogitsProcessor(penalty))
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k is not None:
        processors.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        processors.append(TopPLogitsWarper(top_p))
    for p in processors:
        scores = p(ids, scores)
    return scores


@pytest.mark.parametrize("penalty,temperature,top_k,top_p", [
    (None, 1.0, None, None), (1.3, 1.0, None, None), (0.7, 1.0, None, None), (None, 0.7, None, None),
    (None, 1.0, 5, None), (None, 1.0, VOCAB + 10, None), (None, 1.0, None, 0.8), (None, 1.0, None, 1.0),
    (1.2, 0.8, 10, 0.9), (None, 1.5, 1, 0.5)])
def test_processed_scores_equal_transformers(penalty, temperature, top_k, top_p):
    scores, ids = scores_and_ids()
    options = GenerationOptions(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
                                repetition_penalty=penalty)
    expected = transformers_scores(scores.clone(), ids, penalty, temperature, top_k, top_p)
    torch.testing.assert_close(process(scores, ids, options), expected, rtol=0, atol=0)


def test_greedy_is_argmax_after_the_penalty_and_ignores_the_warpers():
    scores, ids = scores_and_ids(1)
    greedy = GenerationOptions(temperature=0.3, top_k=2, repetition_penalty=1.5)
    expected = transformers_scores(scores.clone(), ids, penalty=1.5).argmax(-1)
    assert torch.equal(next_tokens(scores, ids, greedy), expected)


def test_seeded_sampling_is_reproducible_and_samples_the_processed_distribution():
    scores, ids = scores_and_ids(2)
    options = GenerationOptions(do_sample=True, temperature=0.9, top_k=8, top_p=0.9)
    draws = [next_tokens(scores, ids, options, torch.Generator().manual_seed(5)) for _ in range(2)]
    assert torch.equal(draws[0], draws[1])
    expected = torch.multinomial(process(scores, ids, options).softmax(-1), 1,
                                 generator=torch.Generator().manual_seed(5)).squeeze(1)
    assert torch.equal(draws[0], expected)
    kept = process(scores, ids, options) > -float("inf")
    many = torch.stack([next_tokens(scores, ids, options, torch.Generator().manual_seed(s)) for s in range(50)])
    assert all(kept[row, many[:, row]].all() for row in range(3)), "a filtered token was sampled"


def test_pad_after_eos_as_transformers():
    options = GenerationOptions(eos_token_id=[3, 4], pad_token_id=0)
    tokens, unfinished = finish(torch.tensor([3, 9, 4]), torch.tensor([True, True, False]), options)
    assert tokens.tolist() == [3, 9, 0] and unfinished.tolist() == [False, True, False]
    none = GenerationOptions(eos_token_id=None)
    assert finish(torch.tensor([3]), torch.tensor([True]), none)[1].tolist() == [True]
    with pytest.warns(UserWarning, match="pad_token_id is not set"):
        assert GenerationOptions(eos_token_id=7).pad_token_id == 7


@pytest.mark.parametrize("bad,match", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=1.5), "max_new_tokens"),
    (dict(do_sample=True, temperature=0), "temperature"), (dict(top_k=0), "top_k"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"), (dict(repetition_penalty=0), "repetition_penalty"), (dict(do_sample=1), "do_sample")])
def test_bad_options_get_one_clear_error(bad, match):
    with pytest.raises(ValueError, match=match):
        GenerationOptions(**bad)


def test_unknown_options_are_refused_not_ignored():
    with pytest.raises(ValueError, match="unknown generate options .'num_beams'."):
        GenerationOptions.from_config(object(), num_beams=4)
