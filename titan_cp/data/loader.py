"""Data-parallel loading of packed rows, with the step's global valid-token count.

The packed rows of the stream are numbered globally ``0, 1, 2, ...``. Each step takes the next
``G = global_batch_size`` rows; with ``D`` data-parallel ranks, ``L = G / D`` rows each and
microbatches of ``B = local_batch_size`` rows::

    step rows        [n, n + G)                    n = next global row at the step's start
    dp rank d        [n + d*L, n + (d+1)*L)
    microbatch m     [n + d*L + m*B, n + d*L + (m+1)*B)      m < L / B (gradient accumulation)

The ranks of one cp (and tp, pp) group have the same dp rank, so they read the same rows; sharding
a row over cp is the layout's job. Every rank walks the whole (deterministic) stream to find where
its rows start, so it also knows each other row's pieces and loss masks, hence
``global_valid_tokens = sum over the step's G rows of the row's loss-bearing tokens`` (``S -
pieces in row`` without loss masks or padding; only the masked-in tokens of chat records): the
exact loss denominator over dp x cp x gradient accumulation, with no communication. The same walk
counts the step's padding tokens and the tokens drawn from each mixture source.

The state is global, ``next_row`` plus the packer's position (and the running per-source token
counts), so a run resumed with a different number of dp ranks (or a different mesh) reads exactly
the rows that come next.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from titan_cp.data.datasets import Split, build_dataset
from titan_cp.data.document import DocumentSource
from titan_cp.data.packing import PackedRow, make_packer
from titan_cp.data.tokenizer import Tokenizer

if TYPE_CHECKING:
    from titan_cp.config import JobConfig


@dataclass
class Batch:
    """One microbatch of ``B`` rows of ``S`` tokens.

    ``tokens``, ``labels``, ``positions``, ``recall_distance``: ``(B, S)`` int64 (see
    :mod:`titan_cp.data.packing`); ``doc_lens``: per row, the document-piece lengths (each list
    sums to ``S``); ``doc_lens_padded``: the same as ``(B, max_docs)`` int64, zero-padded;
    ``rows``: the global row numbers.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    recall_distance: torch.Tensor
    doc_lens: list[list[int]]
    doc_lens_padded: torch.Tensor
    rows: list[int]

    @classmethod
    def collate(cls, rows: list[PackedRow], indices: list[int]) -> Batch:
        max_docs = max(len(r.doc_lens) for r in rows)
        padded = torch.zeros(len(rows), max_docs, dtype=torch.int64)
        for i, r in enumerate(rows):
            padded[i, : len(r.doc_lens)] = torch.tensor(r.doc_lens)
        return cls(
            tokens=torch.stack([r.tokens for r in rows]),
            labels=torch.stack([r.labels for r in rows]),
            positions=torch.stack([r.positions for r in rows]),
            recall_distance=torch.stack([r.recall_distance for r in rows]),
            doc_lens=[list(r.doc_lens) for r in rows],
            doc_lens_padded=padded,
            rows=indices,
        )


@dataclass
class Step:
    """What one dp rank trains on in one optimizer step.

    ``microbatches``: gradient-accumulation microbatches of this rank, in order;
    ``global_valid_tokens``: tokens with ``labels != -100`` over all dp ranks and microbatches of
    the step (the loss denominator); ``first_row``: global number of the step's first row;
    ``padding_tokens``: padding over the step's rows (all ranks); ``source_tokens``: tokens the
    step's rows (all ranks) drew from each mixture source.
    """

    microbatches: list[Batch]
    global_valid_tokens: int
    first_row: int
    padding_tokens: int = 0
    source_tokens: dict[str, int] = field(default_factory=dict)


class PackedDataLoader:
    """Endless iterator of :class:`Step` for data-parallel rank ``dp_rank`` of ``dp_degree``.

    ``packing``, ``lookahead``, ``pad_id``: the packer (``stream`` or ``best_fit``, see
    :mod:`titan_cp.data.packing`). ``source_names``: mixture sources whose drawn tokens are counted
    (``source_tokens``, running totals kept in the state).
    """

    def __init__(
        self,
        source: DocumentSource,
        seq_len: int,
        global_batch_size: int,
        local_batch_size: int,
        dp_rank: int = 0,
        dp_degree: int = 1,
        packing: str = "stream",
        lookahead: int = 512,
        pad_id: int = 0,
        source_names: tuple[str, ...] = (),
    ) -> None:
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank must be in [0, {dp_degree}), got {dp_rank}")
        if local_batch_size < 1 or global_batch_size % (local_batch_size * dp_degree):
            raise ValueError(
                f"training.global_batch_size ({global_batch_size}) must be a positive multiple of "
                f"training.local_batch_size ({local_batch_size}) x data-parallel degree ({dp_degree})"
            )
        self.packing = packing
        self.packer = make_packer(source, seq_len, packing, lookahead, pad_id)
        self.source_tokens = {name: 0 for name in source_names}
        self.seq_len = seq_len
        self.global_batch_size, self.local_batch_size = global_batch_size, local_batch_size
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.next_row = 0

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.global_batch_size // (self.local_batch_size * self.dp_degree)

    def __iter__(self) -> Iterator[Step]:
        return self

    def __next__(self) -> Step:
        first, per_rank = self.next_row, self.global_batch_size // self.dp_degree
        mine = range(first + self.dp_rank * per_rank, first + (self.dp_rank + 1) * per_rank)
        rows: list[PackedRow] = []
        valid = padding = 0
        sources: dict[str, int] = {}
        for r in range(first, first + self.global_batch_size):
            if r in mine:
                row = self.packer.next_row()
                rows.append(row)
                row_valid, row_padding, row_sources = row.num_valid_tokens, row.padding, row.source_tokens
            else:
                summary = self.packer.skip_row()
                row_valid, row_padding, row_sources = summary.valid_tokens, summary.padding, summary.source_tokens
            valid += row_valid
            padding += row_padding
            for name, n in row_sources.items():
                sources[name] = sources.get(name, 0) + n
        for name, n in sources.items():
            self.source_tokens[name] = self.source_tokens.get(name, 0) + n
        self.next_row += self.global_batch_size
        B = self.local_batch_size
        microbatches = [Batch.collate(rows[i : i + B], list(mine[i : i + B])) for i in range(0, per_rank, B)]
        return Step(microbatches, valid, first, padding, sources)

    def state_dict(self) -> dict:
        """Global position: the same on every rank, valid for any dp degree. The packer's position
        and the per-source counts are JSON strings (their shape varies with the packer and the
        mixture, a checkpoint's fixed keys do not)."""
        return {
            "next_row": self.next_row,
            "seq_len": self.seq_len,
            "packing": self.packing,
            "packer": json.dumps(self.packer.state_dict()),
            "source_tokens": json.dumps(self.source_tokens),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["seq_len"] != self.seq_len:
            raise ValueError(
                f"the data position was saved with training.seq_len = {state['seq_len']}, "
                f"now {self.seq_len}: rows would not line up"
            )
        if state["packing"] != self.packing:
            raise ValueError(
                f"the data position was saved with training.packing = {state['packing']!r}, "
                f"now {self.packing!r}: rows would not line up"
            )
        self.next_row = int(state["next_row"])
        self.packer.load_state_dict(json.loads(state["packer"]))
        self.source_tokens.update(json.loads(state["source_tokens"]))


def build_dataloader(
    job_config: JobConfig,
    tokenizer: Tokenizer,
    dp_rank: int,
    dp_degree: int,
    split: Split = "train",
    announce: bool = False,
    source: DocumentSource | None = None,
) -> PackedDataLoader:
    """The loader of ``split`` for dp rank ``dp_rank`` of ``dp_degree`` (the ``"dp"`` mesh view).

    Training steps take ``training.global_batch_size`` rows; validation steps take
    ``validation.local_batch_size x dp_degree`` rows (no accumulation). Both pack with
    ``training.packing`` (``training.packing_lookahead`` pieces ahead, padding with the
    tokenizer's PAD id). ``source``: the split's documents, built already (:func:`build_sources`);
    ``None``: built here. ``announce``: log what the source drops (chat records without a loss
    turn), on one rank.
    """
    t, v = job_config.training, job_config.validation
    source = build_dataset(job_config, tokenizer, split, announce) if source is None else source
    packing: dict[str, Any] = dict(packing=t.packing, lookahead=t.packing_lookahead, pad_id=tokenizer.pad_id)
    if split == "train":
        global_batch_size, _ = job_config.resolve_batch_sizes(dp_degree)
        names = tuple(m.name for m in t.mixture) if t.dataset == "mixture" else ()
        return PackedDataLoader(
            source, t.seq_len, global_batch_size, t.local_batch_size, dp_rank, dp_degree, source_names=names, **packing
        )
    seq_len = t.seq_len if v.seq_len == -1 else v.seq_len
    local = t.local_batch_size if v.local_batch_size == -1 else v.local_batch_size
    return PackedDataLoader(source, seq_len, local * dp_degree, local, dp_rank, dp_degree, **packing)


def build_sources(job_config: JobConfig, tokenizer: Tokenizer, announce: bool = False) -> dict[Split, DocumentSource]:
    """The documents of the training split and, with ``validation.enable``, of the validation split
    (:func:`~titan_cp.data.datasets.build_dataset`): every data file is read and checked here, so the
    trainer calls this before any process group starts. ``announce``: as :func:`build_dataloader`."""
    splits: tuple[Split, ...] = ("train", "validation") if job_config.validation.enable else ("train",)
    return {split: build_dataset(job_config, tokenizer, split, announce) for split in splits}
