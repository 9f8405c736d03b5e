"""BERT: word + position + token-type embeddings, post-LayerNorm encoder blocks, pooler, and task heads.

    embeddings (word: vocab-parallel) -> LayerNorm
        -> [self_attn (qkv column -> bidirectional attention -> out_proj row) -> + -> LayerNorm
            -> fc1 column -> act -> fc2 row -> + -> LayerNorm] x n
    base:                    last hidden state, pooler = tanh(dense(first token))
    masked_lm:               dense -> act -> LayerNorm -> vocab-parallel decoder (tied to the word embedding, own bias)
    sequence_classification: pooler -> dropout -> classifier (replicated; CE, MSE or BCE as transformers picks)

Heads run on the full sequence: under sequence parallelism the last hidden state is all-gathered first.
"""
from __future__ import annotations

import copy
import importlib
import torch
import torch.nn.functional as F
from torch import nn

from colozoo.layers import (AttentionSpec, Embedding, LayerNorm, SelfAttention, TransformerLayer,
                            VocabParallelEmbedding, VocabParallelLMHead, scatter_to_sequence,
                            vocab_parallel_cross_entropy)
from colozoo.layers.activations import get_activation
from colozoo.layers.batch import BatchContext
from colozoo.layers.vocab import LogitsRequest, keep_positions, token_mean
from colozoo.models.base import ModelOutput, ParallelModel, check_divisible, dropout, require
from colozoo.models.family import TINY, Family, Tiny


def resolve_task(cls, config, task: str | None) -> type:
    """Our class for `task`, or for the first of config.architectures we know (else the base). Our task classes
    carry the names of the transformers classes whose weights they hold."""
    if task is None:
        by_architecture = {arch: name for name, arch in cls.TASKS.items()}
        by_architecture.update(getattr(cls, "ARCHITECTURE_ALIASES", {}))
        known = [by_architecture[a] for a in (getattr(config, "architectures", None) or []) if a in by_architecture]
        task = known[0] if known else "base"
    if task not in cls.TASKS:
        raise ValueError(f"unknown task {task!r} for {config.model_type}; choose one of {sorted(cls.TASKS)}")
    return getattr(importlib.import_module(cls.__module__), cls.TASKS[task])


def with_architecture(config, architecture: str):
    """The config naming the transformers class whose weights the model holds (the converters read it)."""
    if list(getattr(config, "architectures", None) or []) == [architecture]:
        return config
    config = copy.deepcopy(config)
    config.architectures = [architecture]
    return config


def classification_loss(logits: torch.Tensor, labels: torch.Tensor, config) -> torch.Tensor:
    """The loss transformers' sequence/image classifiers use, chosen by config.problem_type like theirs."""
    n = config.num_labels
    problem = config.problem_type
    if problem is None:
        if n == 1:
            problem = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem = "single_label_classification"
        else:
            problem = "multi_label_classification"
    if problem == "regression":
        return F.mse_loss(logits.squeeze(), labels.squeeze().to(logits.dtype)) if n == 1 else \
            F.mse_loss(logits, labels.to(logits.dtype))
    if problem == "single_label_classification":
        return F.cross_entropy(logits.view(-1, n), labels.view(-1))
    if problem == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))
    raise ValueError(f"unknown problem_type {problem!r}")


class BertEmbeddings(nn.Module):
    def __init__(self, config, parallel, device=None, dtype=None):
        super().__init__()
        h, kw = config.hidden_size, dict(device=device, dtype=dtype)
        self.group, self.sequence_parallel = parallel.tp_group, parallel.sequence_parallel
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, h, padding_idx=config.pad_token_id,
                                                      group=parallel.tp_group,
                                                      sequence_parallel=parallel.sequence_parallel, **kw)
        self.position_embeddings = Embedding(config.max_position_embeddings, h, **kw)
        self.token_type_embeddings = Embedding(config.type_vocab_size, h, **kw)
        self.LayerNorm = LayerNorm(h, eps=config.layer_norm_eps, group=parallel.tp_group,
                                   sequence_parallel=parallel.sequence_parallel, **kw)
        self.dropout_p = config.hidden_dropout_prob

    def _replicated(self, x):
        return scatter_to_sequence(x, self.group) if self.sequence_parallel else x

    def forward(self, input_ids, batch: BatchContext):
        hidden = self.word_embeddings(input_ids, batch.token_rows)
        hidden = hidden + self._replicated(self.token_type_embeddings(batch.token_type_ids))
        hidden, _ = self.LayerNorm(hidden, residual=self._replicated(self.position_embeddings(batch.position_ids)))
        return dropout(hidden, self.dropout_p, self.training, sharded=self.sequence_parallel)


class EncoderLayer(TransformerLayer):
    """A layer of BERT (post-LayerNorm: attention -> + -> LayerNorm -> MLP -> + -> LayerNorm) or of ViT (pre-LayerNorm:
    LayerNorm -> attention -> + -> LayerNorm -> MLP -> +), built from the config fields the two share."""

    def __init__(self, config, layer_idx: int, parallel, pre_norm: bool, qkv_bias: bool = True, device=None,
                 dtype=None):
        check_divisible("the attention heads (num_attention_heads)", config.num_attention_heads, parallel.tp_size)
        check_divisible("the MLP width (intermediate_size)", config.intermediate_size, parallel.tp_size)
        kw = dict(group=parallel.tp_group, sequence_parallel=parallel.sequence_parallel, device=device, dtype=dtype)
        spec = AttentionSpec(config.hidden_size, config.num_attention_heads, head_dim=getattr(config, "head_dim", None),
                             causal=False, qkv_bias=qkv_bias, dropout=config.attention_probs_dropout_prob)
        attention = SelfAttention(spec, layer_idx=layer_idx, **kw)
        super().__init__(attention, config.hidden_size, config.intermediate_size, activation=config.hidden_act,
                         pre_norm=pre_norm, dropout=config.hidden_dropout_prob, norm_eps=config.layer_norm_eps, **kw)


class EncoderModel(ParallelModel):
    """What the encoders (BERT, ViT) share: a class per task head (TASKS, chosen from config.architectures, the
    config marked with the class whose weights the model holds) and sequence parallelism, not context parallelism."""

    task = "base"
    causal = False
    TASKS: dict[str, str] = {}
    title = ""  # the family's name in messages

    @classmethod
    def for_task(cls, config, task=None):
        return resolve_task(cls, config, task)

    def __init__(self, config, parallel=None, layer_ids=None):
        super().__init__(with_architecture(config, self.TASKS[self.task]), parallel, layer_ids)
        require(self.parallel.config.cp == 1,
                f"context parallelism is not supported for {self.title} (use sequence parallelism)")


class BertPooler(nn.Module):
    def __init__(self, config, device=None, dtype=None):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, device=device, dtype=dtype)

    def forward(self, hidden):
        return torch.tanh(self.dense(hidden[:, 0]))


class BertModel(EncoderModel):
    """The encoder with its pooler: returns last_hidden_state and pooler_output (full sequence, on every rank)."""

    family, title = "bert", "BERT"
    input_embedding = "embeddings.word_embeddings"
    TASKS = {"base": "BertModel", "masked_lm": "BertForMaskedLM",
             "sequence_classification": "BertForSequenceClassification"}
    ARCHITECTURE_ALIASES = {"BertForPreTraining": "masked_lm"}  # its NSP head is ignored when loading
    with_pooler = True

    def __init__(self, config, parallel=None, layer_ids=None, device=None, dtype=None):
        super().__init__(config, parallel, layer_ids)
        config, parallel = self.config, self.parallel
        require(not config.is_decoder and not config.add_cross_attention,
                "BERT as a decoder (is_decoder / add_cross_attention) is not supported")
        position_type = getattr(config, "position_embedding_type", "absolute")
        require(position_type == "absolute",
                f"BERT position_embedding_type={position_type!r} is not supported (only 'absolute')")
        kw = dict(device=device, dtype=dtype)
        if self.is_first:
            self.embeddings = BertEmbeddings(config, parallel, **kw)
        self.layers = nn.ModuleDict({str(i): EncoderLayer(config, i, parallel, pre_norm=False, **kw)
                                     for i in self.layer_ids})
        if self.is_last:
            self.build_head(config, parallel, **kw)

    def build_head(self, config, parallel, device=None, dtype=None):
        self.pooler = BertPooler(config, device, dtype)

    def example_inputs(self, batch_size: int, seq_len: int, device=None) -> dict:
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
        return {"input_ids": ids, **self.example_labels(ids)}

    def example_labels(self, ids) -> dict:
        return {}

    def position_limit(self) -> int:
        return self.config.max_position_embeddings

    def batch_context(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                      rope_length=None) -> BatchContext:
        batch = super().batch_context(input_ids, attention_mask, position_ids)
        batch.token_type_ids = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        return batch

    def embed(self, input_ids, batch):
        return self.embeddings(input_ids, batch)

    def head(self, hidden, batch, labels=None, logits: LogitsRequest = LogitsRequest()) -> ModelOutput:
        hidden = self.whole_sequence(hidden, batch)
        return ModelOutput(last_hidden_state=hidden, pooler_output=self.pooler(hidden),
                           hidden_states=self.output_hidden_states(batch))


class BertForMaskedLM(BertModel):
    """Masked-LM loss over positions whose label is not -100 (no shift); logits as `logits` asks."""

    task = "masked_lm"
    tied_embedding = "embeddings.word_embeddings.weight"

    def build_head(self, config, parallel, device=None, dtype=None):
        h, kw = config.hidden_size, dict(device=device, dtype=dtype)
        self.transform = nn.Linear(h, h, **kw)
        self.transform_act = get_activation(config.hidden_act)
        self.transform_norm = nn.LayerNorm(h, eps=config.layer_norm_eps, **kw)
        tied = None
        if config.tie_word_embeddings:
            if not self.is_first:  # the last pipeline stage holds its own copy of the tied word embedding
                self.embeddings = nn.Module()
                self.embeddings.word_embeddings = VocabParallelEmbedding(config.vocab_size, h, group=parallel.tp_group,
                                                                         **kw)
            tied = self.embeddings.word_embeddings
        self.lm_head = VocabParallelLMHead(h, config.vocab_size, bias=True, group=parallel.tp_group,
                                           tied_embedding=tied, **kw)

    def head(self, hidden, batch, labels=None, logits: LogitsRequest = LogitsRequest()) -> ModelOutput:
        states = self.output_hidden_states(batch)
        hidden = self.whole_sequence(hidden, batch)
        logits_local = self.lm_head(self.transform_norm(self.transform_act(self.transform(hidden))))
        loss = None
        if labels is not None:
            per_token = vocab_parallel_cross_entropy(logits_local, labels, self.config.vocab_size, self.tp_group)
            loss = token_mean(per_token.sum(), (labels != -100).sum())
        out = None
        if logits.gather != "none":
            out = logits_local if logits.gather == "vocab_slice" else self.lm_head.full_logits(logits_local)
            out = keep_positions(out, logits.keep)
        return ModelOutput(loss=loss, logits=out, hidden_states=states)

    def loss_token_count(self, labels) -> torch.Tensor:
        return (labels != -100).sum()

    def example_labels(self, ids) -> dict:
        return {"labels": ids}


class BertForSequenceClassification(BertModel):
    """Classifier on the pooled first token; logits (batch, num_labels) are always returned (they are small)."""

    task = "sequence_classification"

    def build_head(self, config, parallel, device=None, dtype=None):
        super().build_head(config, parallel, device, dtype)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels, device=device, dtype=dtype)
        self.classifier_dropout = (config.classifier_dropout if config.classifier_dropout is not None
                                   else config.hidden_dropout_prob)

    def head(self, hidden, batch, labels=None, logits: LogitsRequest = LogitsRequest()) -> ModelOutput:
        pooled = self.pooler(self.whole_sequence(hidden, batch))
        scores = self.classifier(dropout(pooled, self.classifier_dropout, self.training, sharded=False))
        loss = classification_loss(scores, labels, self.config) if labels is not None else None
        return ModelOutput(loss=loss, logits=scores, hidden_states=self.output_hidden_states(batch))

    def loss_token_count(self, labels) -> torch.Tensor:
        return torch.tensor(labels.numel(), device=labels.device)

    def example_labels(self, ids) -> dict:
        dtype = torch.long if self.config.num_labels > 1 else torch.float
        return {"labels": torch.zeros(ids.shape[0], dtype=dtype, device=ids.device)}


FAMILIES = (Family("bert", ("bert",), BertModel, learned_positions=True, title="BERT",
                   features="base model, masked LM, sequence classification",
                   tiny=Tiny(dict(TINY, max_position_embeddings=32, type_vocab_size=2,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
                                  architectures=["BertForMaskedLM"]), meshes=("tp2-sp", "pp2"),
                             lora=("query", "value", "output.dense", "intermediate.dense"), generates=False)),)
