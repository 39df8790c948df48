"""What the trainer runs: a plan's config keys, set on the job config and put through the trainer's own checks.

The planner restates none of the trainer's rules (the batch sizes against the data-parallel degree, the
sequence against the layout, the heads against TP and the CP strategy, pipeline stages and microbatches,
the long-context options against compile and FSDP). It sets each plan's keys (:func:`plan_keys`: the five
degrees, the strategy and its Ulysses degree, the options it turns on) on the job config and asks the
config layer what the trainer asks before its first step (:meth:`TrainerChecks.refusal`): each changed
section's ``validate``, ``JobConfig.reconcile``, the model family's keys
(:func:`titan_cp.preflight.check_model`), the model's heads and layers against the degrees
(``Parallelism.check_model``, on the planner's shapes: what a Hugging Face folder's ``config.json`` is
checked by), the mesh (``JobConfig.parallel_dims``) and the batch sizes (``JobConfig.resolve_batch_sizes``).
A plan the trainer refuses is never printed; the most frequent refusal is.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from titan_cp.families.llama3.model import ModelArgs
from titan_cp.mesh import DEGREE_KEYS
from titan_cp.plan.problem import Candidate, Workload
from titan_cp.preflight import check_model

if TYPE_CHECKING:
    from titan_cp.config import JobConfig

Keys = dict[str, Any]
"""Dotted config keys and their values (``parallelism.context_parallel_degree``: 8)."""


def option_keys(w: Workload) -> Keys:
    """The long-context options of ``w`` as config keys (activation checkpointing, offloads, tiles)."""
    h = w.host
    return {
        "activation_checkpoint.mode": w.ac,
        "activation_checkpoint.cpu_offload": h.cpu_offload,
        "activation_checkpoint.blocks_per_checkpoint": h.blocks_per_checkpoint,
        "activation_checkpoint.tile_tokens": h.tile_tokens,
        "training.enable_cpu_offload": h.fsdp_offload,
    }


def plan_keys(c: Candidate, w: Workload, base: Workload, ulysses: int) -> Keys:
    """The config keys that run ``c`` with ``w``'s options on a job config planned as ``base`` whose Ulysses
    degree is ``ulysses``: the five degrees; the strategy with CP; the Ulysses degree where the strategy
    reads one or the config's would not fit (a strategy that reads none takes 1); and the options ``w``
    turned on beyond ``base``'s (:func:`option_keys`)."""
    keys: Keys = {key: getattr(c, axis) for axis, key in DEGREE_KEYS.items()}
    takes = c.cp > 1 and c.attention.takes_ulysses_degree()
    if c.cp > 1:
        keys["parallelism.context_parallel_strategy"] = c.strategy
    if takes or ulysses != 1:
        keys["parallelism.context_parallel_ulysses_degree"] = c.ulysses if takes else 1
    given = option_keys(base)
    keys.update({k: v for k, v in option_keys(w).items() if given[k] != v})
    return keys


def with_keys(job_config: JobConfig, keys: Keys) -> JobConfig:
    """A copy of ``job_config`` with ``keys`` set (each section replaced, none of ``job_config`` changed);
    the keys count as given, as on the command line."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in keys.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    out = dataclasses.replace(
        job_config, **{s: dataclasses.replace(getattr(job_config, s), **kw) for s, kw in sections.items()}
    )
    out.given_keys = job_config.given_keys | frozenset(keys)
    return out


@dataclass
class TrainerChecks:
    """The trainer's checks of the plans of ``job_config`` on ``ngpu`` ranks (module docstring), each key set
    asked once. ``shapes``, ``label``: the planned model and its name; ``family``: whether the config's model
    family checks its own keys (not for a model given to the planner, a torchtitan run's); ``base``: the
    workload as configured, whose options a plan's keys leave as they are."""

    job_config: JobConfig
    ngpu: int
    shapes: ModelArgs
    label: str
    base: Workload
    family: bool = True
    refusals: Counter[str] = field(default_factory=Counter)
    _seen: dict[tuple[tuple[str, Any], ...], str | None] = field(default_factory=dict)

    def keys(self, c: Candidate, w: Workload) -> Keys:
        """:func:`plan_keys` of ``c`` with ``w``'s options."""
        return plan_keys(c, w, self.base, self.job_config.parallelism.context_parallel_ulysses_degree)

    def runs(self, c: Candidate, w: Workload) -> bool:
        """Whether the trainer takes ``c`` with ``w``'s options (a refusal is counted once per key set)."""
        return self.refusal(self.keys(c, w)) is None

    def refusal(self, keys: Keys) -> str | None:
        """The trainer's error for the job config with ``keys`` set on :attr:`ngpu` ranks, or ``None``."""
        seen = tuple(sorted(keys.items()))
        if seen not in self._seen:
            why = self._check(keys)
            self._seen[seen] = why
            if why is not None:
                self.refusals[why] += 1
        return self._seen[seen]

    def _check(self, keys: Keys) -> str | None:
        cfg = with_keys(self.job_config, keys)
        try:
            for section in dict.fromkeys(k.split(".")[0] for k in keys):
                getattr(cfg, section).validate()
            cfg.reconcile()
            if self.family:
                check_model(cfg)
            a = self.shapes
            cfg.parallelism.check_model(self.label, a.n_heads, a.kv_heads, a.n_layers)
            dims = cfg.parallel_dims(self.ngpu)
            cfg.resolve_batch_sizes(dims.dp_replicate * dims.dp_shard)
        except ValueError as e:
            return str(e)
        return None

    def most_refused(self) -> str | None:
        """The refusal met most often, or ``None``."""
        return self.refusals.most_common(1)[0][0] if self.refusals else None
