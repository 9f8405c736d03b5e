"""What makes a decoding step fast: greedy decoding under tp gathers the chosen tokens' embedding rows with the
argmax (no embedding all-reduce); the linear layers multiply the few rows of a step as weight @ x^T (torch's linear
of a few rows is slow on CPU)."""
import types

import torch
import torch.nn.functional as F

from distributed import run_distributed
from test_generate import NEW

TIMEOUT = 120


def argmax_with_rows(tp):
    from colozoo.core.groups import vocab_range
    from colozoo.core.mesh import init_parallel
    from colozoo.layers.vocab import vocab_parallel_argmax

    parallel = init_parallel(tp=tp)
    agree = []
    for vocab, dtype in ((10, torch.float32), (5, torch.bfloat16)):  # 5 over 4 ranks: the last holds only padding
        full = torch.randint(0, 3, (6, vocab), generator=torch.Generator().manual_seed(vocab)).float()  # many ties
        table = torch.randn(vocab, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
        start, stop, per = vocab_range(vocab, parallel.tp_group)
        local, weight = torch.full((6, per), 100.0), torch.zeros(per, 8, dtype=dtype)
        local[:, : stop - start], weight[: stop - start] = full[:, start:stop], table[start:stop]
        tokens, rows = vocab_parallel_argmax(local, vocab, parallel.tp_group, weight)
        agree += [torch.equal(tokens, full.argmax(dim=-1)), torch.equal(rows, table[full.argmax(dim=-1)])]
    return agree


def test_sharded_argmax_brings_the_chosen_tokens_embedding_rows():
    assert all(all(r) for r in run_distributed(argmax_with_rows, 4, tp=4, timeout=TIMEOUT))


def embedding_all_reduces(families, eos_from_step=None):
    """Greedy generate at tp2 equals transformers', and the token embedding all-reduces only at the prefill (and
    after a row finished, whose pad token nobody chose)."""
    import test_generate

    from colozoo.layers import vocab

    calls = []
    plain = vocab.reduce_from_parallel
    vocab.reduce_from_parallel = lambda x, group, **kw: calls.append(x.shape) or plain(x, group, **kw)
    try:
        test_generate.greedy_matches_transformers(families, tp=2, eos_from_step=eos_from_step)
    finally:
        vocab.reduce_from_parallel = plain
    return len(calls)


def test_greedy_decoding_at_tp2_needs_no_embedding_all_reduce():
    # per family: hf's generate, the eos-free generate (1 prefill) for each; gpt2 (learned positions), opt, llama
    families = ["gpt2", "opt", "llama"]
    counts = run_distributed(embedding_all_reduces, 2, families=families, timeout=TIMEOUT)
    assert counts == [len(families)] * 2, f"{counts}: one embedding all-reduce per generate (its prefill) expected"
    # a row that ended continues with the pad token: from then on the embedding looks tokens up again
    counts = run_distributed(embedding_all_reduces, 2, families=["llama"], eos_from_step=1, timeout=TIMEOUT)
    assert counts[0] == counts[1] and 1 < counts[0] <= NEW, counts


def microbatched_greedy():
    from test_generate import ours_and_hf, prompts

    from colozoo.core.mesh import init_parallel

    config, hf, model = ours_and_hf("llama", init_parallel(tp=2))
    ids, mask = prompts(config.vocab_size)
    options = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
    return torch.equal(model.generate(ids, attention_mask=mask, num_microbatches=3, **options),
                       hf.generate(ids, attention_mask=mask, **options))


def test_greedy_tp2_decoding_in_micro_batches_takes_each_ones_embedding_rows():
    assert run_distributed(microbatched_greedy, 2, timeout=TIMEOUT) == [True, True]


def test_few_rows_at_inference_multiply_as_weight_times_rows(monkeypatch):
    from colozoo.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelLMHead, matmul

    torch.manual_seed(0)
    layers = [ColumnParallelLinear(16, 24), RowParallelLinear(24, 16), VocabParallelLMHead(16, 40)]
    inputs = [torch.randn(4, 1, 16), torch.randn(4, 1, 24), torch.randn(4, 1, 16)]
    expected = [F.linear(x, m.weight, getattr(m, "bias", None)) for m, x in zip(layers, inputs)]
    plain = F.linear

    def refused(x, weight, bias=None):
        if not torch.is_grad_enabled() and x.numel() // x.shape[-1] <= matmul.FEW_ROWS:
            raise AssertionError("a decoding step's few rows took F.linear")
        return plain(x, weight, bias)

    monkeypatch.setattr(matmul, "F", types.SimpleNamespace(linear=refused))
    with torch.no_grad():
        for layer, x, want in zip(layers, inputs, expected):
            got = layer(x)
            assert got.shape == want.shape and got.is_contiguous()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        many = torch.randn(2, matmul.FEW_ROWS, 16)  # a prefill's rows: F.linear as before
        torch.testing.assert_close(layers[0](many), plain(many, layers[0].weight, layers[0].bias))
    assert torch.equal(layers[0](inputs[0]), expected[0])  # training (grad enabled) keeps F.linear exactly
