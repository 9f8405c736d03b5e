"""What generation costs on a mesh, before any weight is read: weights and KV cache per rank, the bytes one decode
step reads, and the memory-bandwidth bound on decode tokens/s; and the smallest mesh whose ranks hold it all.

    colozoo profile Llama-3.1-70B --generate --batch-size 8 --seq-len 4096 --mesh tp=4
    colozoo plan Llama-3.1-70B --generate --gpus 8 --batch-size 8 --seq-len 4096

Decoding reads every weight and the whole cache of a rank once per step; a token passes the pipeline stages one
after the other, so a step takes the sum over stages of (stage bytes / HBM bandwidth). The weights per rank come
from the profiler's trace of the sharded model (tied copies, vocabulary padding and replicated norms included).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from colozoo.core.dtypes import NAMES as DTYPES
from colozoo.core.dtypes import human_bytes
from colozoo.cost.hardware import get_hardware
from colozoo.cost.profiler import profile
from colozoo.cost.setup import ProfilerError, Workload, get_config, parse_mesh, plan_of


@dataclass
class GenerationProfile:
    model: str
    mesh: str
    batch_size: int
    seq_len: int                  # prompt + new tokens the cache holds
    dtype: str
    weights_bytes: float          # per rank, on the fullest stage
    kv_cache_bytes: float         # per rank, on the fullest stage
    bytes_per_decode_step: float  # per rank, summed over the stages a token passes
    decode_tokens_per_s_bound: float  # the whole batch, at the hardware's HBM bandwidth
    fits: bool
    hardware: str

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        return (f"{self.model} generating on {self.mesh} ({self.hardware}), batch {self.batch_size} x {self.seq_len} "
                f"tokens, {self.dtype}\n"
                f"  weights per rank      {human_bytes(self.weights_bytes)}\n"
                f"  KV cache per rank     {human_bytes(self.kv_cache_bytes)}\n"
                f"  bytes per decode step {human_bytes(self.bytes_per_decode_step)}\n"
                f"  decode bound          {self.decode_tokens_per_s_bound:,.0f} tokens/s (HBM bandwidth)\n"
                f"  fits                  {'yes' if self.fits else 'no'}")


def whole_model(config):
    """`config`'s model built whole on meta (global shapes, no process groups)."""
    from colozoo.core.mesh import ParallelContext
    from colozoo.models import build_shard

    return build_shard(config, parallel=ParallelContext.virtual(), device="meta")


def attention_caches(config, model=None) -> list[tuple[int | None, object]]:
    """Every layer's sliding window (None: full attention) and its attention module's `cache_width` (tp -> numbers a
    position of one sequence the layer caches on a rank), read off the model built on meta: the window each attention
    module hands the KV cache (Gemma's alternating layers, Qwen2's layer_types, Mistral's and Phi-3's one window for
    all), the keys and values of its kv heads, or MLA's latent and rotary key (DeepSeek-V3: on every tp rank).
    `model`: that model, whole, when the caller has built it."""
    model = whole_model(config) if model is None else model
    caches = []
    for i in range(config.num_hidden_layers):
        attention = next(m for m in model.layers[str(i)].modules() if hasattr(m, "cache_width"))
        caches.append((getattr(attention, "window", None), attention.cache_width))
    return caches


def kv_cache_bytes(config, layers, tp: int, batch_size: int, seq_len: int, element_bytes: int,
                   caches: list | None = None) -> int:
    """Numbers a position each layer caches on one of tp ranks (keys and values: 2 x kv heads / tp x head_dim, one
    replicated kv head per rank when tp is a multiple of the kv heads; MLA: kv_lora_rank + qk_rope_head_dim on every
    rank) x batch x positions kept, summed over `layers` (global layer indices, or a count from layer 0), as
    colozoo's cache holds them: seq_len positions, a sliding-window layer only its window (a ring) when that is
    shorter. `caches`: every layer's window and width, attention_caches(config) when not given."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if kv_heads % tp and tp % kv_heads:
        raise ProfilerError(f"tp={tp} must divide the key/value heads ({kv_heads}) or be a multiple of them")
    caches = attention_caches(config) if caches is None else caches
    layers = range(layers) if isinstance(layers, int) else layers
    numbers = 0
    for i in layers:
        window, width = caches[i]
        numbers += width(tp) * (seq_len if window is None else min(window, seq_len))
    return numbers * batch_size * element_bytes


def profile_generation(name, batch_size: int = 1, seq_len: int = 2048, mesh=None, dtype: str = "bfloat16",
                       hardware="H100-80GB", caches: list | None = None) -> GenerationProfile:
    degrees = parse_mesh(mesh)
    if degrees.cp > 1 or degrees.dp > 1:
        raise ProfilerError("generation profiles a model replica: give tp and pp (cp and dp are 1)")
    hw = get_hardware(hardware)
    config = get_config(name) if isinstance(name, str) else name
    element = DTYPES[dtype].itemsize
    report = profile(name, plan_of(degrees), Workload(seq_len=min(seq_len, 128), dtype=dtype, optimizer="none"))
    caches = attention_caches(config) if caches is None else caches
    stages = []
    for stage in report.stages:
        weights = stage["params"] * element
        cache = kv_cache_bytes(config, stage["layers"], degrees.tp, batch_size, seq_len, element, caches)
        stages.append((weights, cache))
    weights, cache = max(stages, key=sum)
    step_bytes = sum(w + c for w, c in stages)
    return GenerationProfile(model=name if isinstance(name, str) else type(name).__name__, mesh=degrees_text(degrees),
                             batch_size=batch_size, seq_len=seq_len, dtype=dtype, weights_bytes=weights,
                             kv_cache_bytes=cache, bytes_per_decode_step=step_bytes,
                             decode_tokens_per_s_bound=batch_size * hw.hbm_bw / step_bytes,
                             fits=weights + cache <= hw.memory_limit, hardware=hw.name)


def degrees_text(degrees) -> str:
    return f"tp={degrees.tp},pp={degrees.pp}"


def plan_generation(name, gpus: int = 8, batch_size: int = 1, seq_len: int = 2048, dtype: str = "bfloat16",
                    hardware="H100-80GB") -> GenerationProfile:
    """The smallest tp x pp (fewest GPUs, then the fastest bound) whose ranks hold the weights and the cache."""
    config = get_config(name) if isinstance(name, str) else name
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    model = whole_model(config)
    caches = attention_caches(config, model)  # the same on every mesh
    weights, limit = model.num_parameters() * DTYPES[dtype].itemsize, get_hardware(hardware).memory_limit
    candidates = []
    for size in range(1, gpus + 1):
        if weights > size * limit:  # the ranks of a mesh hold every weight at least once between them
            continue
        for tp in (d for d in range(1, size + 1) if size % d == 0):
            pp = size // tp
            if (kv_heads % tp and tp % kv_heads) or config.num_attention_heads % tp or pp > config.num_hidden_layers:
                continue
            found = profile_generation(name, batch_size, seq_len, f"tp={tp},pp={pp}", dtype, hardware, caches)
            if found.fits:
                candidates.append(found)
        if candidates:
            return max(candidates, key=lambda p: p.decode_tokens_per_s_bound)
    raise ProfilerError(f"{name} does not fit on {gpus} x {get_hardware(hardware).name} for generation at batch "
                        f"{batch_size} x {seq_len} tokens in {dtype}")
