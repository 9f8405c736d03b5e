"""What `generate` does, resolved as transformers resolves it: the options given, else those of the generation config
passed in, else the model's `generation_config` (from generation_config.json), else transformers' global defaults;
then the lengths (max_new_tokens over max_length; by default 20 new tokens) and the checks.

colozoo implements the decoding transformers' generate does for a causal LM with these options: greedy, sampling
(temperature, top_k, top_p, min_p), beam search (num_beams, length_penalty, early_stopping), repetition_penalty,
min_length / min_new_tokens, one or several eos_token_id, stop_strings (with the tokenizer), num_return_sequences,
return_dict_in_generate with output_scores / output_logits, use_cache. An option it does not implement, set to
anything but its neutral value, is refused by name rather than ignored.

How it decodes (colozoo.runtime.static_decode): `cache_implementation` "static" (transformers' "hybrid" and
"sliding_window" name the same preallocated cache) asks for the static decode step, "dynamic" for the growing cache;
unset, CUDA takes the static step replayed from a CUDA graph where it applies. `compile_config` (transformers'
CompileConfig) runs that step torch.compile'd with its settings instead; `disable_compile=True` keeps CUDA graphs
and compilation off. Only the call's own options (and the generation config passed to it) choose: a model's
generation_config.json that names a cache for transformers (Gemma 2's "hybrid") changes nothing here.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import transformers

# transformers' defaults for options nobody set (GenerationConfig._get_default_generation_params)
DEFAULTS = dict(max_length=20, min_length=0, do_sample=False, use_cache=True, early_stopping=False, num_beams=1,
                temperature=1.0, top_k=50, top_p=1.0, repetition_penalty=1.0, length_penalty=1.0,
                num_return_sequences=1, output_scores=False, output_logits=False, return_dict_in_generate=False)
IMPLEMENTED = {*DEFAULTS, "max_new_tokens", "min_new_tokens", "stop_strings", "pad_token_id", "eos_token_id",
               "bos_token_id", "min_p", "cache_implementation", "disable_compile", "compile_config"}
STATIC_CACHES = ("static", "hybrid", "sliding_window")  # transformers' preallocated caches: colozoo's static step
CACHES = (*STATIC_CACHES, "dynamic")
# options that change nothing at these values, or concern only how transformers itself caches or compiles
NEUTRAL = dict(typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, encoder_repetition_penalty=1.0, no_repeat_ngram_size=0,
               encoder_no_repeat_ngram_size=0, renormalize_logits=False, remove_invalid_values=False,
               output_attentions=False, output_hidden_states=False, num_beam_groups=1, diversity_penalty=0.0,
               decoder_start_token_id=None, forced_bos_token_id=None, forced_eos_token_id=None, guidance_scale=None)
IGNORED_PREFIXES = ("assistant", "num_assistant", "prompt_lookup", "max_matching", "target_lookbehind", "cache_",
                    "compile", "disable_compile", "max_cache_len", "is_assistant", "transformers_version", "_",
                    "low_memory", "continuous_batching", "prefill_chunk", "use_mtp", "speculation")


@dataclass(frozen=True)
class Decoding:
    """The options of one generate call, resolved: every length a total length, as transformers' loop reads them."""
    max_length: int
    min_length: int
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    repetition_penalty: float | None
    eos_token_id: tuple[int, ...] | None
    pad_token_id: int | None
    num_beams: int
    num_return_sequences: int
    length_penalty: float
    early_stopping: bool | str
    stop_strings: tuple[str, ...] | None
    use_cache: bool
    return_dict_in_generate: bool
    output_scores: bool
    output_logits: bool
    seed: int | None = None
    min_p: float | None = None
    cache_implementation: str | None = None  # "static" or "dynamic" as asked by the call, None: colozoo chooses
    disable_compile: bool = False
    compile_config: object | None = None  # transformers.CompileConfig: the static step torch.compile'd with it

    @property
    def processes_scores(self) -> bool:
        """Anything to do to a step's logits but pick the best (greedy over a vocab-sharded head needs nothing else)."""
        return (self.do_sample or self.repetition_penalty not in (None, 1.0)
                or (self.min_length > 0 and self.eos_token_id is not None))


def _unset(config, defaults: dict) -> set[str]:
    return {name for name, value in config.to_dict().items() if value is None or value == defaults.get(name, object())}


def resolve(model, input_length: int, generation_config=None, **options) -> Decoding:
    """The Decoding of a call with `options` on prompts of `input_length` tokens (padded)."""
    seed = options.pop("seed", None)
    cache = options.get("cache_implementation", getattr(generation_config, "cache_implementation", None))
    fresh = transformers.GenerationConfig().to_dict()
    config = copy.deepcopy(generation_config) if generation_config is not None else transformers.GenerationConfig()
    base = model.generation_config or transformers.GenerationConfig.from_model_config(model.config)
    unset = _unset(config, fresh)
    for name, value in base.to_dict().items():
        if name in unset and value is not None:
            setattr(config, name, value)
    max_length_is_default = "max_length" in _unset(config, fresh) and options.get("max_length") is None
    for name, value in DEFAULTS.items():
        if name in _unset(config, fresh):
            setattr(config, name, value)
    unknown = [name for name in options if name not in fresh]
    if unknown:
        raise ValueError(f"unknown generate options {sorted(unknown)}; generate takes transformers' GenerationConfig "
                         f"fields, of which colozoo implements {sorted(IMPLEMENTED)}")
    for name, value in options.items():
        setattr(config, name, value)
    _refuse_unimplemented(config, fresh)
    return _lengths_and_checks(model, config, input_length, max_length_is_default, seed, cache)


def _refuse_unimplemented(config, fresh: dict):
    refused = {}
    for name, value in config.to_dict().items():
        if name in IMPLEMENTED or name.startswith(IGNORED_PREFIXES) or value is None or value == fresh.get(name):
            continue
        if name in NEUTRAL and value == NEUTRAL[name]:
            continue
        refused[name] = value
    if refused:
        raise ValueError(f"generate options colozoo does not implement: {refused}; it implements {sorted(IMPLEMENTED)}")


def _token_ids(value) -> tuple[int, ...] | None:
    if value is None:
        return None
    ids = (value,) if isinstance(value, int) else tuple(int(v) for v in value)
    return ids or None


def _cache_choice(cache) -> str | None:
    """The call's cache_implementation as colozoo's path: "static", "dynamic" or None (colozoo chooses)."""
    if cache is None:
        return None
    if cache not in CACHES:
        raise ValueError(f"cache_implementation={cache!r} is not implemented; colozoo takes {CACHES} "
                         f"({', '.join(STATIC_CACHES)}: its static decode step) or leaves it unset")
    return "static" if cache in STATIC_CACHES else "dynamic"


def _lengths_and_checks(model, config, input_length: int, max_length_is_default: bool, seed, cache) -> Decoding:
    if config.max_new_tokens is not None:
        if isinstance(config.max_new_tokens, bool) or not isinstance(config.max_new_tokens, int) \
                or config.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {config.max_new_tokens!r}")
        max_length = input_length + config.max_new_tokens
    elif max_length_is_default:  # transformers: 20 new tokens, within the position table
        max_length = input_length + config.max_length
        limit = getattr(model.config, "max_position_embeddings", None)
        max_length = min(max_length, limit) if limit is not None else max_length
    else:
        max_length = config.max_length
    if max_length <= input_length:
        raise ValueError(f"the prompts are {input_length} tokens long but max_length={max_length} leaves no room for a "
                         f"new token; set max_new_tokens instead")
    min_length = config.min_length or 0
    if config.min_new_tokens is not None:
        min_length = input_length + config.min_new_tokens
    eos = _token_ids(config.eos_token_id)
    pad = config.pad_token_id
    if eos is not None and pad is None:
        pad = eos[0]  # transformers pads finished sequences with the first end-of-sequence token
    beams, returned = int(config.num_beams), int(config.num_return_sequences)
    if beams < 1 or returned < 1:
        raise ValueError(f"num_beams and num_return_sequences must be >= 1, got {beams} and {returned}")
    if beams > 1 and config.do_sample:
        raise ValueError("beam sampling (num_beams > 1 with do_sample=True) is not implemented; use num_beams=1 to "
                         "sample or do_sample=False for beam search")
    if beams > 1 and returned > beams:
        raise ValueError(f"num_return_sequences ({returned}) must be at most num_beams ({beams})")
    if beams == 1 and returned > 1 and not config.do_sample:
        raise ValueError(f"greedy decoding returns one sequence per prompt (num_return_sequences={returned}): sample "
                         f"(do_sample=True) or search num_beams >= {returned} beams")
    if config.do_sample and not config.temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {config.temperature!r} (for greedy decoding set "
                         f"do_sample=False)")
    if config.top_k is not None and (isinstance(config.top_k, bool) or int(config.top_k) < 0):
        raise ValueError(f"top_k must be an integer >= 0, got {config.top_k!r}")
    if config.top_p is not None and not 0 < config.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {config.top_p!r}")
    if config.min_p is not None and not 0 <= config.min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {config.min_p!r}")
    if config.repetition_penalty is not None and not config.repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0, got {config.repetition_penalty!r}")
    compiled = config.compile_config
    if compiled is not None and not isinstance(compiled, transformers.CompileConfig):
        raise ValueError(f"compile_config must be a transformers.CompileConfig, got {type(compiled).__name__}")
    stops = config.stop_strings
    stops = (stops,) if isinstance(stops, str) else tuple(stops) if stops else None
    return Decoding(max_length=max_length, min_length=min_length, do_sample=bool(config.do_sample),
                    temperature=float(config.temperature), top_k=int(config.top_k) if config.top_k else None,
                    top_p=config.top_p, repetition_penalty=config.repetition_penalty, eos_token_id=eos,
                    pad_token_id=pad, num_beams=beams, num_return_sequences=returned,
                    length_penalty=float(config.length_penalty), early_stopping=config.early_stopping,
                    stop_strings=stops, use_cache=bool(config.use_cache),
                    return_dict_in_generate=bool(config.return_dict_in_generate),
                    output_scores=bool(config.output_scores), output_logits=bool(config.output_logits), seed=seed,
                    min_p=config.min_p, cache_implementation=_cache_choice(cache),
                    disable_compile=bool(config.disable_compile), compile_config=compiled)
