"""Phi-3: the shared decoder (RoPE, RMSNorm, grouped-query attention, SwiGLU, optional sliding window) with LongRoPE
scaling in the 128k models, an optional partial rotary factor (Phi-3.5 / Phi-4-mini) and dropout on the embeddings
(embd_pdrop) and on both block outputs (resid_pdrop); no linear has a bias. Its checkpoints store the fused
`qkv_proj` and `gate_up_proj` in our [q; k; v] and [gate; up] layouts (converters/phi3.py)."""
from __future__ import annotations

from torch import nn

from colozoo.layers import GatedMLP
from colozoo.models.base import dropout
from colozoo.models.decoder import DecoderLayer, DecoderModel
from colozoo.models.family import Family


class Phi3ForCausalLM(DecoderModel):
    family = "phi3"

    def build_layer(self, layer_idx: int, config, pc, **kw) -> DecoderLayer:
        return DecoderLayer(config, pc, self.build_attention(layer_idx, config, pc, **kw),
                            self.build_mlp(layer_idx, config, pc, **kw), resid_dropout=config.resid_pdrop, **kw)

    @property
    def reencode_length(self) -> int:
        """Where generate encodes the whole sequence again instead of extending its cache: past
        original_max_position_embeddings LongRoPE rotates with its long factors, cached keys included (transformers'
        Phi-3 drops its cache at this length whatever its RoPE type, so greedy decoding stays token-for-token equal)."""
        return self.config.original_max_position_embeddings + 1

    def build_attention(self, layer_idx: int, config, pc, **kw) -> nn.Module:
        return self.attention(layer_idx, qkv_bias=False, out_bias=False, **kw)

    def build_mlp(self, layer_idx: int, config, pc, **kw) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=False, group=pc.tp_group,
                        sequence_parallel=pc.sequence_parallel, **kw)

    def embed(self, input_ids, ctx):
        return dropout(self.embed_tokens(input_ids, ctx.token_rows), self.config.embd_pdrop, self.training,
                       sharded=self.sequence_parallel)


FAMILIES = (Family("phi3", ("phi3",), Phi3ForCausalLM, converter="phi3", gated_mlp=True),)
