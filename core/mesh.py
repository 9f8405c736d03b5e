"""The parallel runtime: degrees, process-group initialisation and the device mesh.

Every rank of a torchrun job builds one `ParallelContext`. It owns a `DeviceMesh` with the named
dimensions (pp, dp, cp, tp) and hands each layer the process group it needs. Expert parallelism is
folded over dp x cp: the dp*cp ranks of one (pp, tp) coordinate are split into groups of ep ranks.
On a single process nothing is initialised and every group is None (size 1).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from datetime import timedelta

import torch
import torch.distributed as dist

from colozoo.core.sequence import sequence_multiple

MESH_DIMS = ("pp", "dp", "cp", "tp")


class ParallelConfigError(ValueError):
    """Degrees that cannot form a mesh."""


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "sequence_parallel":
                if not isinstance(value, bool):
                    raise ParallelConfigError(f"sequence_parallel must be a bool, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ParallelConfigError(f"degree {f.name} must be an integer >= 1, got {value!r}")
        if (self.dp * self.cp) % self.ep:
            raise ParallelConfigError(
                f"ep={self.ep} must divide dp*cp={self.dp * self.cp} (experts are spread over the data and context ranks)"
            )

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def sequence_multiple(self) -> int:
        """What a sequence's length must be a multiple of for this mesh to split it (core.sequence)."""
        return sequence_multiple(self.cp, self.tp if self.sequence_parallel else 1)

    @classmethod
    def for_world(cls, world_size: int, *, tp=1, pp=1, dp=None, cp=1, ep=1, sequence_parallel=False) -> "ParallelConfig":
        """Fill in dp from the world size when it is None, then check the product."""
        if dp is None:
            model_ranks = tp * pp * cp
            if model_ranks < 1 or world_size % model_ranks:
                raise ParallelConfigError(
                    f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {model_ranks}"
                )
            dp = world_size // model_ranks
        config = cls(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, sequence_parallel=sequence_parallel)
        if config.world_size != world_size:
            raise ParallelConfigError(
                f"world size {world_size} != pp*dp*cp*tp = {pp}*{dp}*{cp}*{tp} = {config.world_size}; "
                f"launch with torchrun --nproc-per-node {config.world_size} or change the degrees"
            )
        return config


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


COLLECTIVE_TIMEOUT_S = 600.0  # a rank stuck this long in a collective ends the job (COLOZOO_COLLECTIVE_TIMEOUT)


def collective_timeout(seconds: float | None = None) -> timedelta:
    """How long a collective may wait for its peers: `seconds`, else COLOZOO_COLLECTIVE_TIMEOUT seconds, else 10
    minutes. A lost rank (a dead node, which torchrun's local monitoring does not see) then makes every rank fail,
    not hang."""
    value = os.environ.get("COLOZOO_COLLECTIVE_TIMEOUT", COLLECTIVE_TIMEOUT_S) if seconds is None else seconds
    try:
        seconds = float(value)
    except ValueError:
        raise ParallelConfigError(f"COLOZOO_COLLECTIVE_TIMEOUT must be a number of seconds, got {value!r}") from None
    if seconds <= 0:
        raise ParallelConfigError(f"the collective timeout must be > 0 seconds, got {value!r}")
    return timedelta(seconds=seconds)


def init_distributed(timeout_s: float | None = None) -> int:
    """Initialise torch.distributed from torchrun's environment; NCCL on CUDA, gloo on CPU, with an explicit
    collective timeout (`timeout_s`, else see `collective_timeout`). Returns the world size."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 1
    timeout = collective_timeout(timeout_s)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()), timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return world_size


class ParallelContext:
    """The mesh of one job seen from one rank: its coordinates and the process group of each dimension."""

    def __init__(self, config: ParallelConfig, device: torch.device | None = None):
        self.config = config
        self.device = device or default_device()
        self.mesh = self.dp_cp_mesh = None
        self.groups: dict[str, dist.ProcessGroup | None] = {d: None for d in (*MESH_DIMS, "ep", "edp", "dp_cp")}
        self.ranks = {d: 0 for d in (*MESH_DIMS, "ep", "edp", "dp_cp")}
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world != config.world_size:
            raise ParallelConfigError(
                f"world size {world} != pp*dp*cp*tp = {config.world_size} for {config}"
            )
        if world > 1:
            self._build_mesh()

    def _build_mesh(self):
        from torch.distributed.device_mesh import init_device_mesh

        c = self.config
        self.mesh = init_device_mesh(self.device.type, (c.pp, c.dp, c.cp, c.tp), mesh_dim_names=MESH_DIMS)
        for name in MESH_DIMS:
            self.groups[name] = self.mesh.get_group(name)
            self.ranks[name] = self.mesh.get_local_rank(name)
        dp_cp = self.dp_cp_mesh = self.mesh["dp", "cp"]._flatten("dp_cp")  # kept: slicing it off again is deprecated
        self.groups["dp_cp"] = dp_cp.get_group()
        self.ranks["dp_cp"] = dp_cp.get_local_rank()
        self.groups["ep"], self.ranks["ep"] = self._expert_group()
        self.groups["edp"], self.ranks["edp"] = self._expert_data_group()

    def _expert_group(self):
        """Split every dp*cp group into consecutive groups of ep ranks: the ranks that exchange tokens."""
        ep = self.config.ep
        return self._dp_cp_subgroups(lambda ranks: [ranks[i : i + ep] for i in range(0, len(ranks), ep)])

    def _expert_data_group(self):
        """The ranks of a dp*cp group holding the same experts (same ep rank): where expert gradients are reduced."""
        ep = self.config.ep
        return self._dp_cp_subgroups(lambda ranks: [ranks[j::ep] for j in range(ep)])

    def _dp_cp_subgroups(self, subgroups_of):
        """Create the groups `subgroups_of(ranks)` cuts from every dp*cp group's ranks (collective: every rank
        creates every group, in the same order); return this rank's group and its rank in it."""
        mesh = self.mesh.mesh  # (pp, dp, cp, tp) tensor of global ranks
        dp_cp_lists = mesh.permute(0, 3, 1, 2).reshape(-1, self.config.dp * self.config.cp).tolist()
        me, mine = dist.get_rank(), (None, 0)
        for ranks in (sub for dp_cp in dp_cp_lists for sub in subgroups_of(dp_cp)):
            group = dist.new_group(ranks)
            if me in ranks:
                mine = group, ranks.index(me)
        return mine

    @classmethod
    def virtual(cls, pp: int = 1, pp_rank: int = 0, device=None, **degrees) -> "ParallelContext":
        """The context of one pipeline stage of a mesh of these degrees, for building meta models offline: the
        degrees are checked (heads, kv heads, widths divisible by tp ...), but there are no process groups, so
        layers take their global shapes."""
        self = cls.__new__(cls)
        self.config = ParallelConfig(pp=pp, **degrees)
        if not 0 <= pp_rank < pp:
            raise ParallelConfigError(f"pp_rank {pp_rank} is not a stage of pp={pp}")
        self.device = torch.device(device or "cpu")
        self.mesh = self.dp_cp_mesh = None
        self.groups = {d: None for d in (*MESH_DIMS, "ep", "edp", "dp_cp")}
        self.ranks = {d: 0 for d in (*MESH_DIMS, "ep", "edp", "dp_cp")}
        self.ranks["pp"] = pp_rank
        return self

    def group(self, dim: str):
        return self.groups[dim]

    def stage_ends_group(self):
        """The group of the first and last pipeline stage at this rank's (dp, cp, tp) coordinate, e.g. for a
        tied embedding. Collective the first time: every rank creates every pair's group."""
        if "stage_ends" not in self.groups:
            mine = None
            for pair in torch.stack([self.mesh.mesh[0], self.mesh.mesh[-1]], dim=-1).reshape(-1, 2).tolist():
                group = dist.new_group(pair)
                if dist.get_rank() in pair:
                    mine = group
            self.groups["stage_ends"] = mine
        return self.groups["stage_ends"]

    def tp_subgroup(self, size: int):
        """The group of the `size` consecutive tp ranks this rank is one of (the ranks holding one replicated kv
        head); None when size is 1 or there is no mesh. Collective the first time for each size: every rank
        creates every group."""
        if size == 1 or self.mesh is None:
            return None
        tp = self.config.tp
        if tp % size:
            raise ParallelConfigError(f"tp={tp} cannot be cut into groups of {size} ranks")
        key = f"tp/{size}"
        if key not in self.groups:
            mine = None
            for row in self.mesh.mesh.reshape(-1, tp).tolist():
                for i in range(0, tp, size):
                    group = dist.new_group(row[i:i + size])
                    if dist.get_rank() in row[i:i + size]:
                        mine = group
            self.groups[key] = mine
        return self.groups[key]

    def size(self, dim: str) -> int:
        if dim == "dp_cp":
            return self.config.dp * self.config.cp
        if dim == "edp":
            return self.config.dp * self.config.cp // self.config.ep
        return getattr(self.config, dim)

    def rank(self, dim: str) -> int:
        return self.ranks[dim]

    tp_group = property(lambda self: self.groups["tp"])
    tp_size = property(lambda self: self.config.tp)
    tp_rank = property(lambda self: self.ranks["tp"])
    pp_rank = property(lambda self: self.ranks["pp"])
    sequence_parallel = property(lambda self: self.config.sequence_parallel and self.config.tp > 1)

    @property
    def is_first_stage(self) -> bool:
        return self.ranks["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.ranks["pp"] == self.config.pp - 1

    def __repr__(self):
        coords = ", ".join(f"{d}={self.ranks[d]}/{self.size(d)}" for d in (*MESH_DIMS, "ep"))
        return f"ParallelContext({coords}, device={self.device})"


# One context per mesh and device for the life of the default process group: building a mesh creates process
# groups (NCCL communicators, gloo connections), which are costly and never freed while the job runs.
_CONTEXTS: dict[tuple, tuple[object, ParallelContext]] = {}


def init_parallel(tp=1, pp=1, dp=None, cp=1, ep=1, sequence_parallel=False, device=None) -> ParallelContext:
    """Initialise distributed (if launched by torchrun) and build this rank's ParallelContext (reused when the
    same degrees and device are asked for again under the same default process group)."""
    world = init_distributed()
    config = ParallelConfig.for_world(world, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, sequence_parallel=sequence_parallel)
    if world == 1:
        return ParallelContext(config, device=device)
    device = torch.device(device) if device is not None else default_device()
    world_group, parallel = _CONTEXTS.get((config, device), (None, None))
    if world_group is not dist.group.WORLD:
        parallel = ParallelContext(config, device=device)
        _CONTEXTS[(config, device)] = (dist.group.WORLD, parallel)
    return parallel


def single_process() -> ParallelContext:
    return ParallelContext(ParallelConfig())


def coords_of(parallel: ParallelContext) -> dict[str, tuple[int, int]]:
    """Mesh coordinates used by shard specs: {mesh_dim: (rank, size)}."""
    return {dim: (parallel.rank(dim), parallel.size(dim)) for dim in ("tp", "ep")}
