"""The named device mesh: parallelism degrees, their validation, and the mesh views each part uses.

World mesh axes, outermost first (the last axis holds adjacent ranks)::

    ("pp", "dp_replicate", "dp_shard", "cp", "tp")                       # every strategy but hybrid
    ("pp", "dp_replicate", "dp_shard", "cp_ring", "cp_ulysses", "tp")    # hybrid CP

All axes are kept even when of size 1, so code can always slice by name ("never assume a 1-D
mesh"). Flattened views, created once with ``DeviceMesh._flatten`` and kept here (torch warns that
re-slicing a flattened axis from the root mesh is deprecated, so get them from
:meth:`ParallelDims.get_mesh`):

============== ============================================ ==========================================
view           axes                                         used for
============== ============================================ ==========================================
``dp``         dp_replicate x dp_shard                      data loading: ranks that read different rows
``dp_shard_cp`` dp_shard x cp                               FSDP sharding (CP ranks shard weights too)
``dp_cp``      dp_replicate x dp_shard x cp                 loss and token-count reduction
``cp``         cp_ring x cp_ulysses (hybrid only)           the sequence-parallel group as a whole
============== ============================================ ==========================================

FSDP's mesh is :meth:`ParallelDims.fsdp_mesh`: the kept ``dp_shard_cp`` view, or for HSDP the
2-D ``(dp_replicate, dp_shard_cp)`` mesh joined from kept views (``DeviceMesh._concatenate``),
never sliced from the root.

For hybrid CP the Ulysses axis is the inner one (adjacent ranks, the fastest links carry the
all-to-all) and the ring runs across it: cp rank ``r = ring_rank * cp_ulysses + ulysses_rank``.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from math import prod

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_cp.errors import plural

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
HYBRID_AXES = ("pp", "dp_replicate", "dp_shard", "cp_ring", "cp_ulysses", "tp")

DEGREE_KEYS = {  # each mesh axis's degree as a config key
    "pp": "parallelism.pipeline_parallel_degree",
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "dp_shard": "parallelism.data_parallel_shard_degree",
    "cp": "parallelism.context_parallel_degree",
    "tp": "parallelism.tensor_parallel_degree",
}


@dataclass
class ParallelDims:
    """Parallelism degrees for ``world_size`` ranks; ``dp_shard = -1`` takes the ranks left over.

    ``cp_ulysses`` (hybrid CP only) splits the cp axis into ``cp_ring x cp_ulysses``; ``None`` keeps
    one ``cp`` axis. Construction validates the degrees and raises ``ValueError`` naming the config
    key; it needs no process group.
    """

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    cp_ulysses: int | None = None
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be positive, got {self.world_size}")
        for axis in ("pp", "dp_replicate", "cp", "tp"):
            degree = getattr(self, axis)
            if degree == -1:
                raise ValueError(
                    f"{DEGREE_KEYS[axis]} is -1, but only {DEGREE_KEYS['dp_shard']} may be -1 (the ranks left over)"
                )
            if degree < 1:
                raise ValueError(f"{DEGREE_KEYS[axis]} must be positive, got {degree}")
        others = self.pp * self.dp_replicate * self.cp * self.tp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ValueError(
                    f"{DEGREE_KEYS['dp_shard']} = -1 takes the ranks left over, but the world size "
                    f"{self.world_size} is not a multiple of {self._describe(skip='dp_shard')} = {others}"
                )
            self.dp_shard = self.world_size // others
        elif self.dp_shard < 1:
            raise ValueError(f"{DEGREE_KEYS['dp_shard']} must be positive or -1 (the rest), got {self.dp_shard}")
        if others * self.dp_shard != self.world_size:
            raise ValueError(
                f"the parallelism degrees multiply to {others * self.dp_shard} "
                f"({self._describe()}), not the world size {self.world_size}; change them or set "
                f"{DEGREE_KEYS['dp_shard']} = -1"
            )
        if self.cp_ulysses is not None and (self.cp_ulysses < 1 or self.cp % self.cp_ulysses):
            raise ValueError(
                f"parallelism.context_parallel_ulysses_degree ({self.cp_ulysses}) must be a positive "
                f"divisor of {DEGREE_KEYS['cp']} ({self.cp})"
            )

    def _describe(self, skip: str = "") -> str:
        return " x ".join(f"{DEGREE_KEYS[a]}={getattr(self, a)}" for a in AXES if a != skip)

    def summary(self) -> str:
        """The mesh in words, for the log: ``dp_shard`` and ``cp`` always, the other axes where larger
        than 1, a hybrid cp axis with its two factors: ``"dp_shard 1 x cp 2"``,
        ``"pp 2 x dp_shard 1 x cp 4 = ring 2 x ulysses 2 x tp 2"``."""
        parts = [f"{a} {getattr(self, a)}" for a in AXES if a in ("dp_shard", "cp") or getattr(self, a) > 1]
        if self.hybrid_cp:
            parts[parts.index(f"cp {self.cp}")] += f" = ring {self.cp_ring} x ulysses {self.cp_ulysses}"
        return " x ".join(parts)

    # ---- degrees ----------------------------------------------------------------------------

    @property
    def dp_degree(self) -> int:
        """Data-parallel ranks (``dp_replicate * dp_shard``): the ranks that read different rows."""
        return self.dp_replicate * self.dp_shard

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that share one data-parallel rank's rows: ``cp * tp * pp``."""
        return self.cp * self.tp * self.pp

    @property
    def cp_ring(self) -> int:
        """Ring axis size under hybrid CP (``cp`` otherwise)."""
        return self.cp // (self.cp_ulysses or 1)

    @property
    def dp_enabled(self) -> bool:
        return self.dp_degree > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP shards over ``dp_shard x cp``: on when either is larger than 1."""
        return self.dp_shard > 1 or self.cp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def hybrid_cp(self) -> bool:
        """Whether the cp axis is split into ``cp_ring x cp_ulysses``."""
        return self.cp_ulysses is not None

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    # ---- meshes -----------------------------------------------------------------------------

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the world mesh (every axis, sizes 1 included) and the flattened views.

        Needs an initialised default process group of exactly ``world_size`` ranks; every rank
        must call it (creating sub-groups is collective).
        """
        if not dist.is_initialized():
            raise RuntimeError("build_mesh needs torch.distributed to be initialised")
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"the parallelism degrees are for {plural(self.world_size, 'rank')} ({self._describe()}), but "
                f"{plural(dist.get_world_size(), 'rank')} {'was' if dist.get_world_size() == 1 else 'were'} launched"
            )
        names: tuple[str, ...]
        cp_axes: tuple[str, ...]
        shape: tuple[int, ...]
        if self.cp_ulysses is not None:  # hybrid_cp
            names, cp_axes = HYBRID_AXES, ("cp_ring", "cp_ulysses")
            shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp_ring, self.cp_ulysses, self.tp)
        else:
            names, cp_axes = AXES, ("cp",)
            shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        assert prod(shape) == self.world_size
        world = init_device_mesh(device_type, shape, mesh_dim_names=names)
        meshes = {"world": world}
        if self.hybrid_cp:
            meshes["cp"] = world[cp_axes]._flatten("cp")
        meshes["dp"] = world["dp_replicate", "dp_shard"]._flatten("dp")
        shard_cp, dp_cp = ("dp_shard", *cp_axes), ("dp_replicate", "dp_shard", *cp_axes)
        meshes["dp_shard_cp"] = world[shard_cp]._flatten("dp_shard_cp")
        meshes["dp_cp"] = world[dp_cp]._flatten("dp_cp")
        meshes["dp_replicate_dp_shard_cp"] = DeviceMesh._concatenate([world["dp_replicate"], meshes["dp_shard_cp"]])
        self._meshes = meshes
        return world

    @property
    def world_mesh(self) -> DeviceMesh:
        return self.get_mesh("world")

    def get_mesh(self, name: str) -> DeviceMesh:
        """The 1-D mesh of axis or view ``name`` (``"tp"``, ``"dp"``, ``"dp_cp"``, ...), or ``"world"``."""
        if not self._meshes:
            raise RuntimeError("call build_mesh(device_type) before get_mesh")
        if name in self._meshes:
            return self._meshes[name]
        world = self._meshes["world"]
        dims = world.mesh_dim_names or ()
        if name not in dims:
            raise KeyError(f"no mesh {name!r}; have {sorted([*dims, *self._meshes])}")
        return world[name]

    def set_timeout(self, seconds: float) -> None:
        """Set the collective timeout of the default process group and of every group of the mesh
        and its views (``comm.train_timeout_seconds`` after the first step, as torchtitan does)."""
        timeout = datetime.timedelta(seconds=seconds)
        groups = {id(g): g for mesh in self._meshes.values() for g in mesh.get_all_groups()}
        for group in [None, *groups.values()]:
            dist.distributed_c10d._set_pg_timeout(timeout, group)

    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP shards over: 1-D ``dp_shard_cp``, or 2-D ``(dp_replicate, dp_shard_cp)``
        for HSDP (``dp_replicate > 1``)."""
        return self.get_mesh("dp_replicate_dp_shard_cp" if self.dp_replicate_enabled else "dp_shard_cp")

    def hybrid_cp_mesh(self) -> DeviceMesh:
        """The 2-D ``("cp_ring", "cp_ulysses")`` sub-mesh of hybrid CP."""
        if not self.hybrid_cp:
            raise ValueError("the cp axis is split only for parallelism.context_parallel_strategy = 'hybrid'")
        return self.get_mesh("world")["cp_ring", "cp_ulysses"]
