"""Exact attention work of a sequence layout: visible pairs per rank, per ring step, kernel calls.

``scripts/bench_balance.py`` prints these records; the planner uses the per-rank pairs.

For every (document mix, cp, balance) this counts the visible (query, key) pairs of
causal-within-document attention that each CP rank computes, and prints one JSON line::

    {"mix": "one_huge", "cp": 8, "balance": "doc_zigzag", "source": "titan_cp",
     "max_over_mean": 1.0001,            # max rank work / mean rank work (worst row)
     "ring_critical_over_ideal": 1.0003, # sum_s max_r pairs(step s, rank r) / (total / cp) (worst row)
     "max_over_mean_batch": ...,         # the same with every rank's work summed over the rows
     "max_tiles": ...,                   # most kernel calls (mask tiles) of one rank, all ring steps
     ...}

Work per rank (N = cp, S = seq_len, W[r, j] = pairs of rank r's queries on rank j's keys)::

    work_r     = sum_j W[r, j]              all keys: what all-gather / Ulysses / a whole ring costs
    step(s, r) = W[r, (r - s) mod N]        ring step s: my queries on the K/V of rank r - s
    critical   = sum_s max_r step(s, r)     a synchronous ring waits for the slowest rank every step
    ideal      = sum_r work_r / N

Balances compared side by side:

    contiguous, zigzag, doc_zigzag   titan_cp.layout; pairs from the mask tiles (tile_mask,
                                     ring_step_tiles, MaskTiles.pairs), cross-checked against the
                                     position counter below
    torch_head_tail                  torch's _HeadTailLoadBalancer
    torch_per_doc_head_tail          torch's _PerDocumentHeadTailLoadBalancer: needs every
                                     document length % 2N == 0, else a null line with a note
    torch_per_doc_head_tail_padded   the same with each document padded up to a multiple of
                                     2N (pads attend and are attended by nothing); reports
                                     padding_fraction = pad tokens / padded tokens
    ..._padded_regrouped             the same indices dealt per document rank by rank, as
                                     torch's docstring draws it (see regroup_per_document)
    torch_ptrr                       torch's _PTRRLoadBalancer (flex_attention, 128-token
                                     blocks), given the exact BlockMask of the mask
    greedy_doc                       prototype, not in titan_cp.layout: long documents split
                                     head-tail as doc_zigzag, short ones whole, packed by work
                                     (see greedy_doc_positions, --greedy-alpha)

For the torch balancers the real ``_generate_indices()`` output is used, cut as DTensor's
``Shard(seq)`` cuts it: rank r holds ``indices[r*S/N : (r+1)*S/N]``. Pairs are counted from
positions and document ids: a query at position p of a document starting at s sees the
keys of rank j at positions ``[s, p]``; with ``C_j[p]`` = number of rank-j tokens at
positions <= p that is ``C_j[p] - C_j[s-1]`` (one cumulative sum per rank, vectorised over
all queries). For every balance the pairs are also counted by titan_cp's mask tiles
(``tiles_of_runs`` on the runs of each rank's positions) and the two counts must agree
exactly; ``max_tiles`` is that tile count: the kernel calls a ring forward makes.

Mixes (each row a fresh draw filling exactly ``seq_len``, deterministic from the seed):

    uniform_short        lengths uniform in [128, 2048]
    lognormal_long_tail  log-normal, median 4096, sigma 1.5
    one_huge             one document of 50-80% of the row at a random place, the rest uniform [64, 1024]
    code_repo            source-file token counts: log-normal body (median 350, sigma 1.2)
                         with a 8% Pareto tail (alpha 1.1, from 2000 tokens), files packed in order

Mixes: :mod:`titan_cp.data.row_mixes`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
    _HeadTailLoadBalancer,
    _PerDocumentHeadTailLoadBalancer,
    _PTRRLoadBalancer,
)

from titan_cp.attention.masks import tile_pairs, tiles_of_runs
from titan_cp.attention.ring import ring_step_tiles
from titan_cp.attention.tiling import Mask, tile_mask
from titan_cp.balance import balance_names
from titan_cp.data.row_mixes import BALANCE_MIXES, ROW_MIXES, make_rows
from titan_cp.layout import Run, Runs, SequenceLayout

TORCH_BALANCES = (
    "torch_head_tail",
    "torch_per_doc_head_tail",
    "torch_per_doc_head_tail_padded",
    "torch_per_doc_head_tail_padded_regrouped",
    "torch_ptrr",
)
PROTOTYPES = ("greedy_doc",)
ALL_BALANCES = balance_names() + TORCH_BALANCES + PROTOTYPES
PTRR_BLOCK = 128  # flex_attention's default sparse block size

__all__ = [
    "ALL_BALANCES",
    "BALANCE_MIXES",
    "ROW_MIXES",
    "TORCH_BALANCES",
    "causal_doc_total",
    "doc_structure",
    "greedy_doc_positions",
    "layout_work",
    "make_rows",
    "measure",
    "pair_matrix",
    "ptrr_block_mask",
    "rank_pairs",
    "ring_step_work",
    "ring_tiles",
    "row_measure",
    "run",
    "runs_of",
    "torch_positions",
]


# ---------------------------------------------------------------------------- exact pair counter
def doc_structure(doc_lens: Sequence[int], pad_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(doc_start, real)`` per position of the row whose documents are padded up to multiples of ``pad_to``.

    doc_start: (S',) global position where the position's document starts; real: (S',) False on pads.
    """
    lens = torch.tensor(list(doc_lens), dtype=torch.long)
    padded = (lens + pad_to - 1) // pad_to * pad_to
    starts = torch.cumsum(padded, 0) - padded
    doc_start = torch.repeat_interleave(starts, padded)
    offset = torch.arange(int(padded.sum())) - doc_start
    real = offset < torch.repeat_interleave(lens, padded)
    return doc_start, real


def pair_matrix(positions: Sequence[torch.Tensor], doc_start: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """W[r, j]: visible causal-within-document (query, key) pairs of rank r's queries on rank j's keys.

    positions: one 1-D tensor of global positions per rank (together a partition of the row).
    """
    n, total = len(positions), doc_start.numel()
    owner = torch.full((total,), -1, dtype=torch.long)
    for r, pos in enumerate(positions):
        owner[pos] = r
    assert (owner >= 0).all(), "the ranks' positions do not cover the row"
    w = torch.zeros(n, n, dtype=torch.long)
    q = torch.nonzero(real).squeeze(1)  # real queries only: pads see nothing
    for j in range(n):
        # C[p + 1] = rank-j real tokens at positions <= p; keys of q's document up to q
        c = torch.zeros(total + 1, dtype=torch.long)
        c[1:] = torch.cumsum(((owner == j) & real).long(), 0)
        seen = c[q + 1] - c[doc_start[q]]
        w[:, j] = torch.zeros(n, dtype=torch.long).scatter_add_(0, owner[q], seen)
    return w


def runs_of(positions: torch.Tensor, doc_start: torch.Tensor, real: torch.Tensor) -> Runs:
    """titan_cp runs (see :mod:`titan_cp.layout`) of a local buffer holding ``positions``; pads are left out.

    A document is named by its start position (the runs only compare documents for equality).
    """
    doc = doc_start[positions]
    keep = real[positions]
    cut = torch.ones(positions.numel(), dtype=torch.bool)
    cut[1:] = (positions[1:] != positions[:-1] + 1) | (doc[1:] != doc[:-1]) | (keep[1:] != keep[:-1])
    first = torch.nonzero(cut).squeeze(1)
    lengths = torch.diff(first, append=torch.tensor([positions.numel()]))
    return tuple(
        Run(local=i, start=p, length=n, doc=d)
        for i, p, n, d, k in zip(
            first.tolist(), positions[first].tolist(), lengths.tolist(), doc[first].tolist(), keep[first].tolist()
        )
        if k
    )


def ring_tiles(runs: Sequence[Runs]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(steps (N steps, N ranks) pairs, tiles (N,))`` from titan_cp's mask tiles of each ring step.

    Rank r at step s: its query runs against the key runs of rank r - s (as ring_step_tiles does).
    """
    n = len(runs)
    steps = torch.zeros(n, n, dtype=torch.long)
    tiles = torch.zeros(n, dtype=torch.long)
    for r in range(n):
        for s in range(n):
            t = tiles_of_runs(runs[r], runs[(r - s) % n], True)
            steps[s, r] = tile_pairs(t)
            tiles[r] += len(t)
    return steps, tiles


def causal_doc_total(doc_lens: Sequence[int]) -> int:
    """All visible pairs of a row: sum over documents of L (L + 1) / 2."""
    return sum(n * (n + 1) // 2 for n in doc_lens)


# ---------------------------------------------------------------------------- balances
def layout_work(layout: SequenceLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From titan_cp's mask tiles: ``(work (N,), steps (N steps, N ranks), tiles (N,))`` for a one-row layout.

    work_r = pairs of tile_mask(q_ranks=(r,), k_ranks=None); steps[s, r] from ring_step_tiles;
    tiles_r = kernel calls of rank r summed over its ring steps.
    """
    n = layout.cp_size
    work = torch.zeros(n, dtype=torch.long)
    steps = torch.zeros(n, n, dtype=torch.long)
    tiles = torch.zeros(n, dtype=torch.long)
    for r in range(n):
        work[r] = tile_mask(layout, (r,), None, True).pairs()
        for s, tiles_s in enumerate(ring_step_tiles(layout, r, n, lambda i: (i,), Mask())):
            steps[s, r] = tiles_s.pairs()
            tiles[r] += tiles_s.num_tiles
    return work, steps, tiles


def rank_pairs(layout: SequenceLayout) -> torch.Tensor:
    """``(N,)`` visible pairs per head of each cp rank's queries on all keys (every row of the layout)."""
    rows = layout.batch_size or 1
    return torch.tensor([tile_mask(layout, (r,), None, True).pairs(rows) for r in range(layout.cp_size)])


def ring_step_work(w: torch.Tensor) -> torch.Tensor:
    """steps[s, r] = W[r, (r - s) mod N]: rank r's pairs at ring step s."""
    n = w.shape[0]
    r = torch.arange(n)
    return torch.stack([w[r, (r - s) % n] for s in range(n)])


def ptrr_block_mask(doc_lens: Sequence[int], block: int = PTRR_BLOCK):
    """The flex_attention BlockMask of the causal-within-document mask, built from its block states.

    Block (i, j) (queries [iB, iB+B), keys [jB, jB+B)) is non-empty iff j <= i and its last key
    reaches the document start of query iB; full iff j < i, the query block lies in one
    document and the key block starts at or after that document's start.
    """
    from torch.nn.attention.flex_attention import BlockMask

    doc_start, _ = doc_structure(doc_lens)
    nb = doc_start.numel() // block
    qfirst = torch.arange(nb) * block
    s_first, s_last = doc_start[qfirst], doc_start[qfirst + block - 1]
    i, j = torch.arange(nb)[:, None], torch.arange(nb)[None, :]
    nonempty = (j <= i) & (j * block + block - 1 >= s_first[:, None])
    full = (j < i) & (s_first == s_last)[:, None] & (j * block >= s_first[:, None])
    partial = nonempty & ~full

    def blocks(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = m.sum(1).to(torch.int32)
        idx = torch.argsort((~m).to(torch.int8), dim=1, stable=True).to(torch.int32)  # listed blocks first
        return num[None, None], idx[None, None]

    kv_num, kv_idx = blocks(partial)
    full_num, full_idx = blocks(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block)


def greedy_doc_positions(doc_lens: Sequence[int], cp: int, alpha: float = 0.02) -> list[torch.Tensor]:
    """Prototype balance: long documents split head-tail, short ones kept whole and packed by work.

    Every rank must hold exactly S/N tokens. A document whose own work L(L+1)/2 exceeds
    ``alpha`` times the ideal per-rank work (all pairs / N) is split as doc_zigzag splits
    it (2N pieces, extras dealt round-robin, rank r takes pieces r and 2N-1-r), which gives
    every rank the same work and tokens. The other documents, longest first, go whole to
    the rank with the least work among those with room for them (LPT: without the room
    limit the heaviest rank ends at most one whole document, <= alpha * ideal, above the
    ideal). A document that fits nowhere whole is cut into contiguous parts
    over the ranks with room, least work first. Whole documents are one run on one rank:
    one kernel call, at ring step 0 only, instead of up to 4 per ring step.
    """
    seq_len, n = sum(doc_lens), cp
    starts = np.cumsum([0] + list(doc_lens[:-1])).tolist()
    room, work = [seq_len // n] * n, [0] * n
    held: list[list[torch.Tensor]] = [[] for _ in range(n)]

    def give(r: int, start: int, length: int, offset: int) -> None:
        """Rank r takes positions [start, start+length): positions [offset, offset+length) of their document."""
        held[r].append(torch.arange(start, start + length))
        room[r] -= length
        work[r] += length * offset + length * (length + 1) // 2

    limit = alpha * causal_doc_total(doc_lens) / n
    whole, cursor = [], 0
    for d, length in enumerate(doc_lens):
        if length * (length + 1) // 2 <= limit:
            whole.append(d)
            continue
        base, extra = divmod(length, 2 * n)
        sizes = [base + (1 if (k - cursor) % (2 * n) < extra else 0) for k in range(2 * n)]
        cursor = (cursor + extra) % (2 * n)
        offs = np.cumsum([0] + sizes[:-1]).tolist()
        for k in range(2 * n):
            if sizes[k]:
                give(min(k, 2 * n - 1 - k), starts[d] + offs[k], sizes[k], offs[k])
    leftovers = []
    for d in sorted(whole, key=lambda d: -doc_lens[d]):
        fits = [r for r in range(n) if room[r] >= doc_lens[d]]
        if fits:
            give(min(fits, key=lambda r: work[r]), starts[d], doc_lens[d], 0)
        else:
            leftovers.append(d)
    for d in leftovers:
        offset = 0
        while offset < doc_lens[d]:
            r = min((r for r in range(n) if room[r]), key=lambda r: work[r])
            m = min(doc_lens[d] - offset, room[r])
            give(r, starts[d] + offset, m, offset)
            offset += m
    assert not any(room), room
    return [torch.sort(torch.cat(h)).values for h in held]


def regroup_per_document(indices: torch.Tensor, doc_lens: Sequence[int], cp: int) -> list[torch.Tensor]:
    """Rank r's positions if every document's slice of ``indices`` were dealt out rank by rank.

    _PerDocumentHeadTailLoadBalancer lists, per document, rank 0's head and tail chunks,
    then rank 1's, ...; DTensor's Shard(seq) then cuts the whole row into N contiguous
    slices, so rank 0 gets the first documents whole (see the module notes). Its docstring's
    picture instead gives rank r its own head-tail chunks of every document: this is that.
    """
    per_doc = torch.split(indices, list(doc_lens))
    return [torch.cat([d.view(cp, -1)[r] for d in per_doc]) for r in range(cp)]


def torch_positions(balance: str, doc_lens: Sequence[int], cp: int) -> tuple[list[torch.Tensor], int]:
    """Each rank's global positions under a torch load balancer, and the pad multiple of the row.

    Raises ValueError (with the reason) where the balancer's own rule rejects the row.
    """
    seq_len = sum(doc_lens)
    pad_to = 1
    if balance == "torch_head_tail":
        if seq_len % (2 * cp):
            raise ValueError(f"_HeadTailLoadBalancer needs seq_len % (2*cp) == 0; {seq_len} % {2 * cp} != 0")
        indices = _HeadTailLoadBalancer(seq_len, cp, "cpu")._generate_indices()
    elif balance == "torch_per_doc_head_tail":
        bad = sum(1 for n in doc_lens if n % (2 * cp))
        if bad:
            raise ValueError(
                f"_PerDocumentHeadTailLoadBalancer needs every document length % (2*cp) == 0; "
                f"{bad} of {len(doc_lens)} documents are not multiples of {2 * cp}"
            )
        indices = _PerDocumentHeadTailLoadBalancer([list(doc_lens)], cp, "cpu")._generate_indices()
    elif balance in ("torch_per_doc_head_tail_padded", "torch_per_doc_head_tail_padded_regrouped"):
        pad_to = 2 * cp
        padded = [(n + pad_to - 1) // pad_to * pad_to for n in doc_lens]
        indices = _PerDocumentHeadTailLoadBalancer([padded], cp, "cpu")._generate_indices()
        if balance.endswith("_regrouped"):
            return regroup_per_document(indices[0].long(), padded, cp), pad_to
    elif balance == "torch_ptrr":
        if seq_len % PTRR_BLOCK or (seq_len // PTRR_BLOCK) % cp:
            raise ValueError(
                f"_PTRRLoadBalancer deals {PTRR_BLOCK}-token blocks round-robin and needs "
                f"(seq_len / {PTRR_BLOCK}) % cp == 0; seq_len {seq_len}, cp {cp}"
            )
        indices = _PTRRLoadBalancer(ptrr_block_mask(doc_lens), cp)._generate_indices()
    else:
        raise ValueError(f"unknown torch balance {balance!r}")
    row = indices[0].long()
    return list(row.view(cp, -1)), pad_to


# ---------------------------------------------------------------------------- the benchmark
def row_measure(balance: str, doc_lens: Sequence[int], cp: int, greedy_alpha: float = 0.02) -> dict:
    """One row under one balance: per-rank work, ring step matrix and kernel calls (mask tiles).

    Returns ``{"work": (N,), "steps": (N, N), "tiles": (N,), "pad_tokens": int}``; raises
    ValueError with the reason where the balance cannot lay out the row. Pairs are counted
    twice, by the position counter and by titan_cp's mask tiles, and must agree exactly.
    """
    seq_len = sum(doc_lens)
    pad_to = 1
    if balance in balance_names():
        layout = SequenceLayout(seq_len, cp, balance, [list(doc_lens)])
        work, steps, tiles = layout_work(layout)
        positions = [layout.index(r) for r in range(cp)]
    else:
        if balance == "greedy_doc":
            positions = greedy_doc_positions(doc_lens, cp, greedy_alpha)
        else:
            positions, pad_to = torch_positions(balance, doc_lens, cp)
    doc_start, real = doc_structure(doc_lens, pad_to)
    if balance not in balance_names():
        steps, tiles = ring_tiles([runs_of(p, doc_start, real) for p in positions])
        work = steps.sum(0)
    w = pair_matrix(positions, doc_start, real)
    assert torch.equal(w.sum(1), work), (balance, cp, w.sum(1), work)
    assert torch.equal(ring_step_work(w), steps), (balance, cp)
    assert int(work.sum()) == causal_doc_total(doc_lens)
    return {"work": work, "steps": steps, "tiles": tiles, "pad_tokens": doc_start.numel() - seq_len}


def ratios(work: torch.Tensor, steps: torch.Tensor) -> tuple[float, float]:
    """(max_over_mean, ring_critical_over_ideal)."""
    n = work.numel()
    ideal = work.sum().item() / n
    return work.max().item() / ideal, steps.max(1).values.sum().item() / ideal


def measure(mix: str, cp: int, balance: str, rows: list[list[int]], greedy_alpha: float = 0.02) -> dict:
    """One JSON record: worst row and whole-batch ratios of ``balance`` on the rows of ``mix``."""
    rec = {
        "mix": mix,
        "cp": cp,
        "balance": balance,
        "source": "torch" if balance in TORCH_BALANCES else "titan_cp" if balance in balance_names() else "prototype",
        "seq_len": sum(rows[0]),
        "rows": len(rows),
        "docs_per_row": round(sum(map(len, rows)) / len(rows), 1),
    }
    try:
        got = [row_measure(balance, lens, cp, greedy_alpha) for lens in rows]
    except ValueError as e:
        rec.update(max_over_mean=None, ring_critical_over_ideal=None, note=str(e))
        return rec
    per_row = [ratios(g["work"], g["steps"]) for g in got]
    batch = ratios(sum(g["work"] for g in got), sum(g["steps"] for g in got))
    rec["max_over_mean"] = round(max(m for m, _ in per_row), 4)
    rec["ring_critical_over_ideal"] = round(max(c for _, c in per_row), 4)
    rec["max_over_mean_batch"] = round(batch[0], 4)
    rec["ring_critical_over_ideal_batch"] = round(batch[1], 4)
    rec["max_tiles"] = max(int(g["tiles"].max()) for g in got)
    pads = sum(g["pad_tokens"] for g in got)
    if pads:
        rec["padding_fraction"] = round(pads / (pads + sum(map(sum, rows))), 4)
        rec["note"] = f"each document padded to a multiple of 2*cp = {2 * cp}; pads hold no pairs"
    return rec


def run(
    mixes: Sequence[str],
    cps: Sequence[int],
    balances: Sequence[str],
    seq_len: int,
    rows: int,
    seed: int,
    greedy_alpha: float = 0.02,
):
    """Yield one record per (mix, cp, balance)."""
    for mix in mixes:
        docs = make_rows(mix, seq_len, rows, seed)
        for cp in cps:
            for balance in balances:
                yield measure(mix, cp, balance, docs, greedy_alpha)
