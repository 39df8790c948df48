"""Global-token loss: every rank sums its token losses and divides by the step's global count.

With ``n`` the number of loss-bearing tokens over all data-parallel ranks, cp ranks and
gradient-accumulation microbatches of a step (counted by the loader)::

    loss_rank = sum_{local valid tokens t} CE(t) / n
    sum over ranks and microbatches of loss_rank = mean CE over the global batch

so gradients are *summed* over ``dp x cp`` (FSDP's division set to 1), never averaged.
Averaging per rank instead would weight a token by 1/(its rank's count): ranks whose shard
holds fewer valid tokens (document ends, masked prompts) would count for more.

The token cross-entropies come from the last hidden states and the output weight, a chunk
of tokens at a time (:func:`chunked_cross_entropy_sum`): the ``(tokens, vocab)`` logits,
in the compute dtype or in fp32, never exist whole, in the forward or in the backward.
Per chunk ``c`` of tokens (``h_c`` ``(n, D)``, ``W`` ``(V, D)``, ``y`` the labels)::

    forward   z_c = h_c W^T (fp32)    lse_c = logsumexp(z_c)    loss += sum_valid (lse_c - z_c[y])
    backward  z_c = h_c W^T again     p_c = exp(z_c - lse_c) - onehot(y), zero where invalid
              dh_c = g p_c W          dW += g p_c^T h_c

Only ``lse`` (``(N,)`` fp32) is kept between forward and backward. Under tensor parallelism
the vocabulary is sharded (``W`` a DTensor ``Shard(0)`` on the tp mesh, rank r holding rows
``[v_r, v_r + V/tp)``) and the chunks are vocabulary-parallel, without gathering logits::

    m = all_reduce_max(max_v z)     lse = log(all_reduce_sum(sum_v exp(z - m))) + m
    z[y] = all_reduce_sum(z[y] where y is in this rank's rows, else 0)
    backward: p_c on this rank's rows only; dW_r = g p_c^T h_c; dh_c = g p_c W_r is a partial
              sum over the tp ranks (the dual of the input all-gather: a reduce-scatter)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

IGNORE_INDEX = -100
LOSS_CHUNK_BYTES = 128 * 2**20  # fp32 logits of one chunk of tokens (per tp rank)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy over tokens whose label is not ``IGNORE_INDEX``, in fp32.

    logits: (batch, seq, vocab) (a vocab-sharded DTensor under loss parallel); labels: (batch, seq).
    """
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def _chunk_lse_and_target(z_nV: Tensor, labels_n: Tensor, vocab_start: int, group) -> tuple[Tensor, Tensor]:
    """``(lse, target logit)`` per token of fp32 logits ``z`` (this rank's vocabulary rows); ``z`` is overwritten."""
    vocab_local = z_nV.shape[1]
    index = labels_n - vocab_start
    mine = (index >= 0) & (index < vocab_local) & (labels_n != IGNORE_INDEX)
    target = z_nV.gather(1, index.clamp(0, vocab_local - 1)[:, None]).squeeze(1).where(mine, 0.0)
    m = z_nV.amax(1)
    if group is not None:
        dist.all_reduce(m, dist.ReduceOp.MAX, group=group)
    m = m.where(m.isfinite(), 0.0)
    sumexp = z_nV.sub_(m[:, None]).exp_().sum(1)
    if group is not None:
        both = torch.stack((sumexp, target))
        dist.all_reduce(both, group=group)
        sumexp, target = both[0], both[1]
    return sumexp.log() + m, target


class _ChunkedCrossEntropy(torch.autograd.Function):
    """``sum over valid tokens of CE(h W^T, y)``; see the module docstring. h ``(N, D)``, W ``(V_local, D)``."""

    @staticmethod
    def forward(ctx, h_ND, w_VD, labels_N, chunk, vocab_start, group):
        lse_N = torch.empty(h_ND.shape[0], dtype=torch.float32, device=h_ND.device)
        total = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        for s in range(0, h_ND.shape[0], chunk):
            e = min(s + chunk, h_ND.shape[0])
            z = torch.mm(h_ND[s:e], w_VD.t()).float()
            lse, target = _chunk_lse_and_target(z, labels_N[s:e], vocab_start, group)
            del z
            lse_N[s:e] = lse
            total += (lse - target).where(labels_N[s:e] != IGNORE_INDEX, 0.0).sum()
        ctx.save_for_backward(h_ND, w_VD, labels_N, lse_N)
        ctx.chunk, ctx.vocab_start = chunk, vocab_start
        return total

    @staticmethod
    def backward(ctx, g):
        h_ND, w_VD, labels_N, lse_N = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        vocab_local = w_VD.shape[0]
        dh_ND = torch.empty_like(h_ND) if need_h else None
        dw_VD = torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device) if need_w else None
        g = g.float()
        for s in range(0, h_ND.shape[0], ctx.chunk):
            e = min(s + ctx.chunk, h_ND.shape[0])
            h_c, y = h_ND[s:e], labels_N[s:e]
            p = torch.mm(h_c, w_VD.t()).float().sub_(lse_N[s:e, None]).exp_()  # softmax of the chunk
            index = y - ctx.vocab_start
            mine = (index >= 0) & (index < vocab_local) & (y != IGNORE_INDEX)
            p.scatter_add_(1, index.clamp(0, vocab_local - 1)[:, None], -mine.to(p.dtype)[:, None])
            p.mul_(((y != IGNORE_INDEX).to(p.dtype) * g)[:, None])
            _through_the_head(p.to(h_ND.dtype), h_c, w_VD, dh_ND, dw_VD, s)
            del p
        dw = dw_VD.to(w_VD.dtype) if need_w else None
        return dh_ND, dw, None, None, None, None


def _through_the_head(
    dz_CV: Tensor, h_CD: Tensor, w_VD: Tensor, dh_ND: Tensor | None, dw_VD: Tensor | None, start: int
) -> None:
    """A chunk's logit gradient ``dz`` (rows ``start`` on of ``h``) through ``z = h W^T``: ``dh[rows] = dz W``
    where ``dh`` is wanted, ``dW += dz^T h`` (fp32) where ``dW`` is."""
    if dh_ND is not None:
        torch.mm(dz_CV, w_VD, out=dh_ND[start : start + dz_CV.shape[0]])
    if dw_VD is not None:
        if dz_CV.dtype == torch.float32:
            dw_VD.addmm_(dz_CV.t(), h_CD)
        else:
            dw_VD += torch.mm(dz_CV.t(), h_CD)


def _local_operands(h: Tensor, weight: Tensor, chunk_tokens: int | None, grad: bool):
    """``(h, weight, chunk_tokens, vocab_start, tp group)``: plain local tensors in the autocast dtype.

    A vocabulary-sharded ``weight`` (DTensor ``Shard(0)`` on a 1-D tp mesh) gives this rank's rows,
    where they start and the tp group; ``h``'s gradient is then a partial sum over the shards.
    """
    group, vocab_start = None, 0
    if isinstance(weight, DTensor):
        if weight.device_mesh.ndim != 1 or not weight.placements[0].is_shard(0):
            raise ValueError(
                f"vocabulary-parallel loss needs the output weight Shard(0) on a 1-D mesh, got {weight.placements}"
            )
        _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
        group, vocab_start = weight.device_mesh.get_group(), offset[0]
        weight = weight.to_local()
        if isinstance(h, DTensor):
            h = h.to_local(grad_placements=[Partial()]) if grad else h.to_local()
    device_type = h.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        h, weight = h.to(dtype), weight.to(dtype)
    if chunk_tokens is None:
        chunk_tokens = max(1, LOSS_CHUNK_BYTES // (4 * weight.shape[0]))
    return h, weight, chunk_tokens, vocab_start, group


def chunked_cross_entropy_sum(h: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int | None = None) -> Tensor:
    """``sum over tokens with a label of CE(h @ weight.T, label)``, fp32, computed chunk by chunk.

    h: ``(..., D)`` last hidden states (after the final norm); weight: ``(V, D)`` the output
    projection; labels: ``(...)`` int64, ``IGNORE_INDEX`` where no loss. chunk_tokens: tokens
    per chunk (default: ``LOSS_CHUNK_BYTES`` of fp32 logits). Under autocast the matmuls run
    in the autocast dtype, as ``F.linear`` would. Tensor parallel: ``weight`` a DTensor
    ``Shard(0)`` on a 1-D mesh and ``h`` a DTensor replicated on it (or a plain tensor equal on
    every rank); the result is then the same plain tensor on every rank of the mesh.
    """
    h, weight, chunk_tokens, vocab_start, group = _local_operands(h, weight, chunk_tokens, grad=True)
    device_type = h.device.type
    with torch.autocast(device_type, enabled=False):
        return _ChunkedCrossEntropy.apply(
            h.reshape(-1, h.shape[-1]), weight, labels.reshape(-1), chunk_tokens, vocab_start, group
        )


@torch.no_grad()
def chunked_evaluate(
    h: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int | None = None
) -> tuple[Tensor, Tensor]:
    """``(sum of token CE over tokens with a label, argmax predictions (...))`` without the whole logits.

    Arguments as :func:`chunked_cross_entropy_sum` (no gradient). Under tensor parallelism each
    rank's best vocabulary row and its logit are gathered over the tp ranks, chunk by chunk,
    and the largest wins (the lowest vocabulary index on a tie, as ``argmax``).
    """
    h, weight, chunk_tokens, vocab_start, group = _local_operands(h, weight, chunk_tokens, grad=False)
    device_type = h.device.type
    h_ND, labels_N = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    pred = torch.empty(labels_N.shape, dtype=torch.int64, device=h.device)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    with torch.autocast(device_type, enabled=False):
        for s in range(0, h_ND.shape[0], chunk_tokens):
            e = min(s + chunk_tokens, h_ND.shape[0])
            z = torch.mm(h_ND[s:e], weight.t()).float()
            best, index = z.max(1)
            index = index + vocab_start
            if group is not None:  # (value, row) of every tp rank, ranks in vocabulary order
                n = dist.get_world_size(group)
                both = torch.empty(n, 2, e - s, dtype=torch.float64, device=z.device)
                dist.all_gather_single(
                    both.view(2 * n, e - s), torch.stack((best.double(), index.double())), group=group
                )
                winner = both[:, 0].argmax(0)  # first (lowest rows) of equal maxima
                index = both[:, 1].gather(0, winner[None]).squeeze(0).long()
            pred[s:e] = index
            lse, target = _chunk_lse_and_target(z, labels_N[s:e], vocab_start, group)
            total += (lse - target).where(labels_N[s:e] != IGNORE_INDEX, 0.0).sum()
    return total, pred.view(labels.shape)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """Per token: ``log p(y)`` and (``want_entropy``) the entropy of ``p = softmax(h W^T / T)``, where
    a label is given; see :func:`chunked_token_logprobs`. h ``(N, D)``, W ``(V, D)``, labels ``(N,)``."""

    @staticmethod
    def forward(ctx, h_ND, w_VD, labels_N, inv_t, chunk, want_entropy):
        n, vocab = h_ND.shape[0], w_VD.shape[0]
        valid_N = labels_N != IGNORE_INDEX
        lse_N, logp_N = (torch.zeros(n, dtype=torch.float32, device=h_ND.device) for _ in range(2))
        mean_N = torch.zeros_like(lse_N) if want_entropy else None  # E_p[z]
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = torch.mm(h_ND[s:e], w_VD.t()).float().mul_(inv_t)
            target = z.gather(1, labels_N[s:e].clamp(0, vocab - 1)[:, None]).squeeze(1)
            m = z.amax(1)
            m = m.where(m.isfinite(), 0.0)
            z.sub_(m[:, None])
            if mean_N is None:
                sumexp = z.exp_().sum(1)
            else:
                p = z.exp()
                sumexp = p.sum(1)
                mean_N[s:e] = p.mul_(z).sum(1).div_(sumexp).add_(m)  # sum_v p_v z_v, z shifted back by m
                del p
            del z
            lse_N[s:e] = sumexp.log_().add_(m)
            logp_N[s:e] = (target - lse_N[s:e]).where(valid_N[s:e], 0.0)
        entropy_N = (lse_N - mean_N).where(valid_N, 0.0) if mean_N is not None else lse_N.new_zeros(0)
        ctx.save_for_backward(h_ND, w_VD, labels_N, lse_N, mean_N if mean_N is not None else lse_N.new_zeros(0))
        ctx.inv_t, ctx.chunk, ctx.want_entropy = inv_t, chunk, want_entropy
        if not want_entropy:
            ctx.mark_non_differentiable(entropy_N)
        return logp_N, entropy_N

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        """``dz = g_logp (onehot(y) - p) - g_entropy p (z - E_p[z])`` per valid token, then through
        ``z = h W^T / T``: ``dh = dz W / T``, ``dW = dz^T h / T``."""
        h_ND, w_VD, labels_N, lse_N, mean_N = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        vocab, valid_N = w_VD.shape[0], labels_N != IGNORE_INDEX
        g_logp = (torch.zeros_like(lse_N) if g_logp is None else g_logp.float()).where(valid_N, 0.0)
        with_entropy = ctx.want_entropy and g_entropy is not None
        g_ent = g_entropy.float().where(valid_N, 0.0) if with_entropy else None
        dh_ND = torch.empty_like(h_ND) if need_h else None
        dw_VD = torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device) if need_w else None
        for s in range(0, h_ND.shape[0], ctx.chunk):
            e = min(s + ctx.chunk, h_ND.shape[0])
            h_c = h_ND[s:e]
            z = torch.mm(h_c, w_VD.t()).float().mul_(ctx.inv_t)
            if g_ent is None:
                dz = z.sub_(lse_N[s:e, None]).exp_().mul_(-g_logp[s:e, None])
            else:
                dz = (z - lse_N[s:e, None]).exp_()  # p
                dz.mul_(z.sub_(mean_N[s:e, None]).mul_(-g_ent[s:e, None]).sub_(g_logp[s:e, None]))
            del z
            dz.scatter_add_(1, labels_N[s:e].clamp(0, vocab - 1)[:, None], g_logp[s:e, None])
            _through_the_head(dz.mul_(ctx.inv_t).to(h_ND.dtype), h_c, w_VD, dh_ND, dw_VD, s)
            del dz
        dw = dw_VD.to(w_VD.dtype) if need_w else None
        return dh_ND, dw, None, None, None, None


def chunked_token_logprobs(
    h: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_tokens: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``(log p(label), entropy)`` of every token of ``softmax(h @ weight.T / temperature)``, fp32,
    computed chunk by chunk: the ``(tokens x vocab)`` logits never exist whole. Per chunk ``c``::

        z_c = h_c W^T / T    lse_c = logsumexp(z_c)    logp = z_c[y] - lse_c
        entropy = lse_c - sum_v p_v z_v   (p = exp(z_c - lse_c))

    Only ``lse`` (and ``E_p[z]`` for the entropy) is kept for the backward, which recomputes each
    chunk's logits; both outputs have gradients (the entropy's: ``-p (z - E_p[z])``).

    h: ``(..., D)`` last hidden states; weight: ``(V, D)`` the output projection (a plain tensor: the
    vocabulary is not split); labels: ``(...)`` int64 token ids, ``IGNORE_INDEX`` where no log-prob is
    wanted (both outputs 0 there). Returns tensors of ``labels``' shape; the entropy ``None`` unless
    ``entropy``. chunk_tokens: as :func:`chunked_cross_entropy_sum`. Under autocast the matmuls run
    in the autocast dtype, as ``F.linear`` would.
    """
    if isinstance(weight, DTensor):
        raise ValueError(
            "chunked_token_logprobs takes the output weight whole (a plain tensor); a vocabulary-sharded "
            f"DTensor ({weight.placements}) is not supported: gather it (weight.full_tensor()) first"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (the logits are divided by it), got {temperature}")
    h, weight, chunk_tokens, _, _ = _local_operands(h, weight, chunk_tokens, grad=True)
    with torch.autocast(h.device.type, enabled=False):
        logp, ent = _ChunkedTokenLogprobs.apply(
            h.reshape(-1, h.shape[-1]), weight, labels.reshape(-1), 1.0 / temperature, chunk_tokens, entropy
        )
    return logp.view(labels.shape), ent.view(labels.shape) if entropy else None


class GlobalTokenLoss:
    """``loss_fn(output, labels) = token CE sum / global_valid_tokens``; set the count every step.

    ``output`` is what the model (or the last pipeline stage) returned: the summed token
    cross-entropy when it was called with ``labels`` (a 0-dim tensor, computed chunk by chunk
    inside the output projection), or logits ``(batch, seq, vocab)``. One object serves a
    pipeline schedule (whose ``loss_fn`` is fixed when it is built) and the plain step alike.
    """

    def __init__(self) -> None:
        self.global_valid_tokens: int | None = None

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if not self.global_valid_tokens:
            raise ValueError("GlobalTokenLoss.global_valid_tokens must be set to the step's positive token count")
        loss_sum = output if output.ndim == 0 else token_loss_sum(output, labels)
        return loss_sum / self.global_valid_tokens
