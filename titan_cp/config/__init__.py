"""torchtitan-style job configuration: one dataclass per TOML section.

Precedence is CLI > TOML > defaults::

    job_config = load_config(["--job.config_file", "train_configs/debug_cp.toml",
                              "--training.steps", "5", "--parallelism.context_parallel_degree=2"])

Section and key names follow torchtitan's v0.2 ``JobConfig`` (``job``, ``metrics``, ``model``,
``optimizer``, ``lr_scheduler``, ``training``, ``parallelism``, ``checkpoint``,
``activation_checkpoint``, ``compile``, ``validation``, ``comm``, ...), so a torchtitan Llama 3
TOML loads unmodified:

- torchtitan keys that titan_cp does not implement (``[float8]``, ``model.converters``, ...) are
  accepted and ignored, all listed in one warning;
- legacy torchtitan keys that were renamed (``checkpoint.enable_checkpoint``,
  ``training.batch_size``, ...) are applied to their new name and listed in the same warning;
- a key that neither defines is a ``ValueError`` with a "did you mean" hint.

CLI overrides: ``--section.key value`` or ``--section.key=value``; booleans also as a bare
``--section.flag`` (true) or ``--section.no_flag`` (false); lists comma-separated; ``none`` for an
optional value.

:func:`load_config` validates the values (:meth:`JobConfig.validate`), then checks them across
sections and makes the adjustments that calls for (:meth:`JobConfig.reconcile`; training's checks, not
made for generation: ``load_config(argv, training=False)``), without starting any process group. The model family's own rules (``model.name``, ``model.flavor``, the
model's heads and layers against the degrees) are the family's, checked by
:func:`titan_cp.preflight.check_model`: this package imports no model, parallel or family code
(docs/architecture.md). What needs the world size (mesh degrees, the gradient-accumulation
count when ``parallelism.data_parallel_shard_degree = -1``) is checked by
``titan_cp.mesh.ParallelDims`` and :meth:`JobConfig.resolve_batch_sizes` at run time.

Modules: :mod:`.values` (bounds declared beside each field, the one walker of type hints),
:mod:`.sections`, :mod:`.training`, :mod:`.parallelism`, :mod:`.generate` (the sections), :mod:`.job`
(:class:`JobConfig` and the checks across sections), :mod:`.torchtitan` (compatibility tables),
:mod:`.loader` (TOML and command line, :func:`usage`).
"""

from titan_cp.config.generate import Generate
from titan_cp.config.job import JobConfig
from titan_cp.config.loader import load_config, usage
from titan_cp.config.parallelism import Parallelism
from titan_cp.config.sections import (
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Compile,
    Job,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Profiling,
    Validation,
)
from titan_cp.config.training import MixtureSource, Training

__all__ = [
    "ActivationCheckpoint",
    "Checkpoint",
    "Comm",
    "Compile",
    "Generate",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Metrics",
    "MixtureSource",
    "Model",
    "Optimizer",
    "Parallelism",
    "Profiling",
    "Training",
    "Validation",
    "load_config",
    "usage",
]
