"""titan_cp.mesh: degree validation (no process group) and the named mesh on 1, 2 and 4 gloo ranks."""

import pytest
import torch
import torch.distributed as dist

from titan_cp.config import load_config
from titan_cp.mesh import AXES, HYBRID_AXES, ParallelDims


def dims(world_size, dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, cp_ulysses=None):
    return ParallelDims(
        dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, world_size=world_size, cp_ulysses=cp_ulysses
    )


# ---- validation, no process group -------------------------------------------------------------


def test_dp_shard_minus_one_takes_the_rest():
    pd = dims(16, dp_replicate=2, cp=2, tp=2)
    assert pd.dp_shard == 2
    assert pd.dp_degree == 4
    assert pd.non_data_parallel_size == 4
    assert (pd.dp_enabled, pd.fsdp_enabled, pd.cp_enabled, pd.tp_enabled, pd.pp_enabled) == (
        True,
        True,
        True,
        True,
        False,
    )


def test_properties_of_the_trivial_mesh():
    pd = dims(1)
    assert pd.dp_shard == 1 and pd.dp_degree == 1 and pd.non_data_parallel_size == 1
    assert not any((pd.dp_enabled, pd.fsdp_enabled, pd.cp_enabled, pd.tp_enabled, pd.pp_enabled, pd.hybrid_cp))
    assert dims(2, cp=2).fsdp_enabled  # FSDP shards over dp_shard x cp


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (
            dict(world_size=8, dp_shard=2, cp=2),
            r"multiply to 4 .* not the world size 8.*parallelism.data_parallel_shard_degree = -1",
        ),
        (
            dict(world_size=6, cp=4),
            r"parallelism.data_parallel_shard_degree = -1 .* world size 6 is not a multiple .*= 4",
        ),
        (dict(world_size=4, cp=0), r"parallelism.context_parallel_degree must be positive, got 0"),
        (dict(world_size=4, tp=-3), r"parallelism.tensor_parallel_degree must be positive"),
        (
            dict(world_size=4, pp=-1),
            r"parallelism.pipeline_parallel_degree is -1, but only parallelism.data_parallel_shard_degree may be -1",
        ),
        (dict(world_size=4, dp_replicate=-1), r"parallelism.data_parallel_replicate_degree is -1"),
        (dict(world_size=4, dp_shard=0), r"parallelism.data_parallel_shard_degree must be positive or -1"),
        (
            dict(world_size=8, cp=4, cp_ulysses=3),
            r"parallelism.context_parallel_ulysses_degree \(3\) must be a positive divisor",
        ),
        (dict(world_size=0), r"world size must be positive"),
    ],
)
def test_bad_degrees_name_the_key(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        dims(**kwargs)


def test_from_config():
    cfg = load_config(["--parallelism.context_parallel_degree", "4", "--parallelism.tensor_parallel_degree", "2"])
    pd = cfg.parallel_dims(world_size=16)
    assert (pd.pp, pd.dp_replicate, pd.dp_shard, pd.cp, pd.tp) == (1, 1, 2, 4, 2)
    assert not pd.hybrid_cp
    cfg = load_config(
        [
            "--parallelism.context_parallel_degree",
            "4",
            "--parallelism.context_parallel_strategy",
            "hybrid",
            "--parallelism.context_parallel_ulysses_degree",
            "2",
        ]
    )
    pd = cfg.parallel_dims(world_size=8)
    assert pd.hybrid_cp and (pd.cp_ring, pd.cp_ulysses, pd.dp_shard) == (2, 2, 2)
    with pytest.raises(ValueError, match="parallelism.context_parallel_degree"):
        cfg.parallel_dims(world_size=6)


def test_the_logs_mesh_line_is_the_mesh_built():
    """The line names the degrees the mesh has (dp_shard -1 resolved, CP from the command line), not
    the config file's: ``cpu_main.toml`` (CP 4) run on 2 ranks with CP 2."""
    from titan_cp.train import mesh_line

    cfg = load_config(
        ["--job.config_file", "train_configs/cpu_main.toml", "--parallelism.context_parallel_degree", "2"]
    )
    assert mesh_line(cfg.parallel_dims(2), cfg) == "dp_shard 1 x cp 2 (ring, contiguous)"
    assert "CP 4" not in cfg.job.description  # the job line says nothing the mesh line contradicts
    assert mesh_line(cfg.parallel_dims(8), cfg) == "dp_shard 4 x cp 2 (ring, contiguous)"
    cfg = load_config(["--parallelism.context_parallel_degree", "1", "--parallelism.tensor_parallel_degree", "2"])
    assert mesh_line(cfg.parallel_dims(4), cfg) == "dp_shard 2 x cp 1 x tp 2"
    hybrid = ["--parallelism.context_parallel_strategy", "hybrid", "--parallelism.context_parallel_ulysses_degree", "2"]
    cfg = load_config(
        ["--parallelism.context_parallel_degree", "4", "--parallelism.pipeline_parallel_degree", "2", *hybrid]
    )
    assert mesh_line(cfg.parallel_dims(8), cfg) == "pp 2 x dp_shard 1 x cp 4 = ring 2 x ulysses 2 (hybrid, doc_local)"


def test_get_mesh_before_build_is_an_error():
    with pytest.raises(RuntimeError, match="build_mesh"):
        dims(1).get_mesh("dp")


# ---- meshes on gloo ranks ---------------------------------------------------------------------


def _mesh_report(rank, world_size, kwargs):
    """Build the mesh; per view, its ranks (this rank's group) and an all-reduce over its group."""
    pd = ParallelDims(world_size=world_size, **kwargs)
    world = pd.build_mesh("cpu")
    views = {}
    for name in (*world.mesh_dim_names, "cp", "dp", "dp_shard_cp", "dp_cp"):
        mesh = pd.get_mesh(name)
        members = mesh.mesh.flatten().tolist()
        total = torch.tensor([rank])
        dist.all_reduce(total, group=mesh.get_group())
        views[name] = (members, mesh.get_local_rank(), total.item())
    report = {"names": world.mesh_dim_names, "shape": tuple(world.shape), "views": views}
    if pd.hybrid_cp:
        sub = pd.hybrid_cp_mesh()
        report["hybrid"] = (sub.mesh_dim_names, tuple(sub.shape), sub.mesh.tolist())
    try:
        pd.get_mesh("nope")
    except KeyError as e:
        report["unknown"] = str(e)
    return report


def _check_views(reports, expected):
    """``expected[name]``: the groups of that view, as sorted lists of ranks."""
    for rank, report in enumerate(reports):
        for name, groups in expected.items():
            members, local_rank, total = report["views"][name]
            group = next(g for g in groups if rank in g)
            assert members == group, (rank, name)
            assert local_rank == group.index(rank), (rank, name)
            assert total == sum(group), (rank, name)  # the process group really holds these ranks


def test_mesh_world_1(dist_pools):
    (report,) = dist_pools.run(1, _mesh_report, dict(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1))
    assert report["names"] == AXES
    assert report["shape"] == (1, 1, 1, 1, 1)
    _check_views([report], {name: [[0]] for name in (*AXES, "dp", "dp_shard_cp", "dp_cp")})
    assert "nope" in report["unknown"]


def test_mesh_world_2_cp(dist_pools):
    reports = dist_pools.run(2, _mesh_report, dict(dp_replicate=1, dp_shard=-1, cp=2, tp=1, pp=1))
    assert reports[0]["shape"] == (1, 1, 1, 2, 1)
    _check_views(
        reports, {"cp": [[0, 1]], "dp": [[0], [1]], "dp_shard_cp": [[0, 1]], "dp_cp": [[0, 1]], "tp": [[0], [1]]}
    )


def test_mesh_world_2_ddp(dist_pools):
    reports = dist_pools.run(2, _mesh_report, dict(dp_replicate=2, dp_shard=1, cp=1, tp=1, pp=1))
    _check_views(reports, {"dp_replicate": [[0, 1]], "dp": [[0, 1]], "dp_shard_cp": [[0], [1]], "dp_cp": [[0, 1]]})


def test_mesh_world_4_fsdp_cp(dist_pools):
    # rank = dp_shard * 2 + cp
    reports = dist_pools.run(4, _mesh_report, dict(dp_replicate=1, dp_shard=2, cp=2, tp=1, pp=1))
    assert reports[0]["names"] == AXES and reports[0]["shape"] == (1, 1, 2, 2, 1)
    _check_views(
        reports,
        {
            "cp": [[0, 1], [2, 3]],
            "dp_shard": [[0, 2], [1, 3]],
            "dp": [[0, 2], [1, 3]],
            "dp_shard_cp": [[0, 1, 2, 3]],
            "dp_cp": [[0, 1, 2, 3]],
        },
    )


def test_mesh_world_4_pp_tp_cp(dist_pools):
    # rank = pp * 2 + tp  (cp 1)  then  pp 1 x cp 2 x tp 2: rank = cp * 2 + tp
    reports = dist_pools.run(4, _mesh_report, dict(dp_replicate=1, dp_shard=-1, cp=2, tp=2, pp=1))
    _check_views(
        reports,
        {
            "tp": [[0, 1], [2, 3]],
            "cp": [[0, 2], [1, 3]],
            "dp": [[0], [1], [2], [3]],
            "dp_cp": [[0, 2], [1, 3]],
            "dp_shard_cp": [[0, 2], [1, 3]],
        },
    )
    reports = dist_pools.run(4, _mesh_report, dict(dp_replicate=1, dp_shard=-1, cp=2, tp=1, pp=2))
    _check_views(reports, {"pp": [[0, 2], [1, 3]], "cp": [[0, 1], [2, 3]], "dp_cp": [[0, 1], [2, 3]]})


def test_mesh_world_4_hybrid_cp(dist_pools):
    # cp 4 = cp_ring 2 x cp_ulysses 2, Ulysses inner: cp rank = ring * 2 + ulysses
    reports = dist_pools.run(4, _mesh_report, dict(dp_replicate=1, dp_shard=-1, cp=4, tp=1, pp=1, cp_ulysses=2))
    assert reports[0]["names"] == HYBRID_AXES and reports[0]["shape"] == (1, 1, 1, 2, 2, 1)
    _check_views(
        reports,
        {
            "cp_ulysses": [[0, 1], [2, 3]],
            "cp_ring": [[0, 2], [1, 3]],
            "cp": [[0, 1, 2, 3]],
            "dp_shard_cp": [[0, 1, 2, 3]],
            "dp_cp": [[0, 1, 2, 3]],
            "dp": [[0], [1], [2], [3]],
        },
    )
    assert reports[0]["hybrid"] == (("cp_ring", "cp_ulysses"), (2, 2), [[0, 1], [2, 3]])


def _build_for_wrong_world(rank, world_size):
    try:
        ParallelDims(dp_replicate=1, dp_shard=1, cp=4, tp=1, pp=1, world_size=4).build_mesh("cpu")
    except ValueError as e:
        return str(e)
    return None


def test_build_mesh_checks_the_launched_world_size(dist_pools):
    messages = dist_pools.run(2, _build_for_wrong_world)
    assert all(m is not None and "for 4 ranks" in m and "2 ranks were launched" in m for m in messages)


def _fsdp_mesh_report(rank, world_size, kwargs):
    """Build the mesh and FSDP's mesh, recording any warning torch gives (deprecated slicing)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pd = ParallelDims(world_size=world_size, **kwargs)
        pd.build_mesh("cpu")
        mesh = pd.fsdp_mesh()
        total = torch.tensor([rank])
        dist.all_reduce(total, group=mesh.get_group(mesh.ndim - 1))
    return mesh.mesh_dim_names, mesh.mesh.tolist(), total.item(), [str(w.message) for w in caught]


def test_fsdp_mesh_is_kept_not_sliced_from_the_root(dist_pools):
    """HSDP: (dp_replicate, dp_shard_cp) joined from kept views; no deprecation warning."""
    reports = dist_pools.run(4, _fsdp_mesh_report, dict(dp_replicate=2, dp_shard=1, cp=2, tp=1, pp=1))
    for rank, (names, ranks, total, warned) in enumerate(reports):
        assert names == ("dp_replicate", "dp_shard_cp")
        assert ranks == [[0, 1], [2, 3]]
        assert total == (1 if rank < 2 else 5)  # the shard group: ranks {0, 1} or {2, 3}
        assert not warned, warned
    (names, ranks, _, warned), *_ = dist_pools.run(
        2, _fsdp_mesh_report, dict(dp_replicate=1, dp_shard=-1, cp=2, tp=1, pp=1)
    )
    assert names == ("dp_shard_cp",) and ranks == [0, 1] and not warned
