"""The config functions of :mod:`titan_cp.integrations.torchtitan` and :func:`with_titan_cp` (see there)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

from torchtitan.models.common.attention import GQAttention
from torchtitan.trainer import Trainer

from titan_cp.attention.strategy import DEFAULT_STRATEGY
from titan_cp.integrations.torchtitan.attention import TitanCPAttention
from titan_cp.integrations.torchtitan.parallelize import TitanCPParallelize
from titan_cp.integrations.torchtitan.trainer import SPMD_BACKEND, TitanCPConfig, TitanCPTrainer
from titan_cp.layout import DEFAULT_BALANCE

ASSETS = Path(__file__).resolve().parents[3] / "train_configs" / "torchtitan"
"""The repository's tokenizer (``tokenizer/``) and packed-document data (``data/``) of the debug configs."""


def _use_titan_cp_attention(model_config) -> None:
    """Every layer's attention runs :class:`TitanCPAttention` (GQA attention only: another kind is
    refused by name, never run with a mask it does not describe)."""
    for i, layer in enumerate(model_config.layers):
        attention = getattr(layer, "attention", None)
        if not isinstance(attention, GQAttention.Config):
            raise ValueError(
                f"with_titan_cp runs torchtitan's GQA attention (Llama 3, Qwen3); layer {i} has "
                f"{type(attention).__qualname__}, which titan_cp does not replace"
            )
        attention.inner_attention = TitanCPAttention.Config()


def with_titan_cp(
    config_fn: Callable[[], Trainer.Config],
    strategy: str = DEFAULT_STRATEGY,
    balance: str = DEFAULT_BALANCE,
    kernel: str | None = None,
) -> Callable[[], TitanCPTrainer.Config]:
    """A config function: ``config_fn``'s run (a torchtitan Llama 3 / Qwen3 config function) with
    titan_cp's context parallelism (module docstring); ``strategy``, ``balance`` and ``kernel`` are the
    defaults of its ``titan_cp`` section, which torchtitan's CLI overrides (``--titan_cp.strategy``)."""
    section = TitanCPConfig(strategy=strategy, balance=balance, kernel=kernel)  # checks the names now

    def config() -> TitanCPTrainer.Config:
        base = config_fn()
        if type(base) is not Trainer.Config:
            raise ValueError(
                f"with_titan_cp wraps a function returning torchtitan's Trainer.Config; "
                f"{getattr(config_fn, '__name__', config_fn)} returns {type(base).__qualname__}"
            )
        spec = base.model_spec
        _use_titan_cp_attention(spec.model)
        spec.parallelize_fn = TitanCPParallelize(spec.parallelize_fn)
        out = TitanCPTrainer.Config(
            **{f.name: getattr(base, f.name) for f in fields(Trainer.Config)},
            titan_cp=TitanCPConfig(strategy=section.strategy, balance=section.balance, kernel=section.kernel),
        )
        out.parallelism.spmd_backend = SPMD_BACKEND
        return out

    config.__name__ = config.__qualname__ = f"{getattr(config_fn, '__name__', 'config')}_cp"
    config.__doc__ = f"{config.__name__}: torchtitan's {config.__name__[:-3]} with titan_cp's context parallelism."
    return config


def llama3_debugmodel_cp() -> TitanCPTrainer.Config:
    """torchtitan's ``llama3_debugmodel`` with titan_cp's CP, reading the repository's byte-level
    tokenizer and packed-document data set (no network), with float32 parameters (torchtitan's
    default computes in bfloat16, whose rounding differs with the token order: a CP run would then
    match the one-process run to ~1e-4, not to float32's reduction order)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: PLC0415

    config = with_titan_cp(llama3_debugmodel)()
    config.hf_assets_path = str(ASSETS / "tokenizer")
    config.dataloader.dataset_path = str(ASSETS / "data")
    config.training.mixed_precision_param = "float32"
    return config
