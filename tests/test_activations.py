"""gelu_new on the torch path: torch's fused tanh GeLU in fp32 (one pass), transformers' composed form otherwise."""
import math

import pytest
import torch

from colozoo.layers.activations import get_activation
from parity import close


def _composed(x):  # transformers' NewGELUActivation
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_new(dtype):
    x = (torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 4).to(dtype).requires_grad_()
    ref = x.detach().clone().requires_grad_()
    with torch.autograd.profiler.profile() as prof:
        y = get_activation("gelu_new")(x)
    fused = any(e.name == "aten::gelu" for e in prof.function_events)
    assert fused == (dtype == torch.float32)
    expected = _composed(ref)
    if dtype == torch.bfloat16:
        assert torch.equal(y, expected)  # bit for bit, as transformers rounds it
    else:
        close(y, expected, 1e-6, "gelu_new")
    g = torch.randn_like(y)
    y.backward(g)
    expected.backward(g)
    close(x.grad, ref.grad, 1e-5 if dtype == torch.float32 else 1e-2, "gelu_new gradient")
