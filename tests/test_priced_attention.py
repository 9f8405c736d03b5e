"""What a symbolic trace prices for attention on the meta device: inside `priced_as("cuda")` the path CUDA runs
(grouped-query flash keeping k and v unrepeated, the flash kernel's stand-in for sinks and capped scores), outside it
the torch path; the setting lives in the block's context only."""
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from colozoo.kernels.attention import local_attention, priced_as


class _Calls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.sdpa_key_heads, self.repeats = [], 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.sdpa_key_heads.append(args[1].shape[1])
        if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
            self.repeats += 1
        return func(*args, **kwargs)


def _attend(sinks=None, **options):
    q = torch.empty(1, 8, 16, 32, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.empty(1, 2, 16, 32, device="meta", dtype=torch.bfloat16) for _ in range(2))
    with _Calls() as calls:
        out = local_attention(q, k, v, causal=True, sinks=sinks, **options)
    assert out.shape == q.shape
    return calls


def test_a_cuda_trace_keeps_grouped_keys_unrepeated():
    with priced_as("cuda"):
        calls = _attend()
    assert (calls.sdpa_key_heads, calls.repeats) == ([2], 0)
    calls = _attend()  # the torch path: k and v repeated to the 8 query heads
    assert (calls.sdpa_key_heads, calls.repeats) == ([8], 2)


def test_sinks_are_priced_as_the_fused_kernel_on_cuda_only():
    sinks = torch.empty(8, device="meta", dtype=torch.bfloat16)
    with priced_as("cuda"):
        assert _attend(sinks).sdpa_key_heads == [2]
    assert _attend(sinks).sdpa_key_heads == []  # the torch path computes the scores itself


@pytest.mark.parametrize("unpadded", [True, False])
def test_capped_scores_are_priced_as_the_flash_kernel_where_auto_takes_it(unpadded):
    """Gemma 2's capped scores under a sliding-window mask: the flash kernel on CUDA where no padding empties a row
    (its saved set: q, k, v, output, log-sum-exp), the torch path's whole scores where padding may."""
    window = torch.ones(16, 16, dtype=torch.bool, device="meta")[None, None]
    with priced_as("cuda"):
        calls = _attend(softcap=50.0, mask=window, unpadded=unpadded)
    assert calls.sdpa_key_heads == ([2] if unpadded else [])
    assert _attend(softcap=50.0).sdpa_key_heads == []  # off CUDA: the torch path computes the scores itself


def test_the_setting_ends_with_its_block_even_on_an_error():
    with pytest.raises(RuntimeError), priced_as("cuda"):
        raise RuntimeError
    assert _attend().repeats == 2
