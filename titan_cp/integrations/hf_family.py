"""``model.name = "hf"``: the Hugging Face causal LM of the folder ``model.hf_assets_path``.

A model family (:mod:`titan_cp.families`) registered from here, above the family layer, as the
Hugging Face parallel adapter is (docs/architecture.md); :mod:`titan_cp.preflight` imports this
module, so every entry point that checks a job knows the family. Built, parallelized (CP, AC,
compile, FSDP; not TP or PP), loaded and exported by :mod:`titan_cp.integrations.hf_folder`;
``transformers`` is imported only when a method runs (it stays optional for the Llama).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from titan_cp.families.base import ModelFamily, ModelSpec, register_family
from titan_cp.families.llama3 import hf_checkpoint
from titan_cp.integrations import hf_shapes
from titan_cp.integrations.hf_model import plain_head, text_config
from titan_cp.integrations.hf_parallel import CausalLM
from titan_cp.parallel import handle_of
from titan_cp.parallel.build import ModelParts

if TYPE_CHECKING:
    from titan_cp.config import JobConfig, Model
    from titan_cp.mesh import ParallelDims
    from titan_cp.parallel.build import ParallelizeOptions

_NAME = "model.name = 'hf'"


class HuggingFace(ModelFamily):
    """A Hugging Face causal LM (module docstring)."""

    name = "hf"

    def check_section(self, model: Model) -> None:
        if not model.hf_assets_path:
            raise ValueError(
                f"{_NAME} needs model.hf_assets_path: the Hugging Face model folder (config.json, "
                "tokenizer, *.safetensors)"
            )

    def check_keys(self, cfg: JobConfig) -> None:
        """What titan_cp builds for Hugging Face models (FSDP, CP, AC, compile; not TP or PP), and
        where their weights come from; the heads are checked against ``config.json`` in :meth:`check_files`."""
        p, c = cfg.parallelism, cfg.checkpoint
        if cfg.is_given("model.flavor"):
            raise ValueError(
                f"model.flavor = {cfg.model.flavor!r} shapes titan_cp's Llama; with {_NAME} the model is "
                "model.hf_assets_path's config.json: remove model.flavor"
            )
        for key, degree in (
            ("parallelism.tensor_parallel_degree", p.tensor_parallel_degree),
            ("parallelism.pipeline_parallel_degree", p.pipeline_parallel_degree),
        ):
            if degree != 1:
                raise ValueError(
                    f"{key} = {degree}: {_NAME} runs with FSDP and context parallelism only (not tensor "
                    f"or pipeline parallelism); set {key} = 1"
                )
        if not (c.initial_load_path and c.initial_load_in_hf):
            raise ValueError(
                f"{_NAME} starts from the weights of a Hugging Face folder: set checkpoint.initial_load_path "
                "(e.g. to model.hf_assets_path) and checkpoint.initial_load_in_hf = true"
            )

    def check_files(self, cfg: JobConfig) -> None:
        from titan_cp.integrations.hf_folder import check_job  # noqa: PLC0415 - transformers is optional

        check_job(cfg)

    def build_parallel(
        self,
        cfg: JobConfig,
        dims: ParallelDims,
        options: ParallelizeOptions,
        device: torch.device | str,
        vocab_size: int,
        loss_fn: Any = None,
    ) -> tuple[ModelParts, Any]:
        from titan_cp.integrations import hf_folder  # noqa: PLC0415 - transformers is optional

        model, args = hf_folder.build_parallel_hf_model(cfg.model.hf_assets_path, dims, options, device)
        hf_folder.check_vocab(model, vocab_size)
        cp = handle_of(model)
        assert cp is not None, "build_parallel_hf_model binds a CP handle (one device too)"
        return ModelParts([model], cp), args

    def load_hf(
        self, parts: list[nn.Module], path: str | Path, shapes: Any, key: str = "checkpoint.initial_load_path"
    ) -> None:
        from titan_cp.integrations import hf_folder  # noqa: PLC0415 - transformers is optional

        hf_folder.load_hf_weights(parts[0], path, key=key)

    def save_hf(self, parts: list[nn.Module], folder: str | Path, shapes: Any, assets: str | None = None) -> Path:
        """Safetensors under ``transformers``' own names, ``config.json`` and the tokenizer files of ``assets``."""
        from titan_cp.integrations import hf_folder  # noqa: PLC0415 - transformers is optional

        return hf_folder.save_weights(parts[0], folder, assets)

    def planner_args(self, cfg: JobConfig) -> hf_shapes.HFShapes:
        assert cfg.model.hf_assets_path, "check_section: model.name = 'hf' names its folder"
        return hf_shapes.hf_model_args(cfg.model.hf_assets_path)  # config.json alone: no transformers

    def builds(self, axis: str) -> bool:
        return axis not in ("tp", "pp")  # FSDP and context parallelism only

    def plan_label(self, cfg: JobConfig, shapes: Any) -> str:
        return shapes.name

    def generation_spec(self, cfg: JobConfig, vocab_size: int) -> ModelSpec:
        from titan_cp.integrations import hf_folder  # noqa: PLC0415 - transformers is optional

        path = cfg.model.hf_assets_path
        what = self.describe(cfg.model)
        config = hf_folder.load_hf_config(path)
        model = hf_folder.meta_model(config)
        if plain_head(model) is None:
            raise ValueError(
                f"{what}: titan_cp.generate takes the logits from a plain output head (logits = lm_head(hidden)); "
                f"{type(model).__name__}'s forward changes them (e.g. final logit soft-capping)"
            )
        rows = model.get_input_embeddings().num_embeddings
        if vocab_size > rows:
            raise ValueError(f"{what}: the tokenizer has {vocab_size} ids but the model's embedding {rows} rows")
        wrapped = CausalLM(model)
        shapes = {name: tuple(p.shape) for name, p in wrapped.named_parameters()}
        aliases = tuple(sorted(set(wrapped.state_dict()) - set(shapes)))  # tied weights, persistent buffers
        max_len = text_config(config).max_position_embeddings
        bound = "config.json's max_position_embeddings"
        return ModelSpec(self, what, max_len, shapes, folder=path, aliases=aliases, bound=bound)

    def check_hf_weights(self, source: Any, spec: ModelSpec) -> bool:
        """The folder and its ``config.json``; the tensors are compared by name and shape after."""
        hf_checkpoint.check_hf_folder(source.path, source.key)
        return False

    def describe(self, model_cfg: Model) -> str:
        return f"model.hf_assets_path = {model_cfg.hf_assets_path!r}"

    def mismatch_fix(self, what: str) -> str:
        return f"point model.hf_assets_path at the model the checkpoint holds ({what} now)"


HF = register_family(HuggingFace())
