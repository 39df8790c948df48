"""``shard_batch``: a Hugging Face batch of packed rows -> this cp rank's shard, labels shifted first.

An HF-style batch holds ``input_ids`` ``(B, S)``, ``labels`` ``(B, S)`` (unshifted: HF's models
shift them inside), and the documents of each packed row as ``position_ids`` that restart at 0
at each document (what ``DataCollatorWithFlattening(return_position_ids=True)`` makes) or as
cumulative lengths ``cu_seq_lens_q`` / ``cu_seq_lens`` over the flattened rows. From it::

    doc_lens   read once, on the host: the documents of every row
    shifted    labels[t] = labels[t + 1] inside a document, -100 at each document's last token
    layout     cp.register(S, doc_lens): the handle's balance; one permutation for every per-token tensor
    local      input_ids, position_ids (in-document positions), labels = shift_labels = shifted,
               each layout.shard(x, 1, cp rank): (B, S / cp)
    N          loss-bearing tokens (shifted != -100) of the whole step: this dp rank's rows summed
               over the dp ranks (every cp rank of a group holds the same rows)

so ``model(**local).loss`` (``shift_labels`` given: ``transformers`` does not shift again, and
``num_items_in_batch = N``: it sums instead of averaging) is ``sum over local tokens CE / N``, and
gradients summed over dp x cp (FSDP with gradient division 1) are one process's mean gradient.

Shifting before sharding is what makes this exact: shifted inside each shard, every shard's last
token would lose its target (or take another shard's first token, another document's).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from titan_cp.attention.handle import CPHandle, register_sharder
from titan_cp.layout import seq_len_multiple, to_device
from titan_cp.loss import IGNORE_INDEX

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_KNOWN = {
    "input_ids",
    "labels",
    "shift_labels",
    "position_ids",
    "attention_mask",
    "cu_seq_lens",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
    "seq_idx",
}


def _host(batch, key: str) -> Tensor | None:
    x = batch.get(key)
    if x is None:
        return None
    x = torch.as_tensor(x)
    return x.cpu()


def _input_ids(batch) -> Tensor:
    """``input_ids`` on the host (:func:`_check_keys` has refused a batch without them)."""
    ids = _host(batch, "input_ids")
    if ids is None:
        raise ValueError("the batch has no input_ids")
    return ids


def _from_cu(cu_tensor: Tensor, b: int, s: int) -> list[list[int]]:
    """Rows of document lengths from cumulative lengths over the ``b * s`` flattened tokens."""
    cu: list[int] = cu_tensor.flatten().tolist()
    if cu[0] != 0 or cu[-1] != b * s or any(x >= y for x, y in zip(cu, cu[1:])):
        raise ValueError(
            f"cu_seq_lens must rise strictly from 0 to the batch's {b} x {s} tokens, got {cu[:8]}{'...' * (len(cu) > 8)}"
        )
    missing = sorted({r * s for r in range(1, b)} - set(cu))
    if missing:
        raise ValueError(f"cu_seq_lens has a document across a row boundary (no boundary at token {missing[0]})")
    rows: list[list[int]] = [[] for _ in range(b)]
    for start, end in zip(cu, cu[1:]):
        rows[start // s].append(end - start)
    return rows


def _from_positions(p: Tensor) -> list[list[int]]:
    """Rows of document lengths from position ids that restart at 0 at each document."""
    if p[:, 0].ne(0).any():
        r = int(p[:, 0].ne(0).nonzero()[0])
        raise ValueError(
            f"position_ids row {r} starts at {int(p[r, 0])}, not 0: packed documents' positions restart at 0 "
            "(as DataCollatorWithFlattening(return_position_ids=True) makes them); pass positions that "
            "describe the documents, or cu_seq_lens"
        )
    bad = ~((p[:, 1:] == p[:, :-1] + 1) | (p[:, 1:] == 0))
    if bad.any():
        r, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"position_ids row {r} goes from {int(p[r, t])} to {int(p[r, t + 1])} at token {t + 1}: inside a "
            "packed document positions count up by one, and each document starts again at 0; pass positions "
            "that describe the documents (or cu_seq_lens)"
        )
    rows = []
    for row in p:
        starts = (row == 0).nonzero().flatten().tolist() + [row.numel()]
        rows.append([b - a for a, b in zip(starts, starts[1:])])
    return rows


def _documents(batch, b: int, s: int) -> list[list[int]]:
    """Each row's document lengths, from ``cu_seq_lens`` (checked against ``position_ids`` when both
    are given), from ``position_ids``, or one document per row."""
    cu = _host(batch, "cu_seq_lens_q")
    cu = _host(batch, "cu_seq_lens") if cu is None else cu
    k = _host(batch, "cu_seq_lens_k")
    if cu is not None and k is not None and not torch.equal(cu, k):
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k differ: titan_cp runs self-attention over the same documents")
    p = _host(batch, "position_ids")
    if p is not None:
        if p.dim() != 2 or p.shape[1] != s or p.shape[0] not in (1, b):
            raise ValueError(
                f"position_ids has shape {tuple(p.shape)}, input_ids {(b, s)}: give one position per token "
                "((batch, seq_len), or (1, seq_len) for every row)"
            )
        p = p.expand(b, s)
    rows = _from_cu(cu, b, s) if cu is not None else None
    if p is not None:
        from_p = _from_positions(p)
        if rows is not None and rows != from_p:
            raise ValueError("position_ids and cu_seq_lens describe different documents; give one of them")
        rows = from_p
    return rows if rows is not None else [[s] for _ in range(b)]


def _doc_positions(rows: list[list[int]]) -> Tensor:
    """Position of every token inside its document, ``(B, S)`` int64."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


def _doc_ends(rows: list[list[int]]) -> tuple[Tensor, Tensor]:
    """(row, token) indices of every document's last token."""
    r = [b for b, row in enumerate(rows) for _ in row]
    t = [end - 1 for row in rows for end in torch.tensor(row).cumsum(0).tolist()]
    return torch.tensor(r), torch.tensor(t)


def _check_unshifted(labels: Tensor, ids: Tensor) -> None:
    """``labels`` in HF's convention (``labels[t]`` is token ``t`` itself, -100 where no loss), not
    already shifted (``labels[t] == input_ids[t + 1]``, whatever the last column holds: a
    ``torch.roll(input_ids, -1, 1)`` wraps the first token round), which shifting again would misalign."""
    valid = labels != IGNORE_INDEX
    if not valid.any() or (labels == ids)[valid].all():
        return
    ahead = valid[:, :-1]
    if ahead.any() and (labels[:, :-1] == ids[:, 1:])[ahead].all():
        raise ValueError(
            "labels look already shifted (labels[t] == input_ids[t + 1] at every labelled token), and "
            "shard_batch shifts them: pass labels unshifted (input_ids with -100 where no loss, HF's "
            "convention), or pass the shifted ones as shift_labels"
        )


def _shifted_labels(batch, ids: Tensor, rows: list[list[int]]) -> Tensor | None:
    """Next-token targets, ``(B, S)``: -100 at each document's last token (nothing follows it there)."""
    labels, shift = _host(batch, "labels"), _host(batch, "shift_labels")
    if labels is not None and shift is not None:
        raise ValueError(
            "the batch has both labels and shift_labels: give labels (unshifted, HF's convention; shard_batch "
            "shifts them) or shift_labels (already shifted), not both"
        )
    if labels is None and shift is None:
        return None
    given = labels if labels is not None else shift
    assert given is not None
    if tuple(given.shape) != tuple(ids.shape):
        name = "labels" if labels is not None else "shift_labels"
        raise ValueError(f"{name} has shape {tuple(given.shape)}, input_ids {tuple(ids.shape)}")
    if labels is not None:
        _check_unshifted(labels, ids)
        shifted = torch.full_like(labels, IGNORE_INDEX)
        shifted[:, :-1] = labels[:, 1:]
    else:
        assert shift is not None  # one of the two is given (above)
        _check_shifted(shift, ids)
        shifted = shift.clone()
    shifted[_doc_ends(rows)] = IGNORE_INDEX
    return shifted


def _check_shifted(shift: Tensor, ids: Tensor) -> None:
    """``shift_labels`` already shifted (``shift_labels[t]`` is token ``t + 1``), not ``input_ids`` itself
    (unshifted: every token would learn to predict itself)."""
    valid = shift != IGNORE_INDEX
    ahead = valid[:, :-1]
    shifted = bool((shift[:, :-1] == ids[:, 1:])[ahead].all()) and not valid[:, -1].any()  # e.g. a run of one token
    if int(valid.sum()) > 1 and (shift == ids)[valid].all() and not shifted:
        raise ValueError(
            "shift_labels equal input_ids at every labelled token: they are not shifted (each token would be "
            "its own target); pass them as labels (unshifted, HF's convention; shard_batch shifts them), or "
            "pass shift_labels[t] = input_ids[t + 1]"
        )


def count_loss_tokens(batch: Mapping[str, Any]) -> int:
    """The loss-bearing tokens of ``batch`` (an HF-style mapping as :func:`shard_batch` takes it): targets
    that are not -100 once the labels are shifted inside each document; what ``shard_batch`` counts."""
    _check_keys(batch)
    ids = _input_ids(batch)
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(ids.shape)}")
    shifted = _shifted_labels(batch, ids, _documents(batch, *ids.shape))
    return 0 if shifted is None else int((shifted != IGNORE_INDEX).sum())


def _global_count(n: int, dp_mesh) -> int:
    """``n`` summed over the ranks of ``dp_mesh`` (a ``DeviceMesh`` of any shape, or a process group)."""
    if dp_mesh is None:
        return n
    if hasattr(dp_mesh, "get_group"):
        group = (dp_mesh if dp_mesh.ndim == 1 else dp_mesh._flatten()).get_group()
    else:
        group = dp_mesh
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    t = torch.tensor(n, dtype=torch.int64, device=on)
    dist.all_reduce(t, group=group)
    return int(t)


def _mesh_ranks(mesh) -> set[int]:
    """The global ranks of this process's group in ``mesh`` (a ``DeviceMesh`` or a process group)."""
    if hasattr(mesh, "mesh"):
        return set(mesh.mesh.flatten().tolist())
    return set(dist.get_process_group_ranks(mesh))


def _check_meshes(cp_mesh, dp_mesh) -> None:
    """``dp_mesh`` must hold this rank's data-parallel peers only: a cp peer in it would count the
    step's tokens twice (every cp rank of a group holds the same rows)."""
    if cp_mesh is None or dp_mesh is None:
        return
    shared = _mesh_ranks(cp_mesh) & _mesh_ranks(dp_mesh)
    if len(shared) > 1:
        raise ValueError(
            f"dp_mesh holds ranks {sorted(shared)} of this rank's cp group too: pass the data-parallel mesh "
            "only (e.g. mesh['dp'] of a (dp, cp) mesh), not the whole world; the cp ranks of a group hold the "
            "same rows, so counting over them would divide the loss by the cp size"
        )


def _fingerprint(ids: Tensor, shifted: Tensor | None, rows: list[list[int]]) -> Tensor:
    """A few int64 numbers that differ when two ranks hold different rows (shape, tokens, labels, documents)."""
    w = torch.arange(1, ids.numel() + 1, dtype=torch.int64).view(ids.shape)
    labels = torch.zeros_like(ids) if shifted is None else shifted.to(torch.int64)
    docs = torch.tensor([len(r) for r in rows] + [n * (i + 1) for r in rows for i, n in enumerate(r)])
    return torch.stack(
        [
            torch.tensor(ids.numel()),
            torch.tensor(ids.shape[0]),
            (ids * w).sum(),
            ids.sum(),
            (labels * w).sum(),
            docs.sum(),
        ]
    )


def _check_same_rows(ids: Tensor, shifted: Tensor | None, rows: list[list[int]], group: dist.ProcessGroup) -> None:
    """Every rank of a cp group must hold the same rows (each takes its shard of them): one small
    all-gather of fingerprints over the cp group."""
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = _fingerprint(ids, shifted, rows).to(on)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    if any(not torch.equal(x, every[0]) for x in every):
        raise ValueError(
            "the ranks of a cp group passed different rows to shard_batch: every cp rank must hold the same "
            "rows (each keeps its shard of them); spread rows over the data-parallel ranks only (a sampler "
            "over mesh['dp'], or titan_cp.integrations.transformers.context_parallel_trainer for a Trainer)"
        )


def _check_keys(batch) -> None:
    unknown = sorted(set(batch.keys()) - _KNOWN)
    if unknown:
        raise ValueError(
            f"shard_batch does not know how to shard batch key(s) {unknown}; it takes input_ids, labels or "
            "shift_labels, and the documents as position_ids or cu_seq_lens"
        )
    if batch.get("input_ids") is None:
        raise ValueError("shard_batch needs batch['input_ids'] (batch, seq_len)")
    mask = _host(batch, "attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError(
            "attention_mask has padding (zeros): titan_cp runs packed rows without padding masks; pack with "
            "DataCollatorWithFlattening, or make the padding a document of its own with labels -100"
        )


def _loss_count(shifted: Tensor, num_items_in_batch: int | None, dp_mesh) -> int:
    """The step's loss-bearing tokens: ``num_items_in_batch``, or counted in ``shifted`` and summed over
    ``dp_mesh``; ``ValueError`` when it is not positive."""
    if num_items_in_batch is None:
        n = _global_count(int((shifted != IGNORE_INDEX).sum()), dp_mesh)
        if n <= 0:
            raise ValueError(
                "the step has no loss-bearing token: every label is -100 once shifted inside each document, "
                "over all dp ranks (a document's last token has no target); give labels to some tokens"
            )
        return n
    n = int(num_items_in_batch)
    if n <= 0:
        raise ValueError(
            f"num_items_in_batch = {n}: it must be the step's count of loss-bearing tokens (> 0), over "
            "every micro-batch and dp rank; pass None to have shard_batch count them"
        )
    return n


def shard_batch(
    batch: Mapping[str, Any],
    cp: CPHandle,
    dp_mesh: DeviceMesh | None = None,
    num_items_in_batch: int | None = None,
    pad_token_id: int | None = None,
    device: torch.device | str | None = None,
) -> dict:
    """This cp rank's shard of an HF-style batch of packed rows, for ``model(**local)`` (module docstring).

    Args:
        batch: a mapping (a dict, a ``BatchEncoding``) with ``input_ids`` ``(B, S)``; ``labels``
            (unshifted, -100 where no loss) or ``shift_labels`` (already shifted); the documents
            as ``position_ids`` restarting at 0, or ``cu_seq_lens_q``/``cu_seq_lens`` (none: one
            document per row); an all-ones ``attention_mask`` is accepted and dropped.
        cp: the handle ``apply_cp`` returned: its mesh, and the balance the batch is sharded by.
        dp_mesh: the data-parallel mesh (or process group) whose ranks hold the step's other rows;
            ``None``: this rank's rows are the whole step.
        num_items_in_batch: the step's loss-bearing token count when it spans more than this batch
            (gradient accumulation); ``None``: counted here, summed over ``dp_mesh``.
        pad_token_id: when ``S`` does not split evenly over the cp ranks, append a padding document
            of this token (no loss on it); ``None``: such a length is a ``ValueError``.
        device: where the local tensors go (default: ``input_ids``' device); ``cp_doc_lens`` stays
            on the host, where the attention reads it without synchronising the device.

    Returns ``input_ids``, ``position_ids`` (in-document positions), ``labels`` = ``shift_labels``
    (shifted, local), ``num_items_in_batch`` (0-dim int64), ``cp_doc_lens`` (the ``(B, max_docs)``
    host tensor by which every layer's attention finds the layout) and ``use_cache=False``; per-token
    tensors ``(B, S_padded / cp)`` on ``device``. Without labels, no loss keys. ``cp.shard(batch)``
    is this function.
    """
    if not isinstance(cp, CPHandle):
        raise ValueError(
            f"shard_batch takes the handle apply_cp returned (cp = apply_cp(model, cp_mesh, ...); "
            f"cp.shard(batch)), got {type(cp).__name__}: the handle carries the mesh and the balance"
        )
    cp_mesh, balance = cp.mesh, cp.balance
    _check_keys(batch)
    device = torch.as_tensor(batch["input_ids"]).device if device is None else torch.device(device)
    ids = _input_ids(batch)
    if ids.dim() != 2 or ids.dtype.is_floating_point:
        raise ValueError(f"input_ids must be (batch, seq_len) integers, got {ids.dtype} of shape {tuple(ids.shape)}")
    b, s = ids.shape
    rows = _documents(batch, b, s)
    shifted = _shifted_labels(batch, ids, rows)
    _check_meshes(cp_mesh, dp_mesh)
    if cp.group is not None and cp.size > 1:
        _check_same_rows(ids, shifted, rows, cp.group)
    size = cp.size
    extra = -s % seq_len_multiple(balance, size)
    if extra:
        if pad_token_id is None:
            raise ValueError(
                f"input_ids has {s} tokens per row, which balance {balance!r} cannot split over cp size {size} (it "
                f"needs a multiple of {seq_len_multiple(balance, size)}): pad the rows, or pass "
                f"shard_batch(..., pad_token_id=...) to append a padding document of {extra} tokens (no loss)"
            )
        ids = torch.cat([ids, ids.new_full((b, extra), pad_token_id)], 1)
        shifted = None if shifted is None else torch.cat([shifted, shifted.new_full((b, extra), IGNORE_INDEX)], 1)
        rows, s = [row + [extra] for row in rows], s + extra
    layout, doc_lens = cp.register(s, rows)

    def local(x: Tensor) -> Tensor:
        return to_device(layout.shard(x, 1, cp.rank), device)

    out: dict[str, Any] = {"input_ids": local(ids), "position_ids": local(_doc_positions(rows))}
    if shifted is not None:
        n = _loss_count(shifted, num_items_in_batch, dp_mesh)
        out["labels"] = out["shift_labels"] = local(shifted)
        out["num_items_in_batch"] = torch.tensor(n, dtype=torch.int64, device=device)
    out.update(cp_doc_lens=doc_lens, use_cache=False)
    return out


def gather_unshard(x: Tensor, local: Mapping[str, Any], cp: CPHandle, dim: int = 1) -> Tensor:
    """Every cp rank's ``x`` (this rank's tokens along ``dim``, e.g. logits ``(B, S_local, V)``)
    gathered and put back in natural token order: ``(..., S, ...)``. Collective over the handle's
    mesh; no gradient. ``local``: what :func:`shard_batch` returned for this batch."""
    return cp.unshard(x, local.get("cp_doc_lens"), dim)


register_sharder(Mapping, lambda cp, batch, **options: shard_batch(batch, cp, **options))
