"""The collectives of decoding: small CPU all-reduces go as an all-gather and a local sum (gloo's all-reduce takes
several rounds of messages), with the bits of gloo's all-reduce at two ranks and the same bits on every rank."""
import torch

from distributed import run_distributed
from test_generate import NEW

TIMEOUT = 120


def small_all_reduces():
    import torch.distributed as dist

    from colozoo.core import groups

    results = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for shape in ((), (3,), (4, 1, 512), (2, 7, 9)):
            x = (torch.randn(shape, generator=torch.Generator().manual_seed(dist.get_rank() + 7)) * 1e3).to(dtype)
            expected = x.clone()
            dist.all_reduce(expected)
            plain, dist.all_reduce = dist.all_reduce, None  # the small path must not call it
            try:
                got = groups.all_reduce(x.clone(), dist.group.WORLD)
            finally:
                dist.all_reduce = plain
            results.append(torch.equal(got, expected))
    large = torch.ones(groups.SMALL_ALL_REDUCE)  # above the limit: gloo's all-reduce as before
    results.append(torch.equal(groups.all_reduce(large, dist.group.WORLD), torch.full_like(large, 2.0)))
    return results


def test_small_all_reduce_is_an_all_gather_with_gloos_sum():
    assert all(all(r) for r in run_distributed(small_all_reduces, 2, timeout=TIMEOUT))


def argmax_with_rows(tp):
    from colozoo.core.groups import vocab_range
    from colozoo.core.mesh import init_parallel
    from colozoo.layers.vocab import vocab_parallel_argmax

    pc = init_parallel(tp=tp)
    agree = []
    for vocab, dtype in ((10, torch.float32), (5, torch.bfloat16)):  # 5 over 4 ranks: the last holds only padding
        full = torch.randint(0, 3, (6, vocab), generator=torch.Generator().manual_seed(vocab)).float()  # many ties
        table = torch.randn(vocab, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
        start, stop, per = vocab_range(vocab, pc.tp_group)
        local, weight = torch.full((6, per), 100.0), torch.zeros(per, 8, dtype=dtype)
        local[:, : stop - start], weight[: stop - start] = full[:, start:stop], table[start:stop]
        tokens, rows = vocab_parallel_argmax(local, vocab, pc.tp_group, weight)
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
    vocab.reduce_from_parallel = lambda x, group: calls.append(x.shape) or plain(x, group)
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
