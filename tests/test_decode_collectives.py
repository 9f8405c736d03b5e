"""The collectives of decoding: small CPU all-reduces go as an all-gather and a local sum (gloo's all-reduce takes
several rounds of messages), with the bits of gloo's all-reduce at two ranks and the same bits on every rank."""
import torch

from distributed import run_distributed

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
