"""Parallel layers against their plain torch counterparts, at tp 1 (one process) and tp 2/4 (gloo ranks)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from colozoo.layers import (ColumnParallelLinear, RowParallelLinear, Split, VocabParallelEmbedding,
                            gather_tensor, load_shard, local_pieces, shard_tensor, spec_of,
                            vocab_parallel_cross_entropy)
from colozoo.layers import comm
from colozoo.layers.shard import ShardError, local_shape, stored_pieces
from colozoo.layers.vocab import vocab_range
from colozoo.core.mesh import coords_of, init_parallel
from parity import close
from distributed import run_distributed

ATOL = 1e-5
TP_SIZES = [1, 2, 4]


def _run(fn, tp, *args):
    """tp 1 runs in this process (no process group); larger tp on gloo ranks."""
    if tp == 1:
        return [fn(tp, *args)]
    return run_distributed(fn, tp, tp, *args, timeout=60)


def _close(actual, expected, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    close(actual, expected, ATOL, what)


def _seq_chunk(t, parallel, sequence_parallel: bool, dim=1):
    """This rank's part of the sequence when sequence parallelism was asked for (the test's own flag, not the
    layer's: a mesh that dropped the flag must fail the shape checks)."""
    return t.chunk(parallel.tp_size, dim=dim)[parallel.tp_rank] if sequence_parallel and parallel.tp_size > 1 else t


# ---------------------------------------------------------------- vocab-parallel cross entropy

def _cross_entropy(tp, vocab, label_smoothing):
    parallel = init_parallel(tp=tp)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, vocab, generator=g) * 3
    target = torch.randint(0, vocab, (3, 7), generator=g)
    target[0, :3] = -100
    target[2, -1] = -100
    upstream = torch.rand(3, 7, generator=g)

    full = logits.clone().requires_grad_()
    expected = F.cross_entropy(full.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="none",
                               label_smoothing=label_smoothing).view(3, 7)
    (expected * upstream).sum().backward()

    start, stop, per = vocab_range(vocab, parallel.tp_group)
    local = torch.full((3, 7, per), 1e4)  # padded columns hold garbage that must never matter
    local[..., : stop - start] = logits[..., start:stop]
    local.requires_grad_()
    given = local.detach().clone()
    loss = vocab_parallel_cross_entropy(local, target, vocab, parallel.tp_group, label_smoothing=label_smoothing)
    assert torch.equal(local.detach(), given), "the loss wrote into the caller's fp32 logits"
    (loss * upstream).sum().backward()
    _close(loss, expected, "per-token loss")
    _close(local.grad[..., : stop - start], full.grad[..., start:stop], "logits gradient")
    assert not local.grad[..., stop - start:].any(), "gradient leaked into padded vocab columns"
    assert not loss[target == -100].any()


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_vocab_parallel_cross_entropy(tp, label_smoothing):
    _run(_cross_entropy, tp, 101, label_smoothing)  # 101 is divisible by neither 2 nor 4


def test_vocab_parallel_cross_entropy_rank_with_only_padding():
    # vocab 5 over 4 ranks: slices of 2, so rank 3 holds no real token at all
    _run(_cross_entropy, 4, 5, 0.1)


# ---------------------------------------------------------------- column / row parallel linear

def _reference_linear(in_features, out_features, seed):
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features)


def _column(tp, sequence_parallel, chunks, gather_output):
    parallel = init_parallel(tp=tp, sequence_parallel=sequence_parallel)
    coords = coords_of(parallel)
    ref = _reference_linear(16, 24, seed=0)
    layer = ColumnParallelLinear(16, 24, group=parallel.tp_group, sequence_parallel=parallel.sequence_parallel,
                                 chunks=chunks, gather_output=gather_output)
    with torch.no_grad():
        layer.weight.copy_(shard_tensor(ref.weight, spec_of(layer.weight), coords))
        layer.bias.copy_(shard_tensor(ref.bias, spec_of(layer.bias), coords))

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, 16, generator=g)
    upstream = torch.randn(2, 8, 24, generator=g)
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * upstream).sum().backward()

    x_local = _seq_chunk(x, parallel, sequence_parallel).clone().requires_grad_()
    y = layer(x_local)
    out_spec = (Split("tp", 2, chunks=chunks),)
    if gather_output:
        _close(y, y_ref, "gathered output")
        (y * upstream).sum().backward()
    else:
        _close(y, shard_tensor(y_ref.detach(), out_spec, coords), "local output")
        (y * shard_tensor(upstream, out_spec, coords)).sum().backward()
    _close(x_local.grad, _seq_chunk(x_ref.grad, parallel, sequence_parallel), "input gradient")
    for name in ("weight", "bias"):
        p = getattr(layer, name)
        full = gather_tensor(p.grad, spec_of(p), tuple(getattr(ref, name).shape), parallel.groups, coords)
        _close(full, getattr(ref, name).grad, f"{name} gradient")


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_column_parallel_linear(tp, sequence_parallel):
    _run(_column, tp, sequence_parallel, None, False)


@pytest.mark.parametrize("tp", [2, 4])
def test_column_parallel_linear_fused_chunks(tp):
    _run(_column, tp, True, (8, 8, 8), False)  # each rank gets its share of every part, like q/k/v


@pytest.mark.parametrize("tp", [1, 2])
def test_column_parallel_linear_gather_output(tp):
    _run(_column, tp, False, None, True)


def _row(tp, sequence_parallel, bias):
    parallel = init_parallel(tp=tp, sequence_parallel=sequence_parallel)
    coords = coords_of(parallel)
    ref = _reference_linear(24, 16, seed=2)
    if not bias:
        ref.bias = None
    layer = RowParallelLinear(24, 16, bias=bias, group=parallel.tp_group, sequence_parallel=parallel.sequence_parallel)
    with torch.no_grad():
        layer.weight.copy_(shard_tensor(ref.weight, spec_of(layer.weight), coords))
        if bias:
            layer.bias.copy_(ref.bias)

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 8, 24, generator=g)
    upstream = torch.randn(2, 8, 16, generator=g)
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * upstream).sum().backward()

    in_spec = (Split("tp", 2),)
    x_local = shard_tensor(x, in_spec, coords).requires_grad_()
    y = layer(x_local)
    _close(y, _seq_chunk(y_ref.detach(), parallel, sequence_parallel), "output")
    (y * _seq_chunk(upstream, parallel, sequence_parallel)).sum().backward()
    _close(x_local.grad, shard_tensor(x_ref.grad, in_spec, coords), "input gradient")
    full = gather_tensor(layer.weight.grad, spec_of(layer.weight), tuple(ref.weight.shape), parallel.groups, coords)
    _close(full, ref.weight.grad, "weight gradient")
    if bias:
        _close(layer.bias.grad, ref.bias.grad, "bias gradient")


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_row_parallel_linear(tp, sequence_parallel):
    _run(_row, tp, sequence_parallel, True)


def test_row_parallel_linear_without_bias():
    _run(_row, 2, True, False)


# ---------------------------------------------------------------- vocab-parallel embedding

def _embedding(tp, sequence_parallel, vocab, padding_idx):
    parallel = init_parallel(tp=tp, sequence_parallel=sequence_parallel)
    coords = coords_of(parallel)
    torch.manual_seed(4)
    ref = nn.Embedding(vocab, 8, padding_idx=padding_idx)
    with torch.no_grad():
        ref.weight.normal_()  # a non-zero padding row: its value is used, only its gradient is blocked
    layer = VocabParallelEmbedding(vocab, 8, padding_idx, group=parallel.tp_group,
                                   sequence_parallel=parallel.sequence_parallel)
    spec = spec_of(layer.weight)
    with torch.no_grad():
        layer.weight.copy_(shard_tensor(ref.weight, spec, coords))

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (3, 8), generator=g)
    ids[0, :3] = padding_idx
    ids[1, -1] = vocab - 1
    upstream = torch.randn(3, 8, 8, generator=g)
    out_ref = ref(ids)
    (out_ref * upstream).sum().backward()

    out = layer(ids)
    _close(out, _seq_chunk(out_ref.detach(), parallel, sequence_parallel), "output")
    (out * _seq_chunk(upstream, parallel, sequence_parallel)).sum().backward()
    full = gather_tensor(layer.weight.grad, spec, (vocab, 8), parallel.groups, coords)
    _close(full, ref.weight.grad, "weight gradient")
    assert not full[padding_idx].any(), "the padding row got a gradient"
    start, stop, _ = vocab_range(vocab, parallel.tp_group)
    assert not layer.weight.grad[stop - start:].any(), "padded vocab rows got a gradient"


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_vocab_parallel_embedding(tp, sequence_parallel):
    _run(_embedding, tp, sequence_parallel, 101, 1)


@pytest.mark.parametrize("padding_idx", [50, 100])
def test_vocab_parallel_embedding_padding_on_later_ranks(padding_idx):
    _run(_embedding, 4, False, 101, padding_idx)


def test_vocab_parallel_embedding_rank_with_only_padding():
    _run(_embedding, 4, True, 5, 4)  # vocab 5 over 4 ranks: rank 3 holds no real row


# ---------------------------------------------------------------- comm mappings

def _value(rank, shape, salt):
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) * (rank + 1) + salt


def _comm_pairs(tp):
    """Forward and backward of every mapping, with rank-dependent inputs and upstream gradients."""
    init_parallel(tp=tp)
    group = dist.group.WORLD
    rank = dist.get_rank()
    all_ranks = range(tp)
    x_shape, seq = (2, 4 * tp, 3), 1

    def run(op, x_rank_shape, y_shape):
        x = _value(rank, x_rank_shape, 0.5).requires_grad_()
        y = op(x, group)
        grad = _value(rank, y_shape, -1.0)
        y.backward(grad)
        return y.detach(), x.grad

    # f: identity forward, all-reduce backward
    y, dx = run(comm.copy_to_parallel, x_shape, x_shape)
    _close(y, _value(rank, x_shape, 0.5), "copy_to_parallel forward")
    _close(dx, sum(_value(r, x_shape, -1.0) for r in all_ranks), "copy_to_parallel backward")
    # g: all-reduce forward, identity backward
    y, dx = run(comm.reduce_from_parallel, x_shape, x_shape)
    _close(y, sum(_value(r, x_shape, 0.5) for r in all_ranks), "reduce_from_parallel forward")
    _close(dx, _value(rank, x_shape, -1.0), "reduce_from_parallel backward")
    # split (last dim) / all-gather
    y, dx = run(lambda t, gr: comm.split_to_parallel(t, gr, dim=-1), (2, 3, 2 * tp), (2, 3, 2))
    _close(y, _value(rank, (2, 3, 2 * tp), 0.5).chunk(tp, -1)[rank], "split_to_parallel forward")
    _close(dx, torch.cat([_value(r, (2, 3, 2), -1.0) for r in all_ranks], -1), "split_to_parallel backward")
    # all-gather (last dim) / split
    y, dx = run(lambda t, gr: comm.gather_from_parallel(t, gr, dim=-1), (2, 3, 2), (2, 3, 2 * tp))
    _close(y, torch.cat([_value(r, (2, 3, 2), 0.5) for r in all_ranks], -1), "gather_from_parallel forward")
    _close(dx, _value(rank, (2, 3, 2 * tp), -1.0).chunk(tp, -1)[rank], "gather_from_parallel backward")
    # sequence: split / all-gather
    local_shape = (2, 4, 3)
    y, dx = run(comm.scatter_to_sequence, x_shape, local_shape)
    _close(y, _value(rank, x_shape, 0.5).chunk(tp, seq)[rank], "scatter_to_sequence forward")
    _close(dx, torch.cat([_value(r, local_shape, -1.0) for r in all_ranks], seq), "scatter_to_sequence backward")
    # sequence: all-gather / reduce-scatter
    y, dx = run(comm.gather_from_sequence, local_shape, x_shape)
    _close(y, torch.cat([_value(r, local_shape, 0.5) for r in all_ranks], seq), "gather_from_sequence forward")
    _close(dx, sum(_value(r, x_shape, -1.0) for r in all_ranks).chunk(tp, seq)[rank], "gather_from_sequence backward")
    # sequence: reduce-scatter / all-gather
    y, dx = run(comm.reduce_scatter_to_sequence, x_shape, local_shape)
    _close(y, sum(_value(r, x_shape, 0.5) for r in all_ranks).chunk(tp, seq)[rank],
           "reduce_scatter_to_sequence forward")
    _close(dx, torch.cat([_value(r, local_shape, -1.0) for r in all_ranks], seq),
           "reduce_scatter_to_sequence backward")


@pytest.mark.parametrize("tp", [2, 4])
def test_comm_mapping_pairs(tp):
    run_distributed(_comm_pairs, tp, tp=tp, timeout=60)


def test_comm_mappings_are_identities_without_a_group():
    x = torch.randn(2, 4, 3, requires_grad=True)
    for op in (comm.copy_to_parallel, comm.reduce_from_parallel, comm.split_to_parallel, comm.gather_from_parallel,
               comm.scatter_to_sequence, comm.gather_from_sequence, comm.reduce_scatter_to_sequence):
        assert op(x, None) is x, op.__name__


# ---------------------------------------------------------------- shard specs

def test_local_pieces_fused_chunks():
    qkv = Split("tp", 0, chunks=(8, 8, 8))
    assert local_pieces(qkv, 24, 1, 2) == ([(4, 8, 0, 4), (12, 16, 4, 8), (20, 24, 8, 12)], 12)
    gqa = Split("tp", 0, chunks=(8, 4, 4))  # q with 4 heads, k and v with 2 (head_dim 2)
    assert local_pieces(gqa, 16, 0, 2) == ([(0, 4, 0, 4), (8, 10, 4, 6), (12, 14, 6, 8)], 8)


def test_local_pieces_padded_vocab():
    vocab = Split("tp", 0, logical_size=10)
    assert [local_pieces(vocab, 10, r, 4) for r in range(4)] == [
        ([(0, 3, 0, 3)], 3), ([(3, 6, 0, 3)], 3), ([(6, 9, 0, 3)], 3), ([(9, 10, 0, 1)], 3)]
    assert local_pieces(Split("tp", 0, logical_size=5), 5, 3, 4) == ([], 2)  # a rank holding only padding


@pytest.mark.parametrize("split,length,size,message", [
    (Split("tp", 0, chunks=(8, 8)), 24, 2, "do not add up"),
    (Split("tp", 0, chunks=(6, 6, 6)), 18, 4, "fused part of length 6 is not divisible by tp=4"),
    (Split("tp", 0, logical_size=10), 12, 2, "expects logical length 10, got 12"),
    (Split("tp", 1), 10, 4, "dimension of length 10 is not divisible by tp=4"),
])
def test_local_pieces_errors(split, length, size, message):
    with pytest.raises(ShardError, match=message):
        local_pieces(split, length, 0, size)


def test_split_rejects_chunks_and_padding_together():
    with pytest.raises(ValueError, match="not both"):
        Split("tp", 0, chunks=(2, 2), logical_size=4)


def test_split_json_round_trip():
    for split in (Split("tp", 0, chunks=(8, 4, 4)), Split("tp", 0, logical_size=101), Split("ep", 0)):
        assert Split.from_json(split.to_json()) == split


SPECS = {
    "fused_qkv": ((24, 6), (Split("tp", 0, chunks=(8, 8, 8)),)),
    "padded_vocab": ((101, 6), (Split("tp", 0, logical_size=101),)),
    "row": ((6, 8), (Split("tp", 1),)),
    "expert_and_tp": ((4, 8, 6), (Split("ep", 0), Split("tp", 1, chunks=(4, 4)))),
}


def _reassemble(full, spec, sizes):
    """Scatter every rank's shard into an empty global tensor from the stored pieces alone (no process group)."""
    out = torch.full_like(full, float("nan"))
    ranks = [dict(zip(sizes, coords)) for coords in torch.cartesian_prod(
        *(torch.arange(s) for s in sizes.values())).view(-1, len(sizes)).tolist()]
    for rank in ranks:
        coords = {dim: (rank[dim], sizes[dim]) for dim in sizes}
        local = shard_tensor(full, spec, coords)
        assert tuple(local.shape) == local_shape(full.shape, spec, coords)
        for _, g_index, l_index in stored_pieces(full.shape, spec, coords):
            out[g_index] = local[l_index]
    return out


@pytest.mark.parametrize("name", sorted(SPECS))
def test_shard_round_trip_single_process(name):
    shape, spec = SPECS[name]
    full = torch.randn(shape)
    assert torch.equal(_reassemble(full, spec, {"tp": 2, "ep": 2}), full)
    assert torch.equal(shard_tensor(full, spec, {}), full)


def test_load_shard_reads_only_its_slices():
    full = torch.arange(24 * 2, dtype=torch.float32).view(24, 2)
    reads = []

    def read(index):
        reads.append(index)
        return full[index]

    local = load_shard(read, full.shape, (Split("tp", 0, chunks=(8, 8, 8)),), {"tp": (1, 4)})
    assert torch.equal(local, torch.cat([full[2:4], full[10:12], full[18:20]]))
    assert [i[0] for i in reads] == [slice(2, 4), slice(10, 12), slice(18, 20)]
    padding_only = load_shard(read, (5, 2), (Split("tp", 0, logical_size=5),), {"tp": (3, 4)}, dtype=torch.float32)
    assert padding_only.shape == (2, 2) and not padding_only.any()


def _gather_round_trip(degrees):
    parallel = init_parallel(**degrees)
    coords = coords_of(parallel)
    for name, (shape, spec) in SPECS.items():
        full = torch.randn(shape, generator=torch.Generator().manual_seed(len(name)))
        local = shard_tensor(full, spec, coords)
        gathered = gather_tensor(local, spec, shape, parallel.groups, coords)
        assert torch.equal(gathered, full), name


@pytest.mark.parametrize("degrees", [dict(tp=2), dict(tp=4), dict(tp=2, dp=2, ep=2)],
                         ids=["tp2", "tp4", "tp2_ep2"])
def test_gather_tensor_round_trip(degrees):
    world = 1
    for v in degrees.values():
        world *= v if v else 1
    world //= degrees.get("ep", 1)  # ep is folded over dp, it adds no ranks
    run_distributed(_gather_round_trip, world, degrees=degrees, timeout=60)
