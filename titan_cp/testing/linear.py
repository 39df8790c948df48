"""The linear layers' placements forced, for the tests: every late middle piece placed
(:func:`titan_cp.attention.linear.plan.piece_calls`), priced or not."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def every_late_middle() -> Iterator[None]:
    """Inside the block, each document's longest later piece, where it is a middle one, runs after the exchange
    from its state whatever the pricing says (:data:`~titan_cp.attention.linear.plan.MARGIN` forced). Layouts
    and the planner's work are kept by value with their plans (a row without documents is one of them): none made
    before the block is used in it, none made in it is kept after it."""
    from titan_cp import layout as layout_module  # noqa: PLC0415 - the planner imports the model code
    from titan_cp.attention.linear import plan as plan_module  # noqa: PLC0415
    from titan_cp.plan import linear as linear_plan  # noqa: PLC0415

    def forget() -> None:
        layout_module._layout.cache_clear()
        linear_plan.linear_work.cache_clear()

    forget()
    before, plan_module.MARGIN = plan_module.MARGIN, -100.0
    try:
        yield
    finally:
        plan_module.MARGIN = before
        forget()
