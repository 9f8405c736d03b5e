"""Which implementation a layer runs: the Triton kernels or the pure-torch references.

    COLOZOO_KERNELS=auto    Triton on CUDA tensors when triton imports and the kernel beats torch's, torch elsewhere
                            (the default)
    COLOZOO_KERNELS=triton  always Triton (CPU tensors need TRITON_INTERPRET=1 set before the kernels load)
    COLOZOO_KERNELS=torch   always torch

`set_kernels(mode)` overrides the environment for this process (`set_kernels(None)` goes back to it);
`use_kernels(mode)` does the same for a `with` block. Nothing here imports triton until it is asked.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

MODES = ("auto", "triton", "torch")
ENV_VAR = "COLOZOO_KERNELS"
_override: str | None = None


def _check(mode: str, where: str) -> str:
    if mode not in MODES:
        raise ValueError(f"{where}={mode!r} is not a kernel mode; choose one of {MODES}")
    return mode


def set_kernels(mode: str | None) -> None:
    """Force 'triton' or 'torch' (or 'auto') for this process; None returns to $COLOZOO_KERNELS."""
    global _override
    _override = None if mode is None else _check(mode, "set_kernels(mode)")


@contextlib.contextmanager
def use_kernels(mode: str | None):
    global _override
    previous = _override
    set_kernels(mode)
    try:
        yield
    finally:
        _override = previous


def kernel_mode() -> str:
    if _override is not None:
        return _override
    return _check(os.environ.get(ENV_VAR, "auto").strip().lower() or "auto", f"${ENV_VAR}")


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def interpreting() -> bool:
    """True when triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1)."""
    if not triton_available():
        return False
    from triton import knobs

    return bool(knobs.runtime.interpret)


def kernels_interpreted(like: torch.Tensor) -> bool:
    """True when the ops would run Triton kernels on triton's CPU interpreter for tensors like `like` (what
    torch.compile cannot trace)."""
    return not like.is_cuda and interpreting() and use_triton(like)


def autocasting(x: torch.Tensor) -> bool:
    """True under autocast on x's device: the fused ops that hold a matmul leave it to torch's autocast there."""
    device = x.device.type
    return torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)


# Up to this many elements without autograd (a decode step's activations) an elementwise op costs the CPU its
# launches, not the GPU its bytes, and one Triton launch costs several aten ones: 'auto' keeps torch there.
LAUNCH_BOUND_ELEMENTS = 1 << 20


def _launch_bound(x: torch.Tensor) -> bool:
    return not torch.is_grad_enabled() and x.numel() <= LAUNCH_BOUND_ELEMENTS


def use_triton(*tensors: torch.Tensor | None, auto: bool = True, elementwise: bool = False) -> bool:
    """Whether the op on these tensors should take the Triton path. `auto=False`: 'auto' mode keeps torch here,
    because torch's own CUDA kernel is faster for this case (bench/kernels.py measures both); `elementwise`: an
    elementwise kernel, which 'auto' leaves to torch on a decode step's inputs (the first tensor launch-bound).
    'triton' still forces the kernel."""
    mode = kernel_mode()
    if mode == "torch":
        return False
    on_cuda = all(t.is_cuda for t in tensors if t is not None)
    if mode == "auto":
        return auto and on_cuda and triton_available() and not (elementwise and _launch_bound(tensors[0]))
    if not triton_available():
        raise RuntimeError(f"{ENV_VAR}=triton but triton does not import on this machine")
    if not on_cuda and not interpreting():
        raise RuntimeError(f"{ENV_VAR}=triton on CPU tensors needs TRITON_INTERPRET=1 (set before colozoo.kernels "
                           "modules are imported)")
    return True
