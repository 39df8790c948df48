"""Prefill, decode and scoring of a parallelized model under its CP layout.

::

    prompts ─ packed as the documents of one row (+ one padding document to the layout's multiple)
      └─ layout.shard(cp rank) ─ the model's own layers, CP attention (any strategy)
           ├─ each layer's K/V (post-RoPE) of this rank's tokens ─> ShardedKVCache
           └─ hidden state of each prompt's last token (on the rank that holds it) ─ all-reduce over cp
                ─ (norm) ─ output ─ logits (B, V), equal on every rank
    decode step (one token per prompt, the same on every rank):
      embed ─ per layer: q, k, v of the token; its K/V stored by its owner rank;
              decode_attention: each rank's partial over its cache, merged by log-sum-exp
              (one all-gather per layer) ─ the rest of the layer ─ logits (B, V)
    scoring: the prefill's hidden states at the continuation's positions ─ log-softmax of the
             next token, chunk by chunk ─ all-reduce over cp

The model is titan_cp's Llama (tensor parallelism applies as in training: heads split over tp,
activations replicated) or a Hugging Face causal LM; :mod:`.models` says what each must answer.
Every rank computes the same logits from the same merged numbers, so every rank chooses the
same tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from titan_cp.attention import check_kernel
from titan_cp.attention.api import local_handle
from titan_cp.attention.decode import KeyRanges, decode_attention
from titan_cp.errors import plural
from titan_cp.generate.cache import ShardedKVCache, plan_owners
from titan_cp.generate.registry import runner_of
from titan_cp.generate.sampling import Sampling, sample_next
from titan_cp.layout import seq_len_multiple, to_device
from titan_cp.loss import LOSS_CHUNK_BYTES
from titan_cp.parallel import handle_of


@dataclass(frozen=True)
class PackedPrompts:
    """Token lists packed as the documents of one row, padded with one document of ``pad`` tokens
    to a multiple of ``multiple``: ``tokens`` ``(1, S)`` and per-document ``positions`` ``(1, S)``."""

    lengths: tuple[int, ...]
    doc_lens: tuple[int, ...]
    tokens: Tensor
    positions: Tensor

    @classmethod
    def pack(cls, prompts: Sequence[Sequence[int]], multiple: int, pad: int = 0) -> PackedPrompts:
        lengths = tuple(len(p) for p in prompts)
        filler = -sum(lengths) % multiple
        doc_lens = lengths + ((filler,) if filler else ())
        tokens = torch.tensor([t for p in prompts for t in p] + [pad] * filler, dtype=torch.int64)
        positions = torch.cat([torch.arange(n) for n in doc_lens])
        return cls(lengths, doc_lens, tokens[None], positions[None])

    @property
    def seq_len(self) -> int:
        return sum(self.doc_lens)


@dataclass
class Generation:
    """One prompt's result: the generated ids (a stop token included, as the last), why it ended
    (``"stop"`` or ``"length"``), the time to the first token (the prefill of the whole batch and
    the first choice) and the decode time after it; ``logits``: each step's ``(V,)`` fp32 when kept."""

    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    time_to_first_token_s: float = 0.0
    decode_s: float = 0.0
    logits: list[Tensor] | None = None

    @property
    def tokens_per_s(self) -> float | None:
        """Decode throughput: the tokens after the first per second of decoding (``None`` for one token)."""
        return (len(self.tokens) - 1) / self.decode_s if len(self.tokens) > 1 and self.decode_s > 0 else None


@dataclass(frozen=True)
class Score:
    """A continuation's log-likelihood given its context: per token (natural log), summed, and
    whether every token is the argmax of its distribution (greedy decoding would produce it)."""

    logprobs: list[float]
    greedy: bool

    @property
    def loglik(self) -> float:
        return float(sum(self.logprobs))


@dataclass
class DecodeState:
    """Where each prompt stands: its cache on this rank, the owner plan of the tokens to feed,
    the next position of each prompt and how many tokens each has fed."""

    cache: ShardedKVCache
    owners: list[list[int]]
    next_position: list[int]
    fed: list[int]


def _find(index: Tensor, wanted: Tensor) -> tuple[Tensor, Tensor]:
    """For each global slot in ``wanted (n,)``: whether ``index`` (this rank's global slot of each local
    slot, ``(S_local,)``) holds it, and at which local slot (meaningful where it does)."""
    order = torch.argsort(index)
    at = torch.searchsorted(index[order], wanted).clamp(max=len(index) - 1)
    return index[order][at] == wanted, order[at]


def _check_prompts(name: str, prompts, model, extra: int = 0) -> None:
    """Each of ``prompts`` is a non-empty list of token ids of the ``model``'s (a runner's) vocabulary
    whose length (plus ``extra`` positions) fits the positions it takes (``max_seq_len``); ``ValueError``
    naming ``name[i]``."""
    if not prompts:
        raise ValueError(f"{name} is empty: give at least one token list")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"{name}[{i}] has no tokens")
        if len(p) + extra > model.max_seq_len:
            raise ValueError(
                f"{name}[{i}] has {plural(len(p), 'token')}{f' (+ {extra} to generate)' if extra else ''}, more than the "
                f"{model.max_seq_len} positions the model takes"
            )
        if not all(isinstance(t, int) and 0 <= t < model.vocab_size for t in p):
            raise ValueError(
                f"{name}[{i}] holds a token that is not an id below the vocabulary size {model.vocab_size}"
            )


class Generator:
    """Prefill, decode and scoring with ``model``: titan_cp's :class:`~titan_cp.families.llama3.model.Transformer`
    (tensor- and context-parallelized as in training, or plain on one device; :func:`.runners.build_generation_model`)
    or a Hugging Face causal LM (:func:`.hf.build_hf_model`).

    Args:
        model: the model; under CP its attention runs by the handle ``apply_cp`` bound
            (:func:`~titan_cp.parallel.handle_of`): its mesh, strategy and balance are the layout here,
            and its mesh's group carries decode merges and prefill reductions.
        kernel: the local attention kernel of decode steps (``None``: the device's default).
    """

    def __init__(self, model: nn.Module, kernel: str | None = None) -> None:
        self.runner, self.kernel_name = runner_of(model), kernel
        self.handle = handle_of(model) or local_handle()
        self.cp, self.rank, self.group = self.handle.size, self.handle.rank, self.handle.group
        self.multiple = seq_len_multiple(self.handle.balance, self.cp)
        self.device = self.runner.device

    # ------------------------------------------------------------------ shared pieces
    def _layout(self, packed: PackedPrompts):
        """The layout of the packed row, this rank's tokens and positions ``(1, S_local)`` on the device, and
        the layout's documents tensor for the model (registered with the handle while it lives)."""
        layout, doc_lens = self.handle.register(packed.seq_len, [list(packed.doc_lens)])
        assert doc_lens is not None, "a packed row has documents"
        tokens = layout.shard(packed.tokens, 1, self.rank)
        positions = layout.doc_positions(self.rank)
        return layout, to_device(tokens, self.device), to_device(positions, self.device), doc_lens

    def _sum_over_cp(self, x: Tensor) -> Tensor:
        if self.group is not None:
            dist.all_reduce(x, group=self.group)
        return x

    # ------------------------------------------------------------------ prefill and decode
    @torch.no_grad()
    def prefill(self, prompts: Sequence[Sequence[int]], new_tokens: int = 1) -> tuple[Tensor, DecodeState]:
        """Run the prompts (token lists) through the model under the layout, filling this rank's
        cache, planned for ``new_tokens`` tokens per prompt. Returns each prompt's last logits
        ``(B, V)`` fp32 (the same on every rank) and the decode state."""
        _check_prompts("prompts", prompts, self.runner, max(new_tokens - 1, 0))
        packed = PackedPrompts.pack(prompts, self.multiple)
        layout, tokens, positions, doc_lens = self._layout(packed)
        n = len(prompts)
        prompt_of = [torch.where(layout.doc_ids(r)[0] < n, layout.doc_ids(r)[0], -1) for r in range(self.cp)]
        held = torch.stack([torch.bincount(p[p >= 0], minlength=n) for p in prompt_of], dim=1).tolist()
        owners = plan_owners(held, max(new_tokens - 1, 0))
        mine, doc_pos = prompt_of[self.rank], layout.doc_positions(self.rank)[0]
        cache = ShardedKVCache(
            len(self.runner.masks),
            [sorted(doc_pos[mine == b].tolist()) for b in range(n)],
            [row.count(self.rank) for row in owners],
            self.device,
        )
        slots, rows = cache.prefill_rows(mine, doc_pos)
        slots_d, rows_d = to_device(slots, self.device), to_device(rows, self.device)

        def capture(i: int, k: Tensor, v: Tensor) -> None:  # k, v (1, K, S_local, E): this rank's tokens
            cache.write(i, rows_d, *(x[0].transpose(0, 1).index_select(0, slots_d) for x in (k, v)))

        h = self.runner.hidden(tokens, positions, doc_lens, capture)
        last = torch.tensor(packed.lengths).cumsum(0) - 1  # the global slot of each prompt's last token
        here, slot = _find(layout.index(self.rank), last)
        rows_h = h.new_zeros((n, h.shape[-1]))
        rows_h[to_device(here, self.device)] = h[0, to_device(slot[here], self.device)]
        logits = self.runner.logits(self._sum_over_cp(rows_h))
        return logits, DecodeState(cache, owners, list(packed.lengths), [0] * n)

    def _check_decode(self, state: DecodeState, prompts: Sequence[int], tokens: Sequence[int]) -> None:
        if (
            not prompts
            or len(tokens) != len(prompts)
            or list(prompts) != sorted(set(prompts))
            or not 0 <= prompts[0] <= prompts[-1] < len(state.fed)
        ):
            raise ValueError(
                f"decode takes distinct ascending prompt indices below {len(state.fed)} and one token each, got "
                f"prompts {list(prompts)} and {plural(len(tokens), 'token')}"
            )
        for b in prompts:
            if state.fed[b] >= len(state.owners[b]):
                raise ValueError(
                    f"prompt {b} has fed the {plural(len(state.owners[b]), 'token')} the prefill planned for; "
                    "prefill with a larger new_tokens"
                )

    @torch.no_grad()
    def decode(self, state: DecodeState, prompts: Sequence[int], tokens: Sequence[int]) -> Tensor:
        """Feed ``tokens[i]`` to prompt ``prompts[i]`` (indices into the prefill's prompts, ascending);
        returns the next logits ``(len(prompts), V)`` fp32, the same on every rank."""
        self._check_decode(state, prompts, tokens)
        cache, positions = state.cache, [state.next_position[b] for b in prompts]
        batch, rows = [], []
        for i, b in enumerate(prompts):
            if state.owners[b][state.fed[b]] == self.rank:
                batch.append(i)
                rows.append(cache.append(b, positions[i]))
            state.fed[b] += 1
            state.next_position[b] += 1
        keys = {
            mask: KeyRanges.build([cache.key_range(b, p, *mask) for b, p in zip(prompts, positions)], self.device)
            for mask in set(self.runner.masks)
        }
        batch_d, rows_d = (to_device(torch.tensor(x, dtype=torch.int64), self.device) for x in (batch, rows))

        def attend(i: int, q: Tensor, k: Tensor, v: Tensor, scale: float, sinks: Tensor | None) -> Tensor:
            """Layer ``i``: the new tokens' K/V ``(B, K, E)`` stored where this rank owns them, then the
            attention of ``q (B, H, E)`` over every rank's cache."""
            if len(batch):
                cache.write(i, rows_d, k.index_select(0, batch_d), v.index_select(0, batch_d))
            kernel = check_kernel(self.kernel_name, q.device, q.dtype, q.shape[-1])
            k_all, v_all = cache.k[i], cache.v[i]
            assert k_all is not None and v_all is not None, "the prefill wrote every layer's cache"
            return decode_attention(q, k_all, v_all, keys[self.runner.masks[i]], self.group, kernel, scale, sinks)

        column = lambda x: to_device(torch.tensor(x)[:, None], self.device)  # noqa: E731
        return self.runner.logits(self.runner.decode_hidden(column(tokens), column(positions), attend))

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        sampling: Sampling | None = None,
        stop_tokens: Sequence[int] = (),
        prompt_ids: Sequence[int] | None = None,
        keep_logits: bool = False,
    ) -> list[Generation]:
        """Generate up to ``max_new_tokens`` tokens for each prompt (token lists, all at once).

        A prompt stops at the first token in ``stop_tokens`` (kept as its last token). Sampling
        draws from the generator of ``prompt_ids[b]`` (default ``b``): the same id and seed give
        the same tokens in any batch and on any mesh. ``keep_logits``: keep each step's logits.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        sampling = Sampling() if sampling is None else sampling
        ids = list(range(len(prompts))) if prompt_ids is None else list(prompt_ids)
        stop, start = set(stop_tokens), time.perf_counter()
        logits, state = self.prefill(prompts, max_new_tokens)
        gens = sampling.generators(ids)
        out = [Generation(len(p), logits=[] if keep_logits else None) for p in prompts]
        active = list(range(len(prompts)))
        for step in range(max_new_tokens):
            if step:
                logits = self.decode(state, active, [out[b].tokens[-1] for b in active])
            chosen = sample_next(logits, sampling, [gens[b] for b in active])
            now = time.perf_counter()
            for row, (b, token) in enumerate(zip(active, chosen)):
                g = out[b]
                g.tokens.append(token)
                if g.logits is not None:  # keep_logits
                    g.logits.append(logits[row].cpu())
                if step == 0:
                    g.time_to_first_token_s = now - start
                g.decode_s = now - start - g.time_to_first_token_s
                if token in stop:
                    g.finish_reason = "stop"
            active = [b for b in active if out[b].finish_reason != "stop"]
            if not active:
                break
        return out

    # ------------------------------------------------------------------ scoring
    @torch.no_grad()
    def score(self, contexts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]) -> list[Score]:
        """The log-likelihood of each continuation given its context (token lists), from one prefill
        of every pair at once: ``log p(x_j | context, x_<j)`` for each continuation token ``x_j``."""
        if len(contexts) != len(continuations):
            raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuations")
        _check_prompts("contexts", contexts, self.runner)
        _check_prompts("continuations", continuations, self.runner)
        docs = [list(c) + list(x) for c, x in zip(contexts, continuations)]
        _check_prompts("contexts + continuations", docs, self.runner)
        packed = PackedPrompts.pack(docs, self.multiple)
        layout, tokens, positions, doc_lens = self._layout(packed)
        # label j of pair b: the slot of continuation token j's predecessor, and the token
        starts = torch.tensor([0, *packed.lengths]).cumsum(0)
        lens = torch.tensor([len(x) for x in continuations])
        label_at = torch.cat([starts[b] + len(c) - 1 + torch.arange(int(lens[b])) for b, c in enumerate(contexts)])
        targets = packed.tokens[0, label_at + 1]
        here, slot = _find(layout.index(self.rank), label_at)
        local, slot_of = torch.nonzero(here).flatten(), slot[here]  # the labels whose slot is here, and where
        h = self.runner.hidden(tokens, positions, doc_lens)[0]
        result = torch.zeros(2, len(label_at), dtype=torch.float64, device=self.device)
        chunk = max(1, LOSS_CHUNK_BYTES // (4 * self.runner.vocab_size))
        local_d, slot_d = to_device(local, self.device), to_device(slot_of, self.device)
        targets_d = to_device(targets, self.device)
        for s in range(0, len(local), chunk):
            rows, slots = local_d[s : s + chunk], slot_d[s : s + chunk]
            z = self.runner.logits(h.index_select(0, slots))
            t = targets_d.index_select(0, rows)
            result[0, rows] = z.log_softmax(-1).gather(1, t[:, None])[:, 0].double()
            result[1, rows] = (z.argmax(-1) == t).double()
        result = self._sum_over_cp(result).cpu()
        bounds = [0, *lens.cumsum(0).tolist()]
        return [Score(result[0, a:b].tolist(), bool(result[1, a:b].all())) for a, b in zip(bounds, bounds[1:])]
