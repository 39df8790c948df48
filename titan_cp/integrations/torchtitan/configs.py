"""The config functions of :mod:`titan_cp.integrations.torchtitan` and :func:`with_titan_cp` (see there)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace
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
        if hasattr(attention, "sliding_window_size"):  # gpt-oss: windows, and sinks from the inner LSE
            raise ValueError(
                f"with_titan_cp does not run torchtitan's gpt-oss yet: its attention (layer {i}) applies per-layer "
                "sliding windows and per-head sinks through an out_transform of the inner attention's log-sum-exp, "
                "which TitanCPAttention does not return; titan_cp runs gpt-oss's windows and sinks exactly through "
                "transformers (context_parallel_trainer, apply_cp) and its own trainer"
            )
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
    ulysses_degree: int = 1,
) -> Callable[[], TitanCPTrainer.Config]:
    """A config function: ``config_fn``'s run (a torchtitan Llama 3 / Qwen3 config function) with
    titan_cp's context parallelism (module docstring); ``strategy``, ``balance``, ``kernel`` and
    ``ulysses_degree`` (hybrid) are the defaults of its ``titan_cp`` section (checked now), which torchtitan's
    CLI overrides (``--titan_cp.strategy hybrid --titan_cp.ulysses_degree 2``). The layers' attention holds
    none of them: the Trainer builds one CP handle of the section, which every layer reads."""
    section = TitanCPConfig(strategy=strategy, balance=balance, kernel=kernel, ulysses_degree=ulysses_degree)
    section.check()

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
        base.parallelism.spmd_backend = SPMD_BACKEND
        return TitanCPTrainer.Config(
            **{f.name: getattr(base, f.name) for f in fields(Trainer.Config)},
            titan_cp=replace(section),
        )

    config.__name__ = config.__qualname__ = f"{getattr(config_fn, '__name__', 'config')}_cp"
    config.__doc__ = f"{config.__name__}: torchtitan's {config.__name__[:-3]} with titan_cp's context parallelism."
    return config


def _offline_debug(config: TitanCPTrainer.Config) -> TitanCPTrainer.Config:
    """A debug config reading the repository's byte-level tokenizer and packed-document data set (no
    network), with float32 parameters: torchtitan's default computes in bfloat16, whose rounding
    differs with the token order, so a CP run would match the one-process run to ~1e-4, not to
    float32's reduction order."""
    config.hf_assets_path = str(ASSETS / "tokenizer")
    config.dataloader.dataset_path = str(ASSETS / "data")
    config.training.mixed_precision_param = "float32"
    return config


def llama3_debugmodel_cp() -> TitanCPTrainer.Config:
    """torchtitan's ``llama3_debugmodel`` (6 layers, 16 heads) with titan_cp's CP, offline (:func:`_offline_debug`)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: PLC0415

    return _offline_debug(with_titan_cp(llama3_debugmodel)())


def qwen3_debugmodel_cp() -> TitanCPTrainer.Config:
    """torchtitan's ``qwen3_debugmodel`` (8 layers, q/k norms, head_dim 128) with titan_cp's CP, offline
    (:func:`_offline_debug`)."""
    from torchtitan.models.qwen3.config_registry import qwen3_debugmodel  # noqa: PLC0415

    return _offline_debug(with_titan_cp(qwen3_debugmodel)())


def llama3_8b_cp() -> TitanCPTrainer.Config:
    """torchtitan's ``llama3_8b`` at 128K tokens a row (its RoPE's length), CP 8 over one node by default
    (``--parallelism.context_parallel_degree`` to change it), one row per data-parallel rank."""
    from torchtitan.models.llama3.config_registry import llama3_8b  # noqa: PLC0415

    config = with_titan_cp(llama3_8b)()
    config.training.seq_len, config.training.local_batch_size = 131072, 1
    config.parallelism.context_parallel_degree = 8
    return config
