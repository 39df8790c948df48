"""``model.name = "llama3"``: titan_cp's own Llama 3 (:mod:`titan_cp.model`), shaped by ``model.flavor``.

Every parallelism applies (TP, CP, AC, compile, FSDP/HSDP, PP: :func:`titan_cp.parallel.build.build_parallel_model`);
Hugging Face checkpoints come in and go out renamed and with q/k permuted (:mod:`titan_cp.model.hf_checkpoint`).
"""

from __future__ import annotations

import torch

from titan_cp.families.base import ModelFamily, ModelSpec, register_family
from titan_cp.model import hf_checkpoint
from titan_cp.model.flavors import FLAVORS, model_args
from titan_cp.model.llama import MAX_POSITIONS, Transformer
from titan_cp.parallel.build import build_parallel_model

BOUND = "RoPE's float32 positions, exact up to 2**24; the flavor's max_seq_len is informational"
"""What bounds the sequences the Llama takes (:data:`titan_cp.model.llama.MAX_POSITIONS`), for errors."""


class Llama3(ModelFamily):
    """titan_cp's Llama 3 (module docstring)."""

    name = "llama3"

    def check_keys(self, cfg) -> None:
        """The flavor's heads and layers against the degrees (TP, the CP strategy, pipeline stages)."""
        flavor = cfg.model.flavor
        args = FLAVORS[flavor]
        cfg.parallelism.check_model(flavor, args.n_heads, args.n_kv_heads or args.n_heads, args.n_layers)

    def build_parallel(self, cfg, dims, options, device, vocab_size: int, loss_fn=None):
        t, p = cfg.training, cfg.parallelism
        args = model_args(cfg.model.flavor, vocab_size=vocab_size)
        built = build_parallel_model(
            args,
            dims,
            options,
            device,
            seed=t.seed,
            loss_fn=loss_fn,
            pp_microbatches=t.local_batch_size // p.pipeline_parallel_microbatch_size,
            pp_schedule=p.pipeline_parallel_schedule,
        )
        return built, args

    def load_hf(self, parts, path, shapes, key="checkpoint.initial_load_path") -> None:
        hf_checkpoint.load_hf(parts, path, shapes, key=key)

    def save_hf(self, parts, folder, shapes, assets=None):
        """The Llama's own export: safetensors and ``config.json`` (no tokenizer files, as before)."""
        return hf_checkpoint.save_hf(parts, folder, shapes)

    def planner_args(self, cfg):
        return model_args(cfg.model.flavor)

    def generation_spec(self, cfg, vocab_size: int) -> ModelSpec:
        args = model_args(cfg.model.flavor, vocab_size=vocab_size)
        with torch.device("meta"):
            shapes = {name: tuple(p.shape) for name, p in Transformer(args).named_parameters()}
        return ModelSpec(self, self.describe(cfg.model), MAX_POSITIONS, shapes, args=args, bound=BOUND)

    def build_for_generation(self, spec, dims, strategy, balance, device):
        from titan_cp.generate.runners import build_generation_model  # noqa: PLC0415 - titan_cp.generate's engine imports the families

        return build_generation_model(spec.args, dims, strategy, balance, device)

    def owns(self, model) -> bool:
        return isinstance(model, Transformer)

    def runner(self, model):
        from titan_cp.generate.runners import LlamaRunner  # noqa: PLC0415 - titan_cp.generate's engine imports the families

        return LlamaRunner(model)

    def check_hf_weights(self, source, spec) -> bool:
        """Renamed and permuted from transformers' Llama: ``config.json`` and every tensor checked here."""
        hf_checkpoint.check_hf_folder(source.path, source.key)
        hf_checkpoint.check_hf_weights(source.path, spec.args, source.key)
        return True

    def describe(self, model_cfg) -> str:
        return f"model.flavor = {model_cfg.flavor!r}"

    def mismatch_fix(self, what: str) -> str:
        return f"set model.flavor to the flavor the checkpoint was trained with ({what} now)"


LLAMA3 = register_family(Llama3())
