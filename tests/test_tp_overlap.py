"""Communication at tp > 1 that overlaps computation or is folded into fewer collectives: the column-parallel
backward reduces the input gradient while the weight gradient is computed; the vocab-parallel loss is one collective."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from colozoo.core.mesh import init_parallel
from colozoo.layers import ColumnParallelLinear, comm, vocab_parallel_cross_entropy
from colozoo.layers.vocab import vocab_range
from distributed import run_distributed
from parity import close


class _Events(TorchDispatchMode):
    """Records matmuls and collectives (c10d ops) in the order they are issued."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.log.append("collective")
        elif func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.log.append("matmul")
        return func(*args, **(kwargs or {}))


class _WaitLogged:
    def __init__(self, work, log):
        self.work, self.log = work, log

    def wait(self):
        self.log.append("wait")
        return self.work.wait()


def _async_logged(fn, log):
    def call(*args, **kwargs):
        work = fn(*args, **kwargs)
        return _WaitLogged(work, log) if kwargs.get("async_op") else work

    return call


def _column_backward_order(sequence_parallel):
    parallel = init_parallel(tp=2, sequence_parallel=sequence_parallel)
    torch.manual_seed(0)
    full = torch.nn.Linear(16, 24)
    layer = ColumnParallelLinear(16, 24, group=parallel.tp_group, sequence_parallel=sequence_parallel)
    with torch.no_grad():
        layer.weight.copy_(full.weight.chunk(2)[parallel.tp_rank])
        layer.bias.copy_(full.bias.chunk(2)[parallel.tp_rank])
    x = torch.randn(2, 8, 16)
    local = (x.chunk(2, dim=1)[parallel.tp_rank] if sequence_parallel else x).clone().requires_grad_()
    upstream = torch.randn(2, 8, 24)
    y = layer(local)
    log = []
    saved = dist.all_reduce, comm._reduce_scatter_single
    dist.all_reduce, comm._reduce_scatter_single = (_async_logged(f, log) for f in saved)
    try:
        with _Events(log):
            (y * upstream.chunk(2, dim=-1)[parallel.tp_rank]).sum().backward()
    finally:
        dist.all_reduce, comm._reduce_scatter_single = saved
    reference = x.clone().requires_grad_()
    (full(reference) * upstream).sum().backward()
    expected = reference.grad.chunk(2, dim=1)[parallel.tp_rank] if sequence_parallel else reference.grad
    close(local.grad, expected, 1e-5, "input gradient")
    close(layer.weight.grad, full.weight.grad.chunk(2)[parallel.tp_rank], 1e-5, "weight gradient")
    return log


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_column_parallel_backward_reduces_the_input_gradient_during_the_weight_gradient(sequence_parallel):
    for log in run_distributed(_column_backward_order, 2, sequence_parallel, timeout=60):
        # input gradient, its reduction started, the weight gradient computed, then the wait
        assert log == ["matmul", "collective", "matmul", "wait"], log


def _loss_collectives(label_smoothing):
    parallel = init_parallel(tp=2)
    vocab = 11  # padded to 12: rank 1 holds a padded column
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, vocab, generator=g) * 3
    target = torch.randint(0, vocab, (2, 5), generator=g)
    start, stop, per = vocab_range(vocab, parallel.tp_group)
    local = torch.zeros(2, 5, per)
    local[..., : stop - start] = logits[..., start:stop]
    log = []
    with _Events(log):
        loss = vocab_parallel_cross_entropy(local, target, vocab, parallel.tp_group, label_smoothing=label_smoothing)
    expected = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none",
                               label_smoothing=label_smoothing).view(2, 5)
    close(loss, expected, 1e-5, "per-token loss")
    return log.count("collective")


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_vocab_parallel_loss_is_one_collective(label_smoothing):
    assert run_distributed(_loss_collectives, 2, label_smoothing, timeout=60) == [1, 1]
