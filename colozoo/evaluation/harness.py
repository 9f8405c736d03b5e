"""`ColozooLM`: lm-evaluation-harness's model interface over a colozoo model on any tp x pp mesh.

    import lm_eval, colozoo
    from colozoo.evaluation import ColozooLM, task_manager

    model = colozoo.from_pretrained("./my-model", tp=2, pp=2)          # every rank of the torchrun job
    results = lm_eval.simple_evaluate(model=ColozooLM(model, batch_size=8), tasks=["colozoo_mc"],
                                      task_manager=task_manager())   # the results on rank 0, None elsewhere
    # or by name: simple_evaluate(model="colozoo", model_args="pretrained=./my-model,tp=2,pp=2", ...)

It is the harness's HF backend (`lm_eval.models.huggingface.HFLM`) with the model calls replaced, so requests are
tokenized, sorted, batched, truncated and cut into rolling windows exactly as `lm_eval --model hf` does; only the
scoring (`colozoo.evaluation.scoring`: the continuation's log-probabilities from each rank's vocabulary slice) and the
generation (the model's own `generate`, with the request's stop sequences) run on the mesh. The harness sees one
process (rank 0 of a world of 1) and hands every rank every request; each dp replica scores a share of them (the
pipeline stages and the tensor-parallel ranks of a replica work together on each batch) and every rank gets every
answer back (colozoo.evaluation.replicas); `simple_evaluate` returns the results on rank 0.
"""
from __future__ import annotations

import copy
import os
import time

import torch
import torch.distributed as dist
import transformers
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import Collator, configure_pad_token
from tqdm import tqdm

from colozoo.evaluation.replicas import on_replicas
from colozoo.evaluation.scoring import Span, score_spans
from colozoo.generate_cli import stops_early


def global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


def check_model(model):
    """One line for a model the harness cannot score: no causal LM head, or a mesh that splits the sequence."""
    if not getattr(model, "can_generate", lambda: False)():
        task = getattr(model, "task", None)
        raise ValueError(f"lm-eval scores causal language models; {type(model).__name__} has no causal LM head "
                         f"({task or 'not a colozoo model'})")
    if model.parallel.config.cp > 1:
        raise ValueError(f"evaluation runs on cp=1 (requests are scored and generated whole), got "
                         f"cp={model.parallel.config.cp}")


@register_model("colozoo")
class ColozooLM(HFLM):
    """An lm-eval LM over a colozoo model. `pretrained`: the model (built by colozoo.from_pretrained on this rank's
    mesh), or a name or directory loaded here with `tp`, `pp`, `dtype`, `adapter` and `device`. `tokenizer`: a
    tokenizer or its directory (default: the model's directory). `batch_size`, `max_length`, `max_gen_toks`,
    `add_bos_token`, `prefix_token_id`, `logits_cache`, `truncation`: as the HF backend's (`max_batch_size` is only
    for its batch_size "auto", which this backend refuses). `progress`: progress bars on rank 0. Every rank of the
    job constructs it alike."""

    def __init__(self, pretrained=None, tokenizer=None, batch_size: int | str = 1, max_length: int | None = None,
                 max_gen_toks: int = 256, add_bos_token: bool | None = None, prefix_token_id: int | None = None,
                 logits_cache: bool = True, truncation: bool = False, tp: int = 1, pp: int = 1, dtype=None,
                 adapter: str | None = None, device: str | None = None, max_batch_size: int | None = None,
                 progress: bool = True):
        TemplateLM.__init__(self)  # not HFLM's: it loads a transformers model; the attributes its methods read:
        model = _load(pretrained, tp=tp, pp=pp, dtype=dtype, adapter=adapter, device=device)
        check_model(model)
        self._model, self._config, self.backend = model, model.config, "causal"
        self._device = model.parallel.device
        self.tokenizer = configure_pad_token(_tokenizer(tokenizer, model, add_bos_token), model_config=model.config)
        self.batch_size_per_gpu = _batch_size(batch_size)
        self.add_bos_token, self.custom_prefix_token_id = add_bos_token, prefix_token_id
        self._max_length, self._max_gen_toks = max_length, int(max_gen_toks)
        self.logits_cache, self.truncation = logits_cache, truncation
        self.think_end_token = self.enable_thinking = None
        self.chat_template_args, self.softmax_dtype, self.mixed_precision_dtype = {}, None, None
        self.vocab_size = self.tokenizer.vocab_size
        self.pretrained, self.peft, self.delta = getattr(model, "name_or_path", None), adapter, None
        self.show_progress = progress and global_rank() == 0
        self.counts = {"tokens": 0, "model_s": 0.0}  # what the model read and wrote, and its time (stats only)

    # each dp replica scores its share of the requests (colozoo.evaluation.replicas); progress on rank 0 only
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        # one context's continuations go together: the logits cache scores one-token answers by one row
        return self._on_replicas(super().loglikelihood, requests, disable_tqdm, lambda r: len(r.args[0] + r.args[1]),
                                 together=lambda r: r.args[0])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return self._on_replicas(super().loglikelihood_rolling, requests, disable_tqdm, lambda r: len(r.args[0]))

    def generate_until(self, requests, disable_tqdm: bool = False):
        return self._on_replicas(super().generate_until, requests, disable_tqdm, lambda r: len(r.args[0]))

    def _on_replicas(self, method, requests, disable_tqdm: bool, length, together=None) -> list:
        """`method` (the HF backend's) on this replica's share, dealt by `length` (characters: the backend counts
        the tokens); every answer on every rank, and the tokens every replica's model read and wrote counted."""
        def score(share):
            before = self.counts["tokens"]
            answers = method(share, disable_tqdm=disable_tqdm or not self.show_progress)
            return answers, self.counts["tokens"] - before

        start = self.counts["tokens"]
        answers, tokens = on_replicas(self._model, requests, length, score, together)
        self.counts["tokens"] = start + sum(tokens)
        return answers

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    def get_model_info(self) -> dict:
        """The model's description in the results (the HF backend's asks the Hub for a revision)."""
        parallel = self._model.parallel
        return {"model_dtype": str(next(self._model.parameters()).dtype), "backend": "colozoo",
                "mesh": {"tp": parallel.config.tp, "pp": parallel.config.pp, "dp": parallel.config.dp}}

    # --- loglikelihood and loglikelihood_rolling (the HF backend's) score here --------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """(log-probability, is greedy) of each (context, continuation) token request, in the HF backend's order,
        batches and left truncation; requests sharing every token but the continuation's last (multiple choice with
        one-token answers) are scored by one row, as the backend's logits cache does."""
        collator = Collator(requests, sort_fn=_longest_first, group_fn=_all_but_last_token,
                            group_by="contexts" if self.logits_cache else None)
        progress = tqdm(total=len(requests), disable=disable_tqdm or not self.show_progress,
                        desc="Running loglikelihood requests")
        answers = []
        for chunk in collator.get_batched(n=self.batch_size):
            inputs, spans, keys = [], [], []
            for row, (key, context, continuation) in enumerate(chunk):
                # what fits the context: (context + continuation)[-(max_length + 1):], less the last token
                inputs.append((context + continuation)[-(self.max_length + 1):][:-1])
                for member_key, member_tokens, _ in collator.get_cache(req_str=key, cxt_toks=context,
                                                                       cont_toks=continuation, logits=_NO_LOGITS):
                    spans.append(Span(row, len(inputs[-1]), tuple(member_tokens)))
                    keys.append(member_key)
            scored = self._timed(score_spans, self._model, _right_padded(inputs), spans)
            self.counts["tokens"] += sum(map(len, inputs))
            for key, answer in zip(keys, scored):
                answers.append(answer)
                if key is not None:  # rolling windows are cached per document (loglikelihood_rolling)
                    self.cache_hook.add_partial("loglikelihood", key, answer)
                progress.update(1)
        progress.close()
        return collator.get_original(answers)

    # --- generate_until (the HF backend's) generates here ----------------------------------------------------

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        """The model's greedy or sampled generate, as the HF backend calls transformers' (temperature 0 without
        do_sample: greedy), ending each sequence at a stop sequence where the tokenizer lets generate match text;
        the backend cuts the text at the first stop sequence either way."""
        options = dict(generation_kwargs)
        options["temperature"] = options.get("temperature", 0.0)
        if options["temperature"] == 0.0 and options.get("do_sample") is None:
            options["do_sample"] = False
        if options.get("do_sample") is False and options["temperature"] == 0.0:
            options.pop("temperature")
        stops = [s for s in stop if s]
        if stops_early(self.tokenizer, stops):
            options.update(stop_strings=stops, tokenizer=self.tokenizer)
        out = self._timed(self._model.generate, context, max_length=max_length, pad_token_id=self.tokenizer.pad_token_id,
                          use_cache=True, **options)
        mask = options.get("attention_mask")
        self.counts["tokens"] += int(mask.sum()) if mask is not None else context.numel()
        self.counts["tokens"] += int((out[:, context.shape[1]:] != self.tokenizer.pad_token_id).sum())
        return out

    def _model_call(self, inps, attn_mask=None, labels=None):
        raise NotImplementedError("ColozooLM scores from the vocabulary slices (colozoo.evaluation.scoring); "
                                  "the whole-vocabulary logits the HF backend's _model_call returns are never built")

    def _timed(self, fn, *args, **kwargs):
        started = time.perf_counter()
        was_training = self._model.training
        self._model.eval()
        try:
            return fn(*args, **kwargs)
        finally:
            self._model.train(was_training)
            self.counts["model_s"] += time.perf_counter() - started


_NO_LOGITS = torch.empty(1, 0, 0)  # the logits cache hands its requests back with whatever stands for the logits


def _longest_first(request):
    """The HF backend's order: longest context + continuation first, then by tokens."""
    tokens = request[1] + request[2]
    return -len(tokens), tuple(tokens)


def _all_but_last_token(request):
    return request[-2] + request[-1][:-1]


def _right_padded(rows: list[list[int]]) -> torch.Tensor:
    out = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row)
    return out


def _batch_size(value) -> int:
    if isinstance(value, str) and value.startswith("auto"):
        raise ValueError("batch_size 'auto' is not supported by the colozoo backend (it would probe the memory of one "
                         "device, not of the mesh): give a number")
    size = int(value)
    if size < 1:
        raise ValueError(f"batch_size must be >= 1, got {value}")
    return size


def _load(pretrained, **options):
    if isinstance(pretrained, torch.nn.Module):
        return pretrained
    if pretrained is None:
        raise ValueError("ColozooLM needs the model: a colozoo model, or pretrained=NAME_OR_DIRECTORY")
    from colozoo.api import from_pretrained

    return from_pretrained(str(pretrained), **options)


def _tokenizer(tokenizer, model, add_bos_token):
    """The tokenizer to evaluate with: a copy of one given (configure_pad_token may set or add its pad token, which
    must not change the caller's: a fine-tune's samples and export use it), else the one of the directory named."""
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return copy.deepcopy(tokenizer)
    source = str(tokenizer) if tokenizer is not None else getattr(model, "name_or_path", None)
    if source is None:
        raise ValueError("give the tokenizer (or its directory): the model does not say where it was loaded from")
    options = {"add_bos_token": add_bos_token} if add_bos_token is not None else {}
    return transformers.AutoTokenizer.from_pretrained(source, use_fast=True, **options)
