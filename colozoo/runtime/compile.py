"""torch.compile of each transformer block, as torchtitan does, a property of the run's stages: a compiled stage runs
each of its layers' body through one compiled function of the layer's class, so layers of the same class share one
graph (parameters are graph inputs) and a model of 80 layers compiles as fast as one of 2. The stage records it
(`Stage.compiled`, the backend; `model.run.compiled`), and it is set up once with the run, like parallelize: at
build (build_model / from_pretrained(compile=True)), by parallelize(compile=True) or by compile_layers(model).

Only the block body compiles. Module hooks stay eager around it, so FSDP2's unshard/reshard hooks, activation
checkpointing (torch's composable `checkpoint` recomputes by calling the module again, i.e. the compiled body) and
the tests' forward hooks work unchanged, in either order with `parallelize`; module and parameter names do not
change. Tensor- and sequence-parallel collectives (`layers.comm`, autograd Functions around torch.distributed
calls) do not break the graph: dynamo traces the Functions, forward and backward, and turns the collectives into
functional collectives inside the one graph (on gloo too).

Why the body and not the module (torch.compile(layer) or nn.Module.compile(), which compile the module's call): those
trace the module's hooks into the graph, and every layer's hooks are closures of their own (composable checkpoint's,
a test's), so each layer would compile a graph of its own (measured: 2 graphs for 2 layers) and past dynamo's cache
limit run eagerly. The body is installed as the layer's `forward`, which module calls run between the hooks.

Dropout draws inductor's random numbers, not eager torch's: compiled and eager runs agree only without dropout.
A forward with a KV cache (generation) runs the layers' eager body, as its arguments say (the cache grows by one
position per step, which would recompile every step): generate says so in its output (`decode_note`), and its
static step is compiled whole with a compile_config instead.

Triton kernels on CUDA are traced by dynamo as user-defined kernels; on CPU under
TRITON_INTERPRET=1 compile is refused (the interpreter runs Python on numpy, nothing inductor can compile).
"""
from __future__ import annotations

import functools

import torch

from colozoo.kernels import kernels_interpreted
from colozoo.runtime.errors import TrainingError
from colozoo.runtime.stage import unwrap

BACKENDS = ("inductor", "aot_eager", "eager")  # eager / aot_eager: dynamo's tracing only, for debugging


@functools.cache
def _compiled_forward(cls: type, backend: str, mode: str | None, dynamic: bool | None):
    """One compiled function per layer class: its cache, guards and graphs serve every layer of that class."""
    return torch.compile(cls.forward, backend=backend, mode=mode, dynamic=dynamic)


def _layer_forward(layer, compiled, eager, *args, **kwargs):
    batch = args[1] if len(args) > 1 else kwargs.get("batch")
    if getattr(batch, "cache", None) is not None:  # decoding: the eager body (generate's output says so)
        return eager(*args, **kwargs)
    if batch is not None:
        batch.prepare()  # what layers would build on first use, so the first layer does not get a graph of its own
    return compiled(layer, *args, **kwargs)


def check_compile(model, backend: str = "inductor"):
    if backend not in BACKENDS:
        raise TrainingError(f"compile backend must be one of {BACKENDS}, got {backend!r}")
    probe = next((p for p in model.parameters() if not p.is_meta), None)
    if probe is not None and kernels_interpreted(probe):
        raise TrainingError("compile=True cannot compile the Triton kernels that run under TRITON_INTERPRET=1 on CPU "
                            "(the interpreter is Python, not a kernel inductor can trace); unset TRITON_INTERPRET or "
                            "set COLOZOO_KERNELS=torch, or leave compile off")


def compile_layers(model, backend: str = "inductor", mode: str | None = None, dynamic: bool | None = None):
    """Compile every transformer block of the stages of `model`'s run (see the module docstring); recorded on each
    stage as `compiled` (the backend). Part of setting the run up, before its first call; a second call does nothing.
    `mode` is torch.compile's ("max-autotune", ...)."""
    run = model.run
    if run is None:
        raise TrainingError(f"{type(model).__name__} has no Run: build it with colozoo.build_model or "
                            f"colozoo.from_pretrained")
    if run.compiled:
        return model
    check_compile(model, backend)
    for stage in run.stages:
        compile_stage(unwrap(stage), backend, mode, dynamic)
    return model


def compile_stage(stage, backend: str, mode: str | None = None, dynamic: bool | None = None):
    """The stage's layers run their body compiled (one function per layer class), module hooks eager around it."""
    for layer in stage.layers.values():
        compiled = _compiled_forward(type(layer), backend, mode, dynamic)
        layer.forward = functools.partial(_layer_forward, layer, compiled, layer.forward)
    stage.compiled = backend


def is_compiled(layer: torch.nn.Module) -> bool:
    forward = layer.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _layer_forward
