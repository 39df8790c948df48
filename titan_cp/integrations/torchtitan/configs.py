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
from torchtitan.models.deepseek_v3.model import Attention as MLAttention
from torchtitan.trainer import Trainer

from titan_cp.attention.strategy import DEFAULT_STRATEGY
from titan_cp.integrations.torchtitan.attention import TitanCPAttention
from titan_cp.integrations.torchtitan.gpt_oss import is_gpt_oss, use_titan_cp_gpt_oss
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


PLAIN_ATTENTIONS = (GQAttention.Config, MLAttention.Config)
"""torchtitan's attention configs whose layer calls its inner attention as :class:`TitanCPAttention` takes it, with no
mask or transform of its own: GQA (Llama 3, Qwen3, Qwen3 MoE) and DeepSeek V3's multi-head latent attention (q and k of
``qk_nope_head_dim + qk_rope_head_dim``, v of ``v_head_dim``: a value head dim of its own; the layer's YaRN scale)."""


def _use_titan_cp_attention(model_config) -> None:
    """Every layer's attention runs :class:`TitanCPAttention` (:data:`PLAIN_ATTENTIONS` only: another kind is
    refused by name, never run with a mask it does not describe)."""
    for i, layer in enumerate(model_config.layers):
        attention = getattr(layer, "attention", None)
        if not isinstance(attention, PLAIN_ATTENTIONS):
            raise ValueError(
                f"with_titan_cp runs torchtitan's GQA attention (Llama 3, Qwen3), DeepSeek V3's MLA, gpt-oss's and "
                f"Qwen3.5's; layer {i} has {type(attention).__qualname__}, which titan_cp does not replace"
            )
        attention.inner_attention = TitanCPAttention.Config()


def _use_titan_cp(model_config) -> None:
    """Every layer runs titan_cp: GQA attention's inner attention (Llama 3, Qwen3); in gpt-oss its windows and sinks
    too (:mod:`.gpt_oss`); in a model with linear-attention layers (torchtitan's Qwen3.5), those layers' kernels too
    (:mod:`.linear`)."""
    if has_linear_layers(model_config):
        from titan_cp.integrations.torchtitan.linear import use_titan_cp_linear  # noqa: PLC0415 - imports Qwen3.5

        use_titan_cp_linear(model_config)
    elif is_gpt_oss(model_config):
        use_titan_cp_gpt_oss(model_config)
    else:
        _use_titan_cp_attention(model_config)


def with_titan_cp(
    config_fn: Callable[[], Trainer.Config],
    strategy: str = DEFAULT_STRATEGY,
    balance: str = DEFAULT_BALANCE,
    kernel: str | None = None,
    ulysses_degree: int = 1,
) -> Callable[[], TitanCPTrainer.Config]:
    """A config function: ``config_fn``'s run (a torchtitan Llama 3 / Qwen3 / Qwen3 MoE / gpt-oss / DeepSeek V3 /
    Qwen3.5 config function) with titan_cp's context parallelism (module docstring); ``strategy``, ``balance``,
    ``kernel`` and ``ulysses_degree`` (hybrid) are the defaults of its ``titan_cp`` section (checked now), which
    torchtitan's CLI overrides (``--titan_cp.strategy hybrid --titan_cp.ulysses_degree 2``). The layers' attention
    holds none of them: the Trainer builds one CP handle of the section, which every layer reads."""
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


DEBUG_EXPERT_HIDDEN = 256
"""The experts' hidden size of :func:`gpt_oss_debugmodel_cp`: torchtitan's gpt-oss debug model has the 20B's 2880,
whose 71M expert parameters (of 81M) would be most of a CPU step, its checkpoints and its optimizer."""
DEBUG_ROPE_POSITIONS = 4096
"""The positions :func:`gpt_oss_debugmodel_cp`'s RoPE caches (YaRN's original length; a buffer, not a weight):
torchtitan's debug model caches 131,072 in every layer, a second of each process's start on a CPU."""


def gpt_oss_debugmodel_cp() -> TitanCPTrainer.Config:
    """torchtitan's ``gpt_oss_debugmodel`` (4 layers, a 128-token sliding window on layers 0 and 2, per-head sinks,
    64 query and 8 KV heads, YaRN's softmax scale, 8 experts, top 4) with titan_cp's CP (:mod:`.gpt_oss`), offline
    and float32 (:func:`_offline_debug`), its experts of hidden size :data:`DEBUG_EXPERT_HIDDEN`, RoPE cached for
    :data:`DEBUG_ROPE_POSITIONS` positions, 1 row of 256 tokens a step."""
    from torchtitan.models.gpt_oss.config_registry import gpt_oss_debugmodel  # noqa: PLC0415

    config = _offline_debug(with_titan_cp(gpt_oss_debugmodel)())
    for layer in config.model_spec.model.layers:
        layer.moe.routed_experts.inner_experts.hidden_dim = DEBUG_EXPERT_HIDDEN
        layer.attention.rope.max_seq_len = DEBUG_ROPE_POSITIONS
    config.training.seq_len, config.training.local_batch_size = 256, 1
    return config


DEBUG_MOE = {"n_layers": 2, "num_experts": 8, "top_k": 2, "moe_hidden_dim": 256}
"""The sizes of :func:`qwen3_moe_debugmodel_cp`'s Qwen3 MoE (torchtitan's debug MoE has 8 layers of 64 experts of
hidden size 768, top 8: 302M parameters, minutes a CPU step)."""


def _qwen3_moe_debugmodel() -> Trainer.Config:
    """torchtitan's ``qwen3_moe_debug`` recipe (lr 3e-4, 2 warm-up steps, selective activation checkpointing) and
    its debug MoE's attention (16 query and 8 KV heads of 128, q/k norms), of :data:`DEBUG_MOE`'s sizes (torchtitan's
    own MoE layers, load-balancing bias and all), 1 row of 256 tokens a step (each data-parallel rank)."""
    from torchtitan.models.qwen3 import _build_qwen3_moe_layers  # noqa: PLC0415 - torchtitan's debug MoE's builder
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug  # noqa: PLC0415

    config = qwen3_moe_debug()
    model = config.model_spec.model
    attention = model.layers[0].attention
    model.layers = _build_qwen3_moe_layers(
        dim=model.dim,
        n_heads=attention.n_heads,
        n_kv_heads=attention.n_kv_heads,
        head_dim=attention.head_dim,
        attn_backend="flex",
        moe_comm_backend="standard",
        rope=attention.rope,
        **DEBUG_MOE,
    )
    config.training.seq_len, config.training.local_batch_size = 256, 1
    return config


def qwen3_moe_debugmodel_cp() -> TitanCPTrainer.Config:
    """:func:`_qwen3_moe_debugmodel` with titan_cp's CP, offline (:func:`_offline_debug`): beside torchtitan's
    expert parallelism (``--parallelism.expert_parallel_degree``)."""
    return _offline_debug(with_titan_cp(_qwen3_moe_debugmodel)())


DEBUG_DEEPSEEK_LAYERS = 3
"""The layers of :func:`deepseek_v3_debugmodel_cp`: torchtitan's debug model's first 3 of 6 (its dense layer and two
MoE layers), whose 33M parameters would be most of the suite's torchtitan time on a CPU."""


def deepseek_v3_debugmodel_cp() -> TitanCPTrainer.Config:
    """torchtitan's ``deepseek_v3_debugmodel`` (6 layers, multi-head latent attention: 16 heads, q/k 128 + 64 of
    RoPE, v 128, YaRN's scale; a dense layer then MoE layers of 8 experts, top 3, and 2 shared) with titan_cp's CP,
    offline and float32 (:func:`_offline_debug`), 1 row of 256 tokens a step."""
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel  # noqa: PLC0415

    config = _offline_debug(with_titan_cp(deepseek_v3_debugmodel)())
    config.model_spec.model.layers = config.model_spec.model.layers[:DEBUG_DEEPSEEK_LAYERS]
    config.training.seq_len, config.training.local_batch_size = 256, 1
    return config


LONG_CONTEXT = 131072
"""Tokens a row of the long-context config functions (:func:`llama3_8b_cp`, DeepSeek V3's), CP 8 by default."""


def _long_context(config: TitanCPTrainer.Config) -> TitanCPTrainer.Config:
    """``config`` at :data:`LONG_CONTEXT` tokens a row (each layer's RoPE cached for as many positions), one row per
    data-parallel rank, CP 8 over one node by default (``--parallelism.context_parallel_degree`` to change it)."""
    config.training.seq_len, config.training.local_batch_size = LONG_CONTEXT, 1
    for layer in config.model_spec.model.layers:
        rope = layer.attention.rope
        rope.max_seq_len = max(rope.max_seq_len, LONG_CONTEXT)
    config.parallelism.context_parallel_degree = 8
    return config


def deepseek_v3_16b_cp() -> TitanCPTrainer.Config:
    """torchtitan's ``deepseek_v3_16b`` (27 layers, MLA with 16 heads, 64 experts; its expert parallel 8) at 128K
    tokens a row (YaRN's factor 40 over 4096: 163,840 positions), CP 8 by default (:func:`_long_context`)."""
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_16b  # noqa: PLC0415

    return _long_context(with_titan_cp(deepseek_v3_16b)())


def deepseek_v3_671b_cp() -> TitanCPTrainer.Config:
    """torchtitan's ``deepseek_v3_671b`` (61 layers, MLA with 128 heads, 256 experts; its expert parallel 2) at 128K
    tokens a row, CP 8 by default (:func:`_long_context`)."""
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_671b  # noqa: PLC0415

    return _long_context(with_titan_cp(deepseek_v3_671b)())


def llama3_8b_cp() -> TitanCPTrainer.Config:
    """torchtitan's ``llama3_8b`` at 128K tokens a row (its RoPE's length), CP 8 over one node by default
    (:func:`_long_context`)."""
    from torchtitan.models.llama3.config_registry import llama3_8b  # noqa: PLC0415

    return _long_context(with_titan_cp(llama3_8b)())


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


DEBUG_QWEN35_LAYERS = 4
"""The layers of :func:`qwen35_debugmodel_cp`: torchtitan's Qwen3.5 debug model's first 4 of 8 (3 Gated DeltaNet and a
gated attention: its pattern once), whose second four would double the suite's Qwen3.5 time on a CPU."""


def _qwen35_debugmodel() -> Trainer.Config:
    """torchtitan's Qwen3.5 ``debugmodel`` (8 layers: 6 Gated DeltaNet, 2 gated attention with 4 query and
    2 KV heads), its first :data:`DEBUG_QWEN35_LAYERS`, with a :data:`DEBUG_VOCAB`-token vocabulary, its debug
    recipe's training settings (lr 5e-3, 2 warm-up steps, linear decay), 10 steps of 2 rows of 256 tokens, on
    torchtitan's c4_test text loader."""
    config = _qwen35_text("debugmodel", 5e-3, SelectiveAC.Config)
    model = config.model_spec.model
    model.layers = model.layers[:DEBUG_QWEN35_LAYERS]
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
