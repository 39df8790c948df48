"""The config functions of :mod:`titan_cp.integrations.torchtitan` and :func:`with_titan_cp` (see there)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig, FullAC, SelectiveAC
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common.attention import GQAttention
from torchtitan.trainer import Trainer

from titan_cp.attention.strategy import DEFAULT_STRATEGY
from titan_cp.integrations.torchtitan.attention import TitanCPAttention
from titan_cp.integrations.torchtitan.parallelize import TitanCPParallelize
from titan_cp.integrations.torchtitan.trainer import (
    CP_FLAG,
    SPMD_BACKEND,
    TitanCPConfig,
    TitanCPTrainer,
    has_linear_layers,
)
from titan_cp.integrations.torchtitan.without_fla import QWEN35, import_qwen35
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


def _use_titan_cp(model_config) -> None:
    """Every layer runs titan_cp: GQA attention's inner attention (Llama 3, Qwen3), or, in a model with
    linear-attention layers (torchtitan's Qwen3.5), those layers' kernels too (:mod:`.linear`)."""
    if has_linear_layers(model_config):
        from titan_cp.integrations.torchtitan.linear import use_titan_cp_linear  # noqa: PLC0415 - imports Qwen3.5

        use_titan_cp_linear(model_config)
    else:
        _use_titan_cp_attention(model_config)


def with_titan_cp(
    config_fn: Callable[[], Trainer.Config],
    strategy: str = DEFAULT_STRATEGY,
    balance: str = DEFAULT_BALANCE,
    kernel: str | None = None,
    ulysses_degree: int = 1,
) -> Callable[[], TitanCPTrainer.Config]:
    """A config function: ``config_fn``'s run (a torchtitan Llama 3 / Qwen3 / Qwen3.5 config function) with
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
        _use_titan_cp(spec.model)
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


# ---------------------------------------------------------------------------- Qwen3.5 (hybrid: Gated DeltaNet)
DEBUG_VOCAB = 2048
"""The vocabulary of :func:`qwen35_debugmodel_cp` (torchtitan's Llama 3 debug model's): torchtitan's Qwen3.5
debug model has Qwen's 248,320 rows, which the repository's 302-token tokenizer does not use and whose
output projection would be most of a CPU step."""


def _qwen35_text(flavor: str, lr: float, ac: Callable[[], ActivationCheckpointingConfig]) -> Trainer.Config:
    """torchtitan's Qwen3.5 ``flavor`` (its ``model_registry``; torchtitan's recipe's learning rate ``lr``,
    20 warm-up steps and activation checkpointing, ``ac()``) on text: torchtitan's text dataloader and the
    model's Hugging Face tokenizer (``./assets/hf/Qwen3.5-<flavor>``, as torchtitan's recipe). torchtitan's own
    Qwen3.5 recipes read image-text data through its multimodal dataloader (which imports torchvision), whose
    vision inputs titan_cp's Trainer does not shard: it runs Qwen3.5's text decoder."""
    import_qwen35(QWEN35)
    from torchtitan.models.qwen3_5 import model_registry  # noqa: PLC0415 - after import_qwen35

    spec = model_registry(flavor)
    return Trainer.Config(
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=spec.model.vocab_size)),
        hf_assets_path=f"./assets/hf/Qwen3.5-{flavor}",
        model_spec=spec,
        optimizer=default_adamw(lr=lr),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=20),
        training=TrainingConfig(local_batch_size=1, seq_len=131072, steps=1000),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4"),
        parallelism=ParallelismConfig(context_parallel_degree=8),
        checkpoint=CheckpointManager.Config(interval=500, last_save_model_only=False),
        activation_checkpoint=ac(),
    )


def _qwen35_debugmodel() -> Trainer.Config:
    """torchtitan's Qwen3.5 ``debugmodel`` (8 layers: 6 Gated DeltaNet, 2 gated attention with 4 query and
    2 KV heads) with a :data:`DEBUG_VOCAB`-token vocabulary, its debug recipe's training settings (lr
    5e-3, 2 warm-up steps, linear decay), 10 steps of 2 rows of 256 tokens, on torchtitan's c4_test text
    loader."""
    config = _qwen35_text("debugmodel", 5e-3, SelectiveAC.Config)
    model = config.model_spec.model
    model.vocab_size = model.tok_embeddings.num_embeddings = model.lm_head.out_features = DEBUG_VOCAB
    config.loss.loss_fn.global_vocab_size = DEBUG_VOCAB
    config.lr_scheduler = LRSchedulersContainer.Config(
        warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
    )
    config.training = TrainingConfig(local_batch_size=2, seq_len=256, steps=10)
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset="c4_test")
    config.parallelism = ParallelismConfig()
    config.metrics = MetricsProcessor.Config(log_freq=1)
    config.checkpoint = CheckpointManager.Config(interval=10, last_save_model_only=False)
    return config


def qwen35_debugmodel_cp() -> TitanCPTrainer.Config:
    """:func:`_qwen35_debugmodel` with titan_cp's CP (its attention, Gated DeltaNet and convolutions), offline
    (:func:`_offline_debug`)."""
    return _offline_debug(with_titan_cp(_qwen35_debugmodel)())


def _qwen35_cp(
    flavor: str, lr: float, ac: Callable[[], ActivationCheckpointingConfig]
) -> Callable[[], TitanCPTrainer.Config]:
    """The config function ``qwen35_<flavor>_cp`` of :func:`_qwen35_text`'s run."""

    def base() -> Trainer.Config:
        return _qwen35_text(flavor, lr, ac)

    base.__name__ = f"qwen35_{flavor.lower().replace('.', '_')}"
    config = with_titan_cp(base)
    config.__doc__ = (
        f"torchtitan's Qwen3.5 {flavor} on text (:func:`_qwen35_text`) at 128K tokens a row, CP 8 by default "
        f"(``{CP_FLAG}`` to change it), with titan_cp's CP in every layer."
    )
    return config


qwen35_0_8b_cp = _qwen35_cp("0.8B", 5e-3, SelectiveAC.Config)
qwen35_2b_cp = _qwen35_cp("2B", 5e-3, SelectiveAC.Config)
qwen35_4b_cp = _qwen35_cp("4B", 5e-4, FullAC.Config)
qwen35_9b_cp = _qwen35_cp("9B", 5e-4, FullAC.Config)
qwen35_27b_cp = _qwen35_cp("27B", 5e-4, FullAC.Config)
