"""What a colozoo model returns: transformers' ModelOutput conventions, without importing transformers.

An ordered dict over the fields that are set, in declaration order, and a dataclass over all of them:
`out.logits`, `out["logits"]`, `out[0]` / `out[:2]` (over the set fields), `"loss" in out`, `out.keys()`,
`out.to_tuple()`. A field that is None is an attribute but no key. The field order is transformers' in every
output class we mirror (CausalLMOutput, MoeCausalLMOutput, BaseModelOutputWithPooling, MaskedLMOutput,
SequenceClassifierOutput, ImageClassifierOutput), so `out[0]` is the same tensor it is in transformers.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, fields

import torch
import torch.utils._pytree as pytree


@dataclass
class ModelOutput(OrderedDict):
    loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None           # MoE load-balancing loss (with output_router_logits)
    logits: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None  # encoders without a head (BertModel, ViTModel)
    pooler_output: torch.Tensor | None = None      # encoders: the pooled first token
    hidden_states: tuple | None = None             # output_hidden_states=True: embeddings, then every layer's output
    router_loss: torch.Tensor | None = None        # the part of `loss` that is a batch statistic (MoE), not a token mean

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                self[f.name] = value

    def __setattr__(self, name, value):
        names = [f.name for f in fields(self)]
        if name in names:
            if value is None:
                if name in self:
                    OrderedDict.__delitem__(self, name)
            else:
                OrderedDict.__setitem__(self, name, value)
                for later in names[names.index(name) + 1:]:  # keys stay in field order whenever a field is set
                    if later in self:
                        self.move_to_end(later)
        super().__setattr__(name, value)

    def __setitem__(self, key, value):
        setattr(self, key, value)

    def __getitem__(self, key):
        if isinstance(key, str):
            return OrderedDict.__getitem__(self, key)
        return self.to_tuple()[key]

    def __delitem__(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} does not support item deletion (set the field to None)")

    def setdefault(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} does not support setdefault")

    def pop(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} does not support pop")

    def update(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} does not support update")

    def __reduce__(self):
        return type(self), tuple(getattr(self, f.name) for f in fields(self))

    def to_tuple(self) -> tuple:
        """The fields that are not None, in order."""
        return tuple(OrderedDict.__getitem__(self, k) for k in self.keys())


# a pytree node as in transformers, so tree utilities (and DDP's static graph) see the tensors inside
pytree.register_pytree_node(ModelOutput, lambda out: (list(out.values()), list(out.keys())),
                            lambda values, keys: ModelOutput(**dict(zip(keys, values))),
                            serialized_type_name=f"{__name__}.ModelOutput")
