"""One object per model for how it runs on its mesh: its pipeline stages (built with the run, once), the schedule
runners, the data-parallel setup once parallelized, the plan the model was built for, and how its files are
written. A model refers to its run as `model.run`; what users call on a model that needs more than its layers
(`model(...)`, `forward_backward`, `generate`, `save_pretrained`) is handed to it.

    run = Run(model)                 # colozoo.build_model / from_pretrained attach one
    parallelize(model, ...)          # wraps the stages: FSDP2 or DDP, mixed precision, checkpointing, offload
    compile_layers(model)            # torch.compile of each layer (colozoo.runtime.compile; compile=True)

Every call is the same path whatever ran before it: a forward goes through the stages (at pp = 1 the one stage
holds the whole model), gradients follow the caller, and each call's values are its arguments and results, never
state kept here (what is kept: the stages, the cached schedule runners, and what `parallelize` and the plan set).
"""
from __future__ import annotations

import torch

from colozoo.layers.vocab import LogitsRequest
from colozoo.runtime.generate import generate
from colozoo.runtime.pipeline import pipeline_forward
from colozoo.runtime.stage import build_stages
from colozoo.runtime.step import forward_backward


class Run:
    def __init__(self, model, plan=None, cp_mode: str = "ring", save=None):
        """`save(model, path, format, **options)`: how the model's files are written (colozoo.build_model passes
        colozoo.checkpoint's, which sits above the runtime); `cp_mode`: context parallelism's default attention."""
        self.model = model
        self.pc = model.pc
        self.plan = plan                 # the colozoo.cost plan the model was built for, if any
        self.cp_mode = cp_mode           # "ring" | "all_to_all", unless a forward names its own
        self.setup = None                # a TrainingSetup once colozoo.runtime.parallelize.parallelize ran
        self.runners: dict = {}          # torch pipelining schedules, per schedule and batch shape
        self.compiled = None             # the torch.compile backend of the layers (colozoo.runtime.compile)
        self._save = save
        self.stages = build_stages(model)  # collective over pp; parallelize wraps them in place
        model.run = self

    def set_stages(self, stages):
        """The stages wrapped for data parallelism (parallelize); the schedule runners are built again."""
        self.stages, self.runners = list(stages), {}

    def forward(self, input_ids=None, attention_mask=None, labels=None, return_logits: bool | None = None,
                logits_to_keep=0, return_dict: bool | None = None, cp_mode: str | None = None, **inputs):
        """The model's forward on its mesh, with transformers' arguments and outputs: a ModelOutput on every rank
        (`return_dict=False`: its tuple). Logits come whenever no labels are given or the model is not training;
        with labels in training the LM head is fused with the loss and the logits are skipped (as Liger-Kernel
        does), unless `return_logits=True`. `logits_to_keep`: transformers' (the last n positions, or positions).
        Gradients follow the caller's mode; under pipeline parallelism a forward with labels and gradients is
        refused (the step is `forward_backward`), one without computes no graph across stages."""
        model = self.model
        if input_ids is None:
            raise ValueError(f"{type(model).__name__} needs its inputs (input_ids, or pixel_values for ViT)")
        if return_logits is None:
            return_logits = labels is None or not model.training
        logits = LogitsRequest("full" if return_logits else "none", logits_to_keep)
        cp_mode = cp_mode or self.cp_mode
        model.wants_hidden_states(inputs.get("output_hidden_states"))  # refused under pp on every rank, before p2p
        if self.pc.config.pp == 1:
            stage, = self.stages
            out = stage(input_ids, token_ids=input_ids, attention_mask=attention_mask, labels=labels, logits=logits,
                        cp_mode=cp_mode, **inputs)
        else:
            if labels is not None and torch.is_grad_enabled():
                raise RuntimeError(f"a forward with labels under gradients at pp={self.pc.config.pp} would return a "
                                   f"loss whose backward cannot cross the pipeline stages: train with "
                                   f"model.forward_backward(input_ids, labels, num_microbatches=...), or run the "
                                   f"forward under torch.no_grad() to evaluate")
            with torch.no_grad():
                out = pipeline_forward(model, input_ids, attention_mask=attention_mask, labels=labels, logits=logits,
                                       cp_mode=cp_mode, **{k: v for k, v in inputs.items() if v is not None})
        return out.to_tuple() if return_dict is False else out

    __call__ = forward

    def forward_backward(self, input_ids, labels, **kwargs):
        return forward_backward(self.model, input_ids, labels, **kwargs)

    def generate(self, input_ids, attention_mask=None, **options):
        return generate(self.model, input_ids, attention_mask=attention_mask, **options)

    def save_pretrained(self, path, format: str = "colozoo", **kwargs):
        if self._save is None:
            raise NotImplementedError("this Run was built without a way to write files: build the model with "
                                      "colozoo.build_model or colozoo.from_pretrained")
        return self._save(self.model, path, format=format, **kwargs)
