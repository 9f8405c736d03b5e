"""What every colozoo model is: this rank's part of a family's model (embed on the first pipeline stage, layers keyed
by their global index on every stage, head on the last), and the model protocol: every hook the runtime and the cost
model read, declared here once with its default.

    class MyModel(ParallelModel):        # a family: build self.layers (a ModuleDict by global layer index), then
        def embed(self, x, batch): ...                            # first stage: input ids (pixels) -> hidden states
        def head(self, hidden, batch, labels=None, logits=LogitsRequest()) -> ModelOutput: ...  # last stage

A model knows only its layers. How it runs on its mesh (pipeline stages, context-parallel sharding of the batch,
data-parallel wrapping, the training step, generation, saving) is the business of its run
(`colozoo.runtime.run.Run`, attached by `colozoo.build_model` / `from_pretrained` as `model.run`): `model(...)`,
`forward_backward`, `generate` and `save_pretrained` are handed to it, and it drives `batch_context`, `embed`, the
layers and `head` stage by stage.
"""
from __future__ import annotations

import torch
from torch import nn

from colozoo.core.errors import UnsupportedConfig, require  # noqa: F401 (the families import them from here)
from colozoo.core.mesh import ParallelContext, single_process
from colozoo.layers.batch import BatchContext
from colozoo.layers.comm import gather_from_parallel
from colozoo.layers.context_parallel import gather_sequence
from colozoo.layers.dropout import dropout  # noqa: F401 (the families import it from here)
from colozoo.layers.vocab import LogitsRequest, VocabParallelEmbedding
from colozoo.models.outputs import ModelOutput


def default_positions(input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """`position_ids`, or 0..seq-1 for every sequence of the batch."""
    if position_ids is not None:
        return position_ids
    b, s = input_ids.shape[:2]
    return torch.arange(s, device=input_ids.device).expand(b, s)


def check_divisible(what: str, value: int, tp: int):
    if value % tp:
        raise UnsupportedConfig(f"tp={tp} must divide {what} ({value})")


class ParallelModel(nn.Module):
    """Base of every family. Subclasses build `self.layers` as a ModuleDict keyed by *global* layer index."""

    # --- what a family declares (class attributes) --------------------------------------------------------------
    family: str = ""                   # the family's name (colozoo.models.family_of gives its traits)
    task: str = "causal_lm"            # the head: causal_lm, or an encoder's (bert, vit)
    input_embedding: str | None = None  # the token embedding module (get_input_embeddings)
    tied_embedding: str | None = None  # parameter a tied LM head shares; the last pp stage holds a copy of it
    causal: bool = True                # batches attend causally (False: encoders)
    reencode_length: int | None = None  # generation encodes the whole sequence again at this length (Phi-3)
    sliding_window: int | None = None  # the window most layers share, in the batch's mask (per-layer ones: their own)
    run = None                         # the colozoo.runtime.run.Run that runs this model on its mesh; set by the run
    generation_config = None           # transformers' GenerationConfig generate starts from (generation_config.json)
    name_or_path = None                # the directory the weights came from (from_pretrained), as in transformers

    def __init__(self, config, parallel: ParallelContext | None = None, layer_ids=None):
        super().__init__()
        self.config = config
        self.parallel = parallel or single_process()
        if layer_ids is None:  # one stage per pp rank, balanced by parameters
            from colozoo.models.partition import model_rank_layers

            layer_ids = model_rank_layers(config, self.parallel.config.pp, self.parallel.rank("pp"))
        self.layer_ids = list(layer_ids)
        self.is_first = self.parallel.is_first_stage
        self.is_last = self.parallel.is_last_stage
        self.rotary = None        # a rotary family's RotaryEmbedding
        self.local_rotary = None  # one for sliding-window layers with their own RoPE base (Gemma 3)

    @staticmethod
    def num_layers(config) -> int:
        return config.num_hidden_layers

    # --- a config's shape, as pipeline partitioning and the cost model weigh it (each family its own keys) ---------
    @classmethod
    def attention_size(cls, config) -> tuple[int, int]:
        """(projection weights, query x key plus probability x value widths summed over heads) of one layer's
        attention: grouped-query attention here (fewer kv heads; Gemma's and Qwen3's head_dim need not be hidden /
        heads), multi-head latent attention in DeepSeek-V3."""
        h, heads = config.hidden_size, config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or h // heads
        return h * head_dim * (2 * heads + 2 * kv_heads), 2 * heads * head_dim  # q and o, k and v

    @classmethod
    def mlp_width(cls, config) -> int:
        """The inner width of a layer's dense MLP."""
        return getattr(config, "intermediate_size", None) or 4 * config.hidden_size

    @classmethod
    def experts(cls, config) -> int:
        """How many routed experts a mixture-of-experts layer holds (0: no such layer)."""
        return 0

    @classmethod
    def expert_width(cls, config) -> int:
        """The inner width of one routed expert."""
        return cls.mlp_width(config)

    @classmethod
    def shared_expert_width(cls, config) -> int:
        """The inner width of the expert every token goes through beside the routed ones (0: none)."""
        return 0

    @classmethod
    def sparse_layers(cls, config) -> int:
        """How many layers hold experts instead of the dense MLP."""
        return cls.num_layers(config) if cls.experts(config) else 0

    @classmethod
    def image_input(cls, config) -> tuple[int, int] | None:
        """(channels, image size) of the images an image model reads; None for a model of tokens."""
        return None

    @property
    def tp_group(self):
        return self.parallel.tp_group

    @property
    def sequence_parallel(self) -> bool:
        return self.parallel.sequence_parallel

    # --- the batch --------------------------------------------------------------------------------------------------
    def position_limit(self) -> int | None:
        """How many positions a learned position table holds (None: no table, rotary or none)."""
        return None

    def check_sequence(self, seq_len: int):
        """The sequence fits the position table (if any) and sequence parallelism."""
        limit = self.position_limit()
        if limit is not None and seq_len > limit:
            raise ValueError(f"sequence length {seq_len} exceeds max_position_embeddings={limit}")
        if self.sequence_parallel and seq_len % self.parallel.tp_size:
            raise ValueError(f"sequence parallel needs the sequence length ({seq_len}) divisible by "
                             f"tp={self.parallel.tp_size}")

    def positions(self, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        """The batch's position ids: given, else 0..seq-1 (OPT counts them over the attention mask)."""
        return default_positions(input_ids, position_ids)

    def batch_context(self, input_ids, attention_mask=None, position_ids=None,
                      rope_length: int | None = None) -> BatchContext:
        """The context of a batch of `input_ids` (batch, seq). `rope_length`: the length of the whole batch these rows
        belong to (generation's pipeline micro-batches), which dynamic and LongRoPE scaling choose by."""
        seq = input_ids.shape[1]
        self.check_sequence(seq)
        positions = self.positions(input_ids, attention_mask, position_ids)
        batch = BatchContext(attention_mask, positions, seq, causal=self.causal, window=self.sliding_window)
        if self.rotary is not None:
            batch.rope_inv_freq, batch.rope_scale = self.rotary(positions, rope_length), self.rotary.attention_factor
        if self.local_rotary is not None:
            batch.local_rope_inv_freq = self.local_rotary(positions, rope_length)
        return batch

    def context(self, input_ids, attention_mask=None, output_hidden_states=None, **inputs) -> BatchContext:
        """The family's batch context, set to keep every layer's hidden states when `output_hidden_states` (or
        the config's, as in transformers) asks for them."""
        batch = self.batch_context(input_ids, attention_mask, **inputs)
        if self.wants_hidden_states(output_hidden_states):
            batch.hidden_states = []
        return batch

    def wants_hidden_states(self, output_hidden_states=None) -> bool:
        """The forward's `output_hidden_states`, else the config's; refused under pipeline parallelism."""
        if output_hidden_states is None:
            output_hidden_states = getattr(self.config, "output_hidden_states", False)
        if not isinstance(output_hidden_states, bool):
            raise ValueError(f"output_hidden_states must be True or False; got {output_hidden_states!r}")
        if output_hidden_states and self.parallel.config.pp > 1:
            raise ValueError(f"output_hidden_states=True is not supported with pipeline parallelism "
                             f"(pp={self.parallel.config.pp}): each stage holds only its own layers' states; run the "
                             f"model at pp=1 to get them")
        return output_hidden_states

    def example_inputs(self, batch_size: int, seq_len: int, device=None) -> dict:
        """A batch of the right shapes (zeros) for symbolic runs such as the profiler's."""
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
        return {"input_ids": ids, "labels": ids}

    # --- the three parts a run drives -----------------------------------------------------------------------------
    def embed(self, x, batch: BatchContext) -> torch.Tensor:
        raise NotImplementedError

    def forward_layers(self, hidden: torch.Tensor, batch: BatchContext, layers=None) -> torch.Tensor:
        """`layers` (default: all of this rank's) in order; with output_hidden_states each input and the last output
        are kept in batch.hidden_states."""
        for layer in (self.layers if layers is None else layers).values():
            if batch.hidden_states is not None:
                batch.hidden_states.append(hidden)
            hidden = layer(hidden, batch)
        if batch.hidden_states is not None:
            batch.hidden_states.append(hidden)
        return hidden

    def head(self, hidden, batch: BatchContext, labels=None, logits: LogitsRequest = LogitsRequest()) -> ModelOutput:
        raise NotImplementedError

    def lm_output(self, normed, batch: BatchContext, labels, logits: LogitsRequest) -> ModelOutput:
        """A causal LM's outputs from its final (normalised) hidden states: loss, logits and hidden states."""
        loss, out = self.lm_head.loss_and_logits(normed, labels, logits, cp=batch.cp)
        return ModelOutput(loss=loss, logits=out, hidden_states=self.output_hidden_states(batch, last=normed))

    def whole_sequence(self, hidden: torch.Tensor, batch: BatchContext) -> torch.Tensor:
        """A (batch, seq, hidden) activation whole on every rank: all-gathered over tp under sequence parallelism
        and over cp under context parallelism (backward keeps this rank's share)."""
        if self.sequence_parallel:
            hidden = gather_from_parallel(hidden, self.tp_group, dim=1)
        if batch.cp is not None:
            hidden = gather_sequence(hidden, batch.cp.group)
        return hidden

    def output_hidden_states(self, batch: BatchContext, last: torch.Tensor | None = None) -> tuple | None:
        """transformers' `hidden_states`: the embedding output, then every layer's output, whole on every rank;
        `last` (a decoder's final norm output, as transformers' decoders give it) replaces the last layer's.
        None unless the forward asked for them."""
        if batch.hidden_states is None:
            return None
        states = batch.hidden_states if last is None else batch.hidden_states[:-1] + [last]
        return tuple(self.whole_sequence(state, batch) for state in states)

    # --- what the runtime and the cost model read -----------------------------------------------------------------
    def loss_token_count(self, labels) -> torch.Tensor:
        """How many label positions the mean loss averages over (causal LM: labels shift by one)."""
        return (labels[..., 1:] != -100).sum()

    def can_generate(self) -> bool:
        """A causal LM (its last stage holds an LM head), as transformers' can_generate."""
        return self.task == "causal_lm"

    def router_stats_width(self) -> int:
        """Length of the MoE router statistics a pipeline stage hands to the next with its hidden states (0: none)."""
        return 0

    def router_statistics(self, batch: BatchContext, device) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} has no MoE router")

    def carries_router_stats(self, output_router_logits: bool | None = None) -> bool:
        """Do pipeline stages hand MoE router statistics on? With the router losses on (the batch's choice, else the
        config's) and pp > 1."""
        if not self.router_stats_width() or self.parallel.config.pp == 1:
            return False
        if output_router_logits is None:
            output_router_logits = getattr(self.config, "output_router_logits", False)
        return bool(output_router_logits)

    def stage_hidden_shape(self, batch: int, inputs: torch.Tensor) -> tuple[int, ...]:
        """The hidden states between pipeline stages for a batch of `inputs`: this rank's share of the sequence
        (context and sequence parallelism)."""
        local_seq = inputs.shape[1] // self.parallel.config.cp
        local_seq = local_seq // self.parallel.tp_size if self.sequence_parallel else local_seq
        return batch, local_seq, self.config.hidden_size

    @torch.no_grad()
    def reset_buffers(self):
        """Recompute non-persistent buffers (RoPE frequencies) after materialising a meta-initialised model."""
        for rotary in (self.rotary, self.local_rotary):
            if rotary is not None:
                rotary.reset_buffers()

    # --- transformers' model surface ------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where this rank's parameters live."""
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of this rank's floating-point parameters (the first one's)."""
        return next(p.dtype for p in self.parameters() if p.is_floating_point())

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """Parameters on this rank, as transformers counts them (a tied weight once; a frozen parameter that
        transformers holds as a buffer, a module's `hf_buffers`, not at all). On a mesh each rank counts its own
        shards: tensor, expert and pipeline parallelism split the count, data parallelism (FSDP) too."""
        embeddings = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding | VocabParallelEmbedding)}
        buffers = {id(getattr(m, name)) for m in self.modules() for name in getattr(m, "hf_buffers", ())}
        unique = {id(p): p for p in self.parameters()}  # named_parameters() would count a tied copy once too
        return sum(p.numel() for key, p in unique.items() if key not in buffers
                   and (p.requires_grad or not only_trainable) and not (exclude_embeddings and key in embeddings))

    def get_input_embeddings(self) -> nn.Module | None:
        """The token embedding (its vocab shard under tp), on the first pipeline stage; None on the others."""
        if self.input_embedding is None or not self.is_first:
            return None
        return self.get_submodule(self.input_embedding)

    def get_output_embeddings(self) -> nn.Module | None:
        """The LM head (its vocab shard under tp), on the last pipeline stage; None elsewhere or without one."""
        return getattr(self, "lm_head", None)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None):
        """Every layer recomputes its forward in backward (transformers' name for activation checkpointing "full")."""
        self._run().gradient_checkpointing_enable()

    # --- what users call: handed to the run ------------------------------------------------------------------------
    def _run(self):
        if self.run is None:
            raise RuntimeError(f"{type(self).__name__} has no Run: build it with colozoo.build_model or "
                               f"colozoo.from_pretrained (a model on its own knows only its layers)")
        return self.run

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        """transformers' forward: a ModelOutput (`return_dict=False`: its tuple), see colozoo.runtime.run.Run.forward."""
        return self._run().forward(input_ids, attention_mask=attention_mask, labels=labels, **kwargs)

    def forward_backward(self, input_ids, labels, attention_mask=None, num_microbatches: int = 1, **kwargs):
        """One training step's forward and backward over the whole mesh; returns the mean loss on every rank."""
        return self._run().forward_backward(input_ids, labels, attention_mask=attention_mask,
                                            num_microbatches=num_microbatches, **kwargs)

    def generate(self, input_ids, attention_mask=None, **options):
        """Token ids (batch, prompt + new) on every rank, as transformers' generate returns them (see
        colozoo.runtime.generate)."""
        return self._run().generate(input_ids, attention_mask=attention_mask, **options)

    def save_pretrained(self, path, format: str = "hf", **kwargs):
        """Write a directory transformers loads (the default, as transformers' save_pretrained; merge_lora=True folds
        LoRA adapters in), with format="colozoo" a sharded checkpoint reshardable onto any mesh (each rank its
        shard), with format="peft" the LoRA adapters as PEFT writes them (colozoo.checkpoint.save)."""
        return self._run().save_pretrained(path, format=format, **kwargs)
