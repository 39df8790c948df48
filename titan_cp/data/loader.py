"""Data-parallel loading of packed rows, with the step's global valid-token count.

The packed rows of the stream are numbered globally ``0, 1, 2, ...``. Each step takes the next
``G = global_batch_size`` rows; with ``D`` data-parallel ranks, ``L = G / D`` rows each and
microbatches of ``B = local_batch_size`` rows::

    step rows        [n, n + G)                    n = next global row at the step's start
    dp rank d        [n + d*L, n + (d+1)*L)
    microbatch m     [n + d*L + m*B, n + d*L + (m+1)*B)      m < L / B (gradient accumulation)

The ranks of one cp (and tp, pp) group have the same dp rank, so they read the same rows; sharding
a row over cp is the layout's job. Every rank walks the whole (deterministic) stream to find where
its rows start, so it also knows each other row's document lengths, hence
``global_valid_tokens = sum over the step's G rows of (S - pieces in row)``: the exact loss
denominator over dp x cp x gradient accumulation, with no communication.

The state is global, ``next_row`` plus the packer's stream position, so a run resumed with a
different number of dp ranks (or a different mesh) reads exactly the rows that come next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch

from titan_cp.data.datasets import DocumentSource, Split, build_dataset
from titan_cp.data.packing import PackedRow, Packer
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
    the step (the loss denominator); ``first_row``: global number of the step's first row.
    """

    microbatches: list[Batch]
    global_valid_tokens: int
    first_row: int


class PackedDataLoader:
    """Endless iterator of :class:`Step` for data-parallel rank ``dp_rank`` of ``dp_degree``."""

    def __init__(
        self,
        source: DocumentSource,
        seq_len: int,
        global_batch_size: int,
        local_batch_size: int,
        dp_rank: int = 0,
        dp_degree: int = 1,
    ):
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank must be in [0, {dp_degree}), got {dp_rank}")
        if local_batch_size < 1 or global_batch_size % (local_batch_size * dp_degree):
            raise ValueError(
                f"training.global_batch_size ({global_batch_size}) must be a positive multiple of "
                f"training.local_batch_size ({local_batch_size}) x data-parallel degree ({dp_degree})"
            )
        self.packer = Packer(source, seq_len)
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
        valid = 0
        for r in range(first, first + self.global_batch_size):
            if r in mine:
                rows.append(self.packer.next_row())
                valid += rows[-1].num_valid_tokens
            else:
                valid += self.seq_len - len(self.packer.skip_row())
        self.next_row += self.global_batch_size
        B = self.local_batch_size
        microbatches = [
            Batch.collate(rows[i : i + B], list(mine[i : i + B])) for i in range(0, per_rank, B)
        ]
        return Step(microbatches, valid, first)

    def state_dict(self) -> dict[str, int]:
        """Global position: the same on every rank, valid for any dp degree."""
        return {"next_row": self.next_row, "seq_len": self.seq_len, **self.packer.state_dict()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seq_len"] != self.seq_len:
            raise ValueError(
                f"the data position was saved with training.seq_len = {state['seq_len']}, "
                f"now {self.seq_len}: rows would not line up"
            )
        self.next_row = int(state["next_row"])
        self.packer.load_state_dict(state)


def build_dataloader(
    job_config: JobConfig, tokenizer: Tokenizer, dp_rank: int, dp_degree: int, split: Split = "train"
) -> PackedDataLoader:
    """The loader of ``split`` for dp rank ``dp_rank`` of ``dp_degree`` (the ``"dp"`` mesh view).

    Training steps take ``training.global_batch_size`` rows; validation steps take
    ``validation.local_batch_size x dp_degree`` rows (no accumulation).
    """
    t, v = job_config.training, job_config.validation
    source = build_dataset(job_config, tokenizer, split)
    if split == "train":
        global_batch_size, _ = job_config.resolve_batch_sizes(dp_degree)
        return PackedDataLoader(source, t.seq_len, global_batch_size, t.local_batch_size, dp_rank, dp_degree)
    seq_len = t.seq_len if v.seq_len == -1 else v.seq_len
    local = t.local_batch_size if v.local_batch_size == -1 else v.local_batch_size
    return PackedDataLoader(source, seq_len, local * dp_degree, local, dp_rank, dp_degree)
