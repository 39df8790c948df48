"""Context parallelism inside ``transformers.Trainer`` and TRL's ``SFTTrainer`` and ``GRPOTrainer``: a class factory.

::

    Trainer = context_parallel_trainer(SFTTrainer, cp_size=2, strategy="ring")   # or transformers.Trainer
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="titan_cp")
    trainer = Trainer(model=model, args=SFTConfig(packing=True, padding_free=True, ...), train_dataset=ds)

The subclass keeps the Trainer's own loop (its DDP, sampler, gradient accumulation, clipping, LR
schedule, logging, checkpoints) and changes what context parallelism needs:

- the mesh: ``(dp, cp)`` over the world (``cp = cp_size``, ``dp = world / cp``, cp innermost: the
  ranks of a cp group are consecutive), built when the trainer is; :func:`apply_cp` binds the
  model to its cp mesh (2-D ``(cp_ring, cp_ulysses)`` for ``"hybrid"``) and returns the handle
  (``trainer.cp``) each micro-batch is sharded with;
- the data: the Trainer's sampler and ``accelerate``'s dataloader preparation spread rows over the
  dp ranks only (``accelerate`` is handed a mesh with a ``cp`` dimension, as for its own CP), so
  every rank of a cp group reads the same rows; ``cp.shard`` checks that they do;
- the loss: ``compute_loss`` shards each micro-batch by the layout (``cp.shard``: labels
  shifted inside each document first), and scales this rank's summed cross-entropy so that the
  gradients DDP averages over the world are one process's: ``sum_local CE x W / N`` where ``N``
  is the step's loss-bearing tokens over every micro-batch and dp rank
  (``average_tokens_across_devices``), or ``sum_local CE x cp / N_group`` when it is off (each
  dp group's mean, averaged over the dp groups, as the stock Trainer does without CP);
- evaluation and prediction: each batch's loss is its cp group's summed CE over its tokens; the
  reported ``eval_loss`` is the whole set's mean over its loss-bearing tokens (every batch once,
  the last partial batch included: the samples ``accelerate`` repeats to even the dp ranks out
  carry no loss); logits are gathered over the cp group and put back in token order, and
  predictions are gathered over the dp ranks only.

The private ``Trainer`` and ``accelerate`` parts this relies on are all in :mod:`.hf_compat`, checked
against the versions it pins. For TRL's ``GRPOTrainer`` a mixin of its own (:mod:`.grpo`) comes first:
rollouts, rewards, log-probs and the loss as TRL computes them, under the CP layout.

What it refuses (``ValueError`` naming the argument): more processes launched than ``accelerate``
runs together (torchrun on a CPU without ``use_cpu=True``: each would train alone), a world the cp
size does not divide, label
smoothing and ``compute_loss_func`` (they would shift the already shifted labels), the
``batch_rebalance`` sampler (it spreads over every rank), ``model_init`` (the model is bound once).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from titan_cp.ac_modes import AC_MODES
from titan_cp.attention.handle import CPHandle
from titan_cp.attention.strategy import DEFAULT_STRATEGY, get_strategy
from titan_cp.balance import balance_names
from titan_cp.errors import plural
from titan_cp.integrations.grpo import GRPOMixin, check_grpo_hooks, is_grpo
from titan_cp.integrations.hf_batch import count_loss_tokens
from titan_cp.integrations.hf_compat import TrainerHooks, accelerate_device_mesh, check_trainer_hooks, mark_sharded
from titan_cp.layout import DEFAULT_BALANCE
from titan_cp.loss import IGNORE_INDEX
from titan_cp.parallel import apply_ac, apply_cp, apply_fsdp
from titan_cp.parallel.tiled_mlp import apply_tiled_mlp

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils.data import DataLoader
    from transformers.trainer_utils import EvalLoopOutput

SAMPLE_LENS = "titan_cp_sample_lens"  # the eval collator's per-sample token counts (dropped before the model)


@dataclass(frozen=True, kw_only=True)
class CPOptions:
    """What :func:`context_parallel_trainer` was asked for (see its arguments)."""

    cp_size: int
    strategy: str = DEFAULT_STRATEGY
    balance: str = DEFAULT_BALANCE
    ulysses_degree: int = 1
    activation_checkpointing: str = "none"
    kernel: str | None = None
    fsdp: bool = False
    chunked_loss: bool = False
    cpu_offload: bool = False
    blocks_per_checkpoint: int = 1
    tile_tokens: int = 0


def _check_options(o: CPOptions) -> None:
    if not isinstance(o.cp_size, int) or o.cp_size < 1:
        raise ValueError(f"context_parallel_trainer(cp_size={o.cp_size!r}): a positive integer")
    strategy = get_strategy(o.strategy)
    if o.balance not in balance_names():
        raise ValueError(f"context_parallel_trainer(balance={o.balance!r}): one of {balance_names()}")
    if strategy.takes_ulysses_degree():
        if o.ulysses_degree < 2 or o.cp_size % o.ulysses_degree or o.cp_size == o.ulysses_degree:
            raise ValueError(
                f"context_parallel_trainer(strategy='hybrid', ulysses_degree={o.ulysses_degree}): a divisor of "
                f"cp_size={o.cp_size} between 2 and cp_size / 2 (Ulysses inside a ring of at least 2)"
            )
    elif o.ulysses_degree != 1:
        raise ValueError(
            f"context_parallel_trainer(ulysses_degree={o.ulysses_degree}) is for strategy='hybrid' (got "
            f"strategy={o.strategy!r}); with 'ulysses' every cp rank splits the heads"
        )
    if o.activation_checkpointing not in AC_MODES:
        raise ValueError(
            f"context_parallel_trainer(activation_checkpointing={o.activation_checkpointing!r}): one of {AC_MODES}"
        )
    if (o.cpu_offload or o.blocks_per_checkpoint != 1) and o.activation_checkpointing == "none":
        raise ValueError(
            "context_parallel_trainer(cpu_offload=, blocks_per_checkpoint=) shape titan_cp's activation "
            "checkpointing: set activation_checkpointing='full' (the Trainer's gradient_checkpointing has neither)"
        )


def context_parallel_trainer(
    trainer_class: type,
    *,
    cp_size: int,
    strategy: str = DEFAULT_STRATEGY,
    balance: str = DEFAULT_BALANCE,
    ulysses_degree: int = 1,
    activation_checkpointing: str = "none",
    kernel: str | None = None,
    fsdp: bool = False,
    chunked_loss: bool = False,
    cpu_offload: bool = False,
    blocks_per_checkpoint: int = 1,
    tile_tokens: int = 0,
) -> type:
    """A subclass of ``trainer_class`` (``transformers.Trainer`` or a subclass: TRL's ``SFTTrainer``, TRL's
    ``GRPOTrainer``: :mod:`.grpo`) that trains its model under context parallelism (module docstring).

    Args:
        trainer_class: the Trainer class to extend.
        cp_size: ranks per cp group; the world size must be a multiple (the rest is data parallel).
        strategy: ``"ring"``, ``"allgather"``, ``"ulysses"`` or ``"hybrid"`` (Ulysses inside a ring).
        balance: the sequence layout (``"doc_local"``, ``"doc_zigzag"``, ``"zigzag"``, ``"contiguous"``).
        ulysses_degree: Ulysses ranks per ring step, for ``"hybrid"`` only.
        activation_checkpointing: titan_cp's checkpointing of the decoder layers (``"full"``,
            ``"selective"``, ``"op"``: matmul and CP-attention outputs saved) or ``"none"``; the
            Trainer's own ``gradient_checkpointing`` works as well.
        cpu_offload, blocks_per_checkpoint: with ``activation_checkpointing``, the checkpointed layer
            inputs in host memory and layers per checkpoint unit (:func:`titan_cp.parallel.apply_ac`).
        tile_tokens: each layer's MLP over tiles of this many local tokens (0: off;
            :func:`titan_cp.parallel.tiled_mlp.apply_tiled_mlp`).
        kernel: the local attention kernel (``None``: the fastest for the device and dtype).
        fsdp: shard the weights with FSDP2 over all ``dp x cp`` ranks (titan_cp's ``apply_fsdp``: one
            unit per decoder layer) instead of the Trainer's DDP; checkpoints then hold the model
            only (``save_only_model=True``), and ``save_model`` gathers the whole weights.
        chunked_loss: in training, the loss from the last hidden states and the head's weight a chunk
            of tokens at a time (``titan_cp.loss.chunked_cross_entropy_sum``): the ``(tokens x
            vocabulary)`` logits never exist. For ``transformers.Trainer`` with DDP and a plain head
            (TRL's ``SFTTrainer`` computes its loss with its own fused head already).
    """
    from transformers import Trainer  # noqa: PLC0415 - optional dependency

    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise ValueError(f"context_parallel_trainer takes a transformers.Trainer subclass, got {trainer_class!r}")
    rl = is_grpo(trainer_class)
    (check_grpo_hooks if rl else check_trainer_hooks)(trainer_class)
    options = CPOptions(
        cp_size=cp_size,
        strategy=strategy,
        balance=balance,
        ulysses_degree=ulysses_degree,
        activation_checkpointing=activation_checkpointing,
        kernel=kernel,
        fsdp=bool(fsdp),
        chunked_loss=bool(chunked_loss),
        cpu_offload=bool(cpu_offload),
        blocks_per_checkpoint=blocks_per_checkpoint,
        tile_tokens=tile_tokens,
    )
    _check_options(options)
    if chunked_loss and (fsdp or any(c.__name__ == "SFTTrainer" for c in trainer_class.__mro__)):
        raise ValueError(
            "context_parallel_trainer(chunked_loss=True) is for transformers.Trainer with DDP: "
            f"{trainer_class.__name__} with fsdp={fsdp} computes its loss another way (SFTTrainer: its own fused "
            "head; FSDP: the head's weight is sharded outside the forward); drop chunked_loss"
        )
    if rl and (chunked_loss or fsdp):
        raise ValueError(
            f"context_parallel_trainer({trainer_class.__name__}, chunked_loss={chunked_loss}, fsdp={fsdp}): GRPO "
            "computes its log-probs chunked over the vocabulary already, from the head's weight outside the "
            "forward (which FSDP shards there); drop chunked_loss and fsdp"
        )
    name = f"ContextParallel{trainer_class.__name__}"
    bases = (GRPOMixin, ContextParallelMixin, trainer_class) if rl else (ContextParallelMixin, trainer_class)
    return type(name, bases, {"cp_options": options, "__module__": __name__})


@dataclass
class _EvalTally:
    """One evaluation's running sums on this rank: summed CE and loss-bearing tokens of its shards."""

    steps: int
    last_real: int | None  # real samples in this rank's last batch (None: every sample is real)
    step: int = 0
    ce_sum: float = 0.0
    tokens: int = 0
    masked: torch.Tensor | None = None  # the last batch's labels, -100 on the repeated samples


class ContextParallelMixin(TrainerHooks):
    """The methods :func:`context_parallel_trainer` puts before the Trainer's (module docstring); the
    private Trainer hooks it changes are :class:`.hf_compat.TrainerHooks`, which call its ``cp_*`` methods."""

    cp_options: CPOptions  # set on the subclass by context_parallel_trainer
    loss_is_scaled_for_ga = True  # compute_loss divides by the step's count, over every micro-batch
    # set by _cp_build_meshes / _cp_bind, before the Trainer's own __init__
    cp_size: int
    dp_size: int
    data_mesh: DeviceMesh | None  # (dp_replicate, cp) over the world; None on one process
    cp_mesh: DeviceMesh | None
    cp: CPHandle  # what apply_cp returned: the model runs by it and each micro-batch is sharded with it
    dp_group: dist.ProcessGroup | None
    cp_pad_token_id: int
    cp_head: nn.Linear | None  # the head the chunked loss reads (chunked_loss=True)

    def __init__(self, model: nn.Module | None = None, args: Any = None, *rest: Any, **kwargs: Any) -> None:
        if model is None or kwargs.get("model_init") is not None:
            raise ValueError(
                f"{type(self).__name__} needs model= (a model loaded with attn_implementation='titan_cp'); "
                "model_init is not supported: the model is bound to the cp mesh once"
            )
        if args is None:
            raise ValueError(f"{type(self).__name__} needs args= (TrainingArguments or SFTConfig)")
        self._cp_setup(model, args)
        super().__init__(model, args, *rest, **kwargs)
        self._cp_after_init()

    def _cp_setup(self, model: nn.Module, args: Any) -> None:
        """Before the Trainer's own ``__init__``: the arguments checked, the meshes built, the model bound."""
        _check_args(args, self.cp_options)
        _check_launch(args, type(self).__name__)
        self._cp_build_meshes(args.device.type)
        self._cp_bind(model)
        self._cp_eval: _EvalTally | None = None

    def _cp_host(self) -> Any:
        """The Trainer class's own methods (the class after this mixin's hooks in the MRO), for a mixin
        put before this one (:class:`.grpo.GRPOMixin`)."""
        return super()

    def _cp_after_init(self) -> None:
        """After the Trainer's own ``__init__``: what it must not have set up."""
        if getattr(self.accelerator, "parallelism_config", None) is not None:
            raise ValueError(
                f"{type(self).__name__} builds its own (dp, cp) mesh: drop accelerate's parallelism_config "
                "(TrainingArguments.parallelism_config / ACCELERATE_* parallelism settings)"
            )
        if self.compute_loss_func is not None:
            raise ValueError(
                f"{type(self).__name__} got compute_loss_func: under context parallelism the loss is the model's "
                "own on shifted, sharded labels; drop compute_loss_func"
            )

    # ---- mesh and model ---------------------------------------------------------------------------

    def _cp_build_meshes(self, device_type: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

        o = self.cp_options
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world % o.cp_size:
            raise ValueError(
                f"context_parallel_trainer(cp_size={o.cp_size}): the world has {plural(world, 'rank')}, not a multiple of "
                "cp_size; launch a multiple of it (torchrun --nproc-per-node, accelerate launch --num_processes)"
            )
        self.cp_size, self.dp_size = o.cp_size, world // o.cp_size
        if world == 1:
            self.data_mesh, self.cp_mesh, self.dp_group = None, None, None
            return
        # accelerate's dataloader preparation gives the ranks of a "cp" dimension the same rows
        self.data_mesh = init_device_mesh(device_type, (self.dp_size, o.cp_size), mesh_dim_names=("dp_replicate", "cp"))
        self.dp_group = self.data_mesh["dp_replicate"].get_group()
        self.cp_mesh = self.data_mesh["cp"] if o.cp_size > 1 else None
        axes = get_strategy(o.strategy).mesh_dims(o.cp_size, o.ulysses_degree)
        if len(axes) > 1:  # e.g. hybrid: (cp_ring, cp_ulysses)
            names, sizes = zip(*axes)
            full = init_device_mesh(device_type, (self.dp_size, *sizes), mesh_dim_names=("dp_replicate", *names))
            self.cp_mesh = full[names]

    def _cp_bind(self, model: nn.Module) -> None:
        o = self.cp_options
        self.cp = apply_cp(model, self.cp_mesh, strategy=o.strategy, balance=o.balance, kernel=o.kernel)
        apply_tiled_mlp(model, o.tile_tokens)
        apply_ac(
            model, o.activation_checkpointing, cpu_offload=o.cpu_offload, blocks_per_checkpoint=o.blocks_per_checkpoint
        )
        self.cp_pad_token_id = _pad_token_id(model)
        self.cp_head = None
        if o.chunked_loss:
            from titan_cp.integrations.hf_model import plain_head  # noqa: PLC0415

            self.cp_head = plain_head(model)
            if self.cp_head is None:
                raise ValueError(
                    f"context_parallel_trainer(chunked_loss=True): {type(model).__name__}'s forward does more than "
                    "logits = lm_head(hidden) (or its head is not a bias-free Linear); drop chunked_loss"
                )
        if o.fsdp and self.data_mesh is not None:
            _shard(model, self.data_mesh)

    def cp_state_dict_to_save(self) -> dict | None:
        """Under FSDP, the whole weights gathered on every rank (PyTorch's ``get_model_state_dict``), which
        the main process writes with ``save_pretrained``; otherwise ``None`` (the Trainer's own)."""
        if not self.cp_options.fsdp or self.data_mesh is None:
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: PLC0415

        assert self.model is not None  # __init__ refuses model=None and model_init
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))

    def get_cp_size(self) -> int:
        """The Trainer's own hook: its batch-size and step arithmetic counts dp ranks as ``world / cp``."""
        return self.cp_size

    # ---- data ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def cp_dataloader(self, training: bool) -> Iterator[None]:
        """While the Trainer builds a dataloader: ``accelerate`` prepares it for the ``(dp_replicate, cp)``
        mesh (rank ``r`` reads the rows of data rank ``r // cp`` of ``world / cp``), and an evaluation
        one carries each sample's token count."""
        with accelerate_device_mesh(self.accelerator, self.data_mesh), self._cp_eval_collator(not training):
            yield

    @contextlib.contextmanager
    def _cp_eval_collator(self, on: bool) -> Iterator[None]:
        """Evaluation batches carry each sample's token count (:data:`SAMPLE_LENS`), so that the samples
        ``accelerate`` repeats to even out the last batch can be told apart."""
        collate = self.data_collator
        if on:
            self.data_collator = _WithSampleLens(collate)
        try:
            yield
        finally:
            self.data_collator = collate

    def cp_num_items_in_batch(self, batch_samples: list, device: torch.device | None) -> torch.Tensor | None:
        """The step's loss-bearing tokens (labels shifted inside each document, as ``shard_batch``
        counts them) over its micro-batches, summed over the dp ranks when
        ``average_tokens_across_devices`` (never over cp ranks: they hold the same rows)."""
        if not batch_samples or not any(k in batch_samples[0] for k in ("labels", "shift_labels")):
            return None
        n = sum(count_loss_tokens(_model_keys(b)) for b in batch_samples)
        if self.args.average_tokens_across_devices and self.dp_size > 1:
            t = torch.tensor(n, dtype=torch.int64, device=_collective_device(self.dp_group))
            dist.all_reduce(t, group=self.dp_group)
            n = int(t)
        return torch.tensor(n, dtype=torch.int64, device=device)

    def cp_track_input_tokens(self, inputs: dict[str, Any], track: Callable[[dict[str, Any]], None]) -> None:
        """The Trainer's count (``track``), gathered over every rank, holds each cp group's rows ``cp`` times."""
        before = self.state.num_input_tokens_seen
        track(_model_keys(inputs))
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // self.cp_size

    # ---- the loss -----------------------------------------------------------------------------

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """This rank's share of the step's loss (module docstring); in evaluation, the batch's mean
        over its loss-bearing tokens, the same on every rank of the cp group."""
        inputs = dict(inputs)
        sample_lens = inputs.pop(SAMPLE_LENS, None)
        training = model.training
        if not training:
            inputs = self._cp_mask_repeated(inputs, sample_lens)
        seq = inputs["input_ids"].shape[1]
        group_tokens = count_loss_tokens(inputs)
        if training and num_items_in_batch is None:
            num_items_in_batch = self.cp_num_items_in_batch([inputs], self.args.device)
        if not training:
            step_tokens = max(group_tokens, 1)
        elif num_items_in_batch is None:
            raise ValueError(
                f"{type(self).__name__} got a training batch without labels (or shift_labels): nothing to train "
                "on; give the collator's batches labels"
            )
        else:
            step_tokens = int(num_items_in_batch)
        local = self.cp.shard(
            inputs,
            num_items_in_batch=step_tokens,
            pad_token_id=self.cp_pad_token_id,
            device=self.args.device,
        )
        mine = int((local["shift_labels"] != IGNORE_INDEX).sum())
        local["num_items_in_batch"] = torch.tensor(max(mine, 1), dtype=torch.int64, device=self.args.device)
        outputs: Any = None
        if training and self.cp_head is not None:
            loss = self._cp_chunked_loss(model, self.cp_head, local, mine)
        else:
            result = super().compute_loss(model, local, return_outputs=return_outputs, num_items_in_batch=None)
            loss, outputs = result if isinstance(result, tuple) else (result, None)
        ce_sum = loss * max(mine, 1) if mine else loss * 0.0  # this rank's summed CE (the model divided by it)
        if training:
            scale = self.accelerator.num_processes if self.args.average_tokens_across_devices else self.cp_size
            loss = ce_sum * (scale / step_tokens)
        else:
            loss = self._cp_eval_loss(ce_sum.detach(), mine, group_tokens)
            if outputs is not None and getattr(outputs, "logits", None) is not None:
                outputs["logits"] = self.cp.unshard(outputs.logits, local["cp_doc_lens"])[:, :seq]
        return (loss, outputs) if return_outputs else loss

    def _cp_chunked_loss(self, model: nn.Module, head: nn.Linear, local: dict, mine: int) -> torch.Tensor:
        """This rank's summed CE over ``max(mine, 1)``, as the model's loss would be, from the decoder's
        last hidden states (caught by a forward hook while the model runs with no logits kept) and
        the head's weight, a chunk of tokens at a time."""
        from titan_cp.integrations.hf_model import hf_model_of  # noqa: PLC0415
        from titan_cp.loss import chunked_cross_entropy_sum  # noqa: PLC0415

        caught: dict[str, torch.Tensor] = {}
        labels = local.pop("shift_labels")
        for key in ("labels", "num_items_in_batch"):
            local.pop(key)
        assert self.model is not None  # __init__ refuses model=None and model_init
        hook = (
            hf_model_of(self.model)
            .get_decoder()
            .register_forward_hook(lambda m, a, out: caught.update(h=out.last_hidden_state))
        )
        try:
            model(**local, logits_to_keep=torch.zeros(labels.shape, dtype=torch.bool, device=labels.device))
        finally:
            hook.remove()
        return chunked_cross_entropy_sum(caught["h"], head.weight, labels) / max(mine, 1)

    def _cp_eval_loss(self, ce_sum: torch.Tensor, mine: int, group_tokens: int) -> torch.Tensor:
        """The batch's mean loss over the cp group (the same on each of its ranks); the tally of the
        whole set gets this rank's shard."""
        if self._cp_eval is not None:
            self._cp_eval.ce_sum += float(ce_sum)
            self._cp_eval.tokens += mine
        total = ce_sum.float().clone()
        if self.cp.group is not None:
            dist.all_reduce(total, group=self.cp.group)
        return total / max(group_tokens, 1)

    def _cp_mask_repeated(self, inputs: dict, sample_lens: Any) -> dict:
        """In the last evaluation batch, labels -100 on the samples ``accelerate`` repeated to give every
        dp rank a full batch (they are in the set once already)."""
        tally = self._cp_eval
        if tally is None:
            return inputs
        tally.step += 1
        if tally.step != tally.steps or tally.last_real is None or sample_lens is None:
            return inputs
        lens = torch.as_tensor(sample_lens).flatten().tolist()
        if tally.last_real >= len(lens):
            return inputs
        key = "shift_labels" if "shift_labels" in inputs else "labels"
        labels = inputs[key].clone()
        if labels.shape[0] == len(lens):  # one row per sample
            labels[tally.last_real :] = IGNORE_INDEX
        elif labels.shape[0] == 1:  # every sample flattened into one row, in order
            labels[:, sum(lens[: tally.last_real]) :] = IGNORE_INDEX
        else:
            raise ValueError(
                f"an evaluation batch of {plural(len(lens), 'sample')} has {plural(labels.shape[0], 'row')}: titan_cp cannot tell "
                "which are repeated; use a collator that keeps one row per sample or flattens them all"
            )
        tally.masked = labels if key == "labels" else None
        return {**inputs, key: labels}

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The Trainer's step; in the last batch the returned labels are -100 on repeated samples too
        (a flattened row cannot be cut at a sample, as ``gather_for_metrics`` cuts rows)."""
        if not any(inputs.get(k) is not None for k in ("labels", "shift_labels", *(self.label_names or ()))):
            return None, (None if prediction_loss_only else self._cp_logits(model, inputs)), None
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        tally = self._cp_eval
        if tally is not None and tally.masked is not None and isinstance(labels, torch.Tensor):
            labels, tally.masked = tally.masked.to(labels.device), None
        return loss, logits, labels

    def _cp_logits(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """Logits ``(B, S, V)`` of a batch without labels, in token order: sharded by the layout, run,
        gathered over the cp group (the Trainer would run the whole rows, which the attention refuses)."""
        inputs = _model_keys(self.cp_prepare_inputs(inputs))
        seq = inputs["input_ids"].shape[1]
        local = self.cp.shard(
            inputs,
            pad_token_id=self.cp_pad_token_id,
            device=self.args.device,
        )
        with torch.no_grad(), self.compute_loss_context_manager():
            logits = model(**local).logits
        return self.cp.unshard(logits, local["cp_doc_lens"])[:, :seq]

    # ---- evaluation ---------------------------------------------------------------------------

    def evaluation_loop(
        self,
        dataloader: DataLoader,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
        **kwargs: Any,
    ) -> EvalLoopOutput:
        """The Trainer's loop, with predictions gathered over dp ranks only and ``<prefix>_loss`` the
        whole set's mean over its loss-bearing tokens."""
        self._cp_eval = _EvalTally(steps=len(dataloader), last_real=self._cp_last_real(dataloader))
        self.gather_function = self._cp_gather_for_metrics  # the Trainer sets it back after its loop
        try:
            out = super().evaluation_loop(
                dataloader,
                description,
                prediction_loss_only,
                ignore_keys,
                metric_key_prefix=metric_key_prefix,
                **kwargs,
            )
            tally = torch.tensor([self._cp_eval.ce_sum, float(self._cp_eval.tokens)], dtype=torch.float64)
        finally:
            self._cp_eval = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            tally = tally.to(_collective_device(None))
            dist.all_reduce(tally)
        if tally[1] > 0:
            assert out.metrics is not None  # the Trainer's loop always returns its metrics
            out.metrics[f"{metric_key_prefix}_loss"] = float(tally[0] / tally[1])
        return out

    def _cp_last_real(self, dataloader: Any) -> int | None:
        """Real samples in this rank's last evaluation batch (the rest repeat earlier samples)."""
        dataset = getattr(dataloader, "dataset", None)
        if dataset is None:
            return None
        try:
            n, steps = len(dataset), len(dataloader)
        except TypeError:
            return None
        b = self.args.eval_batch_size
        left = n - (steps - 1) * b * self.dp_size
        rank = 0 if self.dp_group is None else dist.get_rank(self.dp_group)
        return max(0, min(b, left - rank * b))

    def _cp_gather_for_metrics(self, data: Any) -> Any:
        """``accelerate``'s ``gather_for_metrics`` over the dp ranks only (the ranks of a cp group hold
        the same rows): concatenated, the repeated samples of the last batch dropped."""
        from accelerate.utils import recursively_apply  # noqa: PLC0415

        def gather(t: torch.Tensor) -> torch.Tensor:
            if self.dp_size == 1:
                return t
            parts = [torch.empty_like(t) for _ in range(self.dp_size)]
            dist.all_gather(parts, t.contiguous(), group=self.dp_group)
            return torch.cat(parts)

        data = recursively_apply(gather, data)
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            return recursively_apply(lambda t: t[: state.remainder], data)
        return data


class _WithSampleLens:
    """A collator that also returns each sample's token count under :data:`SAMPLE_LENS`."""

    def __init__(self, collate: Callable[[list], dict]) -> None:
        self.collate = collate

    def __call__(self, features: list) -> dict:
        batch = self.collate(features)
        lens = [len(f["input_ids"]) if isinstance(f, dict) and "input_ids" in f else 0 for f in features]
        batch[SAMPLE_LENS] = torch.tensor(lens, dtype=torch.int64)
        return batch


def _model_keys(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in batch.items() if k != SAMPLE_LENS}


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _shard(model: nn.Module, data_mesh: DeviceMesh) -> None:
    """FSDP2 over every ``dp x cp`` rank, gradients averaged over them as DDP would (the loss of each
    rank is scaled for DDP's average); the Trainer then leaves placement and reduction to the model."""
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

    apply_fsdp(model, data_mesh._flatten("dp_cp"))
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(data_mesh.size()))
    mark_sharded(model)


def _pad_token_id(model: nn.Module) -> int:
    """The token of the padding document ``shard_batch`` appends when a row does not split evenly
    (its own document, no loss: any valid id is exact)."""
    config = getattr(model, "config", None)
    pad = getattr(config, "pad_token_id", None)
    if pad is None:
        pad = getattr(config, "eos_token_id", None)
    if isinstance(pad, (list, tuple)):
        pad = pad[0] if pad else None
    return 0 if pad is None else int(pad)


def _check_launch(args: Any, name: str) -> None:
    """Every process the launcher started is a rank of ``accelerate``'s run. Without an accelerator and
    without ``use_cpu=True``, ``accelerate`` runs each torchrun process alone (``ParallelMode.NOT_PARALLEL``):
    no DDP, so every rank would step on its own gradients and log its own share of the loss."""
    launched = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if launched != args.world_size:
        raise ValueError(
            f"{name}: {launched} processes were launched but accelerate runs {args.world_size} of them together "
            f"({args.parallel_mode}), so no gradient would be reduced across them; on a CPU set use_cpu=True in "
            "the TrainingArguments / SFTConfig (accelerate then joins them over gloo)"
        )


def _check_args(args: Any, o: CPOptions) -> None:
    if getattr(args, "label_smoothing_factor", 0.0):
        raise ValueError(
            f"label_smoothing_factor = {args.label_smoothing_factor}: the label smoother shifts labels again; "
            "under context_parallel_trainer the labels are already shifted inside each document: set it to 0"
        )
    if o.cp_size > 1 and getattr(args, "train_sampling_strategy", None) == "batch_rebalance":
        raise ValueError(
            "train_sampling_strategy = 'batch_rebalance' spreads rows over every rank, cp ranks included; use "
            "'random', 'sequential' or 'group_by_length' with context_parallel_trainer"
        )
