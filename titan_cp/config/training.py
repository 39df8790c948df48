"""``[training]``: data, batch sizes, steps, precision; and the sources of a dataset mixture."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Literal

from titan_cp.config.values import (
    AtLeast,
    AtMost,
    InRange,
    NonEmpty,
    Positive,
    PositiveOrAuto,
    Section,
    did_you_mean,
)

NO_LOSS = "chat records would carry no loss; list at least one role"
MIXTURE_KINDS = ("synthetic_recall", "synthetic_lookup", "text", "chat", "hf")
MAX_SEQ_LEN = 2**24
"""The longest row: RoPE turns positions into float32 angles (``titan_cp.families.llama3.model.rope_cos_sin``),
and float32 holds every integer position exactly only up to 2**24 (16M tokens)."""
SEQ_LEN_BOUND = AtMost(MAX_SEQ_LEN, "RoPE computes with float32 positions, exact only up to 2**24")
MAX_MICROBATCH_TOKENS = 2**31 - 1
"""Tokens of one microbatch (rows x seq_len): the attention indexes them with int32 cumulative
lengths (``cu_seqlens`` of the variable-length kernels)."""


@dataclass
class MixtureSource:
    """One source of ``training.mixture``: a ``[[training.mixture]]`` table in TOML, or
    ``name:kind:path:weight`` on the command line (comma-separated; ``path`` may be empty)."""

    name: str
    """Name of the source, unique in the mixture; its drawn tokens are logged as ``tokens_drawn/<name>``."""

    kind: str
    """Dataset kind: ``synthetic_recall``, ``text``, ``chat`` or ``hf``, read as ``training.dataset``
    of that name reads it."""

    path: str | None = None
    """Local file or folder of the source (not needed for ``synthetic_recall``)."""

    weight: float = 1.0
    """Sampling weight (>= 0): documents are drawn with probability weight / sum of weights."""

    @classmethod
    def parse(cls, key: str, text: str) -> dict[str, str]:
        """``"name:kind:path:weight"`` -> the table's fields (values still strings)."""
        parts = text.split(":")
        if len(parts) < 4:
            raise ValueError(f"{key} entries on the command line are name:kind:path:weight, got {text!r}")
        return {"name": parts[0], "kind": parts[1], "path": ":".join(parts[2:-1]) or "none", "weight": parts[-1]}


@dataclass
class Training(Section, name="training"):
    dataset: str = "synthetic_recall"
    """Dataset: ``synthetic_recall`` (built in, long-range recall), ``synthetic_lookup`` (built in,
    recall as a bare lookup: facts, filler dots, questions; one document a row), ``text`` (local .txt/.jsonl at
    ``training.dataset_path``), ``chat`` (chat/agent-trajectory JSON lines, ``{"messages": [{"role",
    "content"}, ...]}``, loss on ``training.loss_roles``), ``hf`` (a Hugging Face dataset saved on
    disk), ``mixture`` (the sources of ``training.mixture``, by weight), or any other name with
    ``training.dataset_path`` pointing at a local copy. Nothing is ever downloaded."""

    dataset_path: str | None = None
    """Local file or folder of the dataset."""

    packing: Literal["stream", "best_fit"] = "stream"
    """How documents become rows (training and validation): ``stream`` packs them end to end and
    cuts one wherever a row ends (no padding); ``best_fit`` never cuts a document no longer than
    ``seq_len`` (longer ones are split into ``seq_len`` windows) and fills the rest of a row with
    one padding document that carries no loss. See ``titan_cp.data.packing``."""

    packing_lookahead: Annotated[int, Positive] = 512
    """For ``packing = "best_fit"``: document pieces buffered to choose from when filling a row
    (more: less padding, documents read further ahead)."""

    loss_roles: Annotated[list[Literal["system", "user", "assistant", "tool"]], NonEmpty(NO_LOSS)] = field(
        default_factory=lambda: ["assistant"]
    )
    """For ``chat`` records: the roles whose turns carry loss; the other turns are context only. A
    record without such a turn is dropped (counted in the log); a file of only those is an error."""

    chat_template: Literal["chatml", "tokenizer"] = "chatml"
    """For ``chat`` records: ``chatml`` (built in, see ``titan_cp.data.chat``) or ``tokenizer``
    (the ``chat_template`` of the ``tokenizer_config.json`` in ``model.hf_assets_path``)."""

    mixture: list[MixtureSource] = field(default_factory=list)
    """For ``dataset = "mixture"``: the sources and their sampling weights, as ``[[training.mixture]]``
    tables with ``name``, ``kind``, ``path``, ``weight``. Seeded by ``training.seed``."""

    local_batch_size: Annotated[int, Positive] = 8
    """Rows (packed sequences of ``seq_len`` tokens) per microbatch per data-parallel rank."""

    global_batch_size: Annotated[int, PositiveOrAuto] = -1
    """Rows per optimizer step over all data-parallel ranks and microbatches.
    -1: ``local_batch_size * dp degree * gradient_accumulation_steps``."""

    gradient_accumulation_steps: Annotated[int, PositiveOrAuto] = -1
    """Microbatches per optimizer step on each data-parallel rank.
    -1: derived, ``global_batch_size / (local_batch_size * dp degree)`` (1 if both are -1)."""

    seq_len: Annotated[int, Positive, SEQ_LEN_BOUND] = 2048
    """Tokens per row (the full sequence, before context-parallel sharding); at most 2**24
    (:data:`MAX_SEQ_LEN`), and ``local_batch_size * seq_len`` at most 2**31 - 1."""

    max_norm: Annotated[float, Positive] = 1.0
    """Gradient clipping max norm."""

    steps: Annotated[int, Positive] = 10000
    """Optimizer steps to train."""

    max_skipped_fraction: Annotated[float, InRange(0, 1)] = 0.5
    """The share of ``training.steps`` that may be skipped for holding no loss-bearing token (e.g.
    chat records whose turns before their first turn of ``training.loss_roles`` fill whole rows;
    records without such a turn are dropped when read): the run stops with an error naming the
    roles as soon as more steps than that were skipped, and always when every step was."""

    seed: Annotated[int, AtLeast(0)] = 0
    """Base seed for parameter init and data generation."""

    deterministic: bool = False
    """Use deterministic algorithms (slower), for bit-identical reruns."""

    enable_cpu_offload: bool = False
    """Keep the sharded parameters, their gradients and the optimizer state in host memory (FSDP2's
    ``CPUOffloadPolicy``, as torchtitan): each block's weights are copied to the GPU for its forward
    and backward, and the optimizer steps on the CPU. Needs FSDP (a ``dp_shard x cp`` mesh larger
    than 1)."""

    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """Compute dtype: FSDP casts the parameters to it; without FSDP (one device, TP or PP alone)
    the forward runs under ``torch.autocast`` with it. ``float32`` on CUDA falls to the dense
    ``math`` attention kernel (with a warning): the flash kernels take bf16/fp16 only. On a CPU,
    PyTorch's bf16 matmul is a generic kernel about 3x slower than fp32's: left unset there, the
    trainer computes in ``float32`` (and logs so); set to ``bfloat16`` explicitly, bf16 is kept,
    with a warning."""

    def check(self) -> None:
        """A microbatch's tokens fit int32; ``dataset = "mixture"`` exactly when ``mixture`` lists
        sources; names unique, kinds known (not nested), weights >= 0 with a positive, finite sum."""
        check_microbatch_tokens("training", self.local_batch_size, self.seq_len)
        mixture = self.mixture
        if self.dataset == "mixture" and not mixture:
            raise ValueError("training.dataset = 'mixture' needs sources: add [[training.mixture]] tables")
        if self.dataset == "mixture" and self.dataset_path:
            raise ValueError(
                "training.dataset_path is not read for training.dataset = 'mixture' (each source has its "
                "own path in training.mixture): unset it"
            )
        if mixture and self.dataset != "mixture":
            raise ValueError(
                f"training.mixture lists sources but training.dataset = {self.dataset!r}: set training.dataset = "
                "'mixture' to train on them, or remove the table"
            )
        names = [m.name for m in mixture]
        for i, m in enumerate(mixture):
            if not m.name or names.count(m.name) > 1:
                raise ValueError(
                    f"training.mixture[{i}].name = {m.name!r}: names must be non-empty and unique, got {names}"
                )
            if m.kind == "mixture":
                raise ValueError(
                    f"training.mixture[{i}].kind = 'mixture' ({m.name!r}): a mixture cannot hold another mixture"
                )
            if m.kind not in MIXTURE_KINDS:
                raise ValueError(
                    f"training.mixture[{i}].kind = {m.kind!r} ({m.name!r}) is not a dataset kind: choose one of "
                    f"{list(MIXTURE_KINDS)}{did_you_mean(m.kind, MIXTURE_KINDS)}"
                )
            if not m.weight >= 0:
                raise ValueError(f"training.mixture[{i}].weight ({m.name!r}) must be >= 0, got {m.weight}")
        weights = [m.weight for m in mixture]
        if mixture and sum(weights) <= 0:
            raise ValueError(f"training.mixture weights sum to zero ({weights}): give one a positive weight")
        if not math.isfinite(sum(weights)):
            raise ValueError(
                f"training.mixture weights sum to {sum(weights)} ({weights}): scale them down (only their ratios matter)"
            )


def check_microbatch_tokens(section: str, local_batch_size: int, seq_len: int) -> None:
    """``{section}.local_batch_size * {section}.seq_len`` must be at most :data:`MAX_MICROBATCH_TOKENS`."""
    if local_batch_size * seq_len > MAX_MICROBATCH_TOKENS:
        raise ValueError(
            f"{section}.local_batch_size x {section}.seq_len = {local_batch_size} x {seq_len} tokens per microbatch "
            f"must be at most {MAX_MICROBATCH_TOKENS} (the attention indexes a microbatch's tokens with int32): "
            f"lower one of them"
        )
