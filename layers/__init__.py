"""Parallel-aware building blocks. With every degree at 1 they are plain layers."""
from .attention import attention, dense_attention_mask
from .batch import BatchContext, RouterLogits
from .comm import (copy_to_parallel, gather_from_parallel, gather_from_sequence, reduce_from_parallel,
                   reduce_scatter_to_sequence, scatter_to_sequence, split_to_parallel)
from .dropout import dropout
from .linear import ColumnParallelLinear, RowParallelLinear
from .mlp import GatedMLP
from .norm import LayerNorm, RMSNorm
from .shard import Split, gather_tensor, load_shard, local_pieces, shard, shard_tensor, spec_of
from .transformer import AttentionSpec, SelfAttention, TransformerLayer, merge_heads, split_heads
from .vocab import Embedding, VocabParallelEmbedding, VocabParallelLMHead, vocab_parallel_cross_entropy
