"""Where each parameter of titan_cp's Llama is in a torchtitan DCP checkpoint (``checkpoint.initial_load_path``).

torchtitan saves the model's state dict at the top level of its DCP checkpoints (its optimizer, LR
schedule, data loader and train state beside it, under those prefixes). torchtitan 0.2's Llama 3 has
titan_cp's names. torchtitan 0.3's differs in two places:

- the output projection is ``lm_head.weight`` (titan_cp: ``output.weight``);
- each layer's Q/K/V projection is one fused parameter, ``layers.N.attention.qkv_linear.wqkv.weight``
  (``FusedQKVLinear``), of ``n_kv_heads * (r + 2) * head_dim`` rows, ``r = n_heads / n_kv_heads``,
  interleaved per KV group: group ``g``'s ``r`` query heads (heads ``g*r`` to ``g*r + r - 1``, in order),
  then its key head, then its value head (its forward views the output as ``(n_kv_heads, r + 2,
  head_dim)`` and splits ``[r, 1, 1]``). Its module's state-dict hook saves it split, in stock order, as
  ``qkv_linear.wq.weight`` / ``wk`` / ``wv`` (query head ``h`` in rows ``h*head_dim`` on, as titan_cp's
  ``wq``, whose head ``h`` attends with KV head ``h // r``): what torchtitan's checkpointer writes.
  A checkpoint holding the fused tensor itself (saved from the parameters) is split here, exactly so.

:func:`sources` finds every parameter of the model (names and shapes checked) and :func:`split_wqkv`
splits a fused tensor; :class:`~titan_cp.checkpoint.Checkpointer` loads by them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from torch import Tensor

NOT_MODEL = ("optimizer", "lr_scheduler", "dataloader", "train_state")
"""What torchtitan saves beside the model, at the top level of its checkpoints."""

_QKV = re.compile(r"^(layers\.\d+\.attention)\.(wq|wk|wv)\.weight$")
_PART = {"wq": "q", "wk": "k", "wv": "v"}


@dataclass(frozen=True)
class Source:
    """A parameter's tensor in the checkpoint: ``key``, or its ``part`` (``q``, ``k``, ``v``) of the fused
    ``wqkv`` tensor ``key``."""

    key: str
    part: str | None = None


def _candidates(name: str) -> list[Source]:
    """Where titan_cp's parameter ``name`` may be: under its own name (torchtitan 0.2), else torchtitan 0.3's."""
    if name == "output.weight":
        return [Source(name), Source("lm_head.weight")]
    m = _QKV.match(name)
    if m is None:
        return [Source(name)]
    return [
        Source(name),
        Source(f"{m[1]}.qkv_linear.{m[2]}.weight"),
        Source(f"{m[1]}.qkv_linear.wqkv.weight", _PART[m[2]]),
    ]


def _layer_shapes(name: str, shapes: Mapping[str, tuple[int, ...]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of ``wq`` and ``wk`` of the layer of ``name`` (one of its Q/K/V weights)."""
    prefix = name.rsplit(".", 2)[0]
    return shapes[f"{prefix}.wq.weight"], shapes[f"{prefix}.wk.weight"]


def sources(
    shapes: Mapping[str, tuple[int, ...]], saved: Mapping[str, tuple[int, ...]], what: str
) -> dict[str, Source]:
    """Each parameter of ``shapes`` (the model's names and global shapes) to its :class:`Source` among
    ``saved`` (the checkpoint's tensors and shapes); ``what`` names the checkpoint in errors. A
    ``ValueError`` names a parameter that is not there, or a shape that differs (a fused ``wqkv`` must
    hold ``wq``, ``wk`` and ``wv``'s rows)."""
    found = {}
    for name, shape in shapes.items():
        here = [s for s in _candidates(name) if s.key in saved]
        if not here:
            alternatives = " nor ".join(s.key for s in _candidates(name)[1:])
            raise ValueError(f"{what} has no {name}{f' (nor {alternatives})' if alternatives else ''}")
        source = found[name] = here[0]
        want = shape
        if source.part is not None:
            wq, wk = _layer_shapes(name, shapes)
            want = (wq[0] + 2 * wk[0], *wq[1:])
        if tuple(saved[source.key]) != tuple(want):
            raise ValueError(
                f"{what}: {source.key} has shape {tuple(saved[source.key])}, but the model's "
                f"{'wq, wk and wv make' if source.part else 'has'} shape {tuple(want)}"
            )
    return found


ROPE_TABLES = ("freqs_cis", "rope.cache")
"""Buffers of torchtitan's RoPE tables (0.2 saves ``freqs_cis``): titan_cp computes its angles itself."""


def extra_keys(saved: Iterable[str], used: Iterable[str]) -> list[str]:
    """The model tensors of a torchtitan checkpoint (``saved``: its keys) that no parameter ``used`` (RoPE
    tables aside): another model's (e.g. Qwen3's ``q_norm``), which titan_cp's Llama would silently go without."""
    taken = set(used)
    return sorted(
        k for k in saved if k not in taken and k.split(".")[0] not in NOT_MODEL and not k.endswith(ROPE_TABLES)
    )


def split_wqkv(wqkv: Tensor, heads_per_kv: int, head_dim: int) -> dict[str, Tensor]:
    """``{"q": wq, "k": wk, "v": wv}`` of torchtitan 0.3's fused ``wqkv`` (module docstring): rows viewed as
    ``(n_kv_heads, heads_per_kv + 2, head_dim)``, split ``[heads_per_kv, 1, 1]`` (its ``FusedQKVLinear``)."""
    rows, *tail = wqkv.shape
    groups = rows // ((heads_per_kv + 2) * head_dim)
    w = wqkv.reshape(groups, heads_per_kv + 2, head_dim, *tail)
    return {
        "q": w[:, :heads_per_kv].reshape(-1, *tail).contiguous(),
        "k": w[:, heads_per_kv].reshape(-1, *tail).contiguous(),
        "v": w[:, heads_per_kv + 1].reshape(-1, *tail).contiguous(),
    }
