"""Generation and scoring under the CP layout: prefill across ranks, decode from a sharded KV cache.

A long prompt is spread over the cp ranks exactly as training spreads a row (any strategy, any
layout); each rank keeps the K/V of its own tokens (:class:`ShardedKVCache`), and every decode
step merges the ranks' partial attention through its log-sum-exp with one small collective per
layer (:mod:`titan_cp.attention.decode`)::

    gen = Generator(model)     # under CP: the handle apply_cp bound (its mesh, strategy, balance)
    outs = gen.generate([prompt_ids, ...], max_new_tokens=64, sampling=Sampling(0.8, 0.95, seed=0))
    scores = gen.score([context_ids, ...], [continuation_ids, ...])               # log-likelihoods

Modules: :mod:`.engine` (:class:`Generator`), :mod:`.runners` (what a model answers; :func:`build_generation_model`),
:mod:`.hf_runner` (Hugging Face models), :mod:`.registry` (each family's builder and runner), :mod:`.cache`, :mod:`.sampling`,
:mod:`.prompts` (prompt files), :mod:`.weights` (the config's checkpoint), :mod:`.rollouts` (RL rollouts,
registered with the GRPO trainer), :mod:`.needle`
(needle in a haystack), :mod:`.lookup` (the main job's questions), :mod:`.cli` (``python -m titan_cp.generate``).
"""

from titan_cp.generate.cache import ShardedKVCache, plan_owners
from titan_cp.generate.engine import Generation, Generator, PackedPrompts, Score
from titan_cp.generate.rollouts import generate_rollouts
from titan_cp.generate.runners import build_generation_model
from titan_cp.generate.sampling import Sampling, sample_next

__all__ = [
    "Generation",
    "Generator",
    "PackedPrompts",
    "Sampling",
    "Score",
    "ShardedKVCache",
    "build_generation_model",
    "generate_rollouts",
    "plan_owners",
    "sample_next",
]
