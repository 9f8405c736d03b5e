"""Phi-3: the shared decoder (RoPE, RMSNorm, grouped-query attention, SwiGLU, optional sliding window) with LongRoPE
scaling in the 128k models, an optional partial rotary factor (Phi-3.5 / Phi-4-mini) and dropout on the embeddings
(embd_pdrop) and on both block outputs (resid_pdrop); no linear has a bias. Its checkpoints store the fused
`qkv_proj` and `gate_up_proj` in our [q; k; v] and [gate; up] layouts (converters/phi3.py)."""
from __future__ import annotations

from torch import nn

from colozoo.layers import GatedMLP
from colozoo.models.base import dropout
from colozoo.models.decoder import DecoderLayer, DecoderModel
from colozoo.models.family import TINY, Family, Tiny


class Phi3ForCausalLM(DecoderModel):
    family = "phi3"

    def build_layer(self, layer_idx: int, config, parallel, **kw) -> DecoderLayer:
        return DecoderLayer(config, parallel, self.build_attention(layer_idx, config, parallel, **kw),
                            self.build_mlp(layer_idx, config, parallel, **kw), resid_dropout=config.resid_pdrop, **kw)

    @property
    def reencode_length(self) -> int:
        """Where generate encodes the whole sequence again instead of extending its cache: past
        original_max_position_embeddings LongRoPE rotates with its long factors, cached keys included (transformers'
        Phi-3 drops its cache at this length whatever its RoPE type, so greedy decoding stays token-for-token equal)."""
        return self.config.original_max_position_embeddings + 1

    def build_attention(self, layer_idx: int, config, parallel, **kw) -> nn.Module:
        return self.attention(layer_idx, qkv_bias=False, out_bias=False, **kw)

    def build_mlp(self, layer_idx: int, config, parallel, **kw) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=False,
                        group=parallel.tp_group,
                        sequence_parallel=parallel.sequence_parallel, **kw)

    def embed(self, input_ids, batch):
        return dropout(self.embed_tokens(input_ids, batch.token_rows), self.config.embd_pdrop, self.training,
                       sharded=self.sequence_parallel)


# LongRoPE with distinct short and long factors past 11 positions (the tests' sequences are longer; generation
# crosses it, where the cache is encoded again with the long factors), an attention factor from 32 / 11 positions, a
# window of 6, and weights large enough that a cache kept short-rotated changes the greedy tokens
FAMILIES = (Family("phi3", ("phi3",), Phi3ForCausalLM, gated_mlp=True, title="Phi-3",
                   features="causal LM (fused qkv / gate_up checkpoints, LongRoPE, partial rotary, sliding window)",
                   tiny=Tiny(dict(TINY, num_key_value_heads=2, max_position_embeddings=32,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=6,
                                  initializer_range=0.2,
                                  original_max_position_embeddings=11,
                                  rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                   "short_factor": [1.0 + 0.25 * i for i in range(8)],
                                                   "long_factor": [1.0 + 3.0 * i for i in range(8)]}),
                             lora=("qkv_proj", "o_proj", "gate_up_proj"))),)
