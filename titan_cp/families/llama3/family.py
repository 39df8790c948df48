"""``model.name = "llama3"``: titan_cp's own Llama 3 (:mod:`.model`), shaped by ``model.flavor``.

Every parallelism applies (TP, CP, AC, compile, FSDP/HSDP, PP: :func:`titan_cp.parallel.build.build_parallel_model`
over its :class:`~titan_cp.families.llama3.parallelize.LlamaBuilder`);
Hugging Face checkpoints come in and go out renamed and with q/k permuted (:mod:`titan_cp.families.llama3.hf_checkpoint`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from titan_cp.config.values import check_choice
from titan_cp.families.base import ModelFamily, ModelSpec, register_family
from titan_cp.families.llama3 import hf_checkpoint
from titan_cp.families.llama3.flavors import FLAVORS, model_args
from titan_cp.families.llama3.model import MAX_POSITIONS, ModelArgs, Transformer
from titan_cp.families.llama3.parallelize import LlamaBuilder
from titan_cp.parallel.build import ModelParts, build_parallel_model

if TYPE_CHECKING:
    from titan_cp.config import JobConfig, Model
    from titan_cp.mesh import ParallelDims
    from titan_cp.parallel.build import ParallelizeOptions

BOUND = "RoPE's float32 positions, exact up to 2**24; the flavor's max_seq_len is informational"
"""What bounds the sequences the Llama takes (:data:`titan_cp.families.llama3.model.MAX_POSITIONS`), for errors."""


class Llama3(ModelFamily):
    """titan_cp's Llama 3 (module docstring)."""

    name = "llama3"

    def check_section(self, model: Model) -> None:
        """``model.flavor`` is one of :data:`titan_cp.families.llama3.flavors.FLAVORS`."""
        check_choice("model.flavor", model.flavor, list(FLAVORS))

    def check_keys(self, cfg: JobConfig) -> None:
        """The flavor's heads and layers against the degrees (TP, the CP strategy, pipeline stages)."""
        flavor = cfg.model.flavor
        args = FLAVORS[flavor]
        cfg.parallelism.check_model(flavor, args.n_heads, args.n_kv_heads or args.n_heads, args.n_layers)

    def build_parallel(
        self,
        cfg: JobConfig,
        dims: ParallelDims,
        options: ParallelizeOptions,
        device: torch.device | str,
        vocab_size: int,
        loss_fn: Any = None,
    ) -> tuple[ModelParts, ModelArgs]:
        t, p = cfg.training, cfg.parallelism
        args = model_args(cfg.model.flavor, vocab_size=vocab_size)
        built = build_parallel_model(
            LlamaBuilder(args),
            dims,
            options,
            device,
            seed=t.seed,
            loss_fn=loss_fn,
            pp_microbatches=t.local_batch_size // p.pipeline_parallel_microbatch_size,
            pp_schedule=p.pipeline_parallel_schedule,
        )
        return built, args

    def load_hf(
        self, parts: list[nn.Module], path: str | Path, shapes: ModelArgs, key: str = "checkpoint.initial_load_path"
    ) -> None:
        hf_checkpoint.load_hf(parts, path, shapes, key=key)

    def save_hf(self, parts: list[nn.Module], folder: str | Path, shapes: ModelArgs, assets: str | None = None) -> Path:
        """The Llama's own export: safetensors and ``config.json`` (no tokenizer files)."""
        return hf_checkpoint.save_hf(parts, folder, shapes)

    def planner_args(self, cfg: JobConfig) -> ModelArgs:
        return model_args(cfg.model.flavor)

    def generation_spec(self, cfg: JobConfig, vocab_size: int) -> ModelSpec:
        args = model_args(cfg.model.flavor, vocab_size=vocab_size)
        with torch.device("meta"):
            shapes = {name: tuple(p.shape) for name, p in Transformer(args).named_parameters()}
        return ModelSpec(self, self.describe(cfg.model), MAX_POSITIONS, shapes, args=args, bound=BOUND)

    def check_hf_weights(self, source: Any, spec: ModelSpec) -> bool:
        """Renamed and permuted from transformers' Llama: ``config.json`` and every tensor checked here."""
        hf_checkpoint.check_hf_folder(source.path, source.key)
        hf_checkpoint.check_hf_weights(source.path, spec.args, source.key)
        return True

    def describe(self, model_cfg: Model) -> str:
        return f"model.flavor = {model_cfg.flavor!r}"

    def mismatch_fix(self, what: str) -> str:
        return f"set model.flavor to the flavor the checkpoint was trained with ({what} now)"


LLAMA3 = register_family(Llama3())
