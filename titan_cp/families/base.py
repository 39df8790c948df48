"""What a model family is: one object per family, answering everything the package asks of it.

The preflight checks, the trainer, the planner and generation never compare a family's name
(``model.name``); they ask its :class:`ModelFamily`::

    f = get_family(cfg.model.name)
    f.check_section(cfg.model)            the [model] section's own rules    (titan_cp.preflight.check_model)
    f.check_keys(cfg)                     the keys across sections           (titan_cp.preflight.check_model)
    f.check_files(cfg)                    what its files on disk can tell    (titan_cp.preflight.check_files)
    f.build_parallel(cfg, dims, options, device, vocab_size, loss_fn)   -> (ModelParts, shapes)
    f.load_hf(parts, path, shapes)        initial weights from a Hugging Face folder
    f.save_hf(parts, folder, shapes, assets)   export as a Hugging Face folder
    f.planner_args(cfg)                   the flavor's shapes for the planner
    f.builds(axis) / f.plan_label(cfg, shapes)   the meshes it is built for, its name in a plan
    f.generation_spec(cfg, vocab_size)    the model generation builds, with every parameter's shape
    f.describe(model_cfg) / f.mismatch_fix(what)   the key naming its model in errors, and the fix
    f.adapter(model)                      how the ``apply_*`` functions see its model (a ParallelAdapter)

``shapes`` is what the trainer's metrics and the planner ask of a model's size
(``training_flops``, ``n_layers``, ``n_heads``, ``head_dim``): the Llama's ``ModelArgs``, or
``HFModelArgs`` read from a Hugging Face model (the planner's: ``HFShapes`` from ``config.json``).

This package sits above the config (it reads the job config) and the generic parallel code, and
below everything that uses a family (docs/architecture.md). Each built-in family's model lives here, in
a room of its own with its parallel plan and its spec (:mod:`titan_cp.families.llama3`; the Hugging Face
family's is :mod:`titan_cp.integrations`, which needs ``transformers``): what a layer above does for a family
registers there by the family's name, as the parallel adapter does
(:func:`titan_cp.parallel.adapter.register_adapter`), generation's runners
(:func:`titan_cp.generate.runners.register_generation`) and the Hugging Face family itself
(:mod:`titan_cp.integrations.hf_family`). A built model's family is its adapter's (:func:`family_of`).

A third family is one subclass and one :func:`register_family` call: a family that answers
:meth:`ModelFamily.adapter` has it registered with the parallel adapters by that call, so
``apply_cp`` (the trainer's builder, the Trainer factory) takes its models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from titan_cp.config.values import check_choice
from titan_cp.parallel.adapter import ParallelAdapter, adapter_of, register_adapter

if TYPE_CHECKING:
    from titan_cp.config import JobConfig, Model
    from titan_cp.mesh import ParallelDims
    from titan_cp.parallel.build import ModelParts, ParallelizeOptions

Shapes = Any
"""A model's shapes (module docstring): the Llama's ``ModelArgs``, or ``HFModelArgs`` / ``HFShapes``."""


class ModelFamily:
    """A model family (module docstring); the defaults are what a family without the feature answers."""

    name: ClassVar[str]

    def check_section(self, model: Model) -> None:
        """Rules of the ``[model]`` section ``model`` for this family; ``ValueError`` naming the key."""

    def check_keys(self, cfg: JobConfig) -> None:
        """Rules across sections for this family (degrees, weights); ``ValueError`` naming the key."""

    def check_files(self, cfg: JobConfig) -> None:
        """What this family's files on disk can tell before any process starts (no process group)."""

    def build_parallel(
        self,
        cfg: JobConfig,
        dims: ParallelDims,
        options: ParallelizeOptions,
        device: torch.device | str,
        vocab_size: int,
        loss_fn: Any = None,
    ) -> tuple[ModelParts, Shapes]:
        """``(ModelParts, shapes)``: this rank's model parts built on ``meta``, parallelized over
        ``dims``' mesh as ``options`` say, shards allocated on ``device`` and initialised."""
        raise NotImplementedError

    def load_hf(
        self, parts: list[nn.Module], path: str | Path, shapes: Shapes, key: str = "checkpoint.initial_load_path"
    ) -> None:
        """Load the Hugging Face folder ``path`` into the (sharded) ``parts``, in place."""
        raise NotImplementedError

    def save_hf(self, parts: list[nn.Module], folder: str | Path, shapes: Shapes, assets: str | None = None) -> Path:
        """Write ``parts`` (every rank's shards) as a Hugging Face folder; collective. Returns the folder."""
        raise NotImplementedError

    def planner_args(self, cfg: JobConfig) -> Shapes:
        """The model's shapes for the planner (:mod:`titan_cp.plan`): ``ModelArgs``-like fields (``dim``,
        ``n_layers``, heads, ``ffn_dim``, ``vocab_size``...). ``ValueError`` naming ``model.name`` where the
        planner has no model of this family."""
        raise ValueError(
            f"model.name = {self.name!r}: the planner has no model of this family's shapes; plan with "
            "model.name = 'llama3' and the model.flavor closest to it"
        )

    def builds(self, axis: str) -> bool:
        """Whether this family's models are built for the mesh axis ``axis`` (``"tp"``, ``"pp"``; the
        planner lists no other meshes)."""
        return True

    def plan_label(self, cfg: JobConfig, shapes: Shapes) -> str:
        """The model's name in the planner's output (``shapes``: :meth:`planner_args`'s)."""
        return cfg.model.flavor

    def generation_spec(self, cfg: JobConfig, vocab_size: int) -> ModelSpec:
        """The :class:`~titan_cp.generate.weights.ModelSpec` generation builds for ``cfg``."""
        raise NotImplementedError

    def check_hf_weights(self, source: Any, spec: ModelSpec) -> bool:
        """Check a Hugging Face folder ``source`` for ``spec`` beyond its shapes; ``True`` when this
        family checked every name and shape itself (its names there differ from its own)."""
        return False

    def describe(self, model_cfg: Model) -> str:
        """The config key that names the model of ``model_cfg`` (the ``[model]`` section), for errors."""
        return f"model.name = {self.name!r}"

    def mismatch_fix(self, what: str) -> str:
        """The fix to name when a checkpoint's shapes are not ``what``'s."""
        return f"point the checkpoint keys at weights of {what}"

    def adapter(self, model: nn.Module) -> ParallelAdapter | None:
        """``model`` as the ``apply_*`` functions see it (:class:`~titan_cp.parallel.adapter.ParallelAdapter`,
        its ``family`` this family's name), ``None`` for a model of another family. A family that
        overrides this has it registered by :func:`register_family`; the built-ins register their
        adapters beside their models (:mod:`titan_cp.families.llama3.parallelize`,
        :mod:`titan_cp.integrations.transformers`)."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


@dataclass(frozen=True)
class ModelSpec:
    """The model generation builds: its ``family``; ``what`` names it in errors (the config key);
    ``max_seq_len``: the longest sequence (prompt and generated tokens) it takes, ``bound`` what sets
    that (for errors); ``shapes``: every parameter's name (as checkpoints store it) and shape; ``args``
    (the Llama's ``ModelArgs``) or ``folder`` (a Hugging Face folder)."""

    family: ModelFamily
    what: str
    max_seq_len: int
    shapes: dict[str, tuple[int, ...]] = field(repr=False)
    args: Any = None
    folder: str | None = None
    aliases: tuple[str, ...] = ()  # other names a checkpoint may hold the parameters under (tied weights)
    bound: str = "max_seq_len"


_REGISTRY: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Make ``family`` selectable as ``model.name``, and its models parallelizable where it answers
    :meth:`ModelFamily.adapter` (registered with :func:`~titan_cp.parallel.adapter.register_adapter`)."""
    _REGISTRY[family.name] = family
    if type(family).adapter is not ModelFamily.adapter:
        register_adapter(family.adapter)
    return family


def family_names() -> tuple[str, ...]:
    """The registered families' names, in registration order (the built-ins register when the
    package ``titan_cp.families`` is imported, which Python does before any of its modules)."""
    return tuple(_REGISTRY)


def get_family(name: str) -> ModelFamily:
    """The family called ``name`` (``model.name``); ``ValueError`` naming the key and the choices for an unknown one."""
    check_choice("model.name", name, family_names())
    return _REGISTRY[name]


def family_of(model: nn.Module) -> ModelFamily:
    """The family of a built ``model``: its parallel adapter's (:func:`titan_cp.parallel.adapter.adapter_of`,
    the one place a model is recognised); ``ValueError`` for a model no family's adapter takes."""
    return get_family(adapter_of(model).family)
