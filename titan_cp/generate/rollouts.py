"""Rollouts for reinforcement learning under the CP layout: titan_cp's generation as the sampler of TRL's
``GRPOTrainer`` under ``context_parallel_trainer`` (:mod:`titan_cp.integrations.grpo`), registered with it
when ``titan_cp.generate`` is imported (that layer cannot import this one).

The policy is the model being trained (a Hugging Face causal LM ``apply_cp`` bound, weights whole on every
cp rank): for the call its attention runs ``titan_cp_generate`` (:mod:`.hf_runner`: the training attention
in the prefill, the sharded-cache decode after), then ``titan_cp`` again. The prompts are the documents of
one packed row under the handle's layout (:class:`~titan_cp.generate.engine.Generator`); each rollout draws
from its own seeded host generator (:mod:`.sampling`), so every cp rank chooses the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from titan_cp.generate.engine import Generator
from titan_cp.generate.sampling import Sampling
from titan_cp.integrations.grpo import register_rollouts
from titan_cp.integrations.hf_model import hf_model_of


def generate_rollouts(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    prompt_ids: Sequence[int],
    stop_tokens: Sequence[int],
) -> list[list[int]]:
    """Each prompt's sampled continuation (up to ``max_new_tokens`` ids, a stop token kept as the last),
    rollout ``b`` drawn from the stream of ``(seed, prompt_ids[b])``; collective over the cp group."""
    from titan_cp.generate.hf_runner import GENERATE_ATTENTION  # noqa: PLC0415 - transformers is optional

    hf = hf_model_of(model)
    runs = hf.config._attn_implementation
    hf.set_attn_implementation(GENERATE_ATTENTION)
    try:
        out = Generator(model).generate(
            prompts, max_new_tokens, Sampling(temperature, top_p, seed), stop_tokens, prompt_ids
        )
    finally:
        hf.set_attn_implementation(runs)
    return [g.tokens for g in out]


register_rollouts(generate_rollouts)
