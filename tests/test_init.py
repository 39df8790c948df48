"""Meta-device construction: the initial weights do not depend on the mesh, and each rank
allocates only its shards.

Identity is bit-exact (``torch.equal``): every value is drawn by the same generator ops on
the same seeded block of the unsharded tensor, whatever the shard (``titan_cp.families.init``).
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from torch.distributed.tensor import DTensor

from titan_cp.families import init as init_module
from titan_cp.families.init import block_seed, clean_name, seeded_fill_
from titan_cp.families.llama3 import LlamaBuilder, ModelArgs, Transformer, build_model, materialize, model_args
from titan_cp.loss import GlobalTokenLoss
from titan_cp.mesh import ParallelDims
from titan_cp.parallel.build import ParallelizeOptions, build_parallel_model
from titan_cp.testing.trainer import tiny_run_args

SEED = 1234
SMALL_BLOCK = 1000  # values per seeded block in these tests: many blocks per parameter, cut by shards


def _one_process_state(args: ModelArgs) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = Transformer(args)
    materialize(model, "cpu", SEED)
    return {n: p.detach() for n, p in model.named_parameters()}


def _mesh(world: int, mesh: dict) -> ParallelDims:
    pd = ParallelDims(
        dp_replicate=1,
        dp_shard=mesh.get("dp", 1),
        cp=mesh.get("cp", 1),
        tp=mesh.get("tp", 1),
        pp=mesh.get("pp", 1),
        world_size=world,
    )
    pd.build_mesh("cpu")
    return pd


def _gathered_state(rank, world, mesh: dict, ac: str):
    block = init_module.BLOCK_ELEMENTS
    init_module.BLOCK_ELEMENTS = SMALL_BLOCK
    try:
        built = build_parallel_model(
            LlamaBuilder(model_args("tiny", n_layers=4)),
            _mesh(world, mesh),
            ParallelizeOptions(cp_strategy="ring", ac_mode=ac),
            "cpu",
            seed=SEED,
            loss_fn=GlobalTokenLoss(),
            pp_microbatches=2,
            pp_schedule="GPipe",
        )
    finally:
        init_module.BLOCK_ELEMENTS = block
    state = {}
    for part in built.parts:
        for name, p in part.named_parameters():
            assert p.device.type == "cpu"
            state[clean_name(name)] = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
    return state


@pytest.mark.parametrize(
    "mesh, ac",
    [(dict(cp=4), "none"), (dict(dp=2, cp=2), "full"), (dict(tp=2, cp=2), "none"), (dict(pp=2, cp=2), "none")],
    ids=["cp4", "dp2_cp2_ac", "tp2_cp2", "pp2_cp2"],
)
def test_initial_weights_are_the_same_on_every_mesh(dist_pools, monkeypatch, mesh, ac):
    monkeypatch.setattr(init_module, "BLOCK_ELEMENTS", SMALL_BLOCK)
    want = _one_process_state(model_args("tiny", n_layers=4))
    got = {}
    for state in dist_pools.run(4, _gathered_state, mesh, ac):
        for name, t in state.items():
            if name in got:  # replicas (dp, cp, or tp for the norms) hold the same values
                assert torch.equal(got[name], t), name
            got[name] = t
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_seeded_fill_depends_on_the_seed_and_the_name_and_is_sharding_free(monkeypatch):
    monkeypatch.setattr(init_module, "BLOCK_ELEMENTS", 64)
    draw = lambda t, g: t.normal_(generator=g)  # noqa: E731
    whole = torch.empty(37, 10)
    seeded_fill_(whole, 0, "w", draw)
    again = torch.empty(37, 10)
    seeded_fill_(again, 0, "w", draw)
    assert torch.equal(whole, again)
    for seed, name in ((1, "w"), (0, "v")):
        other = torch.empty(37, 10)
        seeded_fill_(other, seed, name, draw)
        assert not torch.equal(other, whole)
    assert block_seed(0, "w", 0) != block_seed(0, "w", 1)
    # a row-block of 6 rows per seed: rows 0-5 and 6-11 are not the same draws
    assert not torch.equal(whole[:6], whole[6:12])
    # the meta path of build_model equals its materialised path (the API tests use)
    torch.manual_seed(5)
    a = build_model("tiny", device="cpu")
    torch.manual_seed(5)
    b = build_model("tiny")
    b.to_empty(device="cpu")
    b.init_weights()
    for (_, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb)


# ------------------------------------------------------------- construction memory

# About 0.7 GB of fp32 weights (176M parameters): a large vocabulary and dim, one layer.
BIG = ModelArgs(dim=2048, n_layers=1, n_heads=16, n_kv_heads=4, vocab_size=32_000, multiple_of=256)


def _status_kib(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _construction_growth(rank, world):
    """Peak resident memory growth (bytes) of this rank while it builds BIG with FSDP over all ranks."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
        f.write("5")
    before = _status_kib("VmRSS")
    pd = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, world_size=world)
    pd.build_mesh("cpu")
    built = build_parallel_model(LlamaBuilder(BIG), pd, ParallelizeOptions(), "cpu", seed=0)
    peak = _status_kib("VmHWM")
    local = sum(p.to_local().numel() * p.element_size() for p in built.parts[0].parameters())
    del built
    gc.collect()
    return (peak - before) * 1024, local


@pytest.mark.skipif(
    not os.path.exists("/proc/self/clear_refs"), reason="reads and resets the peak RSS in /proc (Linux)"
)
def test_construction_allocates_only_shards(dist_pools):
    """4 ranks, FSDP 4, ~0.7 GB of fp32 weights: each rank's peak RSS grows by about a quarter of
    it. Building the whole model on each rank first (the pre-meta path) grows it by >= 0.7 GB."""
    total = BIG.num_params() * 4
    assert 0.65e9 < total < 0.75e9
    for growth, local in dist_pools.run(4, _construction_growth, timeout=600):
        assert local == pytest.approx(total / 4, rel=0.01)
        assert 0.9 * local < growth < 0.4 * total, (growth, local, total)


# ----------------------------------------------------------------- trainer, first steps

TRAIN_ARGV = tiny_run_args(steps=3, warmup_steps=1, global_batch_size=4) + ["--checkpoint.enable", "false"]


def _train_losses(rank, world, argv):
    from titan_cp.train import main

    return [r["loss"] for r in main(argv)]


def test_trainer_first_losses_do_not_depend_on_the_mesh(dist_pools, tmp_path):
    """The trainer builds on meta and initialises shard by shard: its first three losses on
    CP4, DP2xCP2, TP2xCP2 and PP2xCP2 equal one process's (fp32; reduction order only, and
    three AdamW steps: rel 1e-5)."""

    def run(world, cp=1, dp=1, tp=1, pp=1):
        mesh = [
            "--parallelism.context_parallel_degree",
            str(cp),
            "--parallelism.data_parallel_shard_degree",
            str(dp),
            "--parallelism.tensor_parallel_degree",
            str(tp),
            "--parallelism.pipeline_parallel_degree",
            str(pp),
        ]
        folder = tmp_path / f"cp{cp}_dp{dp}_tp{tp}_pp{pp}"
        return dist_pools.run(
            world, _train_losses, TRAIN_ARGV + mesh + ["--job.dump_folder", str(folder)], timeout=600
        )[0]

    one = run(1)
    assert len(one) == 3
    for mesh in (dict(cp=4), dict(dp=2, cp=2), dict(tp=2, cp=2), dict(pp=2, cp=2)):
        assert run(4, **mesh) == pytest.approx(one, rel=1e-5), mesh
