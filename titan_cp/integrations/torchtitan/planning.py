"""What the planner reads of a torchtitan 0.3 run: ``python -m titan_cp.plan --module M --config F``.

:func:`config_function` finds the config function as torchtitan's ``ConfigManager`` does
(``<M>.config_registry``, then ``<M>``; one clear line for a module that does not import or a
name that is not there), and :func:`read_run` builds its ``Trainer.Config`` with torchtitan's own
command line (``--training.seq_len 65536``, ``--titan_cp.strategy ulysses``) and reads what the
planner plans (:class:`PlannedRun`):

- the model's shapes from its ``model_spec.model`` (torchtitan's Llama 3 / Qwen3 / Qwen3.5 / DeepSeek V3
  ``Decoder``: ``dim``, the layers, query and KV heads, head size, q/k norms, feed-forward width, vocabulary,
  weight tying; DeepSeek V3's multi-head latent attention; the MoE layers' experts), as
  :class:`TorchtitanShapes`; layers of a kind that differ in shape are refused;
- ``training.seq_len``, ``local_batch_size``, ``global_batch_size``, ``mixed_precision_param``,
  ``enable_cpu_offload``; the parallelism degrees and pipeline settings it sets; its activation
  checkpointing (``SelectiveAC`` is op-level, ``FullAC`` full, ``None`` none, ``MemoryBudgetAC``
  planned as full); and its ``titan_cp`` section's strategy and balance: as titan_cp config keys
  (:attr:`PlannedRun.keys`), the planner's input for a torchtitan 0.2 TOML too.

The strategies it runs are those of a 1-D cp mesh (:func:`runs_strategy`: torchtitan's cp axis is
1-D), without pipeline parallelism (titan_cp's CP under torchtitan's pipeline is not run yet).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torchtitan.config import ConfigManager
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.models.common.attention import GQAttention
from torchtitan.trainer import Trainer

from titan_cp.attention.strategy import get_strategy
from titan_cp.errors import did_you_mean
from titan_cp.integrations.hf_shapes import LINEAR_KINDS, HFShapes, LinearShapes, MLAShapes, MoEShapes

BUILDS_PIPELINE = False
"""Whether titan_cp's CP runs under torchtitan's pipeline parallelism (not run yet: no pipeline meshes planned)."""


@dataclass
class TorchtitanShapes(HFShapes):
    """The planner's shapes of a torchtitan model: :class:`~titan_cp.integrations.hf_shapes.HFShapes`'s explicit
    head size (``hf_head_dim``), feed-forward width (``hf_ffn``) and weight tying, read from its config."""


@dataclass(frozen=True)
class PlannedRun:
    """A torchtitan run as the planner takes it: ``module`` and ``config`` (as given, for the launch line),
    the model's ``shapes``, its ``label`` in the plan (``torchtitan:<model>/<flavor>``), ``keys`` (titan_cp
    config keys of its training, parallelism, activation checkpointing and titan_cp section) and its
    activation checkpointing as titan_cp's ``activation_checkpoint.mode`` (``ac``), its expert-parallel degree (``ep``)
    and whether it runs CUDA graphs (``cuda_graphs``: torchtitan refuses them beside EP's all-to-all dispatcher)."""

    module: str
    config: str
    shapes: TorchtitanShapes
    label: str
    keys: tuple[str, ...]
    ac: str
    ep: int = 1
    cuda_graphs: bool = False


def runs_strategy(name: str) -> bool:
    """Whether titan_cp's torchtitan integration runs the CP strategy ``name``: one of a 1-D cp mesh, or
    hybrid's 2-D mesh, which it makes of torchtitan's cp axis (``--titan_cp.ulysses_degree``)."""
    strategy = get_strategy(name)
    return strategy.mesh_ndim == 1 or strategy.takes_ulysses_degree()


def _not_found(error: ImportError, name: str) -> bool:
    """Whether ``error`` says that ``name`` itself (or a package above it) is not there, not that the
    module failed inside, importing something else."""
    missing = getattr(error, "name", None)
    return isinstance(error, ModuleNotFoundError) and missing is not None and f"{name}.".startswith(f"{missing}.")


def _close_modules(module: str) -> str:
    """``; did you mean ...?`` among the modules beside ``module`` (its package's), else ``""``."""
    parent, _, _ = module.rpartition(".")
    try:
        path = getattr(importlib.import_module(parent), "__path__", None) if parent else None
    except ImportError:
        return ""
    import pkgutil  # noqa: PLC0415 - only for this hint

    beside = [f"{parent}.{m.name}" for m in pkgutil.iter_modules(path)] if path is not None else []
    return did_you_mean(module, beside)


def config_function(module: str, name: str) -> Callable[[], Any]:
    """The config function ``name`` of ``module``, found as torchtitan's ``ConfigManager`` finds it:
    ``<module>.config_registry``, then ``<module>``. ``ValueError`` (one line) when the module does not
    import, or has no such function (naming the close ones)."""
    found = None
    for candidate in (f"{module}.config_registry", module):
        try:
            found = importlib.import_module(candidate)
            break
        except ImportError as e:
            if not _not_found(e, candidate):
                raise ValueError(f"--module {module!r} does not import: {type(e).__name__}: {e}") from None
    if found is None:
        raise ValueError(
            f"--module {module!r} does not import: no module {module!r} (nor {module}.config_registry)"
            f"{_close_modules(module)}"
        )
    fn = getattr(found, name, None)
    if not callable(fn):
        names = _config_functions(found)
        raise ValueError(
            f"--config {name!r} is not a config function of {found.__name__}{did_you_mean(name, names)} "
            f"(its config functions: {', '.join(names) or 'none'})"
        )
    return fn


def _config_functions(module: Any) -> list[str]:
    """The public functions of ``module`` annotated to return a ``...Config`` (torchtitan's ``Trainer.Config``
    or a subclass's), as config functions are; every public lowercase callable when none is annotated so."""
    names = [n for n in dir(module) if not n.startswith("_") and n[0].islower() and callable(getattr(module, n))]

    def returns_config(name: str) -> bool:
        annotation = getattr(getattr(module, name), "__annotations__", {}).get("return")
        return str(getattr(annotation, "__qualname__", annotation)).endswith("Config")

    return [n for n in names if returns_config(n)] or names


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torchtitan's notes while building a config (assets not on this machine...) silenced: its logger is
    the root logger."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def read_run(module: str, name: str, args: list[str]) -> PlannedRun:
    """The :class:`PlannedRun` of torchtitan's ``--module module --config name`` with torchtitan's
    command-line overrides ``args``. ``ValueError`` for a config without a ``titan_cp`` section, a model
    the planner does not hold (module docstring), or a lookup that fails (:func:`config_function`)."""
    config_function(module, name)  # its errors in one line, before torchtitan's own lookup
    with _quiet():
        config = ConfigManager().parse_args(["--module", module, "--config", name, *args])
    section = getattr(config, "titan_cp", None)
    if not isinstance(config, Trainer.Config) or section is None:
        raise ValueError(
            f"--config {name!r} of {module} returns {type(config).__qualname__} without a titan_cp section: plan "
            "a config function made with titan_cp.integrations.torchtitan.with_titan_cp (docs/torchtitan.md)"
        )
    section.check()  # its strategy, balance and kernel names, in one line naming the flag
    spec = config.model_spec
    if spec is None:
        raise ValueError(f"--config {name!r} of {module} sets no model_spec: the planner plans its model")
    shapes = model_shapes(spec.model, f"--config {name!r}", f"torchtitan:{spec.name}/{spec.flavor}")
    ac = _ac_mode(config.activation_checkpoint)
    keys = tuple(_keys(config, section, ac))
    ep, graphs = config.parallelism.expert_parallel_degree, not config.training.disable_cuda_graphs
    return PlannedRun(module, name, shapes, shapes.name, keys, ac, ep, graphs)


def _ac_mode(ac: Any) -> str:
    """titan_cp's ``activation_checkpoint.mode`` of torchtitan 0.3's policy (a config object or None)."""
    if ac is None:
        return "none"
    if isinstance(ac, (FullAC.Config, SelectiveAC.Config)):
        return "full" if isinstance(ac, FullAC.Config) else "op"  # SelectiveAC is per op
    return "full"  # MemoryBudgetAC: at most full checkpointing's memory (the planner's bound)


def _keys(config: Any, section: Any, ac: str) -> list[str]:
    """The titan_cp config keys of ``config``'s training, parallelism and activation checkpointing and
    of its ``titan_cp`` ``section``, as ``--key=value`` arguments."""
    t, p = config.training, config.parallelism
    values = {
        "training.seq_len": t.seq_len,
        "training.local_batch_size": t.local_batch_size,
        "training.global_batch_size": t.global_batch_size,
        "training.mixed_precision_param": t.mixed_precision_param,
        "training.enable_cpu_offload": str(t.enable_cpu_offload).lower(),
        "parallelism.data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "parallelism.data_parallel_shard_degree": p.data_parallel_shard_degree,
        "parallelism.fsdp_reshard_after_forward": p.fsdp_reshard_after_forward,
        "parallelism.tensor_parallel_degree": p.tensor_parallel_degree,
        "parallelism.pipeline_parallel_degree": p.pipeline_parallel_degree,
        "parallelism.pipeline_parallel_schedule": p.pipeline_parallel_schedule,
        "parallelism.pipeline_parallel_microbatch_size": p.pipeline_parallel_microbatch_size,
        "parallelism.context_parallel_degree": p.context_parallel_degree,
        "parallelism.context_parallel_strategy": section.strategy,
        "parallelism.context_parallel_load_balancer": section.balance,
        "activation_checkpoint.mode": ac,
    }
    return [f"--{key}={value}" for key, value in values.items()]


def model_shapes(model: Any, what: str, label: str = "torchtitan") -> TorchtitanShapes:
    """The planner's shapes of torchtitan's model config ``model`` (a ``Decoder.Config``: Llama 3,
    Qwen3, Qwen3 MoE, Qwen3.5, DeepSeek V3), named ``label`` in the plan; ``what`` names it in errors. Every
    attention layer must be a GQA block (Qwen3.5's gated one too) or DeepSeek V3's MLA of the same shapes, every
    Gated DeltaNet layer (Qwen3.5's linear layers: :class:`~titan_cp.integrations.hf_shapes.LinearShapes`) too,
    the dense feed-forwards of one width and the MoE layers of one :class:`~titan_cp.integrations.hf_shapes.MoEShapes`."""
    layers = getattr(model, "layers", None)
    if not layers:
        raise ValueError(
            f"{what}: the planner reads a torchtitan decoder (Llama 3, Qwen3); {type(model).__name__} has no layers"
        )
    linear_layers = tuple(i for i, layer in enumerate(layers) if getattr(layer, "delta_net", None) is not None)
    moe_layers = tuple(i for i, layer in enumerate(layers) if getattr(layer, "moe", None) is not None)
    shapes = {_layer_shapes(layer, model.dim, what, i) for i, layer in enumerate(layers) if i not in linear_layers}
    linear = {_linear_shapes(layers[i].delta_net) for i in linear_layers}
    ffns = {_feed_forward(layer, what, i) for i, layer in enumerate(layers) if i not in moe_layers}
    moes = {_moe(layers[i].moe) for i in moe_layers}
    if len(shapes) != 1 or len(linear) > 1 or len(ffns) > 1 or len(moes) > 1:
        raise ValueError(
            f"{what}: the layers differ in shape {sorted(map(str, shapes))} {sorted(map(str, linear))} "
            f"{sorted(ffns)} {sorted(map(str, moes))}; the planner plans one shape for every layer of a kind"
        )
    ((heads, kv_heads, head_dim, gate, qk_norm, mla),) = shapes
    moe = next(iter(moes)) if moes else None
    first = next(layer for i, layer in enumerate(layers) if i not in linear_layers)
    return TorchtitanShapes(
        dim=model.dim,
        n_layers=len(layers),
        n_heads=heads,
        n_kv_heads=kv_heads,
        vocab_size=model.vocab_size,
        max_seq_len=first.attention.rope.max_seq_len,
        hf_head_dim=head_dim,
        hf_ffn=next(iter(ffns)) if ffns else moe.hidden if moe is not None else 0,
        tied=bool(model.enable_weight_tying),
        name=label,
        q_gate=gate,
        qk_norm=qk_norm,
        linear=next(iter(linear)) if linear else None,
        linear_layers=linear_layers,
        mla=mla,
        moe=moe,
        moe_layers=moe_layers,
    )


def _linear_shapes(delta_net: Any) -> LinearShapes:
    """A Gated DeltaNet layer's config (torchtitan's Qwen3.5) as the planner's :class:`LinearShapes`."""
    k, v = delta_net.key_head_dim, delta_net.value_head_dim
    heads = delta_net.in_proj_k.out_features // k, delta_net.in_proj_v.out_features // v
    return LinearShapes(LINEAR_KINDS[0], heads[0], heads[1], k, v, delta_net.conv_kernel_size)


def _mla(attention: Any) -> MLAShapes | None:
    """DeepSeek V3's multi-head latent attention config as the planner's :class:`MLAShapes` (``None`` for another)."""
    if not getattr(attention, "kv_lora_rank", 0):
        return None
    a = attention
    return MLAShapes(a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim)


def _moe(moe: Any) -> MoEShapes:
    """torchtitan's ``MoE.Config`` as the planner's :class:`MoEShapes`: its routed experts (``num_experts`` of
    ``hidden_dim``), the router's ``top_k``, its shared experts' width (``w1``'s, ``None``: none)."""
    shared_experts = getattr(moe, "shared_experts", None)
    shared = shared_experts.w1.out_features if shared_experts is not None else 0
    return MoEShapes(moe.num_experts, moe.router.top_k, moe.routed_experts.inner_experts.hidden_dim, shared)


def _layer_shapes(layer: Any, dim: int, what: str, i: int) -> tuple[int, int, int, bool, bool, MLAShapes | None]:
    """``(heads, kv heads, head size, gate, q/k norms, MLA)`` of attention layer ``i``'s config (``gate``: Qwen3.5's
    gated attention, its ``wq`` twice as wide as its heads; MLA: DeepSeek V3's, every head its own K/V)."""
    attention = layer.attention
    mla = _mla(attention)
    if mla is not None:
        return attention.n_heads, attention.n_heads, mla.qk_head_dim, False, False, mla
    heads, head_dim = getattr(attention, "n_heads", 0), getattr(attention, "head_dim", None)
    gated = getattr(getattr(attention, "wq", None), "out_features", 0) == 2 * heads * (head_dim or dim // max(1, heads))
    if not (isinstance(attention, GQAttention.Config) or gated):
        raise ValueError(
            f"{what}: layer {i} has {type(attention).__qualname__}; the planner plans torchtitan's GQA attention"
        )
    kv_heads = heads if attention.n_kv_heads is None else attention.n_kv_heads
    qk_norm = any(getattr(attention, n, None) is not None for n in ("qk_norm", "q_norm"))  # Qwen3's; Qwen3.5's
    return heads, kv_heads, head_dim if head_dim is not None else dim // heads, gated, qk_norm, None


def _feed_forward(layer: Any, what: str, i: int) -> int:
    """Layer ``i``'s dense feed-forward width (``ValueError`` for a layer with neither experts nor one)."""
    if layer.feed_forward is None:
        raise ValueError(f"{what}: layer {i} has neither experts nor a feed-forward; the planner plans one of them")
    return layer.feed_forward.w1.out_features
