import itertools

import pytest
import torch.distributed as dist

from colozoo.core.mesh import (MESH_DIMS, ParallelConfig, ParallelConfigError, ParallelContext, coords_of,
                              init_parallel)
from distributed import run_distributed


@pytest.mark.parametrize("kwargs,message", [
    (dict(tp=0), "degree tp must be an integer >= 1, got 0"),
    (dict(pp=-2), "degree pp must be an integer >= 1, got -2"),
    (dict(dp=2.0), "degree dp must be an integer >= 1, got 2.0"),
    (dict(cp="2"), "degree cp must be an integer >= 1, got '2'"),
    (dict(tp=True), "degree tp must be an integer >= 1, got True"),
    (dict(sequence_parallel=1), "sequence_parallel must be a bool, got 1"),
    (dict(dp=2, cp=3, ep=4), "ep=4 must divide dp*cp=6"),
])
def test_config_rejects_bad_degrees(kwargs, message):
    with pytest.raises(ParallelConfigError, match="^" + message.replace("*", r"\*").replace(".", r"\.")):
        ParallelConfig(**kwargs)


def test_config_accepts_and_sizes():
    config = ParallelConfig(tp=2, pp=3, dp=4, cp=5, ep=10, sequence_parallel=True)
    assert config.world_size == 120


def test_for_world_fills_dp():
    assert ParallelConfig.for_world(8, tp=2) == ParallelConfig(tp=2, dp=4)
    assert ParallelConfig.for_world(8, tp=2, pp=2, cp=2) == ParallelConfig(tp=2, pp=2, cp=2, dp=1)
    assert ParallelConfig.for_world(1) == ParallelConfig()


def test_for_world_rejects_mismatch():
    with pytest.raises(ParallelConfigError, match=r"world size 6 is not divisible by tp\*pp\*cp = 4\*1\*1 = 4"):
        ParallelConfig.for_world(6, tp=4)
    with pytest.raises(ParallelConfigError, match=r"world size 4 != pp\*dp\*cp\*tp = 1\*3\*1\*2 = 6; "
                                                  r"launch with torchrun --nproc-per-node 6"):
        ParallelConfig.for_world(4, tp=2, dp=3)
    with pytest.raises(ParallelConfigError, match="ep=3 must divide dp\\*cp=4"):
        ParallelConfig.for_world(8, tp=2, ep=3)


def test_init_parallel_on_one_process_is_all_ones():
    parallel = init_parallel()
    assert parallel.config == ParallelConfig()
    assert parallel.mesh is None and not dist.is_initialized()
    for dim in (*MESH_DIMS, "ep", "dp_cp"):
        assert parallel.group(dim) is None and parallel.size(dim) == 1 and parallel.rank(dim) == 0
    assert parallel.is_first_stage and parallel.is_last_stage and not parallel.sequence_parallel
    assert coords_of(parallel) == {"tp": (0, 1), "ep": (0, 1)}


def test_init_parallel_on_one_process_rejects_larger_mesh():
    with pytest.raises(ParallelConfigError, match="world size 1 is not divisible by tp\\*pp\\*cp = 2\\*1\\*1 = 2"):
        init_parallel(tp=2)
    with pytest.raises(ParallelConfigError, match="world size 1 != pp\\*dp\\*cp\\*tp = 1\\*2\\*1\\*1 = 2"):
        init_parallel(dp=2)


def test_sequence_parallel_needs_tp():
    assert not ParallelContext(ParallelConfig(sequence_parallel=True)).sequence_parallel


def test_virtual_context():
    parallel = ParallelContext.virtual(pp=4, pp_rank=3)
    assert parallel.rank("pp") == 3 and parallel.size("pp") == 4 and parallel.size("tp") == 1
    assert parallel.is_last_stage and not parallel.is_first_stage


def _mesh_view(degrees):
    parallel = init_parallel(**degrees)
    view = {}
    for dim in (*MESH_DIMS, "ep", "dp_cp"):
        group = parallel.group(dim)
        ranks = dist.get_process_group_ranks(group) if group is not None else [dist.get_rank()]
        view[dim] = (parallel.size(dim), parallel.rank(dim), ranks)
    return view, dist.get_rank()


def _expected_groups(pp=1, dp=1, cp=1, tp=1, ep=1):
    """Ranks laid out row-major over (pp, dp, cp, tp); groups of a dim vary that coordinate only."""
    sizes = dict(pp=pp, dp=dp, cp=cp, tp=tp)
    coords = {}
    for rank, c in enumerate(itertools.product(*(range(sizes[d]) for d in MESH_DIMS))):
        coords[rank] = dict(zip(MESH_DIMS, c))

    def members(rank, dims):
        mine = coords[rank]
        return sorted(r for r, c in coords.items() if all(c[d] == mine[d] for d in MESH_DIMS if d not in dims))

    expected = {}
    for rank, c in coords.items():
        groups = {d: members(rank, (d,)) for d in MESH_DIMS}
        groups["dp_cp"] = members(rank, ("dp", "cp"))
        position = groups["dp_cp"].index(rank)
        groups["ep"] = groups["dp_cp"][position - position % ep: position - position % ep + ep]
        expected[rank] = groups
    return expected


MESHES = [dict(tp=2, dp=2), dict(pp=2, tp=2), dict(dp=4, ep=2), dict(dp=4, ep=4), dict(cp=2, tp=2),
          dict(pp=2, dp=2, ep=2), dict(dp=2, cp=2, ep=4)]


@pytest.mark.parametrize("degrees", MESHES, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_four_rank_mesh_groups(degrees):
    results = run_distributed(_mesh_view, 4, degrees=degrees, timeout=60)
    expected = _expected_groups(**degrees)
    for view, rank in results:
        for dim, (size, local_rank, ranks) in view.items():
            assert ranks == expected[rank][dim], (rank, dim, ranks, expected[rank][dim])
            assert size == len(ranks), (rank, dim)
            assert local_rank == ranks.index(rank), (rank, dim)


def _init_error(degrees):
    try:
        init_parallel(**degrees)
    except ParallelConfigError as e:
        return str(e)
    return None


def test_four_rank_world_mismatch_is_reported():
    errors = run_distributed(_init_error, 4, degrees=dict(tp=2, dp=4), timeout=60)
    assert all(e and e.startswith("world size 4 != pp*dp*cp*tp = 1*4*1*2 = 8") for e in errors), errors
