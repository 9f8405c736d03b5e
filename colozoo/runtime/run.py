"""One object per model for how it runs on its mesh: its pipeline stages (built with the run, once), the data-parallel
setup once parallelized, the plan the model was built for, and how its files are written. The run attaches itself
to the model as `model.run` when it is built (colozoo.build_model and from_pretrained build one): that attribute is
the one link from a model to its run, and what users call on a model that needs more than its layers (`model(...)`,
`forward_backward`, `generate`, `save_pretrained`, `gradient_checkpointing_enable`) is handed over it
(models/base.py's "what users call" methods), never read by the model's own parts.

    run = Run(model)                 # colozoo.build_model / from_pretrained build one
    parallelize(model, ...)          # the one call that changes a run: wraps the stages (FSDP2 or DDP, mixed
                                     # precision, checkpointing, offload, compile), once, before training

Every call is the same path whatever ran before it: a forward goes through the stages by the one driver
(colozoo.runtime.pipeline: at pp = 1 the one stage holds the whole model), gradients follow the caller, and each
call's values are its arguments and results, never state kept here.
"""
from __future__ import annotations

import contextlib

import torch

from colozoo.layers.vocab import LogitsRequest
from colozoo.runtime.generate import generate
from colozoo.runtime.parallelize import sync_tied_embedding
from colozoo.runtime.pipeline import pipeline_forward
from colozoo.runtime.stage import build_stages, unwrap
from colozoo.runtime.step import forward_backward


class Run:
    def __init__(self, model, plan=None, save=None):
        """`save(model, path, format, **options)`: how the model's files are written (colozoo.build_model passes
        colozoo.checkpoint's, which sits above the runtime); `plan`: the colozoo.cost plan the model was built for."""
        self.model = model
        self.parallel = model.parallel
        self.plan = plan                 # the colozoo.cost plan the model was built for, if any
        self.setup = None                # a TrainingSetup once colozoo.runtime.parallelize.parallelize ran
        self._save = save
        self.stages = build_stages(model)  # collective over pp; parallelize wraps them, once
        on_device = not any(p.is_meta for p in model.parameters())
        if model.parallel.config.pp > 1 and model.parallel.mesh is not None and on_device:
            sync_tied_embedding(model)  # built on a device: both copies of a tied embedding start alike
        model.run = self

    @property
    def compiled(self) -> str | None:
        """The torch.compile backend this run's stages run their layers with (colozoo.runtime.compile), or None."""
        return unwrap(self.stages[0]).compiled

    def forward(self, input_ids=None, attention_mask=None, labels=None, return_logits: bool | None = None,
                logits_to_keep=0, return_dict: bool | None = None, cp_mode: str = "ring", inputs_embeds=None,
                use_cache: bool | None = None, **inputs):
        """The model's forward on its mesh, with transformers' arguments and outputs: a ModelOutput on every rank
        (`return_dict=False`: its tuple). Logits come whenever no labels are given or the model is not training;
        with labels in training the LM head is fused with the loss and the logits are skipped (as Liger-Kernel
        does), unless `return_logits=True`. `logits_to_keep`: transformers' (the last n positions, or positions).
        `inputs_embeds` (batch, seq, hidden) stand in for the token embedding's rows of input_ids. `cp_mode`: context
        parallelism's attention, "ring" (the default) or "all_to_all". A forward keeps no cache whatever `use_cache`
        says (generate keeps its own). Gradients follow the caller's mode; under pipeline parallelism a forward with
        labels and gradients is refused (the step is `forward_backward`), one without computes no graph across
        stages."""
        model = self.model
        if inputs_embeds is not None:
            input_ids = _embedded_ids(input_ids, inputs_embeds)
            inputs["token_rows"] = inputs_embeds
        check_inputs(model, input_ids, attention_mask, labels, embedded=inputs_embeds is not None)
        if return_logits is None:
            return_logits = labels is None or not model.training
        logits = LogitsRequest("full" if return_logits else "none", logits_to_keep)
        model.wants_hidden_states(inputs.get("output_hidden_states"))  # refused under pp on every rank, before p2p
        pipelined = self.parallel.config.pp > 1
        if pipelined:
            if labels is not None and torch.is_grad_enabled():
                raise RuntimeError(f"a forward with labels under gradients at pp={self.parallel.config.pp} would "
                                   f"return a loss whose backward cannot cross the pipeline stages: train with "
                                   f"model.forward_backward(input_ids, labels, num_microbatches=...), or run the "
                                   f"forward under torch.no_grad() to evaluate")
        with torch.no_grad() if pipelined else contextlib.nullcontext():
            out = pipeline_forward(model, input_ids, attention_mask=attention_mask, labels=labels, logits=logits,
                                   cp_mode=cp_mode, **{k: v for k, v in inputs.items() if v is not None})
        return out.to_tuple() if return_dict is False else out

    __call__ = forward

    def gradient_checkpointing_enable(self):
        """Every layer recomputes its forward in backward (transformers' gradient_checkpointing_enable; set before
        parallelize, or with its activation_checkpointing option)."""
        from colozoo.runtime.checkpointing import apply_activation_checkpointing, is_checkpointed

        if self.setup is not None:
            raise RuntimeError("gradient_checkpointing_enable() after parallelize(): pass "
                               "activation_checkpointing='full' to parallelize instead")
        if not all(is_checkpointed(layer) for layer in self.model.layers.values()):
            apply_activation_checkpointing(self.model, "full")

    def forward_backward(self, input_ids, labels, **kwargs):
        return forward_backward(self.model, input_ids, labels, **kwargs)

    def generate(self, input_ids, attention_mask=None, **options):
        return generate(self.model, input_ids, attention_mask=attention_mask, **options)

    def save_pretrained(self, path, format: str = "hf", **kwargs):
        if self._save is None:
            raise NotImplementedError("this Run was built without a way to write files: build the model with "
                                      "colozoo.build_model or colozoo.from_pretrained")
        return self._save(self.model, path, format=format, **kwargs)


def _embedded_ids(input_ids, inputs_embeds) -> torch.Tensor:
    """The stand-in ids of a batch given as embeddings: zeros of its (batch, seq) shape, for masks and positions."""
    if input_ids is not None:
        raise ValueError("give input_ids or inputs_embeds, not both")
    if not isinstance(inputs_embeds, torch.Tensor) or inputs_embeds.dim() != 3:
        raise ValueError(f"inputs_embeds must be a (batch, length, hidden) tensor, got "
                         f"{getattr(inputs_embeds, 'shape', type(inputs_embeds).__name__)}")
    return torch.zeros(inputs_embeds.shape[:2], dtype=torch.long, device=inputs_embeds.device)


def check_inputs(model, input_ids, attention_mask, labels, embedded: bool = False):
    """One clear line for the mistakes transformers answers with a raw torch error: no inputs, 1-D or empty ids, ids
    outside the vocabulary, a mask or labels of another shape."""
    name = type(model).__name__
    if input_ids is None:
        raise ValueError(f"{name} needs its inputs: input_ids (or inputs_embeds; pixel_values for ViT)")
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids must be a tensor, got {type(input_ids).__name__}")
    if input_ids.is_floating_point():  # images (ViT) are the model's business
        return
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}"
                         f"{' (one sequence is a batch of one: input_ids[None])' if input_ids.dim() == 1 else ''}")
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} hold no tokens")
    vocab = getattr(model.config, "vocab_size", None)
    known = not embedded and not input_ids.is_meta  # symbolic runs (the profiler's) have shapes only
    if vocab is not None and known and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
        raise ValueError(f"input_ids hold token ids outside the vocabulary [0, {vocab}): "
                         f"{int(input_ids.min())}..{int(input_ids.max())}")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must have input_ids' shape "
                         f"{tuple(input_ids.shape)}")
    if labels is not None and model.task in ("causal_lm", "masked_lm") and labels.shape != input_ids.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must have input_ids' shape {tuple(input_ids.shape)} (one "
                         f"label per token; -100 where no loss is taken)")
    if labels is not None and labels.shape[:1] != input_ids.shape[:1]:
        raise ValueError(f"labels {tuple(labels.shape)} must have one row per sequence ({input_ids.shape[0]})")

