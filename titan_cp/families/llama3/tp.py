"""Tensor parallelism (Megatron-style) with sequence parallelism, via ``parallelize_module``.

Per block, on the ``tp`` mesh axis (n = tp degree; x_s a sequence shard, x the full sequence):

  attention_norm, ffn_norm   SequenceParallel          x_s -> norm(x_s)
  attention, feed_forward    PrepareModuleInput        all_gather over sequence: x_s -> x
  wq, wk, wv, w1, w3         ColwiseParallel           y_n = x @ w_n.T   (heads / hidden split)
  wo, w2                     RowwiseParallel(Shard(1)) y_s = reduce_scatter(y_n @ w_n.T)

and in the backward each collective is replaced by its dual (the all-gather's backward is a
reduce-scatter and vice versa). The extra block inputs ``cos, sin, doc_lens`` are per-token
plain tensors for the *full* local sequence and are passed through unchanged (layout None).

The output projection is column-parallel over the vocabulary (``VocabParallelOutput``):
called with labels it returns the loss computed vocabulary-parallel chunk by chunk, no
logits gathered (``titan_cp.loss``); called without, logits ``Shard(-1)`` (loss parallel)
or gathered.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titan_cp.families.llama3.model import Transformer


class VocabParallelOutput(ColwiseParallel):
    """``ColwiseParallel`` for ``Output`` (weight ``Shard(0)``: rows of the vocabulary) that
    passes ``labels`` through: ``output(h, labels)`` returns the summed token cross-entropy, a
    plain tensor equal on every tp rank; ``output(h)`` returns logits in ``output_layouts``."""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        h = ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs[:1], device_mesh)
        return (h, *inputs[1:])

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if not isinstance(outputs, DTensor):  # the loss
            return outputs
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


def apply_tp(
    model: Transformer, tp_mesh: DeviceMesh, loss_parallel: bool = False, sequence_parallel: bool = True
) -> None:
    """Shard ``model`` in place over the 1-D ``tp_mesh``.

    loss_parallel: logits (``model(tokens)`` without labels) stay a DTensor sharded over the
        vocabulary (``Shard(-1)``), for ``torch.distributed.tensor.parallel.loss_parallel()``;
        otherwise they are gathered to a plain replicated tensor. The training loss
        (``model(tokens, labels=...)``) is vocabulary-parallel either way.
    sequence_parallel: activations between blocks (and the norms) are sharded over the
        sequence dim; otherwise they are replicated and the norms are not parallelised.
    Works on a pipeline stage (parts deleted as None are skipped).
    """
    tp = tp_mesh.size()
    args = model.args
    for name, count in (("model.n_heads", args.n_heads), ("model.n_kv_heads", args.kv_heads)):
        if count % tp != 0:
            raise ValueError(f"{name}={count} is not divisible by parallelism.tensor_parallel_degree={tp}")
    seq = Shard(1) if sequence_parallel else Replicate()

    root_plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        root_plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None and sequence_parallel:
        root_plan["norm"] = SequenceParallel()
    if model.output is not None:
        root_plan["output"] = VocabParallelOutput(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)

    for block in model.layers.values():
        plan: dict[str, ParallelStyle] = {
            # block inputs besides x: cos, sin (B, S, E/2) and doc_lens, left as they are
            "attention": PrepareModuleInput(
                input_layouts=(seq, None, None, None),
                desired_input_layouts=(Replicate(), None, None, None),
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)
        inner = block.get_submodule("attention.inner_attention")
        sinks = getattr(inner, "sinks", None)
        if sinks is not None:  # one logit per head: split like wq's heads
            inner.sinks = nn.Parameter(distribute_tensor(sinks, tp_mesh, [Shard(0)]))
