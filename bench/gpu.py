"""colozoo against its peers on one CUDA GPU in bf16, at the Llama-3.2-1B, Qwen3-1.7B and Gemma-2-2B shapes (random
weights, the configs of colozoo's registry; the same weights on both sides). One JSON line per case:

gpu/train/<model>/<batch>x<seq> (4x2048, 8x4096, 1x16384): zero_grad + forward with labels + backward, against
transformers patched by Liger-Kernel (`liger_kernel.transformers.apply_liger_kernel_to_<family>`: RMSNorm, RoPE,
SwiGLU / GeGLU, the fused linear cross entropy; sdpa attention, which leaves Gemma 2's score cap out). Median ms of
--repeats steps; memory = the peak allocated during a step above what was allocated before it (the weights: the
gradients are freed by zero_grad). ratio = colozoo's tokens/s over Liger's; memory_ratio = colozoo's step memory over
Liger's (< 1: colozoo needs less).

gpu/decode/<model>/b<batch> (1 and 16): greedy decoding of --new tokens after a --prompt-token prompt. colozoo's
generate (on CUDA its decode step replayed from a CUDA graph) against transformers' generate (DynamicCache), and the
roofline: batch / ((the weights' bytes + the KV cache's bytes at the mean length) / the bandwidth of a
device-to-device copy measured in the same run, bytes read + written per second). Decode tokens/s = batch x (new - 1)
/ (time of generate(new) - time of generate(1)), medians of --repeats runs alternating the sides. ratio = colozoo's
decode tokens/s over transformers'.

gpu/decode_compiled/<model>/b<batch>: transformers' static cache with torch.compile (generate with
cache_implementation="static", which compiles its decoding forward on CUDA: the first call, not timed, compiles)
against colozoo's generate; last, since compiling takes about a minute a case.

gpu/hardware (with --hardware-out JSON, first): the fields the planner prices kernels with, measured on this device by
colozoo.cost.measure (sustained and burst matmul rates, a grid of GEMM shapes against the model's tile and wave
quantization, fused attention, HBM copy and read, pinned host copies, a tiny kernel) and written as a preset file for
`colozoo plan --hardware JSON`; ratio = the sustained matmul rate over the datasheet preset's (none on the CPU).

Cases run in that order of importance within --budget seconds: a case that would not fit in what is left prints
{"bench": ..., "skipped": "out of time: ..."} (so do cases whose peer cannot run: "skipped": why), a case that fails
prints its "error". --dry-run runs every case on the CPU at tiny sizes in fp32 (Liger off; what
tests/test_bench_gpu.py checks): none of its numbers is a GPU's.

    python bench/gpu.py [--budget 270] [--models llama,qwen3,gemma2] [--kinds decode,train,decode_compiled]
                        [--train-shapes 4x2048,8x4096,1x16384] [--repeats 5] [--hardware-out gpu.json]
                        [--dry-run]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers  # noqa: E402

from colozoo.cost.measure import synchronize  # noqa: E402

MODELS = {"llama": "Llama-3.2-1B", "qwen3": "Qwen3-1.7B", "gemma2": "gemma-2-2b"}
CAUSAL_LM = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM"}
TRAIN_SHAPES = ((4, 2048), (8, 4096), (1, 16384))
DECODE_BATCHES = (1, 16)
KINDS = ("decode", "train", "decode_compiled")
# seconds a case takes on an H100, first guesses (model build included); a finished case of a kind replaces them
ESTIMATE_S = {"hardware": 25.0, "train": 20.0, "decode": 15.0, "decode_compiled": 90.0}
DRY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, vocab_size=256, max_position_embeddings=512)


def sizes(args) -> dict:
    """Token shapes of the run: the real ones, or tiny ones for a dry run."""
    if args.dry_run:
        return dict(train=((2, 16), (1, 32)), batches=(1, 2), prompt=8, new=4)
    return dict(train=args.train_shapes, batches=DECODE_BATCHES, prompt=args.prompt, new=args.new)


def cases(args) -> list[tuple[str, str, tuple]]:
    """(kind, family, shape) in order of importance: every model's decoding and smallest training step, then the
    larger steps, then the compiled peer."""
    shapes, families = sizes(args), args.models.split(",")
    first = [case for f in families for case in [("decode", f, (b,)) for b in shapes["batches"]]
             + [("train", f, shapes["train"][0])]]
    larger = [("train", f, shape) for f in families for shape in shapes["train"][1:]]
    every = first + larger + [("decode_compiled", f, (b,)) for f in families for b in shapes["batches"]]
    return [case for case in every if case[0] in args.kinds.split(",")]


class Clock:
    """The run's budget: whether a case of a kind still fits (by what the last one of its kind took)."""

    def __init__(self, budget: float):
        self.budget, self.deadline, self.took = budget, time.monotonic() + budget, dict(ESTIMATE_S)

    def refusal(self, kind: str) -> str | None:
        left = self.deadline - time.monotonic()
        if left < self.took[kind]:
            return (f"out of time: a {kind} case takes ~{self.took[kind]:.0f} s, {max(left, 0):.0f} s left of "
                    f"{self.budget:.0f}")
        return None

    def record(self, kind: str, seconds: float):
        self.took[kind] = seconds


def model_config(family: str, args):
    from colozoo.registry import get_config

    config = copy.deepcopy(get_config(MODELS[family]))
    if args.dry_run:
        for name, value in DRY.items():
            setattr(config, name, value)
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:DRY["num_hidden_layers"]]
    return config


@contextlib.contextmanager
def liger_patched(family: str):
    """transformers' modeling module of `family` patched by Liger-Kernel while models are built, then restored (Liger
    patches module globals and the LM class's forward: the decoding cases keep plain transformers)."""
    import liger_kernel.transformers as liger

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    saved, lm = dict(vars(module)), getattr(module, CAUSAL_LM[family])
    forward = lm.__dict__["forward"]
    getattr(liger, f"apply_liger_kernel_to_{family}")()
    try:
        yield
    finally:
        for name, value in saved.items():
            if vars(module)[name] is not value:
                setattr(module, name, value)
        lm.forward = forward


def attention(family: str, train: bool, device) -> str:
    """transformers' attention: sdpa, but for Gemma 2, which refuses it (it cannot cap scores): flex attention to
    train on CUDA (memory like a flash kernel's), eager to decode and on CPU."""
    if family != "gemma2":
        return "sdpa"
    return "flex_attention" if train and device.type == "cuda" else "eager"


def build_pair(family: str, args, device, dtype, liger: bool, train: bool):
    """(colozoo's model, transformers' (Liger-patched) model) with the same random weights."""
    from colozoo.api import build_model
    from colozoo.checkpoint.load import load_hf_weights
    from colozoo.checkpoint.readers import StateDictReader

    config = model_config(family, args)
    torch.manual_seed(0)
    with liger_patched(family) if liger else contextlib.nullcontext(), torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention(family, train, device),
                                                           dtype=dtype)
    ours = build_model(config, device="meta", dtype=dtype)
    load_hf_weights(ours, StateDictReader({k: v.detach() for k, v in hf.state_dict().items()}), device=device)
    return ours, hf



def seconds(fn, device):
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - start, out


class CopyRate:
    """Bytes read + written per second by a device-to-device copy, which the decode roofline divides by: measured
    once a run, by the hardware case when it runs (colozoo.cost.measure: 1 GiB on a GPU), else at first use (1 GiB,
    64 MiB on CPU)."""

    def __init__(self, device):
        self.device, self.bytes_per_s = device, None

    def __call__(self) -> float:
        if self.bytes_per_s is None:
            from colozoo.cost.measure import copy_bandwidth

            self.bytes_per_s = copy_bandwidth(self.device, (1 << 30) if self.device.type == "cuda" else (1 << 26))
        return self.bytes_per_s


def hardware_case(args, device, copy: CopyRate | None = None) -> dict:
    """The hardware fields the planner prices with, measured on this device (colozoo.cost.measure) and written as
    a preset file for `colozoo plan --hardware`; ratio: the measured sustained matmul rate over the preset's. Its
    copy bandwidth serves the run's decode rooflines (`copy`)."""
    from colozoo.cost.hardware import PRESETS
    from colozoo.cost.measure import measure, write_measured

    found = measure(device, by="bench/gpu.py", progress=lambda line: print(line, file=sys.stderr, flush=True))
    write_measured(args.hardware_out, found)
    seen, preset = found["evidence"], PRESETS[found["preset"]]
    if copy is not None:
        copy.bytes_per_s = seen["copy_bytes_per_s"]
    grid = [{"mnk": [r["m"], r["n"], r["k"]], "of_peak": r["of_peak"], "model_of_peak": r["model_of_peak"]}
            for r in seen["gemm_grid"]]
    metrics = {"preset_file": str(args.hardware_out), "over": seen["over"],
               "sustained_tflops": round(seen["sustained_flops_per_s"] / 1e12, 1),
               "burst_tflops": round(seen["burst_flops_per_s"] / 1e12, 1),
               "matmul_efficiency": round(found["matmul_efficiency"], 3),
               "attention_efficiency": round(found["attention_efficiency"], 3),
               "copy_gb_per_s": round(seen["copy_bytes_per_s"] / 1e9),
               "read_gb_per_s": round(seen["read_bytes_per_s"] / 1e9),
               "host_gb_per_s": {k: round(v / 1e9, 1) for k, v in (seen["host_bytes_per_s"] or {}).items()} or None,
               "small_tile": found.get("small_tile"), "small_tile_efficiency": found.get("small_tile_efficiency"),
               "kernel_floor_us": round(found["kernel_floor_s"] * 1e6, 2),
               "gemm_grid": grid}
    if found["preset"] != seen["over"]:
        return dict(metrics=metrics, peer="none: no datasheet preset for this device", ratio=None)
    expected = preset.peak_flops * preset.matmul_efficiency
    return dict(metrics=metrics, peer=f"the {found['preset']} preset's matmul rate (colozoo/cost/hardware.py)",
                ratio=round(seen["sustained_flops_per_s"] / expected, 3))


def step_memory(step, model, device) -> int | None:
    """Peak bytes allocated during a step above what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    model.zero_grad(set_to_none=True)
    synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def train_case(family, shape, args, device, dtype) -> dict:
    liger = device.type == "cuda"
    ours, hf = build_pair(family, args, device, dtype, liger=liger, train=True)
    batch, seq = shape
    ids = torch.randint(0, ours.config.vocab_size, (batch, seq), device=device)
    models, times, losses, memory = {"colozoo": ours.train(), "peer": hf.train()}, {"colozoo": [], "peer": []}, {}, {}

    def step(model):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    for name, model in list(models.items()):
        try:
            losses[name] = float(step(model))
            memory[name] = step_memory(lambda: step(model), model, device)
        except torch.OutOfMemoryError:
            if name == "colozoo":
                raise
            del models[name], times[name]  # ours still measured: the peer alone does not fit beside it
            hf.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
    for _ in range(args.repeats):
        for name, model in models.items():
            times[name].append(seconds(lambda: step(model), device)[0])
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    tokens = batch * seq
    metrics = {"colozoo_ms": round(ms["colozoo"], 2), "colozoo_tokens_per_s": round(tokens / ms["colozoo"] * 1e3)}
    if memory["colozoo"] is not None:
        metrics.update(colozoo_step_memory_gb=round(memory["colozoo"] / 2**30, 2))
    if "peer" in ms:
        metrics.update(peer_ms=round(ms["peer"], 2), peer_tokens_per_s=round(tokens / ms["peer"] * 1e3),
                       loss_diff=abs(losses["colozoo"] - losses["peer"]))
        if memory["colozoo"] is not None:
            metrics.update(peer_step_memory_gb=round(memory["peer"] / 2**30, 2),
                           memory_ratio=round(memory["colozoo"] / memory["peer"], 3))
    else:
        metrics["peer_out_of_memory"] = True
    peer = (f"transformers + Liger-Kernel ({hf.config._attn_implementation})" if liger
            else f"transformers ({hf.config._attn_implementation}; Liger-Kernel runs on CUDA only)")
    return dict(metrics=metrics, peer=peer, ratio=round(ms["peer"] / ms["colozoo"], 3) if "peer" in ms else None)


def rounded(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def decode_rate(generate, args, device, batch: int) -> tuple[float | None, torch.Tensor]:
    """(decode tokens/s, the tokens), generate(n) taking max_new_tokens; None when noise hid the decoding."""
    tokens = generate(args.new)  # warm (and, for a compiled peer, compile)
    prefill = statistics.median(seconds(lambda: generate(1), device)[0] for _ in range(args.repeats))
    whole = statistics.median(seconds(lambda: generate(args.new), device)[0] for _ in range(args.repeats))
    return (batch * (args.new - 1) / (whole - prefill) if whole > prefill else None), tokens


def roofline(ours, batch: int, args, bandwidth: float) -> float:
    """Decode tokens/s if a step only read the weights and the KV cache (at the mean length) at copy bandwidth."""
    from colozoo.cost.inference import kv_cache_bytes

    config = ours.config
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in ours.parameters()}.values())
    length = args.prompt + args.new // 2
    cache = kv_cache_bytes(config, config.num_hidden_layers, 1, batch, length, next(ours.parameters()).element_size())
    return batch / ((weights + cache) / bandwidth)


def first_difference(ours: torch.Tensor, peer: torch.Tensor, prompt: int) -> int | None:
    """The first generated position where any row's tokens differ (None: none does). With random weights in bf16 the
    top logits nearly tie, so two correct implementations part after a few tokens; a wrong one at the first."""
    differs = (ours[:, prompt:] != peer[:, prompt:]).any(dim=0).nonzero()
    return int(differs[0]) if len(differs) else None


def decode_case(family, shape, args, device, dtype, copy: CopyRate, compiled: bool = False) -> dict:
    ours, hf = build_pair(family, args, device, dtype, liger=False, train=False)
    batch, = shape
    ids = torch.randint(3, ours.config.vocab_size, (batch, args.prompt), device=device)
    options = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)
    path = ours.eval().generate(ids, max_new_tokens=2, return_dict_in_generate=True, **options).decode_path
    peer = dict(cache_implementation="static") if compiled else {}
    rates, tokens = {}, {}
    with torch.no_grad():
        for name, generate in (("colozoo", lambda n: ours.generate(ids, max_new_tokens=n, **options)),
                               ("peer", lambda n: hf.eval().generate(ids, max_new_tokens=n, **options, **peer))):
            rates[name], tokens[name] = decode_rate(generate, args, device, batch)
    bandwidth = copy()
    bound = roofline(ours, batch, args, bandwidth)
    metrics = {"colozoo_decode_tokens_per_s": rounded(rates["colozoo"]),
               "peer_decode_tokens_per_s": rounded(rates["peer"]), "roofline_tokens_per_s": round(bound, 1),
               "colozoo_of_roofline": rates["colozoo"] and round(rates["colozoo"] / bound, 3),
               "copy_gb_per_s": round(bandwidth / 1e9),
               "colozoo_decode_path": path, "same_tokens": bool(torch.equal(tokens["colozoo"], tokens["peer"])),
               "first_different_token": first_difference(tokens["colozoo"], tokens["peer"], args.prompt)}
    what = "static cache + torch.compile" if compiled else "DynamicCache"
    return dict(metrics=metrics, peer=f"transformers generate ({what}, {hf.config._attn_implementation})",
                ratio=rates["colozoo"] and rates["peer"] and round(rates["colozoo"] / rates["peer"], 3))


def run_case(kind, family, shape, args, device, dtype, copy: CopyRate) -> dict:
    if kind == "hardware":
        return hardware_case(args, device, copy)
    if kind == "train":
        return train_case(family, shape, args, device, dtype)
    return decode_case(family, shape, args, device, dtype, copy, compiled=kind == "decode_compiled")


def liger_missing(device) -> str | None:
    if device.type != "cuda":
        return None
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError as e:
        return f"liger-kernel is not installed ({e}): pip install 'colozoo[bench]'"
    return None


def case_line(kind, family, shape, args, device_name: str, dtype) -> dict:
    """A case's JSON line before it runs: its bench name and config."""
    config = {"device": device_name, "dtype": str(dtype).split(".")[-1]}
    if kind == "hardware":
        return {"bench": "gpu/hardware", "config": config}
    shown = "x".join(map(str, shape)) if kind == "train" else f"b{shape[0]}"
    return {"bench": f"gpu/{kind}/{MODELS[family].lower()}/{shown}",
            "config": {"model": MODELS[family], "shape": list(shape), **config, "repeats": args.repeats,
                       "prompt": args.prompt, "new": args.new}}


def token_shapes(text: str) -> tuple:
    """'8x4096,1x16384' -> ((8, 4096), (1, 16384)): the training steps' batch x sequence."""
    try:
        shapes = tuple(tuple(int(n) for n in shape.split("x")) for shape in text.split(","))
    except ValueError:
        shapes = ()
    if not shapes or any(len(shape) != 2 or min(shape) < 1 for shape in shapes):
        raise argparse.ArgumentTypeError(f"{text!r}: give batch x sequence pairs, e.g. 4x2048,8x4096")
    return shapes


def arguments(argv=None) -> argparse.Namespace:
    """The command line, checked (the tests build their cases from it too)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help=f"of {sorted(MODELS)}")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"the cases to run, of {list(KINDS)}")
    parser.add_argument("--train-shapes", type=token_shapes,
                        default=",".join("x".join(map(str, shape)) for shape in TRAIN_SHAPES),
                        help="the training steps' batch x sequence, the first run before the larger ones (a dry run "
                             "takes tiny ones)")
    parser.add_argument("--budget", type=float, default=270.0, help="seconds for every case together")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--dry-run", action="store_true", help="every case on the CPU at tiny sizes (no GPU figure)")
    parser.add_argument("--hardware-out", default=None, metavar="JSON",
                        help="first measure the planner's hardware fields (matmul by shape, attention, HBM and host "
                             "copies) and write them as a preset file for `colozoo plan --hardware JSON`")
    args = parser.parse_args(argv)
    for option, known in (("models", MODELS), ("kinds", KINDS)):
        unknown = set(getattr(args, option).split(",")) - set(known)
        if unknown:
            parser.error(f"unknown {option} {sorted(unknown)}; choose from {sorted(known)}")
    return args


def main(argv=None) -> int:
    args = arguments(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print(json.dumps({"bench": "gpu", "skipped": "no CUDA device (--dry-run checks the script on the CPU)"}))
        return 0
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    args.prompt, args.new = sizes(args)["prompt"], sizes(args)["new"]
    args.repeats = 1 if args.dry_run else args.repeats
    clock, copy, no_liger = Clock(args.budget), CopyRate(device), liger_missing(device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)"
    for kind, family, shape in ([("hardware", None, ())] if args.hardware_out else []) + cases(args):
        line = case_line(kind, family, shape, args, name, dtype)
        skipped = clock.refusal(kind) or (no_liger if kind == "train" else None)
        if skipped:
            print(json.dumps({**line, "skipped": skipped}), flush=True)
            continue
        started = time.monotonic()
        try:
            line.update(run_case(kind, family, shape, args, device, dtype, copy))
        except Exception as e:  # one case's failure (a peer's version, memory) is its line, not the run's end
            line["error"] = f"{type(e).__name__}: {e}"[:500]
        clock.record(kind, time.monotonic() - started)
        print(json.dumps(line), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
