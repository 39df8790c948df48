"""The activation-checkpoint modes: the one list that the config (``activation_checkpoint.mode``),
:func:`titan_cp.parallel.apply_ac` and the Trainer factory (``activation_checkpointing=``) read.

  "none"       no checkpointing
  "full"       every block keeps only its input and is recomputed in the backward
  "selective"  every k-th block fully checkpointed (torchtitan's integer ``selective_ac_option``)
  "op"         op by op: matmul and attention outputs saved, the rest recomputed (also spelled as
               torchtitan does, ``mode = "selective"`` with ``selective_ac_option = "op"``)
"""

from __future__ import annotations

AC_MODES: tuple[str, ...] = ("none", "full", "selective", "op")


def ac_modes() -> tuple[str, ...]:
    """:data:`AC_MODES` (the config's choices for ``activation_checkpoint.mode``)."""
    return AC_MODES


def ac_mode_and_every(mode: str, selective_ac_option: str) -> tuple[str, int]:
    """``activation_checkpoint.mode`` and ``.selective_ac_option`` -> ``apply_ac``'s ``(mode, every)``:
    ``("selective", "op")`` is ``("op", 1)``, ``("selective", "k")`` is ``("selective", k)``."""
    if mode != "selective":
        return mode, 1
    if selective_ac_option == "op":
        return "op", 1
    if not (selective_ac_option.isdigit() and int(selective_ac_option) > 0):
        raise ValueError(
            f"activation_checkpoint.selective_ac_option must be a positive integer or 'op', got {selective_ac_option!r}"
        )
    return "selective", int(selective_ac_option)
