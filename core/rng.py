"""Model-parallel RNG: identical dropout masks where tensors are replicated, different where they are sharded.

The default generator is seeded identically on the ranks of one tensor-parallel group (and differently per
pipeline stage), so dropout on replicated activations agrees across tp ranks. A second, tracked state is
seeded per tp rank; `fork()` swaps it in for dropout on sharded activations (attention heads, the
sequence-parallel region). This is the idea behind Megatron's CudaRNGStatesTracker, for CPU and CUDA.
"""
from __future__ import annotations

import contextlib

import torch

TENSOR_PARALLEL = "tensor-parallel"
_TP_SEED_OFFSET = 2718
_PP_SEED_STRIDE = 100


def _get_state(device_type: str):
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_state(device_type: str, state):
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    def __init__(self):
        self.states: dict[tuple[str, str], torch.Tensor] = {}
        self.seeds: dict[str, int] = {}

    def reset(self):
        self.states.clear()
        self.seeds.clear()

    def add(self, name: str, seed: int):
        if name in self.seeds:
            raise ValueError(f"RNG state {name!r} already exists (seed {self.seeds[name]})")
        self.seeds[name] = seed
        for device_type in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
            saved = _get_state(device_type)
            if device_type == "cuda":
                torch.cuda.manual_seed(seed)
            else:
                torch.manual_seed(seed)
            self.states[(name, device_type)] = _get_state(device_type)
            _set_state(device_type, saved)

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL, device_type: str = "cpu"):
        """Run the block with the tracked generator `name`, then restore the default one."""
        key = (name, device_type)
        if key not in self.states:
            yield  # not seeded (single process): the default generator serves
            return
        saved = _get_state(device_type)
        _set_state(device_type, self.states[key])
        try:
            yield
        finally:
            self.states[key] = _get_state(device_type)
            _set_state(device_type, saved)

    def get_states(self):
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states):
        self.states = {k: v.clone() for k, v in states.items()}


_TRACKER = RNGTracker()


def get_rng_tracker() -> RNGTracker:
    return _TRACKER


def model_parallel_seed(seed: int, parallel) -> None:
    """Seed the default generator per pipeline stage and the tracked one per tensor-parallel rank."""
    default_seed = seed + _PP_SEED_STRIDE * parallel.rank("pp")
    torch.manual_seed(default_seed)
    _TRACKER.reset()
    _TRACKER.add(TENSOR_PARALLEL, default_seed + _TP_SEED_OFFSET + parallel.rank("tp"))
