"""The gated MLP of LLaMA-style decoders (SwiGLU with silu): down_proj(act(gate) * up), gate and up fused into one
column-parallel projection (chunks gate | up, so each rank gets its share of both), down_proj row-parallel.

The norm before the MLP may be handed in (`norm`, with the residual it adds first): the gate | up projection then fuses
it where it can, and SwiGLU fuses with down_proj (RowParallelLinear.swiglu_forward): a training layer on the Triton
path keeps the residual sum and gate | up for backward, neither the normed input nor the product."""
from __future__ import annotations

from torch import nn

from .activations import get_gated_activation, swiglu
from .linear import ColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, inner_size: int, activation: str = "silu", *, bias: bool = False,
                 group=None, sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=bias, group=group, sequence_parallel=sequence_parallel, device=device, dtype=dtype)
        self.gate_up = ColumnParallelLinear(hidden_size, 2 * inner_size, chunks=(inner_size, inner_size), **kw)
        self.down_proj = RowParallelLinear(inner_size, hidden_size, **kw)
        self.gated_act = get_gated_activation(activation)

    def forward(self, x, norm=None, residual=None):
        """down_proj(act(gate) * up) of x, or of norm(x) given the `norm` before the MLP, or of norm(x + residual)
        given a residual too, then returning (output, x + residual)."""
        if residual is not None:
            gate_up, summed = self.gate_up(x, norm=norm, residual=residual)
            return self._down(gate_up), summed
        return self._down(self.gate_up(x, norm=norm))

    def _down(self, gate_up):
        if self.gated_act is swiglu:
            return self.down_proj.swiglu_forward(gate_up)
        return self.down_proj(self.gated_act(*gate_up.chunk(2, dim=-1)))
