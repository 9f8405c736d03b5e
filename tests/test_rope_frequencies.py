"""The rotary frequencies of every registered model with scaled RoPE (YaRN, llama3, linear, LongRoPE) equal
transformers' at the published settings, where the tiny configs of the family tests cannot tell some options apart:
gpt-oss's YaRN with truncate=False moves its ramp's bounds off the integers, which head_dim 64 shows (2.2e-4 in the
frequencies, whole radians in the angles at 128k positions) and head_dim 16 does not."""
import copy

import pytest
import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from colozoo.layers.rope import RotaryEmbedding, rope_config, rotary_angles
from colozoo.registry import get_config, registry


def scaled_rope_layers():
    """(model name, layer type or None) of every registered model whose RoPE is scaled."""
    found = []
    for name in sorted(registry()):
        params = getattr(get_config(name), "rope_parameters", None) or {}
        per_type = {k: v for k, v in params.items() if isinstance(v, dict)}
        for layer_type, p in (per_type or {None: params}).items():
            if p.get("rope_type", "default") != "default":
                found.append((name, layer_type))
    return found


@pytest.mark.parametrize("name,layer_type", scaled_rope_layers())
def test_registered_frequencies_equal_transformers(name, layer_type):
    config = get_config(name)
    rope_type = (config.rope_parameters[layer_type] if layer_type else config.rope_parameters)["rope_type"]
    expected, factor = ROPE_INIT_FUNCTIONS[rope_type](config, None, **({"layer_type": layer_type} if layer_type else {}))
    ours = RotaryEmbedding(rope_config(config, layer_type) if layer_type else config)
    torch.testing.assert_close(ours.inv_freq, expected, rtol=1e-6, atol=0)
    assert ours.attention_factor == pytest.approx(factor, rel=1e-12)


def test_gpt_oss_yarn_without_truncation_rotates_as_transformers():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    config = get_config("gpt-oss-20b")
    assert config.rope_parameters["truncate"] is False and config.head_dim == 64
    positions = torch.arange(0, config.max_position_embeddings, 997)[None]
    hf = GptOssRotaryEmbedding(config)
    cos, sin = hf(torch.zeros(1, 1, positions.shape[1], config.head_dim), positions)  # gpt-oss keeps one half
    ours = RotaryEmbedding(config)
    our_cos, our_sin = rotary_angles(positions, ours.inv_freq, ours.attention_factor)
    half = config.head_dim // 2
    torch.testing.assert_close(our_cos[..., :half], cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(our_sin[..., :half], sin, rtol=1e-5, atol=1e-5)
    truncated = copy.deepcopy(config)
    truncated.rope_parameters = {**config.rope_parameters, "truncate": True}
    assert (GptOssRotaryEmbedding(truncated).inv_freq - hf.inv_freq).abs().max() > 1e-4  # the setting matters here
