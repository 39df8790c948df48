"""What a Gated DeltaNet layer does under CP: every rank of a crossing plan joins the exchange's backward and
gets its summaries' gradients back (the ``fla`` path, through its stand-in, against the torch kernel)."""

from __future__ import annotations

import torch

from titan_cp.data.row_mixes import lognormal_doc_lens
from titan_cp.layout import DEFAULT_BALANCE, SequenceLayout

SMALL_ROWS = [lognormal_doc_lens(256, 16, seed=2)]  # at CP 4, rank 3's summary is read only by other ranks


def fla_error(rank: int, world: int) -> float:
    """The largest difference of this rank's gradients of the gated delta rule on :data:`SMALL_ROWS` through
    ``fla`` (its stand-in on the CPU) from the torch kernel's, relative to the largest gradient."""
    from tests import fla_standin  # noqa: PLC0415
    from tests.dist_utils import cp_mesh  # noqa: PLC0415
    from titan_cp.attention.linear import cp_gated_delta_rule  # noqa: PLC0415

    layout, mesh = SequenceLayout(256, world, DEFAULT_BALANCE, SMALL_ROWS), cp_mesh("ring", world)
    gen = torch.Generator().manual_seed(0)
    shapes = dict(q=(2, 8), k=(2, 8), v=(4, 6), g=(4,), beta=(4,))
    full = {n: torch.randn(1, 256, *s, generator=gen) for n, s in shapes.items()}
    full["g"], full["beta"] = -full["g"].sigmoid(), full["beta"].sigmoid()
    grads = {}
    for backend in ("fla", "torch"):
        local = {n: layout.shard(t, 1, rank).requires_grad_() for n, t in full.items()}
        with fla_standin.installed():
            out = cp_gated_delta_rule(*local.values(), mesh, layout, qk_l2norm=True, backend=backend)
            grads[backend] = torch.cat(
                [g.flatten() for g in torch.autograd.grad(out.square().sum(), list(local.values()))]
            )
    return ((grads["fla"] - grads["torch"]).abs().max() / grads["torch"].abs().max()).item()


def test_the_fla_path_returns_every_summary_gradient(dist_pools):
    """At CP 4 on :data:`SMALL_ROWS` the ``fla`` path's gradients equal the torch kernel's on every rank (before
    the join, rank 3 skipped the exchange's backward: its summary's gradient lost, the others left waiting)."""
    assert max(dist_pools.run(4, fla_error)) < 1e-5
