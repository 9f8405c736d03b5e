"""Greedy and sampled decoding with a decode step of static shapes, replayed from a CUDA graph on CUDA.

    generate(ids, max_new_tokens=128)                                   # CUDA: captured once, replayed every token
    generate(ids, max_new_tokens=128, cache_implementation="static")    # the same step anywhere (CPU: eagerly)
    generate(ids, cache_implementation="static", compile_config=transformers.CompileConfig(...))  # torch.compile'd

The step (`decode_step`) is one token per sequence through the whole model against a StaticKVCache
(layers.kv_cache): the cache preallocated for max_length, the write position and the positions device tensors the
step moves on itself, attention over every slot under a mask built on the device. Its shapes never change and it
reads nothing back to the host, so it is captured once per call (its batch and max length) and replayed for every
token. Token choice (colozoo.runtime.sampling: the processors, greedy or sampled) runs after each replay as a few
device ops that wait for nothing; the host reads whether every sequence ended only every CHECK_EVERY steps (every
step with a streamer, which copies each token to the host anyway) and cuts the tokens past the step where they all
had, so the result is the eager loop's, token for token, scores and logits included.

Why torch.cuda.CUDAGraph and not torch.compile(mode="reduce-overhead"): the step is already free of host syncs and
of shape changes, which is all a graph needs, so capturing it costs one step's Python time at the start of a call,
where compiling a model costs tens of seconds and again for every new batch or length; the Triton kernels and the
tensor-parallel collectives (NCCL) are captured as they run; a replay is one launch with no guards to check.
torch.compile stays the check that the step has no graph break, no host sync and no recompilation
(tests/test_static_decode.py compiles it with fullgraph=True, dynamic=False), and what a call asks for with
transformers' `compile_config` (fused kernels, for the price of compiling; its mode="reduce-overhead" then replays
CUDA graphs of its own). The graph lives for the call: nothing is kept on the model between calls, and its cache
memory goes when the call returns.

Where it applies: pp = 1 (stages pass micro-batches by the host) and no num_microbatches, no beam search (it
reorders its cache by the host's choice), use_cache, no mixture-of-experts layer (their experts' token counts are
read on the host), fixed RoPE frequencies (dynamic and LongRoPE scaling choose by the longest position), no
re-encoding within max_length (Phi-3), plain weights on the device (not FSDP-sharded or offloaded), eval mode.
`decode_path` says which path a call takes and why. A step reads every slot of the cache (the masked ones too): up
to twice the cache bytes of a growing slice over a call, small beside the weights until the cache outgrows them.
"""
from __future__ import annotations

import contextlib
import time

import torch

from colozoo.layers.kv_cache import StaticKVCache
from colozoo.layers.moe import MoE
from colozoo.layers.vocab import LogitsRequest, vocab_parallel_argmax
from colozoo.runtime.decode_steps import generate_output, generation_positions, shared_seed
from colozoo.runtime.generation_config import Decoding
from colozoo.runtime.pipeline import through_stages
from colozoo.runtime.sampling import choose, eos_ids, finish, process

CHECK_EVERY = 8  # steps between the host's looks at whether every sequence ended (a wait for the device each)


def static_refusal(model, decoding: Decoding, num_microbatches: int | None = None) -> str | None:
    """Why the static step cannot decode this call, or None."""
    parallel = model.parallel
    if parallel.config.pp > 1:
        return f"pipeline parallelism (pp={parallel.config.pp}) hands micro-batches between stages from the host"
    if num_microbatches not in (None, 1):
        return f"num_microbatches={num_microbatches} runs the batch as micro-batches one after another"
    if decoding.num_beams > 1:
        return "beam search reorders its cache by the host's choice of beams every step"
    if not decoding.use_cache:
        return "use_cache=False encodes the whole sequence again every step"
    if model.training:
        return "the model is in training mode (dropout): call model.eval() first"
    if any(isinstance(m, MoE) for m in model.modules()):
        return "its mixture-of-experts layers read their experts' token counts on the host"
    if any(r is not None and (r.dynamic or r.long_after is not None) for r in (model.rotary, model.local_rotary)):
        return "its RoPE scaling (dynamic or LongRoPE) chooses the frequencies by the longest position"
    if model.reencode_length is not None and decoding.max_length >= model.reencode_length:
        return f"{model.family} encodes the whole sequence again at {model.reencode_length} tokens"
    if any(type(p.data) is not torch.Tensor or p.device.type != parallel.device.type for p in model.parameters()):
        return "its weights are sharded (FSDP) or offloaded: hooks around every forward gather them"
    return None


def decode_path(model, decoding: Decoding, num_microbatches: int | None = None) -> tuple[str, str | None]:
    """("cuda_graph" | "compiled" | "static" | "eager", why not the static step) for a greedy or sampled call: the
    static step replayed from a CUDA graph on CUDA where it applies (the default), eagerly with
    cache_implementation="static" elsewhere or with disable_compile, torch.compile'd with a compile_config; a named
    static cache it cannot take is refused."""
    if decoding.cache_implementation == "dynamic":
        return "eager", "cache_implementation='dynamic'"
    refusal = static_refusal(model, decoding, num_microbatches)
    asked = decoding.cache_implementation is not None
    if refusal is not None and asked:
        raise ValueError(f"cache_implementation={decoding.cache_implementation!r} cannot decode this call: {refusal}; "
                         f"leave cache_implementation unset")
    cuda = model.parallel.device.type == "cuda"
    if refusal is not None or not (asked or cuda) or (decoding.disable_compile and not asked):
        return "eager", refusal or ("disable_compile=True" if cuda else "not on CUDA")
    if decoding.disable_compile:
        return "static", None
    return ("compiled" if decoding.compile_config is not None else "cuda_graph" if cuda else "static"), None


def decode_note(model, path: str, why: str | None) -> str | None:
    """Why a call decodes on `path` (`why`: why not on the static step), and what a run compiled for forward and
    training (compile=True) does there: its layers run their eager body on a KV cache."""
    notes = [f"not the static step: {why}"] if why else []
    if model.run.compiled and path in ("eager", "static", "cuda_graph"):
        notes.append("the layers compiled for forward and training run their eager body on the KV cache (compile the "
                     "static step itself with cache_implementation='static' and a compile_config)")
    return "; ".join(notes) or None


class StaticStep:
    """The static step of one call: its cache, its input buffers (the last tokens, their positions) and its
    forward, which writes the cache at the device position and moves both positions on by one."""

    def __init__(self, model, mask: torch.Tensor, max_length: int, logits: LogitsRequest):
        self.model, self.logits = model, logits
        self.cache = StaticKVCache(mask, max_len=max_length)
        self.tokens = torch.zeros(mask.shape[0], 1, dtype=torch.long, device=mask.device)
        self.positions = mask.long().sum(dim=1, keepdim=True)  # the first new token's: the prompt's real tokens

    def prefill(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The prompt into the cache (eagerly: its length is the call's); the last position's logits."""
        out = through_stages(self.model, input_ids, token_ids=input_ids, position_ids=generation_positions(mask),
                             cache=self.cache, logits=self.logits)
        self.cache.advance(input_ids.shape[1])
        self.cache.start_decoding()
        return out.logits[:, -1]

    def forward(self) -> torch.Tensor:
        return decode_step(self.model, self.cache, self.tokens, self.positions, self.logits)

    def compiled(self, config):
        """forward torch.compile'd with a transformers CompileConfig's settings; the tensors a step writes in place
        are marked static, so that mode="reduce-overhead" replays them from CUDA graphs (as transformers' static
        cache does)."""
        for tensor in (self.tokens, self.positions, self.cache.position, *self.cache.buffers_flat()):
            torch._dynamo.mark_static_address(tensor)
        step = torch.compile(decode_step, fullgraph=config.fullgraph, dynamic=config.dynamic, backend=config.backend,
                             mode=config.mode, options=config.options)

        def run():
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are not read again
            return step(self.model, self.cache, self.tokens, self.positions, self.logits)
        return run


def decode_step(model, cache: StaticKVCache, tokens: torch.Tensor, positions: torch.Tensor,
                logits: LogitsRequest) -> torch.Tensor:
    """The next-token logits (batch, vocab or this rank's vocab slice) of `tokens` (batch, 1) at `positions`
    (batch, 1); the cache takes them at cache.position, and both positions move on by one. Static shapes, no host
    sync: what torch.compile(fullgraph=True, dynamic=False) and a CUDA graph capture."""
    cache.masks = {}  # this step's masks are built in this step (a replay rebuilds them from the new position)
    out = through_stages(model, tokens, token_ids=tokens, position_ids=positions, cache=cache, logits=logits)
    cache.position.add_(1)
    positions.add_(1)
    return out.logits[:, -1]


class CapturedStep:
    """`step()` replayed from a CUDA graph: the first call runs it eagerly on a side stream (what happens once —
    Triton's compilation, cuBLAS's workspace, lazy initialisation — happens outside the capture), the second
    captures it on that stream, and every call from then on replays it. Returns the step's output, which each replay
    overwrites. (torch.cuda.CUDAGraph's own capture_begin/capture_end: the torch.cuda.graph context would also
    synchronise, empty the allocator's cache and maybe collect garbage at every call of generate.)"""

    def __init__(self, step):
        self.step, self.graph, self.output, self.stream = step, None, None, torch.cuda.Stream()

    def __call__(self) -> torch.Tensor:
        if self.graph is None:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                if self.output is None:  # the first call: eagerly
                    self.output = self.step()
                else:  # the second: captured (nothing runs), then replayed below
                    self.graph, self.output = self._capture()
            torch.cuda.current_stream().wait_stream(self.stream)
            if self.graph is None:
                return self.output
        self.graph.replay()
        return self.output

    def _capture(self) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin()
        try:
            output = self.step()
        except BaseException:
            with contextlib.suppress(Exception):  # the step's error, not the broken capture's
                graph.capture_end()
            raise
        graph.capture_end()
        return graph, output


def _synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def static_sample(model, input_ids, mask, decoding: Decoding, stop, streamer, path: str):
    """transformers' greedy / sampled decoding (colozoo.runtime.generate's loop, token for token) on the static
    step, replayed from a CUDA graph when `path` is "cuda_graph"."""
    parallel, device = model.parallel, input_ids.device
    batch, prompt = input_ids.shape
    keep_scores = decoding.return_dict_in_generate and decoding.output_scores
    keep_logits = decoding.return_dict_in_generate and decoding.output_logits
    sharded_argmax = parallel.tp_size > 1 and not decoding.processes_scores and not (keep_scores or keep_logits)
    step = StaticStep(model, mask, decoding.max_length, LogitsRequest("vocab_slice" if sharded_argmax else "full", 1))
    generator = _generator(decoding, parallel, device)
    eos, stops = eos_ids(decoding, device), decoding.eos_token_id is not None or stop is not None
    padding = (mask != 0).int().argmax(dim=1)
    sequences = torch.cat([input_ids, input_ids.new_zeros(batch, decoding.max_length - prompt)], dim=1)
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    ended = torch.zeros(decoding.max_length - prompt, dtype=torch.bool, device=device)  # all ended at each step
    scores, raw_logits = [], []
    check_every = 1 if streamer is not None else CHECK_EVERY
    if streamer is not None:
        streamer.put(input_ids.cpu())
    started = time.perf_counter()
    logits = step.prefill(input_ids, mask)
    run = _runner(step, path, decoding)  # after the prefill, which allocates the cache
    steps = 0
    for length in range(prompt, decoding.max_length):
        if length > prompt:
            logits = run()
        if sharded_argmax:
            tokens = vocab_parallel_argmax(logits, model.config.vocab_size, parallel.tp_group)[0]
        else:
            processed = process(logits, sequences[:, :length], decoding, padding, eos)
            tokens = choose(processed, decoding, generator)
            scores += [processed] if keep_scores else []
            raw_logits += [logits.to(torch.float32, copy=True)] if keep_logits else []  # replays overwrite logits
        tokens, unfinished = finish(tokens, unfinished, decoding, eos)
        sequences[:, length] = tokens
        step.tokens.copy_(tokens[:, None])
        if stop is not None:
            unfinished = unfinished & ~stop(sequences[:, :length + 1], None).to(device)
        steps += 1
        if steps == 1:
            _synchronize(device)
            prefill_s, started = time.perf_counter() - started, time.perf_counter()
        if streamer is not None:
            streamer.put(tokens.cpu())
        if stops:
            ended[steps - 1] = ~unfinished.any()
            if steps % check_every == 0 and bool(ended[steps - 1]):  # the host looks: a wait for the device
                break
    if stops and bool(ended[steps - 1]):  # cut the steps past the one where every sequence had ended
        steps = int(ended.int().argmax()) + 1
    _synchronize(device)
    timings = {"prefill_s": prefill_s, "decode_s": time.perf_counter() - started, "decode_steps": steps - 1,
               "batch": batch, "prompt_tokens": prompt, "new_tokens": steps}
    if streamer is not None:
        streamer.end()
    sequences = sequences[:, :prompt + steps]
    if not decoding.return_dict_in_generate:
        return sequences
    return generate_output(sequences=sequences, scores=tuple(scores[:steps]) if keep_scores else None,
                           logits=tuple(raw_logits[:steps]) if keep_logits else None, timings=timings,
                           cache_elements=step.cache.numel(), decode_path=path)


def _generator(decoding: Decoding, parallel, device):
    """Sampling's random numbers: seeded alike on every rank (or by the caller's seed); None when greedy."""
    if not decoding.do_sample:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(decoding.seed if decoding.seed is not None else shared_seed(parallel))
    return generator


def _runner(step, path: str, decoding: Decoding):
    """What runs a decoding step: the step's forward replayed from a CUDA graph, compiled, or eager."""
    if path == "cuda_graph":
        return CapturedStep(step.forward)
    if path == "compiled":
        return step.compiled(decoding.compile_config)
    return step.forward
