"""The gated MLP of LLaMA-style decoders (SwiGLU with silu): down_proj(act(gate) * up), gate and up fused into one
column-parallel projection (chunks gate | up, so each rank gets its share of both), down_proj row-parallel."""
from __future__ import annotations

from torch import nn

from .activations import get_gated_activation
from .linear import ColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, inner_size: int, activation: str = "silu", *, bias: bool = False,
                 group=None, sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=bias, group=group, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.gate_up = ColumnParallelLinear(hidden_size, 2 * inner_size, chunks=(inner_size, inner_size), **kw)
        self.down_proj = RowParallelLinear(inner_size, hidden_size, **kw)
        self.gated_act = get_gated_activation(activation)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(self.gated_act(gate, up))
