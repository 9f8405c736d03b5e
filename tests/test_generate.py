"""model.generate against transformers' generate, token for token (fp32 greedy), for every causal family of the table
(tests/helpers/family_cases.py: each family's declared tiny config) on one process and at tp2 x pp2, the MoE families
at ep 2, some at tp 2 and 4, with left-padded prompts of different lengths; seeded sampling identical on every rank
and across runs; the KV cache holds exactly its formula's elements; bad input refused."""
import pytest
import torch

from distributed import run_distributed
from family_cases import GENERATING, MOE, attention, tiny_kwargs
from parity import hf_causal_lm

from colozoo.core.mesh import init_parallel, single_process

TIMEOUT = 240
NEW = 6
# router losses are for training (transformers' gpt-oss fails to generate with them on)
FAMILIES = {name: {**tiny_kwargs(name), **({"output_router_logits": False} if name in MOE else {})}
            for name in GENERATING}


def prompts(vocab_size: int, lengths=(5, 9, 3)):
    """Left-padded prompts of different lengths: ids and mask (batch, max length)."""
    g = torch.Generator().manual_seed(7)
    width = max(lengths)
    ids = torch.randint(3, vocab_size, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, width - n:] = 1
    return ids.masked_fill(mask == 0, 0), mask


def ours_and_hf(family, parallel, config_kwargs=None, attn_implementation=None, prepare=None):
    """transformers' tiny model of `family` (its declared config unless `config_kwargs` is given; passed through
    `prepare` first, if given) and ours loaded from it."""
    from family_parity import load

    config, hf = hf_causal_lm(family, config_kwargs or FAMILIES[family],
                              attn_implementation=attn_implementation or attention(family))
    if prepare is not None:
        prepare(hf)
    return config, hf, load(hf, config, parallel)[0].eval()


def greedy_matches_transformers(families, tp=1, pp=1, dp=1, ep=1, eos_from_step=None, configs=None, attention=None,
                                new=NEW):
    """`configs`: family -> tiny config for families outside FAMILIES (other test files); `attention`: family ->
    transformers' attention implementation where SDPA will not do (Gemma 2's soft-capping)."""
    parallel = init_parallel(tp=tp, pp=pp, dp=dp, ep=ep) if tp * pp * dp > 1 else single_process()
    results = {}
    for family in families:
        config, hf, model = ours_and_hf(family, parallel, (configs or {}).get(family), (attention or {}).get(family))
        ids, mask = prompts(config.vocab_size)
        options = dict(max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)
        expected = hf.generate(ids, attention_mask=mask, **options)
        if eos_from_step is not None:  # a token the first row writes: it stops there and pads after
            options["eos_token_id"] = int(expected[0, ids.shape[1] + eos_from_step])
            expected = hf.generate(ids, attention_mask=mask, **options)
        got = model.generate(ids, attention_mask=mask, **options)
        assert torch.equal(got, expected), f"{family} tp={tp} pp={pp}:\nours {got.tolist()}\nhf   {expected.tolist()}"
        results[family] = got.tolist()
    return results


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generate_equals_transformers_on_one_process(family):
    greedy_matches_transformers([family])


def test_generate_pads_after_eos_and_stops_when_all_finished():
    greedy_matches_transformers(["gpt2", "llama"], eos_from_step=2)


@pytest.mark.parametrize("tp", [2, 4])
def test_greedy_generate_equals_transformers_tensor_parallel(tp):
    # at tp=4: GPT-2's and OPT's 4 heads split, Mistral's 2 kv heads each replicated on 2 ranks
    families = ["gpt2", "opt", "llama", "mistral", "mixtral"] if tp == 2 else ["gpt2", "opt", "mistral"]
    results = run_distributed(greedy_matches_transformers, tp, families=families, tp=tp, timeout=TIMEOUT)
    assert all(r == results[0] for r in results)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generate_equals_transformers_tp2_pp2(family):
    results = run_distributed(greedy_matches_transformers, 4, families=[family], tp=2, pp=2, timeout=TIMEOUT)
    assert all(r == results[0] for r in results)


@pytest.mark.parametrize("family", MOE)
def test_greedy_generate_moe_expert_parallel(family):
    run_distributed(greedy_matches_transformers, 2, families=[family], dp=2, ep=2, timeout=TIMEOUT)


def sampled(tp, seed):
    parallel = init_parallel(tp=tp) if tp > 1 else single_process()
    config, hf, model = ours_and_hf("llama", parallel)
    ids, mask = prompts(config.vocab_size)
    options = dict(max_new_tokens=NEW, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.2,
                   pad_token_id=0, eos_token_id=None, seed=seed)
    first, again = (model.generate(ids, attention_mask=mask, **options).tolist() for _ in range(2))
    assert first == again, "the same seed must give the same tokens"
    return first


def test_seeded_sampling_is_identical_on_every_rank_and_across_runs():
    ranks = run_distributed(sampled, 2, tp=2, seed=123, timeout=TIMEOUT)
    assert ranks[0] == ranks[1]
    other = run_distributed(sampled, 2, tp=2, seed=124, timeout=TIMEOUT)
    assert other[0] != ranks[0], "another seed should sample other tokens"


def unseeded(tp):
    """Without a seed: the same tokens on every rank, and every rank's global generator advanced alike (dropout
    masks of replicated activations must keep agreeing across tp ranks after a generate during training)."""
    parallel = init_parallel(tp=tp)
    config, hf, model = ours_and_hf("llama", parallel)
    ids, mask = prompts(config.vocab_size)
    torch.manual_seed(11)
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0, eos_token_id=None)
    after_greedy = torch.get_rng_state()
    torch.manual_seed(11)
    assert torch.equal(after_greedy, torch.get_rng_state()), "greedy decoding must not draw random numbers"
    tokens = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, pad_token_id=0,
                            eos_token_id=None)
    return greedy.tolist(), tokens.tolist(), torch.rand(3).tolist()


def test_unseeded_sampling_agrees_across_ranks_and_keeps_their_generators_in_step():
    ranks = run_distributed(unseeded, 2, tp=2, timeout=TIMEOUT)
    assert ranks[0] == ranks[1]


def cache_elements(tp, pp):
    parallel = init_parallel(tp=tp, pp=pp)
    config, hf, model = ours_and_hf("llama", parallel)
    ids, mask = prompts(config.vocab_size)
    stats = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, eos_token_id=None,
                           return_dict_in_generate=True)
    head_dim = config.hidden_size // config.num_attention_heads
    expected = (2 * len(model.layers) * (config.num_key_value_heads // tp) * head_dim * (ids.shape[1] + NEW)
                * ids.shape[0])
    return stats.cache_elements, expected


def test_kv_cache_holds_exactly_its_shard():
    for got, expected in run_distributed(cache_elements, 4, tp=2, pp=2, timeout=TIMEOUT):
        assert got == expected


def test_bad_input_gets_one_clear_error():
    config, hf, model = ours_and_hf("gpt2", single_process())
    ids, mask = prompts(config.vocab_size)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(ids, attention_mask=mask, max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=True, top_p=1.5)
    too_long = torch.zeros(1, 65, dtype=torch.long)
    with pytest.raises(ValueError, match="longer than the model's maximum positions"):
        model.generate(too_long, max_new_tokens=1)
    with pytest.raises(ValueError, match="position table"):
        model.generate(ids, attention_mask=mask, max_new_tokens=60)


def test_cli_streams_text_and_reports_tokens_per_second(tmp_path, capsys):
    """`colozoo generate` on a model directory with a tokenizer: the prompt as given and its greedy continuation (the
    new text transformers writes), then prefill and decode tokens/s."""
    import transformers

    from colozoo.cli import main
    from colozoo.demo_finetune import make_tiny_gpt2

    path = make_tiny_gpt2(tmp_path / "tiny")
    assert main(["generate", str(path), "--prompt", "once upon a time", "--max-new-tokens", "5"]) == 0
    out, err = capsys.readouterr()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    ids = tokenizer("once upon a time", return_tensors="pt")
    expected = hf.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    full = tokenizer.decode(expected[0], skip_special_tokens=True)
    prompt = tokenizer.decode(ids["input_ids"][0], skip_special_tokens=True)
    assert out == "once upon a time" + full[len(prompt):] + "\n"
    assert "prefill" in err and "decode" in err and "tokens/s" in err
    assert main(["generate", str(path), "--max-new-tokens", "5"]) == 1  # no prompt: one clear error
    assert "give at least one --prompt" in capsys.readouterr().err


def test_sliding_window_layers_keep_only_their_window():
    config, hf, model = ours_and_hf("mistral", single_process())  # window 5 < prompt 9 + 6 new tokens
    ids, mask = prompts(config.vocab_size)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, eos_token_id=None,
                         return_dict_in_generate=True)
    head_dim = config.hidden_size // config.num_attention_heads
    window = config.sliding_window
    assert out.cache_elements == (2 * config.num_hidden_layers * config.num_key_value_heads
                                                           * head_dim * window * ids.shape[0])


def sharded_argmax(tp):
    from colozoo.core.groups import vocab_range
    from colozoo.layers.vocab import vocab_parallel_argmax

    parallel = init_parallel(tp=tp)
    agree = []
    for vocab in (10, 5):  # uneven slices; 5 over 4 ranks leaves the last one only padding
        full = torch.randint(0, 3, (6, vocab), generator=torch.Generator().manual_seed(vocab)).float()  # many ties
        start, stop, per = vocab_range(vocab, parallel.tp_group)
        local = torch.full((6, per), 100.0)  # padding columns would win if they were counted
        local[:, : stop - start] = full[:, start:stop]
        agree.append(torch.equal(vocab_parallel_argmax(local, vocab, parallel.tp_group)[0], full.argmax(dim=-1)))
    return agree


def test_vocab_parallel_argmax_is_argmax_of_the_gathered_logits():
    """Greedy decoding at tp > 1 exchanges each slice's best (value, index), ties to the lowest index."""
    assert all(all(r) for r in run_distributed(sharded_argmax, 4, tp=4, timeout=TIMEOUT))
