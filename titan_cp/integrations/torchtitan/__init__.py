"""titan_cp as the context-parallel backend of torchtitan 0.3's own Trainer.

A module torchtitan's launcher accepts (``--module titan_cp.integrations.torchtitan --config NAME``:
torchtitan imports this module and calls the config function ``NAME``)::

    torchrun --nproc-per-node 8 -m torchtitan.train --module titan_cp.integrations.torchtitan \\
        --config llama3_debugmodel_cp --parallelism.context_parallel_degree 8 \\
        --titan_cp.strategy ring --titan_cp.balance doc_local

On a CPU (gloo) the same arguments go to ``torchrun --nproc-per-node N -m titan_cp.integrations.torchtitan.train``
(or ``python -m titan_cp.integrations.torchtitan.train`` alone, one process; :mod:`.train`: torchtitan's launcher
plus what torchtitan lacks on a CPU, and titan_cp's one-line errors).

A run of one's own gains titan_cp's CP in one call, in one's own module::

    from torchtitan.models.llama3.config_registry import llama3_8b
    from titan_cp.integrations.torchtitan import with_titan_cp

    llama3_8b_cp = with_titan_cp(llama3_8b, strategy="ulysses")

What it changes in torchtitan's config (:func:`with_titan_cp`): every layer's ``inner_attention``
becomes :class:`~.attention.TitanCPAttention` (titan_cp's exact packed-document attention; in gpt-oss with
the layer's window and its sinks, :mod:`.gpt_oss`); in Qwen3.5 each Gated DeltaNet's kernel and short
convolutions run titan_cp's linear ops (:mod:`.linear`); the
model's ``parallelize_fn`` becomes :class:`~.parallelize.TitanCPParallelize` (torchtitan's own,
with only its CP step replaced by titan_cp's), the Trainer becomes :class:`~.trainer.TitanCPTrainer`
(a ``titan_cp`` config section, checked with torchtitan's settings when built; one CP handle of it that
every layer reads; batches sharded by titan_cp's layout of their documents; loss metrics per
data-parallel rank) and the spmd backend ``partial_dtensor``. The CP size is torchtitan's
``--parallelism.context_parallel_degree``.

Tested with torchtitan 0.3.0 on CPU (gloo): Llama 3 (dense, GQA), Qwen3.5 (Gated DeltaNet and gated
attention; imported without ``fla``: :mod:`.without_fla`), gpt-oss (sliding windows and sinks: :mod:`.gpt_oss`)
Qwen3 MoE beside torchtitan's expert parallel and DeepSeek V3 (multi-head latent attention: a value head dim of
its own), on a 1-D cp mesh and hybrid's 2-D one.

Importing this package imports nothing of torchtitan: its names (below) load on first use, so
that :mod:`.train` can prepare torchtitan for a CPU before torchtitan reads its device.
"""

from __future__ import annotations

import importlib

TESTED_VERSION = "0.3.0"

_NAMES = {
    "configs": (
        "ASSETS",
        "llama3_8b_cp",
        "llama3_debugmodel_cp",
        "qwen3_debugmodel_cp",
        "gpt_oss_debugmodel_cp",
        "qwen3_moe_debugmodel_cp",
        "deepseek_v3_debugmodel_cp",
        "deepseek_v3_16b_cp",
        "deepseek_v3_671b_cp",
        "with_titan_cp",
        "qwen35_debugmodel_cp",
        "qwen35_0_8b_cp",
        "qwen35_2b_cp",
        "qwen35_4b_cp",
        "qwen35_9b_cp",
        "qwen35_27b_cp",
    ),
    "attention": ("DocumentAttention", "TitanCPAttention"),
    "linear": ("TitanCPGatedDeltaKernel", "TitanCPGatedDeltaNet"),
    "parallelize": ("TitanCPParallelize", "apply_titan_cp", "cp_handle"),
    "trainer": ("TitanCPConfig", "TitanCPTrainer", "check_run", "shard_by_documents"),
}
_MODULE_OF = {name: module for module, names in _NAMES.items() for name in names}
__all__ = sorted(_MODULE_OF)


def check_version() -> None:
    """``RuntimeError`` naming both versions when the installed torchtitan is not the tested one (not an
    ``ImportError``: torchtitan's launcher would take that for a module it may try another name for)."""
    import torchtitan  # noqa: PLC0415 - its __init__ reads the version only

    if torchtitan.__version__ != TESTED_VERSION:
        raise RuntimeError(
            f"titan_cp.integrations.torchtitan is written for torchtitan {TESTED_VERSION}, but torchtitan "
            f"{torchtitan.__version__} is installed: pip install torchtitan=={TESTED_VERSION}"
        )


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    check_version()
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
