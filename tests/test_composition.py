"""CP composed with FSDP2, TP and PP, each against a single-process run of the same model
on the same packed-document batches: the loss, every parameter's gradient, and the
parameters after three AdamW steps. The parallel models are built as the trainer builds
them (``build_parallel_model``: on meta, parallelized, then materialised shard by shard)
and computes the loss (chunked, vocabulary-parallel under TP).

fp32 throughout. Tolerances: the parallel runs add the same numbers in a different order
(sharded reductions, tile splits, log-sum-exp merges), which moves losses and gradients
by ~1e-6 relative; after three AdamW steps (lr 1e-3) parameters agree within 1e-5. We
assert rtol 1e-4 / atol 2e-5 for losses and gradients and 5e-5 for parameters.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_cp.families.llama3 import LlamaBuilder, build_model, materialize, model_args
from titan_cp.loss import IGNORE_INDEX, GlobalTokenLoss
from titan_cp.mesh import ParallelDims
from titan_cp.parallel.build import ModelParts, ParallelizeOptions, build_parallel_model
from titan_cp.step import Microbatch, forward_backward

SEQ, ROWS, STEPS, LR, SEED = 48, 4, 3, 1e-3, 0


def make_batch(seed: int, rows: int = ROWS, seq: int = SEQ, vocab: int = 256) -> Microbatch:
    """Packed rows with random documents; labels are the next token within a document."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, seq), generator=g)
    labels = torch.full((rows, seq), IGNORE_INDEX)
    positions = torch.zeros(rows, seq, dtype=torch.long)
    all_lens = []
    for b in range(rows):
        lens, left = [], seq
        while left:
            n = int(torch.randint(1, min(left, 20) + 1, (), generator=g))
            lens.append(n)
            left -= n
        start = 0
        for n in lens:
            positions[b, start : start + n] = torch.arange(n)
            labels[b, start : start + n - 1] = tokens[b, start + 1 : start + n]
            start += n
        all_lens.append(lens)
    width = max(map(len, all_lens))
    doc_lens = torch.tensor([lens + [0] * (width - len(lens)) for lens in all_lens])
    return Microbatch(tokens, labels, positions, doc_lens)


def _clean(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


@functools.cache
def _reference(n_layers: int, flavor: str = "tiny"):
    """The single-process run: its losses, its first step's gradients and its parameters after the steps
    (computed once per model in the test process; every rank of every mesh compares with it)."""
    model = build_model(flavor, n_layers=n_layers)
    materialize(model, "cpu", SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    loss_fn = GlobalTokenLoss()
    losses, grads = [], None
    for step in range(STEPS):
        mb = make_batch(step)
        loss_fn.global_valid_tokens = int((mb.labels != IGNORE_INDEX).sum())
        losses.append(forward_backward([model], mb, loss_fn).item())
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def build_combo(world: int, combo: dict):
    """``(parallel dims, options, the built model, its GlobalTokenLoss)`` of the tiny model on ``combo``'s mesh."""
    pd = ParallelDims(
        dp_replicate=combo.get("dp_replicate", 1),
        dp_shard=combo.get("dp_shard", 1),
        cp=combo.get("cp", 1),
        tp=combo.get("tp", 1),
        pp=combo.get("pp", 1),
        world_size=world,
        cp_ulysses=combo.get("ulysses"),
    )
    pd.build_mesh("cpu")
    options = ParallelizeOptions(
        cp_strategy=combo["strategy"], cp_balance=combo.get("balance", "doc_zigzag"), ac_mode=combo.get("ac", "none")
    )
    loss_fn = GlobalTokenLoss()
    built = build_parallel_model(
        LlamaBuilder(model_args(combo.get("flavor", "tiny"), n_layers=combo.get("n_layers", 2))),
        pd,
        options,
        "cpu",
        seed=SEED,
        loss_fn=loss_fn,
        pp_microbatches=2,
        pp_schedule=combo.get("schedule", "1F1B"),
    )
    return pd, options, built, loss_fn


def local_microbatch(pd: ParallelDims, built: ModelParts, full: Microbatch) -> Microbatch:
    """This rank's rows (by its dp rank) of ``full``, sharded with the model's CP handle (for the
    pipeline schedule's 2 microbatches when there is one)."""
    dp = pd.get_mesh("dp")
    rows = slice(dp.get_local_rank() * ROWS // dp.size(), (dp.get_local_rank() + 1) * ROWS // dp.size())
    mine = Microbatch(full.tokens[rows], full.labels[rows], full.positions[rows], full.doc_lens[rows])
    return mine.shard(built.cp, 1 if built.schedule is None else 2)


def _compare(rank, world, combo: dict, reference):
    ref_losses, ref_grads, ref_params = reference
    pd, options, built, loss_fn = build_combo(world, combo)
    parts, schedule, first, last = built.parts, built.schedule, built.has_first, built.has_last
    opt = torch.optim.AdamW([p for part in parts for p in part.parameters()], lr=LR)
    tp_rank = pd.get_mesh("tp").get_local_rank()
    losses, grad_errs = [], {}
    for step in range(STEPS):
        full = make_batch(step)
        loss_fn.global_valid_tokens = int((full.labels != IGNORE_INDEX).sum())
        loss = forward_backward(parts, local_microbatch(pd, built, full), loss_fn, schedule, first, last)
        counted = loss if (last and tp_rank == 0) else torch.zeros(())
        dist.all_reduce(counted)  # every dp x cp rank's share, once per tp group, from the last stage
        losses.append(counted.item())
        if step == 0:
            for part in parts:
                for name, p in part.named_parameters():
                    g = _full(p.grad)
                    want = ref_grads[_clean(name)]
                    grad_errs[_clean(name)] = ((g - want).abs() - 1e-4 * want.abs()).max().item()
        opt.step()
        opt.zero_grad()
    param_errs = {}
    for part in parts:
        for name, p in part.named_parameters():
            param_errs[_clean(name)] = (_full(p.detach()) - ref_params[_clean(name)]).abs().max().item()
    return ref_losses, losses, grad_errs, param_errs


COMBOS = {
    "cp2_ring": (2, dict(cp=2, strategy="ring")),
    "cp4_ulysses": (4, dict(cp=4, strategy="ulysses", balance="zigzag")),
    "fsdp2_cp2_allgather": (4, dict(dp_shard=2, cp=2, strategy="allgather")),
    "tp2_cp2_ring": (4, dict(tp=2, cp=2, strategy="ring")),
    "pp2_cp2_gpipe_ring": (4, dict(pp=2, cp=2, strategy="ring", schedule="GPipe")),
    "pp2_cp2_1f1b_allgather": (4, dict(pp=2, cp=2, strategy="allgather", schedule="1F1B", balance="zigzag")),
    "pp2_cp2_interleaved_ring": (4, dict(pp=2, cp=2, strategy="ring", schedule="Interleaved1F1B", n_layers=4)),
    "hybrid_cp4": (4, dict(cp=4, ulysses=2, strategy="hybrid")),
    "hsdp2_cp2_ring_ac": (4, dict(dp_replicate=2, cp=2, strategy="ring", ac="full")),
    "fsdp2_tp2_cp2_ulysses": (8, dict(dp_shard=2, tp=2, cp=2, strategy="ulysses")),
    # sliding-window layers and attention sinks (sharded over tp like the heads), doc_local
    "cp2_doc_local_window_sinks": (2, dict(cp=2, strategy="ring", balance="doc_local", flavor="tiny_swa")),
    "fsdp2_tp2_cp2_window_sinks": (8, dict(dp_shard=2, tp=2, cp=2, strategy="allgather", flavor="tiny_swa")),
}


@pytest.mark.parametrize("name", list(COMBOS))
def test_composition_matches_single_process(dist_pools, name):
    world, combo = COMBOS[name]
    reference = _reference(combo.get("n_layers", 2), combo.get("flavor", "tiny"))
    for rank, (ref_losses, losses, grad_errs, param_errs) in enumerate(
        dist_pools.run(world, _compare, combo, reference, timeout=600)
    ):
        assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), (rank, losses, ref_losses)
        bad = {n: e for n, e in grad_errs.items() if not e <= 2e-5}
        assert not bad, (rank, "gradients", bad)
        bad = {n: e for n, e in param_errs.items() if not e <= 5e-5}
        assert not bad, (rank, "parameters", bad)
        assert grad_errs and param_errs


def _bad_mesh(rank, world):
    errors = []
    for kwargs, key in (
        (dict(dp_replicate=1, dp_shard=1, cp=3, tp=1, pp=1), "parallelism.data_parallel_shard_degree"),
        (dict(dp_replicate=1, dp_shard=-1, cp=3, tp=1, pp=1), "not a multiple of"),
        (dict(dp_replicate=1, dp_shard=1, cp=4, tp=1, pp=1, cp_ulysses=3), "context_parallel_ulysses_degree"),
        (dict(dp_replicate=1, dp_shard=1, cp=0, tp=1, pp=1), "parallelism.context_parallel_degree must be positive"),
    ):
        try:
            ParallelDims(world_size=world, **kwargs)
            errors.append(f"no error for {kwargs}")
        except ValueError as e:
            if key not in str(e):
                errors.append(f"{key!r} not in {e}")
    try:
        ParallelDims(dp_replicate=1, dp_shard=1, cp=2, tp=1, pp=1, world_size=2).build_mesh("cpu")
        errors.append("no error for a mesh of 2 ranks on 4")
    except ValueError as e:
        if "2 ranks" not in str(e) or "4 ranks were launched" not in str(e):
            errors.append(str(e))
    return errors


def test_bad_meshes_name_the_config_key(dist_pools):
    for errors in dist_pools.run(4, _bad_mesh):
        assert not errors, errors
