"""Per-token log-probs of a Hugging Face causal LM under CP, without the logits: ``cp.token_logprobs``.

::

    cp = apply_cp(model, cp_mesh)                      # model loaded with attn_implementation="titan_cp"
    out = cp.token_logprobs(model, batch, temperature=0.9, entropy=True, gather=True)
    out.logprobs   # (B, S): log p(labels[b, t] | tokens before t in its document), 0 where labels is -100

What runs, on each cp rank::

    local      cp.shard(batch): this rank's tokens by the layout, targets shifted inside each document
    h          the model's forward (through its wrapper: DDP's hooks fire), the decoder's last hidden
               states caught by a forward hook, (B, S_local, D); the head computes one token's logits
    logp, H    titan_cp.loss.chunked_token_logprobs(h, head.weight, targets, T): a chunk of tokens at
               a time, fp32; the (tokens x vocabulary) logits never exist
    gather     (asked for) every rank's (B, S_local) all-gathered and put in token order, moved one
               place on to sit at the target's own position; backward: the gradient all-reduced over
               the cp ranks, this rank's tokens kept (the dual of the all-gather, a reduce-scatter)

The model must have a plain head (``logits = lm_head(hidden)``, a bias-free ``nn.Linear``:
:func:`.hf_model.plain_head`); families that rescale or soft-cap their logits are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from titan_cp.attention.handle import CPHandle, TokenLogprobs, register_scorer
from titan_cp.integrations.hf_model import hf_model_of, plain_head
from titan_cp.loss import IGNORE_INDEX, chunked_token_logprobs


def _inner(model: nn.Module) -> nn.Module:
    """The model a ``DistributedDataParallel`` (or FSDP1-style ``.module``) wrapper holds, else itself."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def scoring_head(model: nn.Module) -> nn.Linear:
    """The output head of ``model`` (a Hugging Face causal LM, possibly wrapped by DDP) that
    :func:`hf_token_logprobs` reads; ``ValueError`` naming the model when its logits are not the head's."""
    head = plain_head(hf_model_of(_inner(model)))
    if head is None:
        raise ValueError(
            f"{type(_inner(model)).__name__}: titan_cp's per-token log-probs read the hidden states and a plain "
            "output head (logits = lm_head(hidden), a bias-free Linear); this family's forward changes the logits "
            "(scaling or soft-capping), so they are not computed under CP"
        )
    return head


class _GatherTokens(torch.autograd.Function):
    """This rank's ``(B, S_local)`` in layout order -> every token ``(B, S)`` in natural order, on every
    cp rank. Backward: the gradient all-reduced over the cp ranks, this rank's tokens kept."""

    @staticmethod
    def forward(ctx, x: Tensor, cp: CPHandle, doc_lens: Tensor | None) -> Tensor:
        ctx.cp, ctx.doc_lens = cp, doc_lens
        return cp.unshard(x, doc_lens, 1)

    @staticmethod
    def backward(ctx, g: Tensor):
        cp: CPHandle = ctx.cp
        g = g.contiguous().clone()
        if cp.group is not None:
            dist.all_reduce(g, group=cp.group)
        layout = cp.find(g.shape[1], ctx.doc_lens)
        return layout.shard(g, 1, cp.rank), None, None


def _to_targets(x: Tensor, seq: int, first: int = 0) -> Tensor:
    """Natural-order values of next-token targets ``(B, S_padded)`` moved one place on, to the
    target's own position, and cut to the batch's ``seq`` tokens (``first`` at token 0; a later
    document's first token gets the value of the one before it, whose target is -100: 0)."""
    return torch.cat([x.new_full((x.shape[0], 1), first), x[:, : seq - 1]], 1)


def hf_token_logprobs(
    cp: CPHandle,
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    gather: bool = False,
    **options: Any,
) -> TokenLogprobs:
    """:meth:`CPHandle.token_logprobs` for Hugging Face causal LMs (module docstring). ``batch``: a
    Hugging Face batch (:func:`.hf_batch.shard_batch`'s keys, with ``labels`` or ``shift_labels``
    naming the targets), or what ``cp.shard`` returned for one; ``options`` go to ``cp.shard``
    (``pad_token_id`` defaults to 0: the padding is a document of its own, any token is exact)."""
    head = scoring_head(model)
    if "cp_doc_lens" in batch:
        local, seq = dict(batch), None
    else:
        local = cp.shard(batch, **{"pad_token_id": 0, **options})
        seq = torch.as_tensor(batch["input_ids"]).shape[1]
    if local.get("shift_labels") is None:
        raise ValueError("token_logprobs needs the tokens to score: give the batch labels (or shift_labels)")
    targets = local["shift_labels"]
    caught: dict[str, Tensor] = {}
    decoder = hf_model_of(_inner(model)).get_decoder()
    hook = decoder.register_forward_hook(lambda m, a, out: caught.update(h=out.last_hidden_state))
    try:
        model(
            input_ids=local["input_ids"],
            position_ids=local["position_ids"],
            cp_doc_lens=local["cp_doc_lens"],
            use_cache=False,
            logits_to_keep=1,
        )
    finally:
        hook.remove()
    logp, ent = chunked_token_logprobs(caught["h"], head.weight, targets, temperature, entropy)
    if not gather:
        return TokenLogprobs(logp, targets, ent)
    doc_lens = local["cp_doc_lens"]
    full = _GatherTokens.apply(logp, cp, doc_lens)
    seq = full.shape[1] if seq is None else seq
    labels = _to_targets(cp.unshard(targets, doc_lens, 1), seq, IGNORE_INDEX)
    ent_full = None if ent is None else _to_targets(_GatherTokens.apply(ent, cp, doc_lens), seq)
    return TokenLogprobs(_to_targets(full, seq), labels, ent_full)


register_scorer(nn.Module, hf_token_logprobs)
