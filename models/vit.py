"""ViT: patch-embedding convolution, CLS token, learned positions, pre-LayerNorm encoder blocks, task heads.

    conv patches (replicated) -> [CLS, patches] + positions -> [LayerNorm -> self_attn (qkv column -> bidirectional
    attention -> out_proj row) -> + LayerNorm -> fc1 column -> act -> fc2 row -> +] x n -> layernorm
    base:                 last hidden state, pooler = act(dense(CLS))
    image_classification: classifier(CLS) (replicated; CE, MSE or BCE as transformers picks)

Under sequence parallelism the CLS + patches sequence (never a multiple of 4) is padded to a multiple of tp;
padded positions are masked out as keys and stripped before the heads.
"""
from __future__ import annotations

import torch
from torch import nn

from colozoo.layers import LayerNorm, scatter_to_sequence
from colozoo.layers.activations import get_activation
from colozoo.layers.batch import BatchContext
from colozoo.layers.vocab import LogitsRequest
from colozoo.models.base import ModelOutput, dropout, require
from colozoo.models.family import Family, Tiny

from .bert import EncoderLayer, EncoderModel, classification_loss


def pair(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x, x)


def num_patches(config) -> int:
    (ih, iw), (ph, pw) = pair(config.image_size), pair(config.patch_size)
    return (ih // ph) * (iw // pw)


class ViTEmbeddings(nn.Module):
    def __init__(self, config, parallel, device=None, dtype=None):
        super().__init__()
        h, kw = config.hidden_size, dict(device=device, dtype=dtype)
        self.group, self.sequence_parallel = parallel.tp_group, parallel.sequence_parallel
        patch = pair(config.patch_size)
        self.projection = nn.Conv2d(config.num_channels, h, kernel_size=patch, stride=patch, **kw)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, h, **kw))
        self.position_embeddings = nn.Parameter(torch.zeros(1, num_patches(config) + 1, h, **kw))
        self.dropout_p = config.hidden_dropout_prob

    def forward(self, pixel_values, batch: BatchContext):
        patches = self.projection(pixel_values.to(self.projection.weight.dtype)).flatten(2).transpose(1, 2)
        hidden = torch.cat([self.cls_token.expand(patches.shape[0], -1, -1), patches], dim=1)
        hidden = hidden + self.position_embeddings
        pad = batch.position_ids.shape[1] - hidden.shape[1]
        if pad:
            hidden = nn.functional.pad(hidden, (0, 0, 0, pad))
        if self.sequence_parallel:
            hidden = scatter_to_sequence(hidden, self.group)
        return dropout(hidden, self.dropout_p, self.training, sharded=self.sequence_parallel)


class ViTPooler(nn.Module):
    def __init__(self, config, device=None, dtype=None):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.pooler_output_size, device=device, dtype=dtype)
        self.act = get_activation(config.pooler_act)

    def forward(self, hidden):
        return self.act(self.dense(hidden[:, 0]))


class ViTModel(EncoderModel):
    """The encoder with its pooler: returns last_hidden_state (CLS + patches) and pooler_output on every rank.
    Called as model(pixel_values, labels=None)."""

    family, title = "vit", "ViT"
    input_embedding = "embeddings.projection"
    TASKS = {"base": "ViTModel", "image_classification": "ViTForImageClassification"}

    @classmethod
    def image_input(cls, config) -> tuple[int, int]:
        return config.num_channels, config.image_size

    def __init__(self, config, parallel=None, layer_ids=None, device=None, dtype=None):
        super().__init__(config, parallel, layer_ids)
        config, parallel = self.config, self.parallel
        kw = dict(device=device, dtype=dtype)
        if self.is_first:
            self.embeddings = ViTEmbeddings(config, parallel, **kw)
        self.layers = nn.ModuleDict({str(i): EncoderLayer(config, i, parallel, pre_norm=True, qkv_bias=config.qkv_bias,
                                                          **kw) for i in self.layer_ids})
        if self.is_last:
            self.layernorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps, group=parallel.tp_group,
                                       sequence_parallel=parallel.sequence_parallel, **kw)
            self.build_head(config, **kw)

    def build_head(self, config, device=None, dtype=None):
        self.pooler = ViTPooler(config, device, dtype)

    def example_inputs(self, batch_size: int, seq_len: int | None = None, device=None) -> dict:
        """A batch of the right shapes (zeros) for symbolic runs such as the profiler's; the image size sets the
        sequence length, so `seq_len` is ignored."""
        c = self.config
        pixels = torch.zeros(batch_size, c.num_channels, *pair(c.image_size), device=device)
        if self.task == "base":
            return {"pixel_values": pixels}
        dtype = torch.long if c.num_labels > 1 else torch.float
        return {"pixel_values": pixels, "labels": torch.zeros(batch_size, dtype=dtype, device=device)}

    def forward(self, pixel_values=None, labels=None, **kwargs) -> ModelOutput:
        return super().forward(pixel_values, None, labels=labels, **kwargs)

    def batch_context(self, pixel_values, attention_mask=None, position_ids=None, rope_length=None) -> BatchContext:
        c = self.config
        if pixel_values.dim() != 4 or pixel_values.shape[1] != c.num_channels:
            raise ValueError(f"pixel_values must be (batch, {c.num_channels}, height, width); got {tuple(pixel_values.shape)}")
        if tuple(pixel_values.shape[2:]) != pair(c.image_size):
            raise ValueError(f"image size {tuple(pixel_values.shape[2:])} does not match the model's "
                             f"{pair(c.image_size)} (position interpolation is not supported)")
        seq, padded = self.sequence_lengths()
        device = pixel_values.device
        positions = torch.arange(padded, device=device).expand(pixel_values.shape[0], padded)
        mask = (torch.arange(padded, device=device) < seq)[None, None, None, :] if padded > seq else None
        return BatchContext(None, positions, seq, causal=False, dense_mask=mask)

    def sequence_lengths(self) -> tuple[int, int]:
        """(CLS + patches, that padded to a multiple of tp under sequence parallelism)."""
        seq = num_patches(self.config) + 1
        padded = seq + (-seq) % self.parallel.tp_size if self.sequence_parallel else seq
        return seq, padded

    def stage_hidden_shape(self, batch: int, pixel_values) -> tuple[int, int, int]:
        """The hidden states between pipeline stages: the (padded) token sequence, this rank's share under SP."""
        padded = self.sequence_lengths()[1]
        return batch, padded // self.parallel.tp_size if self.sequence_parallel else padded, self.config.hidden_size

    def embed(self, pixel_values, batch):
        return self.embeddings(pixel_values, batch)

    def whole_sequence(self, hidden, batch):
        """Whole on every rank, without the sequence-parallel padding."""
        return super().whole_sequence(hidden, batch)[:, :batch.seq_len]

    def head(self, hidden, batch, labels=None, logits: LogitsRequest = LogitsRequest()) -> ModelOutput:
        # transformers' ViT keeps the last layer's output, before the final LayerNorm, in hidden_states
        hidden = self.whole_sequence(self.layernorm(hidden), batch)
        return ModelOutput(last_hidden_state=hidden, pooler_output=self.pooler(hidden),
                           hidden_states=self.output_hidden_states(batch))


class ViTForImageClassification(ViTModel):
    """Classifier on the CLS token; logits (batch, num_labels) are always returned (they are small)."""

    task = "image_classification"

    def build_head(self, config, device=None, dtype=None):
        require(config.num_labels > 0, "ViTForImageClassification needs num_labels > 0")
        self.classifier = nn.Linear(config.hidden_size, config.num_labels, device=device, dtype=dtype)

    def head(self, hidden, batch, labels=None, logits: LogitsRequest = LogitsRequest()) -> ModelOutput:
        scores = self.classifier(self.whole_sequence(self.layernorm(hidden), batch)[:, 0])
        loss = classification_loss(scores, labels, self.config) if labels is not None else None
        return ModelOutput(loss=loss, logits=scores, hidden_states=self.output_hidden_states(batch))

    def loss_token_count(self, labels) -> torch.Tensor:
        return torch.tensor(labels.numel(), device=labels.device)


# 8x8 images in 2x2 patches: 16 patches + CLS = 17 tokens, a multiple of neither 2 nor 4 (sequence-parallel padding)
FAMILIES = (Family("vit", ("vit",), ViTModel, title="ViT", features="base model, image classification",
                   tiny=Tiny(dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=8, patch_size=2, num_channels=3, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, num_labels=3,
                                  architectures=["ViTForImageClassification"]), meshes=("tp2-sp", "pp2"),
                             lora=("q_proj", "v_proj", "o_proj", "fc1"), generates=False)),)
