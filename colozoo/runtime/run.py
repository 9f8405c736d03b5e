"""One object per model for how it runs on its mesh: pipeline stages and schedule runners, the data-parallel
wrapping and what the training step needs to know of it, the plan the model was built for, the
context-parallel mode. A model refers to its run as `model.run`; the methods users call on a model that need
more than its layers (`model(...)` on a pipeline or cp mesh, `forward_backward`, `save_pretrained`) are
handed to it.

    run = Run(model)                 # colozoo.build_model / from_pretrained attach one
    parallelize(model, ...)          # fills run.setup: FSDP2 or DDP, mixed precision, checkpointing, offload
    compile_layers(model)            # torch.compile of each layer (colozoo.runtime.compile; compile=True)
"""
from __future__ import annotations

from colozoo.runtime.context_parallel import context_parallel_forward
from colozoo.runtime.generate import generate
from colozoo.runtime.pipeline import build_stage_modules, pipeline_forward
from colozoo.runtime.step import forward_backward


class Run:
    def __init__(self, model, plan=None, cp_mode: str = "ring"):
        self.model = model
        self.pc = model.pc
        self.plan = plan                 # the colozoo.cost plan the model was built for, if any
        self.cp_mode = cp_mode           # "ring" | "all_to_all"
        self.setup = None                # a TrainingSetup once colozoo.runtime.parallelize.parallelize ran
        self.runners: dict = {}          # torch pipelining schedules, per schedule and batch shape
        self.last_step = None            # the StepScales of the last training step (its router losses, for logs)
        self.last_generation = None      # timings and KV-cache size of the last generate()
        self.compiled = None             # the torch.compile backend of the layers (colozoo.runtime.compile)
        self._stages = None
        model.run = self

    @property
    def stages(self):
        """This rank's (virtual) pipeline stages, FSDP/DDP-wrapped once parallelized; built on first use."""
        if self._stages is None:
            self._stages = build_stage_modules(self.model)
        return self._stages

    def set_stages(self, stages):
        self._stages, self.runners = list(stages), {}

    def forward(self, input_ids, attention_mask=None, labels=None, return_logits=False, cp_mode=None, **kwargs):
        """The model's forward on its mesh: through the stages once they exist (a wrapped stage must run its
        hooks) or on a pipeline mesh, else with the batch sharded over cp, else on this rank alone."""
        model = self.model
        model.wants_hidden_states(kwargs.get("output_hidden_states"))  # refused under pp on every rank, before p2p
        if self._stages is None and model.pc.config.pp == 1:
            if model.pc.config.cp > 1:
                return context_parallel_forward(model, input_ids, attention_mask=attention_mask, labels=labels,
                                                return_logits=return_logits, cp_mode=cp_mode or self.cp_mode,
                                                **kwargs)
            return model.local_forward(input_ids, attention_mask=attention_mask, labels=labels,
                                       return_logits=return_logits, **kwargs)
        default, self.cp_mode = self.cp_mode, cp_mode or self.cp_mode  # the stages read it from here
        try:
            return pipeline_forward(model, input_ids, attention_mask=attention_mask, labels=labels,
                                    return_logits=return_logits, **kwargs)
        finally:
            self.cp_mode = default

    def forward_backward(self, input_ids, labels, **kwargs):
        return forward_backward(self.model, input_ids, labels, **kwargs)

    def generate(self, input_ids, attention_mask=None, **options):
        return generate(self.model, input_ids, attention_mask=attention_mask, **options)

    def save_pretrained(self, path, format: str = "colozoo", **kwargs):
        raise NotImplementedError("this Run cannot write files: build the model with colozoo.build_model or "
                                  "colozoo.from_pretrained, whose run can")
