"""TRL's ``GRPOTrainer`` under context parallelism: what :func:`.trainer_factory.context_parallel_trainer`
adds for it.

::

    Trainer = context_parallel_trainer(GRPOTrainer, cp_size=2, strategy="ring")
    trainer = Trainer(model=model, reward_funcs=reward, args=GRPOConfig(...), train_dataset=prompts)

TRL's loop runs unchanged (its sampler, rewards, group advantages, KL to the reference, clipping,
every ``loss_type``); what changes:

- **One data-parallel process per cp group.** The ranks of a cp group read the same prompts (the
  factory's ``(dp, cp)`` mesh), generate the same completions, score the same rewards and compute
  the same loss; their forwards split the tokens. TRL's config counts every process in
  ``generation_batch_size``: it is set to ``per_device_train_batch_size x dp x steps_per_generation``
  (``steps_per_generation`` kept), and TRL's seed per process becomes a seed per dp rank.
- **Log-probs under CP, without logits.** ``_get_per_token_logps_and_entropies`` (the policy's, the old
  policy's, the reference's) packs each row's prompt + completion as one document of a packed row,
  shards it by the layout and scores the completion tokens with ``cp.token_logprobs`` (chunked over the
  vocabulary, at TRL's temperature); the ``(B, completion)`` log-probs are gathered on every cp rank,
  and their backward sums the cp ranks' gradients (:class:`~titan_cp.attention.handle.TokenLogprobs`).
  The reference model is bound to the same handle.
- **Rollouts.** Without ``rollout_func``, completions come from titan_cp's generation under the CP layout
  (:meth:`GRPOMixin.cp_generate`: prefill under the strategy, decode from the sharded cache), sampled on
  the host from a generator per rollout seeded by ``(seed + generation round, rollout index)``, so
  every cp rank draws the same tokens, and one process the same as CP 2 (``import titan_cp.generate``
  registers it: this layer cannot import it). A ``rollout_func`` (TRL's own path) runs on every cp rank;
  its completions must agree across the group (checked each round; ``cp_generate`` gives agreement).
- **Rewards.** TRL gathers rewards over every process, so each cp group's rows arrive ``cp`` times: every
  copy but this rank's own is made NaN (TRL's unscorable rows), so group and batch statistics count each
  rollout once; copies that differ (a reward function that answers each process differently) are refused.
- **Normalisation.** ``loss_type = "bnpo"`` divides by the micro-batch's loss tokens over every dp group
  (TRL divides by each process's own); the others already equal one process's at equal per-process
  batches (TRL's ``num_items_in_batch / num_processes`` cancels the cp copies). The entropy bonus and
  metrics keep TRL's per-process forms (under ``bnpo`` the bonus is rescaled with the loss).

Refused, naming the fix (``ValueError``): vLLM (each cp rank would ask the server, or run an engine, for
samples of its own), transformers' continuous batching, evaluation, ``cast_lm_head_to_fp32``, vision-language
processors, MoE router losses, sampling settings titan_cp's sampler does not draw (``top_k``, ``min_p``,
``repetition_penalty``, ``generation_kwargs``), and at dp > 1 a generation batch per process that splits
a prompt's group of ``num_generations`` rollouts across processes (whole groups per dp rank keep every
rank's copy of a group together).

The private TRL methods overridden are :data:`GRPO_HOOKS`, checked against :data:`TRL_PINNED`.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from titan_cp.loss import IGNORE_INDEX

if TYPE_CHECKING:
    from titan_cp.attention.handle import CPHandle

    _Host = Any  # the mixin is put before the factory's ContextParallelMixin and TRL's GRPOTrainer
else:
    _Host = object

TRL_PINNED = "1.16"  # major.minor of trl these overrides are written and tested for
GRPO_HOOKS = {  # private GRPOTrainer methods overridden here -> their parameters (after self) in TRL_PINNED
    "_get_per_token_logps_and_entropies": (
        "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy", "compute_aux_loss",
        "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
        "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
    ),
    "_generate": ("prompts",),
    "_generate_single_turn": ("prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"),
    "_generate_and_score_completions": ("inputs",),
    "_calculate_rewards": ("inputs", "prompts", "completions", "completion_ids_list"),
    "get_high_entropy_mask": ("entropies", "mask", "threshold"),
}  # fmt: skip
SEED_STRIDE = 1_000_003  # titan_cp.generate.sampling's: seeds below it never meet another rollout's stream

Rollouts = Callable[..., list[list[int]]]
"""``(model, prompts, *, max_new_tokens, temperature, top_p, seed, prompt_ids, stop_tokens)`` -> each
prompt's generated ids (a stop token kept as the last): generation under the model's CP layout, the same
on every cp rank; ``prompt_ids`` index each rollout's random stream."""

_ROLLOUTS: list[Rollouts] = []


def register_rollouts(rollouts: Rollouts) -> None:
    """The generation :meth:`GRPOMixin.cp_generate` runs (titan_cp's, registered by ``titan_cp.generate``)."""
    _ROLLOUTS.append(rollouts)


def grpo_trainer_class() -> type | None:
    """TRL's ``GRPOTrainer`` if TRL's GRPO module is loaded (a subclass of it cannot exist otherwise)."""
    module = sys.modules.get("trl.trainer.grpo_trainer")
    return getattr(module, "GRPOTrainer", None)


def is_grpo(trainer_class: type) -> bool:
    grpo = grpo_trainer_class()
    return grpo is not None and issubclass(trainer_class, grpo)


def check_grpo_hooks(trainer_class: type) -> None:
    """``ValueError`` unless ``trainer_class`` has the private methods of :data:`GRPO_HOOKS` as TRL
    :data:`TRL_PINNED` has them, and the Trainer hooks the factory overrides
    (:data:`.hf_compat.OVERRIDDEN`; GRPO's ``_prepare_inputs`` generates, and the factory does not call it):
    an override of a method TRL no longer calls would be silently dead."""
    import transformers  # noqa: PLC0415 - optional dependency
    import trl  # noqa: PLC0415 - loaded already (is_grpo)

    from titan_cp.integrations.hf_compat import OVERRIDDEN, PINNED  # noqa: PLC0415

    for name, want in {**OVERRIDDEN, **GRPO_HOOKS}.items():
        fn = getattr(trainer_class, name, None)
        got = tuple(inspect.signature(fn).parameters)[1:] if callable(fn) else None
        if got != want:
            raise ValueError(
                f"context_parallel_trainer relies on {trainer_class.__name__}.{name}({', '.join(want)}) of trl "
                f"{TRL_PINNED} and transformers {PINNED['transformers']}; trl {trl.__version__} with transformers "
                f"{transformers.__version__} has {'no such method' if got is None else name + str(got)}: install "
                f"those versions or update titan_cp.integrations.grpo"
            )


def _refusals(args: Any, kwargs: dict[str, Any]) -> list[str]:
    """What GRPO under CP refuses in ``args`` (a ``GRPOConfig``) and the trainer's keyword arguments."""
    found = []
    if args.use_vllm:
        found.append(
            f"use_vllm=True (vllm_mode={args.vllm_mode!r}): every cp rank would ask vLLM for samples of its own "
            "(in server mode each rank calls the server), so a cp group would train on different completions; "
            "set use_vllm=False (titan_cp generates under the CP layout) or generate in a rollout_func with "
            "trainer.cp_generate"
        )
    if args.use_transformers_continuous_batching:
        found.append(
            "use_transformers_continuous_batching=True: transformers' paged generation cannot run a model bound "
            "to the CP layout; set it to False (titan_cp generates under the CP layout)"
        )
    if str(getattr(args.eval_strategy, "value", args.eval_strategy)) != "no":
        found.append(f"eval_strategy={args.eval_strategy!r}: evaluation is not built under CP; set eval_strategy='no'")
    if args.cast_lm_head_to_fp32:
        found.append(
            "cast_lm_head_to_fp32=True: titan_cp's log-probs read the head's weight as it is; set it to False "
            "(the log-probs are accumulated in fp32 chunk by chunk already)"
        )
    if kwargs.get("rollout_func") is None:  # titan_cp generates the rollouts
        found += _sampling_refusals(args)
        if not _ROLLOUTS:
            found.append(
                "it generates with titan_cp's generation under the CP layout: import titan_cp.generate (it "
                "registers it), or pass rollout_func="
            )
    return found


def _sampling_refusals(args: Any) -> list[str]:
    """Sampling settings of ``args`` that titan_cp's sampler (temperature and top-p) does not draw."""
    found = []
    for key, off in (("top_k", (0, None)), ("min_p", (None,)), ("repetition_penalty", (1.0, None))):
        if getattr(args, key) not in off:
            found.append(
                f"{key}={getattr(args, key)!r}: titan_cp's sampler draws with temperature and top_p only; unset it"
            )
    if args.generation_kwargs:
        found.append(f"generation_kwargs={args.generation_kwargs!r}: titan_cp's sampler takes none; drop them")
    return found


def _batch_refusals(args: Any, cp: int, dp: int) -> list[str]:
    """``generation_batch_size`` set to count dp ranks (module docstring); its checks under CP."""
    per_rank = args.per_device_train_batch_size * args.steps_per_generation
    args.generation_batch_size = per_rank * dp
    found = []
    if args.generation_batch_size % args.num_generations:
        found.append(
            f"generation_batch_size = per_device_train_batch_size x steps_per_generation x dp = {per_rank} x {dp} "
            f"is not a multiple of num_generations = {args.num_generations} (under CP a cp group is one process): "
            "change per_device_train_batch_size or steps_per_generation"
        )
    elif cp > 1 and dp > 1 and per_rank % args.num_generations:
        found.append(
            f"per_device_train_batch_size x steps_per_generation = {per_rank} rollouts per dp rank split groups of "
            f"num_generations = {args.num_generations} across dp ranks, which TRL's reward gather cannot keep "
            "together under CP; make it a multiple of num_generations"
        )
    return found


def _digest(*lists: Any) -> str:
    """A digest of nested lists of token ids (or tensors, or ``None``): equal on ranks that hold the same."""

    def plain(x: Any) -> Any:
        if isinstance(x, Tensor):
            return x.tolist()
        return [plain(y) for y in x] if isinstance(x, (list, tuple)) else x

    return hashlib.sha256(repr([plain(x) for x in lists]).encode()).hexdigest()


class GRPOMixin(_Host):
    """The methods :func:`.trainer_factory.context_parallel_trainer` puts before its ``ContextParallelMixin``
    for a ``GRPOTrainer`` (module docstring)."""

    cp: CPHandle
    cp_size: int
    dp_size: int
    dp_group: dist.ProcessGroup | None

    def __init__(
        self, model: nn.Module | None = None, reward_funcs: Any = None, args: Any = None, *rest: Any, **kwargs: Any
    ) -> None:
        name = type(self).__name__
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"{name} needs model= (a model loaded with attn_implementation='titan_cp'), got {type(model).__name__}"
            )
        if args is None:
            raise ValueError(f"{name} needs args= (a GRPOConfig)")
        self._cp_setup(model, args)
        found = _refusals(args, kwargs) + _batch_refusals(args, self.cp_size, self.dp_size)
        if found:
            raise ValueError(f"{name}: {found[0]}")
        self._cp_host().__init__(model, reward_funcs, args, *rest, **kwargs)
        self._cp_after_init()
        self._grpo_after_init()

    def _grpo_after_init(self) -> None:
        from accelerate.utils import set_seed  # noqa: PLC0415 - optional dependency

        from titan_cp.integrations.hf_logprobs import scoring_head  # noqa: PLC0415
        from titan_cp.parallel import apply_cp  # noqa: PLC0415

        name = type(self).__name__
        if self._is_vlm:
            raise ValueError(
                f"{name}: a vision-language processor: titan_cp packs text documents only; train a text model"
            )
        if self.aux_loss_enabled:
            raise ValueError(
                f"{name}: the MoE router's auxiliary loss is not computed under CP; set router_aux_loss_coef=0"
            )
        scoring_head(self.model)
        if self.ref_model is not None:
            apply_cp(self.accelerator.unwrap_model(self.ref_model), self.cp)  # the policy's handle and layouts
        self.cp_dp_rank = 0 if self.dp_group is None else dist.get_rank(self.dp_group)
        self._cp_index = dist.get_rank() % self.cp_size if dist.is_initialized() else 0  # cp rank: consecutive
        set_seed(self.args.seed + self.cp_dp_rank)  # TRL's seed per process, per dp rank: the cp ranks agree
        self._cp_round, self._cp_turn, self._cp_round_rows = -1, 0, 0

    # ---- rollouts -----------------------------------------------------------------------------

    def cp_generate(self, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int | None = None) -> list[list[int]]:
        """Completions of ``prompt_ids`` (token lists) from the policy under the CP layout, with TRL's
        sampling (``temperature``, ``top_p``; up to ``max_completion_length`` tokens, stopping at its end
        tokens): the same tokens on every rank of the cp group (collective over it). Rollout ``i`` of
        this rank's ``t``-th call in a generation round draws from the stream of ``(seed + round,
        ((t x dp) + dp rank) x rows + i)``, ``rows`` the round's prompts per dp rank: on one process and
        on any cp size the same rollouts draw the same tokens. For a ``rollout_func``'s turns too."""
        found = _sampling_refusals(self.args)
        if found:
            raise ValueError(f"{type(self).__name__}.cp_generate: {found[0]}")
        if not _ROLLOUTS:
            raise ValueError("cp_generate needs titan_cp's generation: import titan_cp.generate (it registers it)")
        rows = max(self._cp_round_rows, len(prompt_ids))
        first = ((self._cp_turn * self.dp_size) + self.cp_dp_rank) * rows
        self._cp_turn += 1
        return _ROLLOUTS[-1](
            self.accelerator.unwrap_model(self.model),
            [list(map(int, p)) for p in prompt_ids],
            max_new_tokens=max_new_tokens or self.max_completion_length,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=(self.args.seed + max(self._cp_round, 0)) % SEED_STRIDE,
            prompt_ids=[first + i for i in range(len(prompt_ids))],
            stop_tokens=list(self.eos_token_ids),
        )

    def _generate_single_turn(
        self, prompt_ids: list, images: Any, multimodal_fields: Any, num_generations: int, has_tool_images: bool = False
    ) -> tuple[list[list[int]], None]:
        """TRL's transformers path (vLLM and continuous batching are refused): :meth:`cp_generate`."""
        return self.cp_generate(prompt_ids), None

    def _generate(self, prompts: list) -> tuple:
        """TRL's, as one generation round: the rollouts' streams counted from it, the tokens seen
        counted once per cp group, and the completions checked to agree across the cp group."""
        self._cp_round, self._cp_turn, self._cp_round_rows = self._cp_round + 1, 0, len(prompts)
        seen = self.state.num_input_tokens_seen
        out = self._cp_host()._generate(prompts)
        if self.cp_size > 1:
            self.state.num_input_tokens_seen = seen + (self.state.num_input_tokens_seen - seen) // self.cp_size
            self._metrics["train" if self.model.training else "eval"]["num_tokens"] = [self.state.num_input_tokens_seen]
            self._cp_check_agree(out[0], out[1], out[2])
        return out

    def _cp_check_agree(self, prompt_ids: Any, completion_ids: Any, tool_mask: Any) -> None:
        every: list[Any] = [None] * self.cp_size
        dist.all_gather_object(every, _digest(prompt_ids, completion_ids, tool_mask), group=self.cp.group)
        if len(set(every)) > 1:
            raise ValueError(
                f"the {self.cp_size} ranks of a cp group generated different completions for the same prompts "
                "(a rollout_func sampling per process?): they train on one sequence together; generate with "
                "trainer.cp_generate (the same samples on every cp rank) or seed by trainer.cp_dp_rank"
            )

    def cp_track_input_tokens(self, inputs: Any, track: Callable[[Any], None]) -> None:
        """The Trainer's own count (a generation batch holds prompts, not tokens; TRL counts them itself)."""
        track(inputs)

    # ---- rewards ------------------------------------------------------------------------------

    def _calculate_rewards(self, inputs: list, prompts: list, completions: list, completion_ids_list: list) -> Tensor:
        every = self._cp_host()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._cp_own_copies(every, len(prompts))

    def _cp_own_copies(self, every: Tensor, rows: int) -> Tensor:
        """TRL's rewards gathered over every process, ``(world x rows, funcs)`` in rank order (each cp
        group's rows ``cp`` times), with every copy but this cp rank's NaN: each rollout counted once, and
        this rank's slice (``process_index x rows``) its own. Copies that differ are refused."""
        if self.cp_size == 1:
            return every
        copies = every.view(self.dp_size, self.cp_size, rows, -1)
        same = (copies == copies[:, :1]) | (copies.isnan() & copies[:, :1].isnan())
        if not bool(same.all()):
            column = int((~same).nonzero()[0, 3])
            raise ValueError(
                f"reward function {self.reward_func_names[column]!r} gave the {self.cp_size} ranks of a cp group "
                "different rewards for the same completions (it answers each process differently: randomness, or a "
                "service called per process); make it deterministic, or compute it once and share it"
            )
        own = torch.full_like(copies, float("nan"))
        own[:, self._cp_index] = copies[:, self._cp_index]
        return own.view_as(every)

    def _generate_and_score_completions(self, inputs: list) -> dict[str, Any]:
        """TRL's; with the other copies NaN, the share of zero-std groups counts this rank's copy only:
        scaled back by ``cp`` (group statistics only: a batch-wide std is every row's)."""
        out = self._cp_host()._generate_and_score_completions(inputs)
        per_group = self.multi_objective_aggregation == "sum_then_normalize" and self.scale_rewards != "batch"
        if self.cp_size > 1 and per_group and self.num_generations > 1:
            self._metrics["train" if self.model.training else "eval"]["frac_reward_zero_std"][-1] *= self.cp_size
        return out

    def get_high_entropy_mask(self, entropies: Tensor, mask: Tensor, threshold: float) -> Tensor:
        """TRL's quantile over the tokens of every process, each cp group's tokens once: the group's
        first rank gives its tokens, the others none, and its mask goes to the group."""
        if self.cp_size == 1:
            return self._cp_host().get_high_entropy_mask(entropies, mask, threshold)
        first = self._cp_index == 0
        picked = self._cp_host().get_high_entropy_mask(entropies, mask if first else torch.zeros_like(mask), threshold)
        picked = picked.to(torch.uint8).contiguous()
        dist.broadcast(picked, dist.get_rank() - self._cp_index, group=self.cp.group)
        return picked.bool()

    # ---- log-probs and the loss ---------------------------------------------------------------

    def _get_per_token_logps_and_entropies(
        self,
        model: nn.Module,
        input_ids: Tensor,
        attention_mask: Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **multimodal: Any,
    ) -> tuple[Tensor, Tensor | None, None]:
        """Log-probs (and entropies) ``(B, logits_to_keep)`` of the completion tokens of ``input_ids``
        ``(B, S)`` (left-padded prompts, then right-padded completions; ``attention_mask`` their tokens),
        ``batch_size`` rows at a time as TRL, each chunk packed as the documents of one row (module
        docstring); 0 at padding."""
        unused = sorted(k for k, v in multimodal.items() if v is not None)
        assert not compute_aux_loss and not unused, f"refused at construction: {unused or 'the router loss'}"
        step = batch_size or input_ids.shape[0]
        parts = [
            self._cp_completion_logprobs(model, input_ids[s : s + step], attention_mask[s : s + step], logits_to_keep, compute_entropy)
            for s in range(0, input_ids.shape[0], step)
        ]  # fmt: skip
        entropies = [e for _, e in parts if e is not None]
        return torch.cat([lp for lp, _ in parts]), (torch.cat(entropies) if compute_entropy else None), None

    def _cp_completion_logprobs(
        self, model: nn.Module, ids: Tensor, mask: Tensor, keep: int, entropy: bool
    ) -> tuple[Tensor, Tensor | None]:
        """One chunk of rows: each row's tokens (``mask``) a document of one packed row; its last ``keep``
        columns' tokens scored, gathered back to ``(rows, keep)``."""
        kept = mask.bool()
        scored = kept.clone()
        scored[:, : ids.shape[1] - keep] = False
        lens = kept.sum(1).tolist()
        packed = {
            "input_ids": ids[kept][None],
            "labels": ids.masked_fill(~scored, IGNORE_INDEX)[kept][None],
            "position_ids": torch.cat([torch.arange(n) for n in lens])[None].to(ids.device),
        }
        with self.accelerator.autocast():
            out = self.cp.token_logprobs(
                model,
                packed,
                temperature=self.temperature,
                entropy=entropy,
                gather=True,
                pad_token_id=self.cp_pad_token_id,
            )
        where, to = packed["labels"][0] != IGNORE_INDEX, scored[:, ids.shape[1] - keep :]

        def back(x: Tensor) -> Tensor:
            return x.new_zeros(to.shape).masked_scatter(to, x[0][where])

        return back(out.logprobs), (None if out.entropy is None else back(out.entropy))

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Tensor | int | None = None,
    ) -> Tensor:
        """TRL's loss (every cp rank of a group the same); ``bnpo`` over the loss tokens of every dp group."""
        loss = self._cp_host().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.loss_type == "bnpo" and self.dp_size > 1:
            loss = loss * self._cp_bnpo_scale(inputs)
        return loss

    def _cp_bnpo_scale(self, inputs: dict[str, Any]) -> Tensor:
        """``dp x max(n, 1) / max(N, 1)``: TRL's bnpo divides a micro-batch by its own loss tokens ``n``;
        averaged over the dp groups, as their gradients are, it is then the sum over ``N = sum of n``."""
        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        n = mask.sum().float()
        total = n.detach().clone()
        if self.dp_group is not None:
            dist.all_reduce(total, group=self.dp_group)
        return self.dp_size * n.clamp(min=1.0) / total.clamp(min=1.0)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(f"{type(self).__name__}: evaluation is not built under CP; evaluate with GRPOTrainer itself")

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(f"{type(self).__name__}: prediction is not built under CP; predict with GRPOTrainer itself")
